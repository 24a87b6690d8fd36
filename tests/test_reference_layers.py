"""Self-checks of the float64 oracle itself (cupaged/reference/layers.py, _layer_math.py, rope.py) against tiny
cases worked out by hand or by a separate transcription of the published formula: Bloom's ALiBi slopes (and MPT's
gen_slopes), a sink in a two-key softmax, soft-capping, sliding-window visibility, the q/k norms, the biases, and
Hugging Face's RoPE scalings (gpt-oss's YaRN, Phi-3's LongRoPE factor, dynamic NTK). Pure numpy, no kernel."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from cupaged.reference import rope
from cupaged.reference import layers as ref
from cupaged.reference._layer_math import alibi_slopes, l2_norm, layer_norm, qk_normalize, softmax_with_sink

EYE2 = {"wq": np.eye(2), "wk": np.eye(2), "wv": np.eye(2), "wo": np.eye(2)}


def _self(weights, x, *, heads=(1, 1), head_dim=2, **options):
    """One "self" step over all of x from position 0."""
    cache = ref.DenseCache(heads[1], len(x), head_dim)
    return ref.attention(weights, np.asarray(x, np.float64), n_heads=heads[0], n_kv_heads=heads[1],
                         head_dim=head_dim, cache=cache, **options)


# ---- ALiBi slopes ---------------------------------------------------------------------------------------------

def test_alibi_slopes_8_heads_are_powers_of_one_half():
    np.testing.assert_array_equal(alibi_slopes(8), [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125,
                                                    0.00390625])


def test_alibi_slopes_12_heads_follow_bloom():
    """Bloom: the 8 slopes of 8 heads, then 2^(-0.5 k) for k = 1, 3, 5, 7 (every other slope of 16 heads)."""
    r = 2 ** -0.5
    expected = [2.0 ** -i for i in range(1, 9)] + [r, r ** 3, r ** 5, r ** 7]
    np.testing.assert_allclose(alibi_slopes(12), expected, rtol=1e-15)


@pytest.mark.parametrize("n_heads", [1, 2, 3, 5, 6, 12, 16, 20, 24, 40, 64])
def test_alibi_slopes_match_mpt_gen_slopes(n_heads):
    """MPT's formulation (alibi_bias_max 8): the next power of two's slopes 2^(-8 m / N), the odd-placed ones
    (m = 2, 4, ...) first, then the even-placed, cut to n_heads: the same set and order as Bloom's."""
    big = 2 ** math.ceil(math.log2(n_heads))
    slopes = [1.0 / 2 ** (m * 8.0 / big) for m in range(1, big + 1)]
    if big != n_heads:
        slopes = (slopes[1::2] + slopes[0::2])[:n_heads]
    np.testing.assert_allclose(alibi_slopes(n_heads), slopes, rtol=1e-15)


def test_alibi_bias_by_hand_self_and_full():
    """Zero logits (wq = 0), slope 0.5: row p's weights are e^{-0.5 |j - p|} over the visible keys."""
    x = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    w = dict(EYE2, wq=np.zeros((2, 2)))
    got = _self(w, x, alibi=np.array([0.5]))
    e = np.exp(-0.5 * np.array([2.0, 1.0, 0.0]))
    np.testing.assert_allclose(got[2], e @ x / e.sum(), rtol=1e-14)
    np.testing.assert_allclose(got[0], x[0], rtol=1e-14)
    full = ref.attention(w, x, n_heads=1, n_kv_heads=1, head_dim=2, attn_type="full", alibi=np.array([0.5]))
    e0 = np.exp(-0.5 * np.array([0.0, 1.0, 2.0]))  # query 0 sees the later keys too, at distance 1 and 2
    np.testing.assert_allclose(full[0], e0 @ x / e0.sum(), rtol=1e-14)
    slope = alibi_slopes(1)[0]  # alibi=True: Bloom's slopes, 2^-8 for one head
    e1 = np.exp(-slope * np.array([2.0, 1.0, 0.0]))
    np.testing.assert_allclose(_self(w, x, alibi=True)[2], e1 @ x / e1.sum(), rtol=1e-14)


# ---- sinks, softcap, scale, sliding window --------------------------------------------------------------------

