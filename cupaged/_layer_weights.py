"""The weights of :class:`cupaged.layers.Attention`: which keys and shapes it takes (the projections, their biases,
the QK-norm weights, the sinks) and how a state dict becomes them (separate projections fused, every key and
shape checked before anything is kept)."""

from __future__ import annotations

import numpy as np

from cupaged._backend import array_module, host_copy
from cupaged._layer_options import norm_shapes

__all__ = ["expected_shapes", "load_weights", "OPTIONAL"]

OPTIONAL = ("bo",)  # a missing output bias means zero (Qwen2 has q / k / v biases only)


def expected_shapes(layer) -> dict:
    """``{key: shape}`` of what ``layer`` loads: matrices ``[out_features, in_features]``, vectors ``[features]``."""
    q, kv, dim, o = layer.q_size, layer.kv_size, layer.dim, layer.options
    shapes = ({"wqkv": (q + 2 * kv, dim)} if layer.fuse_qkv else
              {"wq": (q, dim), "wk": (kv, layer.context_dim), "wv": (kv, layer.context_dim)})
    shapes["wo"] = (dim, q)
    if o.bias:
        shapes.update({"bqkv": (q + 2 * kv,)} if layer.fuse_qkv else {"bq": (q,), "bk": (kv,), "bv": (kv,)})
        shapes["bo"] = (dim,)
    for key, accepted in norm_shapes(o.qk_norm, layer.n_heads, layer.n_kv_heads, layer.head_dim).items():
        shapes[key] = accepted[0]
    if o.sinks:
        shapes["sinks"] = (layer.n_heads,)
    return shapes


def _fuse(state: dict, parts, fused: str, sizes, width) -> None:
    """Separate q / k / v parts concatenated into ``fused`` (rows in q, k, v order), their shapes checked first."""
    if fused in state or not set(parts) <= state.keys():
        return
    arrays = [state.pop(k) for k in parts]
    xp = array_module(**dict(zip(parts, arrays)))
    for k, a, n in zip(parts, arrays, sizes):
        check_shape(k, a, [(n, width)] if width else [(n,)])
    state[fused] = xp.concatenate(arrays, axis=0)


def load_weights(layer, state_dict) -> dict:
    """``state_dict`` as ``layer`` keeps it: cast to its dtype (the sinks to float32) and contiguous. Raises
    ``KeyError`` for a missing or unexpected key and ``ValueError`` for a wrong shape, before anything is kept."""
    state = dict(state_dict)
    if layer.fuse_qkv:
        sizes = (layer.q_size, layer.kv_size, layer.kv_size)
        _fuse(state, ("wq", "wk", "wv"), "wqkv", sizes, layer.dim)
        if layer.options.bias:
            _fuse(state, ("bq", "bk", "bv"), "bqkv", sizes, None)
    want = expected_shapes(layer)
    missing = sorted(want.keys() - state.keys() - set(OPTIONAL))
    extra = sorted(state.keys() - want.keys())
    if missing or extra:
        raise KeyError(f"load_state_dict: missing {missing}, unexpected {extra} (expected {sorted(want)})")
    xp = array_module(**state)
    norms = norm_shapes(layer.options.qk_norm, layer.n_heads, layer.n_kv_heads, layer.head_dim)
    for k in state:
        check_shape(k, state[k], norms.get(k, [want[k]]))
        if k == "sinks" and not np.all(np.isfinite(host_copy(state[k]))):
            raise ValueError("sinks must be finite logits")
    return {k: xp.ascontiguousarray(xp.asarray(a).astype(np.float32 if k == "sinks" else layer.dtype))
            for k, a in state.items()}


def check_shape(name, w, accepted) -> None:
    if getattr(w, "shape", None) not in accepted:
        want = " or ".join(str(list(s)) for s in accepted)
        raise ValueError(f"{name} must have shape {want}, got {getattr(w, 'shape', type(w).__name__)}")
