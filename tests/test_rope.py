"""Rotary embeddings (RotaryEmbedding, rope_and_cache; kernels_cu/rope.cu) against cupaged.reference.rope, a
float64 complex-multiplication reference, on the sim (and cuda when a GPU is present).

q / k / v are views of one fused QKV buffer; awkward token counts (1, 7, 97); positions int64 and int32 up to
~100k; both pairing styles, partial rotary dims and Llama 3 frequency scaling. Caches start poisoned (0xFF): they
must come back bit-identical to the reference's writes of v and of the kernel's own rotated k (checked itself
against the float64 rotation within the tolerance table).

Hugging Face's scalings (SCALED: every rope_type, the per-length ones below and above the original context O):
frequencies, attention factor, cos_sin_cache, cos_sin_rows and the in-place rotation against the reference, a few
values pinned by hand from transformers' formulas for real configs (gpt-oss, DeepSeek-V3, Phi-3-mini-128k), and
every error."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import reference
from cupaged.testing import assert_close, poisoned

F16, BF16, F32 = np.float16, ml_dtypes.bfloat16, np.float32
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
STYLES = {  # (head size, rotary dim, neox, scaling, theta)
    "neox": (128, None, True, None, 10000.0),
    "gptj": (64, None, False, None, 10000.0),
    "partial-neox": (128, 64, True, None, 1e6),
    "partial-gptj": (80, 32, False, None, 10000.0),
    "llama3": (128, None, True, LLAMA3, 500000.0),
    "odd-neox": (72, 36, True, None, 10000.0),   # 18 pairs: not a multiple of 8, the kernels' element-wise path
    "odd-gptj": (40, 20, False, None, 10000.0),
}


def _qkv(rng, tokens, heads, head_size, dtype):
    """q, k, v as views of one fused [tokens, (H + 2 KV) head_size] buffer, as a model's QKV projection makes."""
    num_heads, num_kv_heads = heads
    fused = (rng.standard_normal((tokens, num_heads + 2 * num_kv_heads, head_size)) * 2).astype(dtype)
    return fused, fused[:, :num_heads], fused[:, num_heads:num_heads + num_kv_heads], fused[:, num_heads + num_kv_heads:]


def test_frequencies_and_cos_sin_cache_match_the_reference():
    for head_size, rotary_dim, neox, scaling, theta in STYLES.values():
        emb = cupaged.RotaryEmbedding(head_size, rope_theta=theta, is_neox_style=neox, rotary_dim=rotary_dim,
                                      scaling=scaling)
        freqs = reference.rope.inv_freq(emb.rotary_dim, theta, scaling)
        np.testing.assert_allclose(emb.inv_freq, freqs, rtol=1e-14)
        cache = emb.cos_sin_cache(9000)
        assert cache.dtype == np.float32 and cache.shape == (9000, emb.rotary_dim)
        np.testing.assert_allclose(cache, reference.rope.cos_sin_cache(9000, freqs), rtol=0, atol=6e-8)  # float32
    # Llama 3: high frequencies kept, low ones divided by the factor, the band between blended
    plain = reference.rope.inv_freq(128, 500000.0)
    scaled = cupaged.RotaryEmbedding(128, rope_theta=500000.0, scaling=LLAMA3).inv_freq
    assert scaled[0] == plain[0] and scaled[-1] == plain[-1] / 8 and np.all(scaled <= plain * (1 + 1e-12))


@pytest.mark.parametrize("style", STYLES, ids=list(STYLES))
@pytest.mark.parametrize("dtype, tokens, pos_dtype", [(F32, 7, np.int64), (F16, 97, np.int32), (BF16, 1, np.int64)],
                         ids=["f32-7", "f16-97", "bf16-1"])
def test_rotary_embedding_rotates_q_and_k_in_place(backend, style, dtype, tokens, pos_dtype):
    head_size, rotary_dim, neox, scaling, theta = STYLES[style]
    rng = np.random.default_rng(tokens + head_size)
    emb = cupaged.RotaryEmbedding(head_size, rope_theta=theta, is_neox_style=neox, rotary_dim=rotary_dim,
                                  scaling=scaling)
    fused, q, k, v = _qkv(rng, tokens, (6, 2), head_size, dtype)
    positions = rng.integers(0, 100_000, tokens).astype(pos_dtype)
    table = reference.rope.cos_sin_cache(100_000, reference.rope.inv_freq(emb.rotary_dim, theta, scaling))
    want_q = reference.rope.rotate(q, positions, table, is_neox_style=neox)
    want_k = reference.rope.rotate(k, positions, table, is_neox_style=neox)
    dev = backend.asarray(fused)
    got_q, got_k = emb(backend.asarray(positions), dev[:, :6], dev[:, 6:8])
    out = backend.to_numpy(dev)
    assert_close(out[:, :6], want_q, dtype, "q")
    assert_close(out[:, 6:8], want_k, dtype, "k")
    assert np.array_equal(out[:, 8:].view(np.uint8), v.view(np.uint8))  # v untouched
    assert backend.to_numpy(got_q).shape == q.shape and backend.to_numpy(got_k).shape == k.shape