def test_sink_in_a_two_key_softmax_by_hand():
    """One head, keys x0 = (1, 0) and x1 = (0.5, 1), sink 0.3: weights e^{l_j} / (e^{l0} + e^{l1} + e^{0.3})."""
    x = np.array([[1.0, 0.0], [0.5, 1.0]])
    got = _self(dict(EYE2, sinks=np.array([0.3])), x)
    l0, l1 = 0.5 / math.sqrt(2), 1.25 / math.sqrt(2)
    den = math.exp(l0) + math.exp(l1) + math.exp(0.3)
    np.testing.assert_allclose(got[1], (math.exp(l0) * x[0] + math.exp(l1) * x[1]) / den, rtol=1e-14)
    first = math.exp(1 / math.sqrt(2)) / (math.exp(1 / math.sqrt(2)) + math.exp(0.3))
    np.testing.assert_allclose(got[0], first * x[0], rtol=1e-14)


def test_sink_is_not_scaled_or_capped():
    """scale 2 and softcap 0.5 shape the key logits only: the sink stays the raw 3.0."""
    x = np.array([[1.0, 0.0], [0.5, 1.0]])
    got = _self(dict(EYE2, sinks=np.array([3.0])), x, scale=2.0, softcap=0.5)
    l0, l1 = (0.5 * math.tanh(2.0 * v / 0.5) for v in (0.5, 1.25))
    den = math.exp(l0) + math.exp(l1) + math.exp(3.0)
    np.testing.assert_allclose(got[1], (math.exp(l0) * x[0] + math.exp(l1) * x[1]) / den, rtol=1e-14)


def test_softmax_with_sink_edge_rows():
    assert softmax_with_sink(np.array([])).shape == (0,)  # an empty row: nothing, so an output of 0
    assert softmax_with_sink(np.array([]), 5.0).shape == (0,)
    np.testing.assert_allclose(softmax_with_sink(np.array([1000.0, 1000.0]), -1000.0), [0.5, 0.5])
    np.testing.assert_allclose(softmax_with_sink(np.array([0.0]), 0.0), [0.5])


def test_softcap_and_scale_by_hand():
    x = np.array([[1.0, 0.0], [0.5, 1.0]])
    got = _self(EYE2, x, softcap=0.4, scale=3.0)
    l0, l1 = 0.4 * math.tanh(3.0 * 0.5 / 0.4), 0.4 * math.tanh(3.0 * 1.25 / 0.4)
    p1 = math.exp(l1) / (math.exp(l0) + math.exp(l1))
    np.testing.assert_allclose(got[1], (1 - p1) * x[0] + p1 * x[1], rtol=1e-14)
    np.testing.assert_allclose(_self(EYE2, x, scale=0.0)[1], x.mean(axis=0), rtol=1e-14)  # uniform weights
    np.testing.assert_allclose(_self(EYE2, x, scale=1 / math.sqrt(2)), _self(EYE2, x), rtol=1e-15)


@pytest.mark.parametrize("window", [1, 2, 3, 10])
def test_sliding_window_visibility(window):
    """Zero logits: row p averages the values of keys (p - W, p], in one step or in two over the same cache."""
    rng = np.random.default_rng(window)
    x = rng.standard_normal((7, 2))
    w = dict(EYE2, wq=np.zeros((2, 2)))
    expected = np.array([x[max(0, p - window + 1):p + 1].mean(axis=0) for p in range(7)])
    np.testing.assert_allclose(_self(w, x, sliding_window=window), expected, rtol=1e-13, atol=1e-15)
    cache = ref.DenseCache(1, 7, 2)
    steps = [ref.attention(w, x[a:b], n_heads=1, n_kv_heads=1, head_dim=2, cache=cache, input_pos=a,
                           sliding_window=window) for a, b in ((0, 4), (4, 7))]
    np.testing.assert_allclose(np.vstack(steps), expected, rtol=1e-13, atol=1e-15)


def test_window_zero_or_none_is_off_and_windows_need_self():
    x = np.random.default_rng(0).standard_normal((5, 2))
    np.testing.assert_array_equal(_self(EYE2, x, sliding_window=0), _self(EYE2, x))
    with pytest.raises(NotImplementedError, match="sliding_window"):
        ref.attention(EYE2, x, n_heads=1, n_kv_heads=1, head_dim=2, attn_type="full", sliding_window=2)
    with pytest.raises(NotImplementedError, match="alibi"):
        ref.attention(EYE2, x, n_heads=1, n_kv_heads=1, head_dim=2, attn_type="cross", context=x, alibi=True)


