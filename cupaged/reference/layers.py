"""Reference of the consumer layer (cupaged/layers.py) and of the demo's tiny decoder: a float64 transcription of
an autoregressive model's attention module as NVIDIA's autoregressive attention module (``ar_modules_attention.py``,
Apache-2.0: the layer cupaged's was modelled on) writes it (one sequence, a dense ``[n_kv_heads, max_seq_len,
head_dim]`` cache written at the input positions, K/V of a query head's GQA group, an explicit visibility mask, a
two-pass softmax per row) -- no paging, no kernel, no online softmax -- with the options of the model families
cupaged serves, each as its published model file writes it: q/k/v/o biases (Qwen2, gpt-oss, Bloom), a logit scale
and soft-cap and a sliding window (Gemma 2), ALiBi (Bloom / MPT), attention sinks (gpt-oss), q/k norms (Qwen 3,
Cohere, OLMo 2, Llama 4) and Hugging Face's RoPE scalings (cupaged/reference/rope.py).

Conventions it fixes where those leave them open: ``"cross"`` with a fused wqkv projects the context with wqkv's
K/V rows (and bqkv's K/V entries); k-norm applies to the context's keys; the causal mask of ``"self"`` lets a query
at position p see keys 0..p of its cache, a sliding window W those in (p - W, p]; soft-capping comes before the
ALiBi bias and the masks; the sink joins only the denominator. ALiBi measures |key position - query position| with
the positions the tokens hold (``"full"``: input_pos + i for both); ``"cross"`` has no positions shared by query and
context, so ALiBi and sliding windows there raise NotImplementedError.
"""

from __future__ import annotations

import numpy as np

from cupaged.reference import rope as _rope
from cupaged.reference._layer_math import (as_f64, projections, qk_normalize, resolve_alibi, rms_norm,
                                           softmax_with_sink)

__all__ = ["DenseCache", "rms_norm", "attention", "decoder_logits"]

ATTENTION_OPTIONS = ("scale", "softcap", "sliding_window", "alibi", "qk_norm")  # what decoder_logits passes on
IMPLIED_BY_WEIGHTS = ("bias", "sinks")  # options the layer weights already say (bq ..., sinks)


class DenseCache:
    """That module's per-sequence cache: float64 ``k``, ``v`` ``[n_kv_heads, max_seq_len, head_dim]``."""

    def __init__(self, n_kv_heads, max_seq_len, head_dim):
        self.k = np.full((n_kv_heads, max_seq_len, head_dim), np.nan)
        self.v = np.full((n_kv_heads, max_seq_len, head_dim), np.nan)


def _rotate(x, positions, rope, seq_len):
    """The rope's rotation recomputed in float64 from its parameters (rotary_dim, theta, style, scaling, the model's
    max_position_embeddings) for a sequence now ``seq_len`` long (dynamic NTK and LongRoPE depend on it); cos and sin
    carry the scaling's attention factor."""
    max_pos = getattr(rope, "max_position_embeddings", None)
    freqs = _rope.inv_freq(rope.rotary_dim, rope.rope_theta, rope.scaling, seq_len=seq_len,
                           max_position_embeddings=max_pos)
    factor = _rope.attention_factor(rope.scaling, max_position_embeddings=max_pos)
    table = _rope.cos_sin_cache(int(np.max(positions)) + 1, freqs, factor)
    return _rope.rotate(x, positions, table, is_neox_style=rope.is_neox_style)


def _visible(attn_type, positions, n_keys, sliding_window):
    """bool ``[seqlen, keys]``: ``"self"`` causal (keys 0..p of the cache, within (p - W, p] under a window W),
    ``"full"`` and ``"cross"`` every key."""
    if attn_type != "self":
        return np.ones((len(positions), n_keys), bool)
    keys = np.arange(n_keys)[None, :]
    mask = keys <= positions[:, None]
    if sliding_window:
        mask &= keys > positions[:, None] - sliding_window
    return mask