CASES = [  # (dtype, kv_cache_dtype, layout, style, tokens, per-head scales, slot dtype)
    (F16, "auto", "NHD", "neox", 7, False, np.int64),
    (BF16, "auto", "HND", "gptj", 97, False, np.int32),
    (F32, "auto", "NHD", "partial-gptj", 1, False, np.int64),
    (F16, "fp8", "HND", "llama3", 33, True, np.int64),
    (BF16, "fp8_e5m2", "NHD", "partial-neox", 97, False, np.int32),
    (F16, "fp8_e4m3", "NHD", "gptj", 7, True, np.int32),
    (BF16, "auto", "HND", "odd-neox", 33, False, np.int64),
    (F32, "fp8_e5m2", "NHD", "odd-gptj", 7, True, np.int64),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{np.dtype(c[0]).name}-{c[1]}-{c[2]}-{c[3]}-t{c[4]}")
def test_rope_and_cache(backend, case):
    dtype, kv, layout, style, tokens, per_head, slot_dtype = case
    head_size, rotary_dim, neox, scaling, theta = STYLES[style]
    rng = np.random.default_rng(tokens)
    emb = cupaged.RotaryEmbedding(head_size, rope_theta=theta, is_neox_style=neox, rotary_dim=rotary_dim,
                                  scaling=scaling)
    table = emb.cos_sin_cache(4096)
    num_kv_heads, block_size, num_blocks = 2, 16, -(-tokens // 16) + 3
    fused, q, k, v = _qkv(rng, tokens, (8, num_kv_heads), head_size, dtype)
    slots = rng.permutation(num_blocks * block_size)[:tokens].astype(slot_dtype)
    slots[::5] = -1  # padding: rotated, not written
    positions = rng.integers(0, 4096, tokens).astype(np.int64)
    shape = (num_blocks, block_size, num_kv_heads, head_size) if layout == "NHD" else \
        (num_blocks, num_kv_heads, block_size, head_size)
    cache_dtype = dtype if kv == "auto" else np.uint8
    kc, vc = poisoned(shape, cache_dtype), poisoned(shape, cache_dtype)
    scale = rng.uniform(0.02, 0.1, num_kv_heads).astype(np.float32) if per_head else 0.05
    want_q, want_k, _, want_vc = reference.rope.rope_and_cache(
        q, k, v, positions, table, kc, vc, slots, kv, scale, scale, is_neox_style=neox, layout=layout)
    dev, dkc, dvc = backend.asarray(fused), backend.asarray(kc), backend.asarray(vc)
    sc = backend.asarray(scale) if per_head else scale
    cupaged.rope_and_cache(dev[:, :8], dev[:, 8:8 + num_kv_heads], dev[:, 8 + num_kv_heads:], backend.asarray(positions),
                           backend.asarray(table), dkc, dvc, backend.asarray(slots), kv, sc, sc, is_neox_style=neox,
                           layout=layout, validate=True)
    out, got_kc, got_vc = backend.to_numpy(dev), backend.to_numpy(dkc), backend.to_numpy(dvc)
    assert_close(out[:, :8], want_q, dtype, "q")
    assert_close(out[:, 8:8 + num_kv_heads], want_k, dtype, "k")
    assert np.array_equal(got_vc.view(np.uint8), want_vc.view(np.uint8)), "value_cache"
    # the key cache holds the kernel's own rotated keys, written as reshape_and_cache_flash writes them (rotated in
    # float32, a key one ulp off the float64 result may quantize to a neighbouring fp8 code: checked above)
    own_kc, _ = reference.reshape_and_cache_flash(out[:, 8:8 + num_kv_heads], v, kc, vc, slots, kv, scale, scale,
                                                  layout=layout)
    assert np.array_equal(got_kc.view(np.uint8), own_kc.view(np.uint8)), "key_cache"


def _valid(backend):
    rng = np.random.default_rng(3)
    fused, q, k, v = _qkv(rng, 5, (4, 2), 64, F16)
    return dict(q=q.copy(), k=k.copy(), v=v.copy(), positions=np.arange(5, dtype=np.int64),
                cos_sin_cache=cupaged.RotaryEmbedding(64).cos_sin_cache(16), key_cache=np.zeros((2, 16, 2, 64), F16),
                value_cache=np.zeros((2, 16, 2, 64), F16), slot_mapping=np.array([0, 1, 2, -1, 20], np.int64))


BAD = {
    "q dtype": (lambda a: {"q": a["q"].astype(np.float32)}, TypeError, "q"),
    "q head size": (lambda a: {"q": a["q"][..., :32]}, ValueError, "head size"),
    "k tokens": (lambda a: {"k": a["k"][:4], "v": a["v"][:4]}, ValueError, "tokens|slot_mapping"),
    "positions dtype": (lambda a: {"positions": a["positions"].astype(np.float32)}, TypeError, "positions"),
    "positions length": (lambda a: {"positions": a["positions"][:3]}, ValueError, "positions"),
    "cache dtype": (lambda a: {"cos_sin_cache": a["cos_sin_cache"].astype(np.float64)}, TypeError, "cos_sin_cache"),
    "odd rotary dim": (lambda a: {"cos_sin_cache": a["cos_sin_cache"][:, :31]}, ValueError, "cos_sin_cache"),
    "rotary dim > head": (lambda a: {"cos_sin_cache": np.zeros((16, 66), np.float32)}, ValueError, "cos_sin_cache"),
    "layout": (lambda a: {"layout": "vllm"}, ValueError, "layout"),
    "key_cache dtype": (lambda a: {"key_cache": a["key_cache"].astype(np.float32)}, TypeError, "key_cache"),
    "position past the cache": (lambda a: {"positions": np.array([0, 1, 2, 3, 16], np.int64)}, ValueError,
                                "positions\\[4\\]"),
    "slot past the pool": (lambda a: {"slot_mapping": np.array([0, 1, 2, 3, 64], np.int64)}, ValueError,
                           "slot_mapping"),
    # the arguments by their own names, k and v (before: "key", "value")
    "v dtype": (lambda a: {"v": a["v"].astype(np.float32)}, TypeError, "^v must have k's dtype float16"),
    "k ndim": (lambda a: {"k": a["k"].reshape(5, -1)}, ValueError, "^k must be 3-D"),
    "v last dim strided": (lambda a: {"v": a["scratch"][:, :2, ::2]}, ValueError, "^v must be contiguous"),
    # arrays the kernel writes while it reads or writes another (before: accepted, the results corrupted)
    "k is q": (lambda a: {"q": a["k"]}, ValueError, "^q and k share memory"),
    "k overlaps q": (lambda a: {"q": a["scratch"][:, :4, :64], "k": a["scratch"][:, 3:5, :64]}, ValueError,
                     "^q and k share memory"),
    "k a view of key_cache": (lambda a: {"k": a["key_cache"].reshape(-1, 2, 64)[:5]}, ValueError,
                              "^k and key_cache share memory"),
    "v a view of value_cache": (lambda a: {"v": a["value_cache"].reshape(-1, 2, 64)[3:8]}, ValueError,
                                "^value_cache and v share memory"),
    "value_cache is key_cache": (lambda a: {"value_cache": a["key_cache"]}, ValueError,
                                 "^key_cache and value_cache share memory"),
    "v overlaps q": (lambda a: {"q": a["scratch"][:, :4, :64], "v": a["scratch"][:, 2:4, :64]}, ValueError,
                     "^q and v share memory"),
    # a missing array (before: AttributeError on None.ndim)
    **{f"{name} None": (lambda a, name=name: {name: None}, TypeError, f"^{name} must be a numpy or cupy array")
       for name in ("q", "k", "v", "positions", "cos_sin_cache", "key_cache", "value_cache", "slot_mapping")},
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_raises_before_any_write(backend, case):
    change, exc, match = BAD[case]
    a = {n: backend.asarray(x) for n, x in _valid(backend).items()}
    a["scratch"] = backend.asarray(np.zeros((5, 8, 128), F16))  # a change may take views of it, or of the arguments
    changed = change(a)
    del a["scratch"]
    a.update({n: backend.asarray(x) if isinstance(x, np.ndarray) else x for n, x in changed.items()})
    before = {n: backend.to_numpy(a[n]).copy() for n in ("q", "k", "key_cache", "value_cache") if a[n] is not None}
    with pytest.raises(exc, match=match):
        cupaged.rope_and_cache(**a, validate=True)
    for n in ("q", "k", "key_cache", "value_cache"):
        if a[n] is not None:
            assert np.array_equal(backend.to_numpy(a[n]).view(np.uint8), before[n].view(np.uint8)), n


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(head_dim=64, rotary_dim=33), ValueError, "rotary_dim"),
    (dict(head_dim=64, rotary_dim=128), ValueError, "rotary_dim"),
    (dict(head_dim=64, rope_theta=0.0), ValueError, "rope_theta"),
    (dict(head_dim=1024), NotImplementedError, "rotary_dim"),
    (dict(head_dim=64, scaling={"rope_type": "llama3", "factor": 8.0}), ValueError, "low_freq_factor"),
    # Hugging Face's rules for Llama 3 (before: accepted; low > high blends the band backwards, equal divides by 0)
    (dict(head_dim=64, scaling={**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0}), ValueError,
     r"scaling\['high_freq_factor'\] must be greater than scaling\['low_freq_factor'\], got 1.0 and 4.0"),
    (dict(head_dim=64, scaling={**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 2.0}), ValueError,
     r"scaling\['high_freq_factor'\] must be greater"),
    (dict(head_dim=64, scaling={**LLAMA3, "factor": 0.5}), ValueError, r"scaling\['factor'\] must be >= 1"),
    (dict(head_dim=64, scaling={**LLAMA3, "original_max_position_embeddings": 8192.5}), TypeError,
     r"scaling\['original_max_position_embeddings'\] must be an int"),
    (dict(head_dim=64, scaling={**LLAMA3, "original_max_position_embeddings": 0}), ValueError,
     r"scaling\['original_max_position_embeddings'\] must be >= 1"),
])
def test_rotary_embedding_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cupaged.RotaryEmbedding(**kwargs)