# ---- biases -----------------------------------------------------------------------------------------------------

def test_value_bias_and_output_bias_by_hand():
    """wv = 0, bv = c: every value is c, so every row is c @ wo.T + bo whatever the weights."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 2))
    c, bo, wo = np.array([0.7, -1.5]), np.array([0.25, 2.0]), rng.standard_normal((2, 2))
    w = dict(EYE2, wv=np.zeros((2, 2)), bv=c, wo=wo, bo=bo, bq=rng.standard_normal(2), bk=rng.standard_normal(2))
    np.testing.assert_allclose(_self(w, x), np.tile(c @ wo.T + bo, (4, 1)), rtol=1e-14)


def test_fused_bias_splits_like_wqkv():
    rng = np.random.default_rng(2)
    n_heads, n_kv_heads, head_dim, dim = 4, 2, 8, 16
    q, kv = n_heads * head_dim, n_kv_heads * head_dim
    sep = {"wq": rng.standard_normal((q, dim)), "wk": rng.standard_normal((kv, dim)),
           "wv": rng.standard_normal((kv, dim)), "wo": rng.standard_normal((dim, q)), "bq": rng.standard_normal(q),
           "bk": rng.standard_normal(kv), "bv": rng.standard_normal(kv), "bo": rng.standard_normal(dim)}
    fused = {"wqkv": np.vstack([sep["wq"], sep["wk"], sep["wv"]]), "wo": sep["wo"], "bo": sep["bo"],
             "bqkv": np.concatenate([sep["bq"], sep["bk"], sep["bv"]])}
    x = rng.standard_normal((5, dim)) / 4
    kw = dict(heads=(n_heads, n_kv_heads), head_dim=head_dim)
    np.testing.assert_allclose(_self(fused, x, **kw), _self(sep, x, **kw), rtol=1e-12)
    no_bo = {k: v for k, v in sep.items() if k != "bo"}
    np.testing.assert_allclose(_self(sep, x, **kw) - _self(no_bo, x, **kw), np.tile(sep["bo"], (5, 1)), rtol=1e-12)


# ---- q/k norms --------------------------------------------------------------------------------------------------

def test_layer_norm_against_numpy_mean_and_var():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((3, 4, 16)) * 3 + 1, rng.standard_normal((4, 16))
    expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(layer_norm(x, w, 1e-5), expected, rtol=1e-13)
    np.testing.assert_allclose(l2_norm(x, 0.0), x / np.linalg.norm(x, axis=-1, keepdims=True) * 4, rtol=1e-13)


def test_qk_norm_modes_by_numpy():
    rng = np.random.default_rng(4)
    n_heads, n_kv_heads, head_dim = 4, 2, 8
    q, k = rng.standard_normal((3, n_heads * head_dim)), rng.standard_normal((5, n_kv_heads * head_dim))
    eps = 1e-6

    def rms(a, w):
        return a / np.sqrt((a ** 2).mean(-1, keepdims=True) + eps) * w

    wq, wk = rng.standard_normal(n_heads * head_dim), rng.standard_normal(n_kv_heads * head_dim)  # OLMo 2
    gq, gk = qk_normalize({"q_norm": wq, "k_norm": wk}, q, k, "rms_all_heads", eps, n_heads, n_kv_heads, head_dim)
    np.testing.assert_allclose(gq, rms(q, wq).reshape(3, n_heads, head_dim), rtol=1e-13)
    np.testing.assert_allclose(gk, rms(k, wk).reshape(5, n_kv_heads, head_dim), rtol=1e-13)
    wq, wk = rng.standard_normal((n_heads, head_dim)), rng.standard_normal((n_kv_heads, head_dim))  # Cohere
    gq, _ = qk_normalize({"q_norm": wq, "k_norm": wk}, q, k, "layer_head", eps, n_heads, n_kv_heads, head_dim)
    qh = q.reshape(3, n_heads, head_dim)
    np.testing.assert_allclose(gq, (qh - qh.mean(-1, keepdims=True)) / np.sqrt(qh.var(-1, keepdims=True) + eps)
                               * wq, rtol=1e-13)
    w = {"q_norm": rng.standard_normal(head_dim), "k_norm": rng.standard_normal(head_dim)}  # Qwen 3, today's
    implicit = qk_normalize(w, q, k, None, eps, n_heads, n_kv_heads, head_dim)
    explicit = qk_normalize(w, q, k, "rms_head", eps, n_heads, n_kv_heads, head_dim)
    np.testing.assert_array_equal(implicit[0], explicit[0])
    np.testing.assert_allclose(explicit[0], rms(qh, w["q_norm"]), rtol=1e-13)
    gq, gk = qk_normalize({}, q, k, "l2", eps, n_heads, n_kv_heads, head_dim)  # Llama 4: no weight
    np.testing.assert_allclose(gq, rms(qh, 1.0), rtol=1e-13)
    with pytest.raises(ValueError, match="qk_norm"):
        qk_normalize({}, q, k, "rms", eps, n_heads, n_kv_heads, head_dim)


def test_l2_norm_commutes_with_rope():
    """Llama 4 normalizes after RoPE, the reference before: a rotation keeps each head's mean square."""
    x = np.random.default_rng(5).standard_normal((6, 2, 16))
    pos = np.arange(6) * 37
    table = rope.cos_sin_cache(200, rope.inv_freq(12, 10000.0))  # partial rotary: 12 of 16 dims
    np.testing.assert_allclose(rope.rotate(l2_norm(x, 1e-5), pos, table), l2_norm(rope.rotate(x, pos, table), 1e-5),
                               rtol=1e-12)


