"""The float64 pieces of cupaged.reference.layers, each one published formula: the projections' biases, the
q/k normalizations of the model families (Qwen 3 / Gemma 3 RMSNorm per head, Cohere's LayerNorm per head, OLMo 2's
RMSNorm over all heads, Llama 4's weightless L2 norm), ALiBi's slopes (Bloom / MPT) and one row's softmax with an
attention sink (gpt-oss)."""

from __future__ import annotations

import math

import numpy as np

QK_NORMS = ("rms_head", "layer_head", "rms_all_heads", "l2")


def as_f64(a):
    return np.asarray(a, np.float64)


def rms_norm(x, weight, eps):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    x = as_f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * as_f64(weight)


def layer_norm(x, weight, eps):
    """Cohere's LayerNorm: (x - mean) / sqrt(biased variance + eps) * weight over the last axis, no bias."""
    x = as_f64(x)
    centred = x - np.mean(x, axis=-1, keepdims=True)
    return centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + eps) * as_f64(weight)


def l2_norm(x, eps):
    """Llama 4's L2Norm: x / sqrt(mean(x^2) + eps) over the last axis, no weight."""
    x = as_f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def projections(weights, q_size, kv_size):
    """(wq, wk, wv, bq, bk, bv): ``wqkv`` split in q, k, v row order or ``wq`` / ``wk`` / ``wv``; the biases likewise
    from ``bqkv`` or ``bq`` / ``bk`` / ``bv`` (zero where absent)."""
    if "wqkv" in weights:
        w = as_f64(weights["wqkv"])
        wq, wk, wv = w[:q_size], w[q_size:q_size + kv_size], w[q_size + kv_size:]
    else:
        wq, wk, wv = (as_f64(weights[name]) for name in ("wq", "wk", "wv"))
    if "bqkv" in weights:
        b = as_f64(weights["bqkv"])
        bq, bk, bv = b[:q_size], b[q_size:q_size + kv_size], b[q_size + kv_size:]
    else:
        bq, bk, bv = (as_f64(weights[name]) if name in weights else np.zeros(size)
                      for name, size in (("bq", q_size), ("bk", kv_size), ("bv", kv_size)))
    return wq, wk, wv, bq, bk, bv


def qk_normalize(weights, q, k, mode, eps, n_heads, n_kv_heads, head_dim):
    """q ``[tokens, n_heads * head_dim]`` and k ``[keys, n_kv_heads * head_dim]`` (projected, biased) normalized as
    ``mode`` says and split into heads: ``[tokens, n_heads, head_dim]``, ``[keys, n_kv_heads, head_dim]``. None:
    "rms_head" when weights has "q_norm", else no norm."""
    if mode is None and "q_norm" in weights:
        mode = "rms_head"
    if mode is not None and mode not in QK_NORMS:
        raise ValueError(f"qk_norm must be None or one of {', '.join(QK_NORMS)}, got {mode!r}")
    if mode == "rms_all_heads":  # OLMo 2: one RMSNorm over the whole projection, before the split into heads
        q, k = rms_norm(q, weights["q_norm"], eps), rms_norm(k, weights["k_norm"], eps)
    q, k = q.reshape(q.shape[0], n_heads, head_dim), k.reshape(k.shape[0], n_kv_heads, head_dim)
    if mode == "rms_head":
        q, k = rms_norm(q, weights["q_norm"], eps), rms_norm(k, weights["k_norm"], eps)
    elif mode == "layer_head":  # weights [head_dim] or per head [heads, head_dim]: both broadcast over tokens
        q, k = layer_norm(q, weights["q_norm"], eps), layer_norm(k, weights["k_norm"], eps)
    elif mode == "l2":
        q, k = l2_norm(q, eps), l2_norm(k, eps)
    return q, k


def alibi_slopes(n_heads):
    """Bloom's get_slopes (= MPT's gen_slopes with alibi_bias_max 8): for the largest power of two n <= n_heads the
    slopes 2^(-8i/n), i = 1..n, then for the remaining heads every other slope of 2n, 2^(-8i/(2n)) for odd i."""
    n = 2 ** int(math.floor(math.log2(n_heads)))
    slopes = [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
    slopes += [2.0 ** (-8.0 * i / (2 * n)) for i in range(1, 2 * n, 2)][:n_heads - n]
    return np.array(slopes)


def resolve_alibi(alibi, n_heads):
    """None / False: no ALiBi; True: :func:`alibi_slopes`; else the given ``[n_heads]`` slopes."""
    if alibi is None or alibi is False:
        return None
    if alibi is True:
        return alibi_slopes(n_heads)
    slopes = as_f64(alibi).reshape(-1)
    if slopes.shape != (n_heads,):
        raise ValueError(f"alibi slopes must have n_heads = {n_heads} entries, got shape {np.shape(alibi)}")
    return slopes


def softmax_with_sink(logits, sink=None):
    """Probabilities of one row's visible ``logits`` (float64 ``[keys]``), the ``sink`` logit (or None) joining the
    denominator with no value of its own; two passes: the maximum, then exponentials over their sum. An empty row
    gives no probabilities."""
    logits = as_f64(logits)
    candidates = list(logits) + ([] if sink is None else [float(sink)])
    if not candidates:
        return logits
    top = max(candidates)
    e = np.exp(logits - top)
    total = e.sum() + (0.0 if sink is None else math.exp(float(sink) - top))
    return e / total