def attention(weights, x, *, n_heads, n_kv_heads, head_dim, attn_type="self", rope=None, norm_eps=1e-5,
              cache=None, input_pos=0, context=None, scale=None, softcap=None, sliding_window=None, alibi=None,
              qk_norm=None):
    """One sequence's step: ``x`` ``[seqlen, dim]`` at positions ``input_pos ..``; ``weights`` as
    ``Attention.load_state_dict`` takes them (``wqkv`` or ``wq``/``wk``/``wv``, ``wo``; optional biases ``bqkv`` or
    ``bq``/``bk``/``bv`` and ``bo``, ``q_norm`` / ``k_norm``, ``sinks`` ``[n_heads]``); ``cache`` a
    :class:`DenseCache` for ``"self"`` (written in place); ``context`` ``[context_len, context_dim]`` for
    ``"cross"``. Options: ``scale`` (None: 1/sqrt(head_dim)), ``softcap`` c (logits = c tanh(logits / c); None or 0:
    off), ``sliding_window`` W (``"self"`` only; None or 0: off), ``alibi`` (None, True for Bloom's slopes, or
    ``[n_heads]`` slopes), ``qk_norm`` (None, "rms_head", "layer_head", "rms_all_heads", "l2"; applied before RoPE).
    Returns float64 ``[seqlen, dim]``."""
    x = as_f64(x)
    seqlen = x.shape[0]
    q_size, kv_size = n_heads * head_dim, n_kv_heads * head_dim
    if attn_type not in ("self", "full", "cross"):
        raise ValueError(f"attn_type must be 'self', 'full' or 'cross', got {attn_type!r}")
    if sliding_window and attn_type != "self":
        raise NotImplementedError(f"sliding_window with attn_type={attn_type!r}: a window needs causal 'self'")
    slopes = resolve_alibi(alibi, n_heads)
    if slopes is not None and attn_type == "cross":
        raise NotImplementedError("alibi with attn_type='cross': query and context share no positions")
    source = x if attn_type != "cross" else as_f64(context)
    wq, wk, wv, bq, bk, bv = projections(weights, q_size, kv_size)
    xq, xk = qk_normalize(weights, x @ wq.T + bq, source @ wk.T + bk, qk_norm, norm_eps, n_heads, n_kv_heads,
                          head_dim)
    xv = (source @ wv.T + bv).reshape(source.shape[0], n_kv_heads, head_dim)
    positions = np.arange(input_pos, input_pos + seqlen)
    if attn_type in ("self", "full") and rope is not None:
        xq = _rotate(xq, positions, rope, input_pos + seqlen)
        xk = _rotate(xk, positions, rope, input_pos + seqlen)
    if attn_type == "self":
        cache.k[:, positions] = xk.transpose(1, 0, 2)
        cache.v[:, positions] = xv.transpose(1, 0, 2)
        keys, values = cache.k[:, :input_pos + seqlen], cache.v[:, :input_pos + seqlen]
        key_positions = np.arange(input_pos + seqlen)
    else:
        keys, values = xk.transpose(1, 0, 2), xv.transpose(1, 0, 2)  # [n_kv_heads, keys, head_dim]
        key_positions = positions  # "full": the same tokens; "cross" never reads them (no ALiBi)
    visible = _visible(attn_type, positions, keys.shape[1], sliding_window)
    scale = 1.0 / np.sqrt(head_dim) if scale is None else float(scale)
    sinks = as_f64(weights["sinks"]).reshape(-1) if "sinks" in weights else None
    group = n_heads // n_kv_heads
    out = np.zeros((seqlen, n_heads, head_dim))
    for h in range(n_heads):
        kv = h // group  # the KV head of query head h's GQA group
        for s in range(seqlen):
            seen = np.flatnonzero(visible[s])  # masked keys are never read, so NaN slots cannot leak in
            logits = scale * (keys[kv, seen] @ xq[s, h])
            if softcap:
                logits = softcap * np.tanh(logits / softcap)
            if slopes is not None:
                logits = logits - slopes[h] * np.abs(key_positions[seen] - positions[s])
            probs = softmax_with_sink(logits, None if sinks is None else sinks[h])
            out[s, h] = probs @ values[kv, seen]
    y = out.reshape(seqlen, q_size) @ as_f64(weights["wo"]).T
    return y + as_f64(weights["bo"]) if "bo" in weights else y


def _layer_options(config, i):
    """config.attention_options(i) (absent: none) as attention's keyword arguments; "bias" and "sinks" are implied
    by the layer's weights, any other key the reference does not know is an error (never silently dropped)."""
    get = getattr(config, "attention_options", None)
    options = dict(get(i)) if get is not None else {}
    unknown = set(options) - set(ATTENTION_OPTIONS) - set(IMPLIED_BY_WEIGHTS)
    if unknown:
        raise ValueError(f"attention_options({i}) has {sorted(unknown)}: the reference knows "
                         f"{', '.join(ATTENTION_OPTIONS + IMPLIED_BY_WEIGHTS)}")
    return {k: v for k, v in options.items() if k in ATTENTION_OPTIONS}


def decoder_logits(weights, config, token_ids):
    """The demo's tiny decoder over one whole token history in float64: embeddings, then per layer x +=
    attention(RMSNorm(x)) with the layer's options (config.attention_options(i)), x += SwiGLU(RMSNorm(x)), then
    RMSNorm and the output head. Returns ``[len, vocab]``: the logits after every position (teacher forcing:
    position i predicts token i + 1)."""
    ids = np.asarray(token_ids, np.int64)
    h = as_f64(weights["embed"])[ids]
    eps = config.norm_eps
    for i in range(config.n_layers):
        lw = {k.split(".", 2)[2]: v for k, v in weights.items() if k.startswith(f"layers.{i}.")}
        attn = {k[5:]: v for k, v in lw.items() if k.startswith("attn.")}
        cache = DenseCache(config.n_kv_heads, len(ids), config.head_dim)
        h = h + attention(attn, rms_norm(h, lw["attn_norm"], eps), n_heads=config.n_heads,
                          n_kv_heads=config.n_kv_heads, head_dim=config.head_dim, rope=config.rope(),
                          norm_eps=eps, cache=cache, **_layer_options(config, i))
        a = rms_norm(h, lw["mlp_norm"], eps)
        gate, up = a @ as_f64(lw["w1"]).T, a @ as_f64(lw["w3"]).T
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ as_f64(lw["w2"]).T
    return rms_norm(h, weights["norm"], eps) @ as_f64(weights["output"]).T
