"""What :class:`cupaged.layers.Attention` takes beyond a Llama-style layer, checked once at construction: projection
biases, the softmax scale, logit soft-capping, a sliding window, attention sinks, ALiBi and the QK norms of the
model families people run (Qwen2 and gpt-oss biases, Gemma's query_pre_attn_scalar and softcap, Mistral's and
Gemma's windows, gpt-oss sinks, Bloom / MPT / Falcon ALiBi, Cohere's LayerNorm, OLMo 2's norm over all heads,
Llama 4's weightless L2 norm). Each maps onto an argument the attention ops already take."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from cupaged._backend import host_copy
from cupaged._checks import check_bool, check_float, check_int

__all__ = ["QK_NORMS", "LayerOptions", "layer_options", "alibi_slopes", "norm_shapes"]

# "rms_head": RMSNorm over head_dim (use_qk_normalization=True); "layer_head": LayerNorm over head_dim (Cohere);
# "rms_all_heads": RMSNorm over all heads' features (OLMo 2); "l2": x / sqrt(mean(x^2) + eps), no weight (Llama 4)
QK_NORMS = ("rms_head", "layer_head", "rms_all_heads", "l2")


@dataclasses.dataclass(frozen=True, eq=False)
class LayerOptions:
    bias: bool
    scale: float                 # the softmax scale, resolved (1 / sqrt(head_dim) when None was given)
    softcap: float | None
    sliding_window: int | None   # W: a query at p sees keys in (p - W, p]
    sinks: bool
    alibi_slopes: np.ndarray | None  # float32 [n_heads], host
    qk_norm: str | None


def alibi_slopes(n_heads: int) -> np.ndarray:
    """float32 ``[n_heads]``: the slopes Bloom and MPT compute from the head count (alibi_bias_max 8): 2^(-8 i / p)
    for i = 1..p with p the largest power of two <= n_heads, then every other slope of 2p heads (the odd ones)."""
    p = 1 << (n_heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * i / p) for i in range(1, p + 1)]
    slopes += [2.0 ** (-4.0 * i / p) for i in range(1, 2 * (n_heads - p), 2)]
    return np.array(slopes, np.float32)


def _optional_positive(name: str, value):
    """None (or 0, as configs write "off") or a finite positive float."""
    if value is None or (not isinstance(value, (bool, np.bool_)) and value == 0):
        return None
    return check_float(name, value, positive=True)


def layer_options(n_heads: int, head_dim: int, attn_type: str, *, bias, scale, softcap, sliding_window, sinks, alibi,
                  qk_norm, use_qk_normalization: bool) -> LayerOptions:
    """The layer's options, each checked (a ValueError / TypeError naming it); NotImplementedError for a
    combination the layer cannot honour (a window outside causal self attention, ALiBi in cross attention)."""
    bias, sinks = check_bool("bias", bias), check_bool("sinks", sinks)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else check_float("scale", scale, positive=True)
    softcap = _optional_positive("softcap", softcap)
    if sliding_window is not None and not (isinstance(sliding_window, (int, np.integer)) and sliding_window == 0):
        sliding_window = check_int("sliding_window", sliding_window, 1)
        if attn_type != "self":
            raise NotImplementedError(f"sliding_window is a causal window: attn_type {attn_type!r} takes none")
    else:
        sliding_window = None
    slopes = _alibi(alibi, n_heads)
    if slopes is not None and attn_type == "cross":
        raise NotImplementedError("alibi: cross attention has no relative positions between queries and context keys")
    if qk_norm is not None and qk_norm not in QK_NORMS:
        raise ValueError(f"qk_norm must be None or one of {', '.join(map(repr, QK_NORMS))}, got {qk_norm!r}")
    if use_qk_normalization:
        if qk_norm not in (None, "rms_head"):
            raise ValueError(f"use_qk_normalization=True means qk_norm='rms_head', got qk_norm={qk_norm!r}")
        qk_norm = "rms_head"
    return LayerOptions(bias, scale, softcap, sliding_window, sinks, slopes, qk_norm)


def _alibi(alibi, n_heads: int):
    if alibi is None or alibi is False:
        return None
    if alibi is True:
        return alibi_slopes(n_heads)
    try:
        slopes = host_copy(alibi).astype(np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"alibi must be None, True or an array of n_heads slopes, got {type(alibi).__name__}") \
            from None
    if slopes.shape != (n_heads,):
        raise ValueError(f"alibi must hold n_heads={n_heads} slopes, got shape {slopes.shape}")
    if not np.all(np.isfinite(slopes)):
        raise ValueError("alibi slopes must be finite")
    return slopes.astype(np.float32)


def norm_shapes(qk_norm: str | None, n_heads: int, n_kv_heads: int, head_dim: int) -> dict:
    """``{"q_norm": [shapes accepted], "k_norm": [...]}``, the first shape the canonical one; {} for none / l2."""
    if qk_norm in ("rms_head", "layer_head"):
        shapes = {"q_norm": [(head_dim,)], "k_norm": [(head_dim,)]}
        if qk_norm == "layer_head":  # Cohere keeps a weight per head
            shapes["q_norm"].append((n_heads, head_dim))
            shapes["k_norm"].append((n_kv_heads, head_dim))
        return shapes
    if qk_norm == "rms_all_heads":
        return {"q_norm": [(n_heads * head_dim,)], "k_norm": [(n_kv_heads * head_dim,)]}
    return {}