@pytest.mark.parametrize("overlap", ["k is q", "k overlaps q"])
def test_rotary_embedding_rejects_q_and_k_sharing_memory(backend, overlap):
    """q and k are rotated in place in one launch: one array as both, or overlapping views, rotate the shared
    elements twice (before: accepted). A ValueError naming both; nothing rotated. Disjoint views of one fused
    buffer pass (test_rotary_embedding_rotates_q_and_k_in_place)."""
    fused = backend.asarray(np.random.default_rng(0).standard_normal((5, 6, 64)).astype(F16))
    before = backend.to_numpy(fused).copy()
    q, k = (fused[:, :2], fused[:, :2]) if overlap == "k is q" else (fused[:, :4], fused[:, 3:5])
    with pytest.raises(ValueError, match="^q and k share memory"):
        cupaged.RotaryEmbedding(64)(backend.asarray(np.arange(5)), q, k)
    assert np.array_equal(backend.to_numpy(fused).view(np.uint8), before.view(np.uint8))


def test_rotary_embedding_names_a_missing_array():
    emb, q = cupaged.RotaryEmbedding(64), np.zeros((5, 4, 64), F16)
    for name, args in (("positions", (None, q, q[:, :2])), ("q", (np.arange(5), None, q[:, :2])),
                       ("k", (np.arange(5), q, None))):
        with pytest.raises(TypeError, match=f"^{name} must be a numpy or cupy array"):
            emb(*args)


