"""Rotary embeddings (RotaryEmbedding, rope_and_cache; kernels_cu/rope.cu) against cupaged.reference.rope, a
float64 complex-multiplication reference, on the sim (and cuda when a GPU is present).

q / k / v are views of one fused QKV buffer; awkward token counts (1, 7, 97); positions int64 and int32 up to
~100k; both pairing styles, partial rotary dims and Llama 3 frequency scaling. Caches start poisoned (0xFF): they
must come back bit-identical to the reference's writes of v and of the kernel's own rotated k (checked itself
against the float64 rotation within the tolerance table)."""

from __future__ import annotations

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
    (dict(head_dim=64, scaling={"rope_type": "yarn", "factor": 4.0}), NotImplementedError, "yarn"),
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
