"""Reference of the consumer layer (cupaged/layers.py) and of the demo's tiny decoder: a float64 transcription of
an autoregressive model's attention module as NVIDIA's autoregressive attention module (``ar_modules_attention.py``, Apache-2.0: the layer cupaged's was modelled on) writes it (one sequence, a dense ``[n_kv_heads,
max_seq_len, head_dim]`` cache written at the input positions, K/V repeated over each GQA group, an explicit
mask, two-pass softmax) -- no paging, no kernel, no online softmax.

Conventions it fixes where that module leaves them open: ``"cross"`` with a fused wqkv projects the context with
wqkv's K/V rows; k-norm applies to the context's keys; the causal mask of ``"self"`` lets a query at position p see
keys 0..p of its cache.
"""

from __future__ import annotations

import numpy as np

from cupaged.reference import rope as _rope

__all__ = ["DenseCache", "rms_norm", "attention", "decoder_logits"]


class DenseCache:
    """That module's per-sequence cache: float64 ``k``, ``v`` ``[n_kv_heads, max_seq_len, head_dim]``."""

    def __init__(self, n_kv_heads, max_seq_len, head_dim):
        self.k = np.full((n_kv_heads, max_seq_len, head_dim), np.nan)
        self.v = np.full((n_kv_heads, max_seq_len, head_dim), np.nan)


def rms_norm(x, weight, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)


def _w(weights, name):
    return np.asarray(weights[name], np.float64)


def _rotate(x, positions, rope):
    """The rope's rotation recomputed in float64 from its parameters (head_dim, rotary_dim, theta, style, scaling)."""
    freqs = _rope.inv_freq(rope.rotary_dim, rope.rope_theta, rope.scaling)
    table = _rope.cos_sin_cache(int(np.max(positions)) + 1, freqs)
    return _rope.rotate(x, positions, table, is_neox_style=rope.is_neox_style)


def attention(weights, x, *, n_heads, n_kv_heads, head_dim, attn_type="self", rope=None, norm_eps=1e-5,
              cache=None, input_pos=0, context=None):
    """One sequence's step: ``x`` ``[seqlen, dim]`` at positions ``input_pos ..``; ``weights`` as
    ``Attention.load_state_dict`` takes them (``wqkv`` or ``wq``/``wk``/``wv``, ``wo``, optional ``q_norm`` /
    ``k_norm``); ``cache`` a :class:`DenseCache` for ``"self"`` (written in place); ``context`` ``[context_len,
    context_dim]`` for ``"cross"``. Returns float64 ``[seqlen, dim]``."""
    x = np.asarray(x, np.float64)
    seqlen = x.shape[0]
    q_size, kv_size = n_heads * head_dim, n_kv_heads * head_dim
    source = x if attn_type != "cross" else np.asarray(context, np.float64)
    if "wqkv" in weights:
        w = _w(weights, "wqkv")
        wq, wk, wv = w[:q_size], w[q_size:q_size + kv_size], w[q_size + kv_size:]
    else:
        wq, wk, wv = _w(weights, "wq"), _w(weights, "wk"), _w(weights, "wv")
    xq = (x @ wq.T).reshape(seqlen, n_heads, head_dim)
    xk = (source @ wk.T).reshape(source.shape[0], n_kv_heads, head_dim)
    xv = (source @ wv.T).reshape(source.shape[0], n_kv_heads, head_dim)
    if "q_norm" in weights:
        xq, xk = rms_norm(xq, weights["q_norm"], norm_eps), rms_norm(xk, weights["k_norm"], norm_eps)
    positions = np.arange(input_pos, input_pos + seqlen)
    if attn_type in ("self", "full") and rope is not None:
        xq, xk = _rotate(xq, positions, rope), _rotate(xk, positions, rope)
    if attn_type == "self":
        cache.k[:, positions] = xk.transpose(1, 0, 2)
        cache.v[:, positions] = xv.transpose(1, 0, 2)
        keys, values = cache.k[:, :input_pos + seqlen], cache.v[:, :input_pos + seqlen]
        mask = np.arange(keys.shape[1])[None, :] <= positions[:, None]  # [seqlen, keys]
    else:
        keys, values = xk.transpose(1, 0, 2), xv.transpose(1, 0, 2)
        mask = np.ones((seqlen, keys.shape[1]), bool)
    rep = n_heads // n_kv_heads
    keys, values = np.repeat(keys, rep, axis=0), np.repeat(values, rep, axis=0)  # [n_heads, keys, head_dim]
    scores = np.einsum("shd,hkd->hsk", xq, keys) / np.sqrt(head_dim)
    scores = np.where(mask[None], scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    p = np.where(mask[None], np.exp(scores - top), 0.0)
    total = p.sum(axis=-1, keepdims=True)
    probs = np.divide(p, total, out=np.zeros_like(p), where=total > 0)
    out = np.einsum("hsk,hkd->shd", probs, values).reshape(seqlen, q_size)
    return out @ _w(weights, "wo").T


def decoder_logits(weights, config, token_ids):
    """The demo's tiny decoder over one whole token history in float64: embeddings, then per layer x +=
    attention(RMSNorm(x)), x += SwiGLU(RMSNorm(x)), then RMSNorm and the output head. Returns ``[len, vocab]``:
    the logits after every position (teacher forcing: position i predicts token i + 1)."""
    ids = np.asarray(token_ids, np.int64)
    h = _w(weights, "embed")[ids]
    eps = config.norm_eps
    for i in range(config.n_layers):
        lw = {k.split(".", 2)[2]: v for k, v in weights.items() if k.startswith(f"layers.{i}.")}
        attn = {k[5:]: v for k, v in lw.items() if k.startswith("attn.")}
        cache = DenseCache(config.n_kv_heads, len(ids), config.head_dim)
        h = h + attention(attn, rms_norm(h, lw["attn_norm"], eps), n_heads=config.n_heads,
                          n_kv_heads=config.n_kv_heads, head_dim=config.head_dim, rope=config.rope(),
                          norm_eps=eps, cache=cache)
        a = rms_norm(h, lw["mlp_norm"], eps)
        gate, up = a @ np.asarray(lw["w1"], np.float64).T, a @ np.asarray(lw["w3"], np.float64).T
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ np.asarray(lw["w2"], np.float64).T
    return rms_norm(h, weights["norm"], eps) @ _w(weights, "output").T