@pytest.mark.parametrize("style", ["neox", "partial-gptj"])
def test_rope_and_cache_reads_each_q_k_v_byte_once(style):
    """Counted by the sim's profiler: k and v are each read once, q's rotated dimensions once (k's rotated runs go
    to the cache from the registers that rotated them; v2 read a token's k back after a barrier), the position by
    the threads of the cos / sin row only (v2: every thread, 128 loads a token)."""
    from cupaged import sim

    head_size, rotary_dim, neox, _, _ = STYLES[style]
    tokens, heads, kv_heads = 9, 4, 2
    rng = np.random.default_rng(5)
    q, k, v = (sim.asarray(rng.standard_normal((tokens, h, head_size)).astype(F16)) for h in (heads, kv_heads, kv_heads))
    emb = cupaged.RotaryEmbedding(head_size, is_neox_style=neox, rotary_dim=rotary_dim)
    kc, vc = sim.zeros((4, 16, kv_heads, head_size), F16), sim.zeros((4, 16, kv_heads, head_size), F16)
    positions = sim.asarray(rng.integers(0, 64, tokens).astype(np.int64))
    with sim.profile() as prof:
        cupaged.rope_and_cache(q, k, v, positions, emb.cos_sin_cache(64), kc, vc,
                               sim.asarray(rng.permutation(64)[:tokens].astype(np.int64)), "auto", 1.0, 1.0,
                               is_neox_style=neox)
    args = prof.launches[0].args
    rotated = q.nbytes * emb.rotary_dim // head_size
    for name, nbytes in (("q", rotated), ("k", k.nbytes), ("v", v.nbytes)):
        assert args[name].bytes_read == nbytes, (name, args[name].bytes_read, nbytes)
    assert args["positions"].bytes_read == tokens * 8 * (emb.rotary_dim // 2)


# Hugging Face's rope scalings: (head_dim, rotary_dim, rope_theta, scaling, max_position_embeddings, current lengths)
PHI3_SHORT, PHI3_LONG = [1.0 + 0.01 * i for i in range(48)], [1.0 + 0.5 * i for i in range(48)]
GPT_OSS = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
           "beta_slow": 1.0, "truncate": False}
PHI3 = {"rope_type": "longrope", "short_factor": PHI3_SHORT, "long_factor": PHI3_LONG,
        "original_max_position_embeddings": 4096}
SCALED = {
    "default-dict": (64, None, None, {"rope_type": "default", "rope_theta": 500000.0}, None, (None,)),
    "linear": (128, None, 10000.0, {"rope_type": "linear", "factor": 4.0}, None, (None, 9000)),
    "linear-legacy-partial": (80, None, 10000.0, {"type": "linear", "factor": 2.5, "partial_rotary_factor": 0.4},
                              None, (None,)),
    "dynamic": (64, None, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 2048, (None, 1000, 2048, 2049, 5000)),
    "dynamic-original": (128, 64, 1e6, {"rope_type": "dynamic", "factor": 4.0,
                                        "original_max_position_embeddings": 1024}, 32768, (1024, 1025, 9000)),
    "yarn": (128, None, 1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072,
             (None,)),
    "yarn-no-original": (64, None, 10000.0, {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0},
                         8192, (None,)),
    "yarn-mscale": (64, None, 10000.0, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                        "mscale": 1.0, "mscale_all_dim": 0.8}, None, (None,)),
    "yarn-attention-factor": (96, 64, 10000.0, {"rope_type": "yarn", "factor": 16.0, "attention_factor": 0.9,
                                                "original_max_position_embeddings": 2048}, None, (None,)),
    "yarn-gpt-oss": (64, None, 150000.0, GPT_OSS, 131072, (None,)),
    "longrope": (96, None, 10000.0, PHI3, 131072, (None, 4096, 4097, 20000)),
    "longrope-factor": (64, None, 10000.0, {"rope_type": "longrope", "short_factor": PHI3_SHORT[:32],
                                            "long_factor": PHI3_LONG[:32], "factor": 8.0}, 2048, (2048, 2049)),
    "llama3": (128, None, 500000.0, LLAMA3, None, (None,)),
}