# ---- RoPE scalings ----------------------------------------------------------------------------------------------

GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
           "beta_slow": 1.0, "truncate": False}


def test_yarn_inv_freq_gpt_oss():
    """gpt-oss (theta 150000, head_dim 64, factor 32 over 4096): the ramp runs from pair 8.0928 to pair 17.3980
    (d/2 ln(4096 / (beta 2 pi)) / ln(theta) for beta 32 and 1), as openai/gpt-oss computes it."""
    got = rope.inv_freq(64, 150000.0, GPT_OSS, max_position_embeddings=131072)
    base, half = 150000.0, 32
    low = half * math.log(4096 / (32 * 2 * math.pi)) / math.log(base)
    high = half * math.log(4096 / (1 * 2 * math.pi)) / math.log(base)
    assert abs(low - 8.0928) < 1e-4 and abs(high - 17.3980) < 1e-4
    plain = np.array([base ** (-i / half) for i in range(half)])
    ramp = np.clip((np.arange(half) - low) / (high - low), 0, 1)
    np.testing.assert_allclose(got, plain / 32 * ramp + plain * (1 - ramp), rtol=1e-13)
    np.testing.assert_allclose(got[:9], plain[:9], rtol=1e-15)  # below the ramp: kept
    np.testing.assert_allclose(got[18:], plain[18:] / 32, rtol=1e-15)  # above it: interpolated
    r = (12 - low) / (high - low)
    np.testing.assert_allclose(got[12], plain[12] * (r / 32 + 1 - r), rtol=1e-14)
    assert rope.attention_factor(GPT_OSS, max_position_embeddings=131072) == pytest.approx(1.3465735902799727,
                                                                                           rel=1e-15)


