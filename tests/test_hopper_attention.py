"""tests/hopper_attention.cu -- FlashAttention-3's inner loop (wgmma S = Q K^T, the online softmax in the
accumulators, P in registers, wgmma O += P V, tensor-map K/V tiles on an mbarrier ring) -- against the float64
reference, varlen_attention's semantics: awkward lengths, GQA, causal (bottom-right) and not, LSE, on the sim in
every order (and on an sm_90 GPU when one exists). The first working step of the Hopper prefill
(docs/hopper-prefill.md); P is rounded to bf16 before P V, as FlashAttention-3 does."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from cupaged import _nvrtc, make_tensor_map, reference
from tests.conftest import hopper_module

SOURCE = os.path.join(os.path.dirname(__file__), "hopper_attention.cu")
SHARED = 6 * 16384 + 1024


def source() -> str:
    with open(SOURCE) as f:
        return f.read()


@pytest.mark.parametrize("causal", [True, False])
def test_matches_the_reference(backend, causal):
    rng = np.random.default_rng(11)
    lens_q, lens_k = [1, 70, 130, 37], [1, 70, 160, 200]
    heads, kv_heads, d = 4, 2, 128
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    bf16 = ml_dtypes.bfloat16
    q = rng.standard_normal((cq[-1], heads, d)).astype(bf16)
    k = rng.standard_normal((ck[-1], kv_heads, d)).astype(bf16)
    v = rng.standard_normal((ck[-1], kv_heads, d)).astype(bf16)
    dq, dk, dv = backend.asarray(q), backend.asarray(k), backend.asarray(v)
    maps = [make_tensor_map(a, (64, 1, 64), swizzle="128B") for a in (dq, dk, dv)]
    out = backend.asarray(np.zeros((cq[-1], heads, d), bf16))
    lse = backend.asarray(np.zeros((heads, cq[-1]), np.float32))
    f = hopper_module(backend, source()).get_function("hopper_attention")
    f.max_dynamic_shared_size_bytes = SHARED
    scale = 1.0 / np.sqrt(d)
    f(((max(lens_q) + 127) // 128, heads, len(lens_q)), (384,),
      (*maps, backend.asarray(cq), backend.asarray(ck), out, lse, np.int32(heads), np.int32(kv_heads),
       np.float32(scale), np.int32(causal)), shared_mem=SHARED)
    want, want_lse = reference.varlen_attention(q, k, v, cq, ck, scale=scale, causal=causal)
    got = backend.to_numpy(out).astype(np.float64)
    np.testing.assert_allclose(got, want, atol=1.6e-2, rtol=1.6e-2)
    np.testing.assert_allclose(backend.to_numpy(lse), want_lse, atol=1e-4, rtol=1e-4)


def test_compiles_for_sm90a_without_spills():
    prog = _nvrtc.compile_cubin(source(), arch="sm_90a", options=("-std=c++17", "-Xptxas=-v"))
    assert "0 bytes spill stores" in prog.log and "0 bytes spill loads" in prog.log, prog.log