def _scaled(name):
    """The case's RotaryEmbedding, and the reference's frequencies (a function of the current length) and factor."""
    head_dim, rotary_dim, theta, scaling, max_pos, _ = SCALED[name]
    emb = cupaged.RotaryEmbedding(head_dim, rope_theta=theta, rotary_dim=rotary_dim, scaling=scaling,
                                  max_position_embeddings=max_pos, is_neox_style=name != "yarn-attention-factor")

    def freqs(seq_len):
        return reference.rope.inv_freq(emb.rotary_dim, 10000.0 if theta is None else theta, scaling, seq_len=seq_len,
                                       max_position_embeddings=max_pos)

    return emb, freqs, reference.rope.attention_factor(scaling, max_position_embeddings=max_pos)


@pytest.mark.parametrize("name", SCALED, ids=list(SCALED))
def test_scaled_frequencies_attention_factor_and_cos_sin_cache(name):
    emb, freqs, factor = _scaled(name)
    kind = SCALED[name][3].get("rope_type", SCALED[name][3].get("type"))
    assert emb.per_length == (kind in ("dynamic", "longrope"))
    assert emb.attention_factor == pytest.approx(factor, rel=1e-14, abs=0)
    assert (emb.attention_factor == 1.0) == (kind not in ("yarn", "longrope"))
    np.testing.assert_array_equal(emb.inv_freq, emb.frequencies())
    for seq_len in SCALED[name][5]:
        np.testing.assert_allclose(emb.frequencies(seq_len), freqs(seq_len), rtol=1e-13, err_msg=f"L={seq_len}")
        cache = emb.cos_sin_cache(9000, seq_len=seq_len)
        assert cache.dtype == np.float32 and cache.shape == (9000, emb.rotary_dim)
        np.testing.assert_allclose(cache, reference.rope.cos_sin_cache(9000, freqs(seq_len), factor), rtol=0,
                                   atol=6e-8 * max(factor, 1.0), err_msg=f"L={seq_len}")  # one float32 rounding


def test_per_length_scalings_switch_at_the_original_length():
    """dynamic: the default frequencies up to O, a grown base past it (lower frequencies, the first kept); longrope:
    the short factors up to O, the long ones past it; the others ignore the length."""
    dynamic, longrope, yarn = (_scaled(n)[0] for n in ("dynamic", "longrope", "yarn-gpt-oss"))
    plain = reference.rope.inv_freq(64)
    for seq_len in (1, 2048):
        np.testing.assert_array_equal(dynamic.frequencies(seq_len), dynamic.inv_freq)
    np.testing.assert_allclose(dynamic.inv_freq, plain, rtol=1e-15)
    grown = dynamic.frequencies(2049)
    assert grown[0] == 1.0 and np.all(grown[1:] < plain[1:]) and np.all(dynamic.frequencies(5000)[1:] < grown[1:])
    np.testing.assert_array_equal(longrope.frequencies(4096), longrope.inv_freq)
    np.testing.assert_array_equal(longrope.frequencies(4097), longrope.frequencies(10**6))
    np.testing.assert_allclose(longrope.frequencies(4097) * PHI3_LONG, longrope.inv_freq * PHI3_SHORT, rtol=1e-15)
    np.testing.assert_array_equal(yarn.frequencies(10**6), yarn.inv_freq)