def test_yarn_truncated_ramp_and_factor_rules():
    """truncate (default): the ramp runs over whole pairs floor(8.09) = 8 .. ceil(17.40) = 18."""
    got = rope.inv_freq(64, 150000.0, dict(GPT_OSS, truncate=True), max_position_embeddings=131072)
    plain = rope.inv_freq(64, 150000.0)
    np.testing.assert_allclose(got[13], plain[13] * (0.5 / 32 + 0.5), rtol=1e-14)  # (13 - 8) / 10 = 0.5
    np.testing.assert_allclose(got[8], plain[8], rtol=1e-15)
    np.testing.assert_allclose(got[18], plain[18] / 32, rtol=1e-15)
    # the dict's O with the model's M: factor = M / O (DeepSeek-V3's rule), so 65536 / 4096 = 16, not 32
    np.testing.assert_allclose(rope.inv_freq(64, 150000.0, GPT_OSS, max_position_embeddings=65536)[20],
                               plain[20] / 16, rtol=1e-15)
    np.testing.assert_allclose(rope.inv_freq(64, 150000.0, GPT_OSS)[20], plain[20] / 32, rtol=1e-15)  # M unknown
    deepseek = {"rope_type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096}
    expected = (0.0707 * math.log(40) + 1) / (0.1 * math.log(40) + 1)
    assert rope.attention_factor(deepseek, max_position_embeddings=163840) == pytest.approx(expected, rel=1e-15)
    assert rope.attention_factor(dict(deepseek, attention_factor=0.9)) == 0.9


def test_linear_dynamic_longrope_by_hand():
    plain = rope.inv_freq(4, 10000.0)
    np.testing.assert_allclose(plain, [1.0, 0.01], rtol=1e-15)
    np.testing.assert_allclose(rope.inv_freq(4, 10000.0, {"type": "linear", "factor": 4.0}), [0.25, 0.0025])
    ntk = {"rope_type": "dynamic", "factor": 2.0}
    for seq_len in (None, 3, 4):  # up to O = 4: unscaled
        np.testing.assert_allclose(rope.inv_freq(4, 10000.0, ntk, seq_len=seq_len, max_position_embeddings=4), plain)
    # L = 6: base 10000 * (2 * 6 / 4 - 1)^(4 / 2) = 40000, so the second frequency is 40000^(-1/2) = 0.005
    np.testing.assert_allclose(rope.inv_freq(4, 10000.0, ntk, seq_len=6, max_position_embeddings=4), [1.0, 0.005],
                               rtol=1e-15)
    longrope = {"rope_type": "longrope", "short_factor": [1.0, 2.0], "long_factor": [2.0, 4.0],
                "original_max_position_embeddings": 4}
    np.testing.assert_allclose(rope.inv_freq(4, 10000.0, longrope, seq_len=4), [1.0, 0.005], rtol=1e-15)
    np.testing.assert_allclose(rope.inv_freq(4, 10000.0, longrope, seq_len=5), [0.5, 0.0025], rtol=1e-15)
    np.testing.assert_allclose(rope.inv_freq(4, 10000.0, longrope), [1.0, 0.005], rtol=1e-15)  # no length: short
    assert rope.attention_factor(longrope, max_position_embeddings=4) == 1.0  # M / O = 1
    phi3 = dict(longrope, original_max_position_embeddings=4096)  # Phi-3 mini 128k: ln 32 / ln 4096 = 5 / 12
    assert rope.attention_factor(phi3, max_position_embeddings=131072) == pytest.approx(math.sqrt(17 / 12), 1e-15)
    assert rope.attention_factor({"rope_type": "llama3", "factor": 8}) == 1.0
    np.testing.assert_allclose(rope.inv_freq(4, 1.0, {"rope_type": "default", "rope_theta": 10000.0}), plain)


def test_cos_sin_cache_carries_the_attention_factor():
    freqs = np.array([1.0, 0.01])
    np.testing.assert_allclose(rope.cos_sin_cache(3, freqs, 2.0)[2], 2 * np.array([math.cos(2), math.cos(0.02),
                                                                                   math.sin(2), math.sin(0.02)]))
    np.testing.assert_array_equal(rope.cos_sin_cache(5, freqs), rope.cos_sin_cache(5, freqs, 1.0))


def _hand_attention(x, freqs, factor):
    """One head (head_dim 4, NeoX pairs (0, 2) and (1, 3)), wq = wk = wv = wo = I, causal, written out."""
    def rot(v, p):
        out = v.copy()
        for i, f in enumerate(freqs):
            c, s = factor * math.cos(p * f), factor * math.sin(p * f)
            out[i], out[i + 2] = v[i] * c - v[i + 2] * s, v[i] * s + v[i + 2] * c
        return out

    rows = []
    for p in range(len(x)):
        logits = [rot(x[p], p) @ rot(x[j], j) / 2.0 for j in range(p + 1)]
        e = np.exp(np.array(logits) - max(logits))
        rows.append(sum(e[j] * x[j] for j in range(p + 1)) / e.sum())
    return np.array(rows)


@pytest.mark.parametrize("scaling, max_pos, freqs, factor", [
    ({"rope_type": "dynamic", "factor": 2.0}, 4, [1.0, 0.005], 1.0),  # L = 6 > O = 4: base 40000
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 64,
     [1.0, 0.0025], 0.1 * math.log(4) + 1),  # ramp over pairs 0..1: pair 0 kept, pair 1 divided by 4
    ({"rope_type": "longrope", "short_factor": [1.0, 1.0], "long_factor": [2.0, 4.0],
      "original_max_position_embeddings": 4}, 16, [0.5, 0.0025], math.sqrt(2)),  # L = 6 > 4: long; M / O = 4
], ids=["dynamic", "yarn", "longrope"])
def test_attention_rotates_with_the_sequence_length_and_attention_factor(scaling, max_pos, freqs, factor):
    emb = types.SimpleNamespace(rotary_dim=4, rope_theta=10000.0, scaling=scaling, is_neox_style=True,
                                max_position_embeddings=max_pos)
    x = np.random.default_rng(6).standard_normal((6, 4))
    eye = {"wq": np.eye(4), "wk": np.eye(4), "wv": np.eye(4), "wo": np.eye(4)}
    got = _self(eye, x, head_dim=4, rope=emb)
    np.testing.assert_allclose(got, _hand_attention(x, freqs, factor), rtol=1e-12)
    old = types.SimpleNamespace(rotary_dim=4, rope_theta=10000.0, scaling=None, is_neox_style=True)  # no max_pos
    np.testing.assert_allclose(_self(eye, x, head_dim=4, rope=old), _hand_attention(x, [1.0, 0.01], 1.0),
                               rtol=1e-12)