def test_real_configs_pinned_by_hand():
    """Values worked out from transformers' formulas, not from a reference implementation."""
    # gpt-oss (rope_theta 150000, head_dim 64, max_position_embeddings 131072): factor 131072 / 4096 = 32, attention
    # factor 0.1 ln 32 + 1 = 1 + ln(2) / 2; correction dims (truncate False) 64 ln(4096 / (2 pi beta)) / (2 ln 150000):
    # low 8.0928 (beta_fast 32), high 17.3980 (beta_slow 1); f_i = 150000^(-i / 32), ramp (i - low) / (high - low)
    emb = _scaled("yarn-gpt-oss")[0]
    assert emb.attention_factor == pytest.approx(1 + math.log(2) / 2, rel=1e-15)
    assert emb.inv_freq[0] == 1.0 and emb.inv_freq[5] == pytest.approx(150000 ** (-5 / 32), rel=1e-15)  # kept
    assert emb.inv_freq[12] == pytest.approx(0.006794959489732219, rel=1e-13)  # ramp 0.41989: blended
    assert emb.inv_freq[31] == pytest.approx(150000 ** (-31 / 32) / 32, rel=1e-13)  # interpolated
    # DeepSeek-V3: mscale = mscale_all_dim = 1 cancel (attention factor exactly 1); factor 163840 / 4096 = 40
    deepseek = {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    ds = cupaged.RotaryEmbedding(64, scaling=deepseek, max_position_embeddings=163840)
    assert ds.attention_factor == 1.0 and ds.inv_freq[-1] == pytest.approx(10000 ** (-31 / 32) / 40, rel=1e-13)
    # Phi-3-mini-128k style longrope: factor 131072 / 4096 = 32, attention factor sqrt(1 + ln 32 / ln 4096) =
    # sqrt(1 + 5 / 12); frequency i = 1 / (ext_i 10000^(i / 48))
    phi = _scaled("longrope")[0]
    assert phi.attention_factor == pytest.approx(math.sqrt(17 / 12), rel=1e-15)
    assert phi.inv_freq[1] == pytest.approx(1 / (1.01 * 10000 ** (1 / 48)), rel=1e-14)
    assert phi.frequencies(4097)[47] == pytest.approx(4.94501085154526e-06, rel=1e-13)  # 1 / (24.5 * 10000^(47/48))


def _reference_rotation(name, q, k, positions, seq_len):
    emb, freqs, factor = _scaled(name)
    table = reference.rope.cos_sin_cache(int(positions.max()) + 1, freqs(seq_len), factor)
    return (reference.rope.rotate(x, positions, table, is_neox_style=emb.is_neox_style) for x in (q, k))


CALLS = [  # (scaling case, dtype, tokens, largest position + 1)
    ("default-dict", F32, 7, 3000),
    ("linear-legacy-partial", F16, 33, 20000),
    ("dynamic", F16, 7, 2048),      # at O: the default frequencies
    ("dynamic", F32, 97, 6000),     # past O: the grown base
    ("yarn-gpt-oss", F16, 97, 131072),
    ("yarn-attention-factor", BF16, 1, 500),  # GPT-J pairs
    ("longrope", BF16, 7, 4096),    # short factors
    ("longrope", F32, 33, 9000),    # long factors
    ("llama3", F16, 7, 100000),
]


@pytest.mark.parametrize("case", CALLS, ids=lambda c: f"{c[0]}-{np.dtype(c[1]).name}-t{c[2]}-L{c[3]}")
def test_scaled_rotary_embedding_call(backend, case):
    """The in-place rotation with the frequencies of length max(positions) + 1 and the attention factor, against the
    reference; bit-identical to rope_and_cache with cos_sin_cache(seq_len=that length) (the kernel multiplies by
    the attention factor in float64 before its one rounding, as cos_sin_cache does)."""
    name, dtype, tokens, seq_len = case
    emb = _scaled(name)[0]
    rng = np.random.default_rng(tokens + seq_len)
    positions = rng.integers(0, seq_len, tokens).astype(np.int64)
    positions[-1] = seq_len - 1
    fused, q, k, _ = _qkv(rng, tokens, (6, 2), emb.head_dim, dtype)
    want_q, want_k = _reference_rotation(name, q, k, positions, seq_len)
    dev, pos = backend.asarray(fused), backend.asarray(positions)
    emb(pos, dev[:, :6], dev[:, 6:8])
    out = backend.to_numpy(dev)
    assert_close(out[:, :6], want_q, dtype, "q")
    assert_close(out[:, 6:8], want_k, dtype, "k")
    cached = backend.asarray(fused)
    kc, vc = (backend.asarray(np.zeros((1, 16, 2, emb.head_dim), dtype)) for _ in range(2))
    cupaged.rope_and_cache(cached[:, :6], cached[:, 6:8], cached[:, 8:], pos,
                           backend.asarray(emb.cos_sin_cache(seq_len, seq_len=seq_len)), kc, vc,
                           backend.asarray(np.full(tokens, -1, np.int64)), is_neox_style=emb.is_neox_style)
    assert np.array_equal(backend.to_numpy(cached)[:, :8].view(np.uint8), out[:, :8].view(np.uint8))


@pytest.mark.parametrize("name", ["dynamic", "longrope", "yarn-gpt-oss"])
def test_cos_sin_rows_give_each_sequence_its_frequencies(name):
    emb, freqs, factor = _scaled(name)
    rng = np.random.default_rng(len(name))
    seq_lens = rng.choice([1, 2048, 2049, 4096, 4097, 9000], 97)
    positions = rng.integers(0, seq_lens)
    rows = emb.cos_sin_rows(positions, seq_lens)
    assert rows.dtype == np.float32 and rows.shape == (97, emb.rotary_dim)
    for length in np.unique(seq_lens).tolist():
        want = reference.rope.cos_sin_cache(length, freqs(length), factor)[positions[seq_lens == length]]
        np.testing.assert_allclose(rows[seq_lens == length], want, rtol=0, atol=6e-8 * max(factor, 1.0),
                                   err_msg=f"L={length}")
        np.testing.assert_array_equal(rows[seq_lens == length],
                                      emb.cos_sin_cache(length, seq_len=length)[positions[seq_lens == length]])
    assert emb.cos_sin_rows(np.zeros(0, np.int32), np.zeros(0, np.int32)).shape == (0, emb.rotary_dim)


@pytest.mark.parametrize("name, dtype", [("dynamic", F16), ("longrope", BF16)], ids=["dynamic", "longrope"])
def test_rope_and_cache_with_cos_sin_rows(backend, name, dtype):
    """The attention layer's path for a batch of sequences of several lengths: rope_and_cache at positions
    arange(num_tokens) over the cos_sin_rows table, each token rotated with its own sequence's frequencies."""
    emb, freqs, factor = _scaled(name)
    rng = np.random.default_rng(7)
    seq_lens = np.repeat([1500, 4097, 8000], [20, 30, 47])  # 97 tokens of three sequences
    positions = rng.integers(0, seq_lens)
    fused, q, k, v = _qkv(rng, 97, (4, 2), emb.head_dim, dtype)
    want_q, want_k = np.empty(q.shape), np.empty(k.shape)
    for length in np.unique(seq_lens).tolist():
        sel = seq_lens == length
        table = reference.rope.cos_sin_cache(length, freqs(length), factor)
        want_q[sel], want_k[sel] = (reference.rope.rotate(x[sel], positions[sel], table) for x in (q, k))
    dev, kc = backend.asarray(fused), backend.asarray(poisoned((7, 16, 2, emb.head_dim), dtype))
    vc = backend.asarray(poisoned((7, 16, 2, emb.head_dim), dtype))
    cupaged.rope_and_cache(dev[:, :4], dev[:, 4:6], dev[:, 6:], backend.asarray(np.arange(97)),
                           backend.asarray(emb.cos_sin_rows(positions, seq_lens)), kc, vc,
                           backend.asarray(np.arange(97, dtype=np.int64)), validate=True)
    out = backend.to_numpy(dev)
    assert_close(out[:, :4], want_q, dtype, "q")
    assert_close(out[:, 4:6], want_k, dtype, "k")


SHORT = {"short_factor": [1.0] * 32, "long_factor": [2.0] * 32}
BAD_SCALING = [  # (scaling, other RotaryEmbedding(64, ...) arguments, exception, match)
    ({"rope_type": "ntk", "factor": 2.0}, {}, ValueError, r"scaling\['rope_type'\] must be one of"),
    ({"factor": 2.0}, {}, ValueError, r"scaling\['rope_type'\] must be one of .* got None"),
    ([("rope_type", "linear")], {}, TypeError, "^scaling must be"),
    ({"rope_type": "linear"}, {}, ValueError, r"lacks factor"),
    ({"rope_type": "linear", "factor": float("nan")}, {}, ValueError, r"scaling\['factor'\] must be a finite positive"),
    ({"rope_type": "linear", "factor": float("inf")}, {}, ValueError, r"scaling\['factor'\]"),
    ({"type": "linear", "factor": 0.0}, {}, ValueError, r"scaling\['factor'\]"),
    ({"rope_type": "linear", "factor": -2.0}, {}, ValueError, r"scaling\['factor'\]"),
    ({"rope_type": "linear", "factor": "2"}, {}, TypeError, r"scaling\['factor'\] must be a float"),
    ({"rope_type": "dynamic"}, {"max_position_embeddings": 2048}, ValueError, "lacks factor"),
    ({"rope_type": "dynamic", "factor": 2.0}, {}, ValueError, "max_position_embeddings"),
    ({"rope_type": "dynamic", "factor": 2.0}, {"max_position_embeddings": 64, "rotary_dim": 2}, ValueError,
     "rotary_dim"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 4096}, {"max_position_embeddings": 8192}, ValueError,
     "lacks factor"),
    ({"rope_type": "yarn", "factor": 4.0}, {}, ValueError, "max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}, {}, ValueError,
     r"scaling\['original_max_position_embeddings'\] must be >= 1"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.0}, {"max_position_embeddings": 4096}, ValueError,
     r"scaling\['attention_factor'\]"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": float("nan")}, {"max_position_embeddings": 4096}, ValueError,
     r"scaling\['beta_fast'\]"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_slow": -1.0}, {"max_position_embeddings": 4096}, ValueError,
     r"scaling\['beta_slow'\]"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale": -1.0, "mscale_all_dim": 1.0}, {"max_position_embeddings": 4096},
     ValueError, r"scaling\['mscale'\] must be >= 0"),
    ({"rope_type": "yarn", "factor": 4.0, "mscale_all_dim": "1"}, {"max_position_embeddings": 4096}, TypeError,
     r"scaling\['mscale_all_dim'\]"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, {"max_position_embeddings": 4096}, TypeError,
     r"scaling\['truncate'\] must be a bool"),
    ({"rope_type": "yarn", "factor": 4.0}, {"max_position_embeddings": 4096, "rope_theta": 1.0}, ValueError,
     "rope_theta"),
    ({"rope_type": "longrope", "long_factor": [1.0] * 32, "factor": 2.0}, {"max_position_embeddings": 64}, ValueError,
     "lacks short_factor"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 32, "factor": 2.0}, {"max_position_embeddings": 64},
     ValueError, "lacks long_factor"),
    ({"rope_type": "longrope", **SHORT, "short_factor": [1.0] * 31, "factor": 2.0}, {"max_position_embeddings": 64},
     ValueError, r"scaling\['short_factor'\] must be a list of rotary_dim / 2 = 32 numbers, got 31"),
    ({"rope_type": "longrope", **SHORT, "long_factor": [[2.0] * 32]}, {"max_position_embeddings": 64}, ValueError,
     r"scaling\['long_factor'\]"),
    ({"rope_type": "longrope", **SHORT, "long_factor": [2.0] * 31 + [0.0], "factor": 2.0},
     {"max_position_embeddings": 64}, ValueError, r"scaling\['long_factor'\] must hold finite positive"),
    ({"rope_type": "longrope", **SHORT, "short_factor": "abc", "factor": 2.0}, {"max_position_embeddings": 64},
     TypeError, r"scaling\['short_factor'\] must be a list"),
    ({"rope_type": "longrope", **SHORT, "factor": 2.0}, {}, ValueError, "max_position_embeddings"),
    ({"rope_type": "longrope", **SHORT}, {"max_position_embeddings": 4096}, ValueError, "lacks factor"),
    ({"rope_type": "longrope", **SHORT, "original_max_position_embeddings": 4096}, {}, ValueError, "lacks factor"),
    *(({k: v for k, v in LLAMA3.items() if k != key}, {}, ValueError, f"lacks {key}")
      for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, {"rotary_dim": 48}, ValueError,
     r"scaling\['partial_rotary_factor'\]=0.5 gives rotary_dim int\(64 \* 0.5\) = 32, but rotary_dim=48"),
    ({"rope_type": "default", "partial_rotary_factor": 1.5}, {}, ValueError, r"scaling\['partial_rotary_factor'\]"),
    ({"rope_type": "default", "partial_rotary_factor": 0.3}, {}, ValueError,
     r"scaling\['partial_rotary_factor'\]=0.3 gives rotary_dim int\(64 \* 0.3\) = 19"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, {"rope_theta": 10000.0}, ValueError,
     r"^rope_theta=10000.0 differs from scaling\['rope_theta'\]=1000000.0"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 0.0}, {}, ValueError, r"scaling\['rope_theta'\]"),
    ({"rope_type": "linear", "factor": 2.0}, {"max_position_embeddings": 0}, ValueError, "max_position_embeddings"),
    ({"rope_type": "linear", "factor": 2.0}, {"max_position_embeddings": 4096.0}, TypeError,
     "max_position_embeddings must be an int"),
]


@pytest.mark.parametrize("scaling, kwargs, exc, match", BAD_SCALING,
                         ids=[f"{i}-{str(c[3])[:40]}" for i, c in enumerate(BAD_SCALING)])
def test_bad_scaling_raises_naming_the_key(scaling, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cupaged.RotaryEmbedding(64, scaling=scaling, **kwargs)


def test_scaling_dict_keys_that_need_no_type():
    """rope_theta from the dict (an equal explicit one is fine), partial_rotary_factor setting rotary_dim, and a
    dict holding only such keys meaning the default rotation, as transformers reads them."""
    emb = cupaged.RotaryEmbedding(64, scaling={"rope_theta": 1e6, "partial_rotary_factor": 0.5}, rope_theta=1e6)
    assert (emb.rope_theta, emb.rotary_dim, emb.scaling, emb.attention_factor) == (1e6, 32, None, 1.0)
    np.testing.assert_allclose(emb.inv_freq, reference.rope.inv_freq(32, 1e6), rtol=1e-15)
    emb = cupaged.RotaryEmbedding(64, scaling={"rope_type": "linear", "factor": 2.0}, max_position_embeddings=4096)
    assert (emb.rope_theta, emb.max_position_embeddings, emb.scaling) == (10000.0, 4096, {"rope_type": "linear",
                                                                                         "factor": 2.0})


@pytest.mark.parametrize("call, exc, match", [
    (lambda e: e.frequencies(0), ValueError, "^seq_len must be >= 1"),
    (lambda e: e.frequencies(4096.0), TypeError, "^seq_len must be an int"),
    (lambda e: e.cos_sin_cache(8, seq_len=0), ValueError, "^seq_len"),
    (lambda e: e.cos_sin_rows(np.arange(5), np.full(4, 9)), ValueError, "^seq_lens must have positions' 5 entries"),
    (lambda e: e.cos_sin_rows(np.arange(5.0), np.full(5, 9)), TypeError, "^positions must be an integer array"),
    (lambda e: e.cos_sin_rows(np.arange(5), [9] * 5), TypeError, "^seq_lens must be a host numpy array"),
    (lambda e: e.cos_sin_rows(np.arange(5) - 1, np.full(5, 9)), ValueError, r"^positions\[0\] = -1 must be >= 0"),
    (lambda e: e.cos_sin_rows(np.arange(5), np.arange(5)), ValueError, r"^seq_lens\[0\] = 0 must be >= 1"),
    (lambda e: e.cos_sin_rows(np.zeros((5, 1), np.int64), np.full(5, 9)), ValueError, "^positions must be 1-D"),
], ids=["freq-0", "freq-float", "cache-0", "rows-length", "rows-float", "rows-list", "rows-negative", "rows-len-0",
        "rows-2d"])
def test_bad_lengths_and_rows(call, exc, match):
    with pytest.raises(exc, match=match):
        call(_scaled("longrope")[0])