# ---- decoder_logits -----------------------------------------------------------------------------------------------

class _Config:
    vocab_size, dim, n_layers, n_heads, n_kv_heads, head_dim, hidden_dim, norm_eps = 11, 8, 2, 2, 1, 4, 6, 1e-5

    def __init__(self, options=None):
        if options is not None:
            self.attention_options = lambda i: options[i]

    def rope(self):
        return None


def _decoder_weights(rng):
    c = _Config
    w = {"embed": rng.standard_normal((c.vocab_size, c.dim)), "norm": np.ones(c.dim),
         "output": rng.standard_normal((c.vocab_size, c.dim))}
    for i in range(c.n_layers):
        p = f"layers.{i}."
        w.update({p + "attn_norm": np.ones(c.dim), p + "mlp_norm": np.ones(c.dim),
                  p + "attn.wq": rng.standard_normal((8, 8)) / 3, p + "attn.wk": rng.standard_normal((4, 8)) / 3,
                  p + "attn.wv": rng.standard_normal((4, 8)), p + "attn.wo": rng.standard_normal((8, 8)) / 3,
                  p + "w1": rng.standard_normal((6, 8)), p + "w3": rng.standard_normal((6, 8)),
                  p + "w2": rng.standard_normal((8, 6)) / 3})
    w["layers.1.attn.bq"], w["layers.1.attn.sinks"] = rng.standard_normal(8), np.array([0.5, -1.0])
    return w


def test_decoder_logits_passes_each_layers_options():
    rng = np.random.default_rng(7)
    w, ids = _decoder_weights(rng), rng.integers(0, 11, 9)
    options = [{"softcap": 0.5, "sliding_window": 3, "alibi": True}, {"bias": True, "sinks": True, "scale": 0.1}]
    got = ref.decoder_logits(w, _Config(options), ids)
    c = _Config
    h = w["embed"][ids]
    for i in range(2):
        attn = {k.split(".", 3)[3]: v for k, v in w.items() if k.startswith(f"layers.{i}.attn.")}
        kw = {k: v for k, v in options[i].items() if k not in ("bias", "sinks")}
        h = h + ref.attention(attn, ref.rms_norm(h, 1.0, c.norm_eps), n_heads=2, n_kv_heads=1, head_dim=4,
                              cache=ref.DenseCache(1, 9, 4), norm_eps=c.norm_eps, **kw)
        a = ref.rms_norm(h, 1.0, c.norm_eps)
        gate, up = a @ w[f"layers.{i}.w1"].T, a @ w[f"layers.{i}.w3"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[f"layers.{i}.w2"].T
    np.testing.assert_allclose(got, ref.rms_norm(h, 1.0, c.norm_eps) @ w["output"].T, rtol=1e-12)
    assert not np.allclose(got, ref.decoder_logits(w, _Config(), ids))  # the options change the logits
    with pytest.raises(ValueError, match="window"):
        ref.decoder_logits(w, _Config([{"window": 3}, {}]), ids)
