"""varlen_attention (FlashAttention varlen semantics) against cupaged.reference.varlen_attention."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import reference
from tests.conftest import assert_close

F16, BF16, F32 = np.float16, ml_dtypes.bfloat16, np.float32
LENGTHS = {  # (len_q per sequence, len_k per sequence)
    "0-1-17-97": ([0, 1, 17, 97], [0, 1, 17, 97]),
    "q>k": ([9, 20, 3], [4, 20, 1]),   # top rows of a causal sequence see no key
    "q<k": ([1, 5, 16], [40, 33, 100]),  # prefill chunks over a context
}


def make(rng, lq, lk, heads, qk, vd, dtype, strided=False):
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = (rng.standard_normal((cq[-1], heads[0], qk)) * 0.7).astype(dtype)
    if strided:  # k and v as views of one fused [total_k, kv_heads, qk + vd] buffer
        kv = rng.standard_normal((ck[-1], heads[1], qk + vd)).astype(dtype)
        k, v = kv[:, :, :qk], kv[:, :, qk:]
    else:
        k = rng.standard_normal((ck[-1], heads[1], qk)).astype(dtype)
        v = rng.standard_normal((ck[-1], heads[1], vd)).astype(dtype)
    return q, k, v, cq, ck


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lengths", LENGTHS, ids=list(LENGTHS))
@pytest.mark.parametrize("dtype, heads, qk, vd", [
    (F16, (8, 2), 192, 128), (BF16, (4, 4), 128, 128), (F32, (6, 1), 64, 64), (F16, (2, 2), 256, 256),
    (BF16, (4, 2), 80, 80),
], ids=["f16-gqa-192x128", "bf16-mha-128", "f32-mqa-64", "f16-256", "bf16-80"])
def test_varlen_against_reference(backend, causal, lengths, dtype, heads, qk, vd):
    q, k, v, cq, ck = make(np.random.default_rng(qk + vd), *LENGTHS[lengths], heads, qk, vd, dtype,
                           strided=dtype == F16)
    args = [backend.asarray(a) if backend.name != "sim" else a for a in (q, k, v, cq, ck)]
    out, lse = cupaged.varlen_attention(*args, causal=causal, return_lse=True)
    ref_out, ref_lse = reference.varlen_attention(q, k, v, cq, ck, causal=causal)
    assert_close(backend.to_numpy(out), ref_out, dtype, "out")
    assert_close(backend.to_numpy(lse), ref_lse, "lse", "lse")
    if lengths == "q>k" and causal:
        assert np.isneginf(backend.to_numpy(lse)[:, 0]).all() and not backend.to_numpy(out)[0].astype(np.float32).any()


def test_hints_out_and_scale(backend):
    q, k, v, cq, ck = make(np.random.default_rng(1), [3, 30], [10, 30], (4, 2), 64, 32, F16)
    out = backend.asarray(np.full((33, 4, 32), np.nan, F16))
    got = cupaged.varlen_attention(*(backend.asarray(a) for a in (q, k, v, cq, ck)), scale=0.3, max_seqlen_q=30,
                                   max_seqlen_k=30, out=out)
    assert got is out
    assert_close(backend.to_numpy(out), reference.varlen_attention(q, k, v, cq, ck, scale=0.3)[0], F16)


BAD = {
    "k dtype": (lambda a: {"k": a["k"].astype(np.float32)}, TypeError, "k"),
    "k head size": (lambda a: {"k": a["k"][..., :32]}, ValueError, "head size"),
    "v rows": (lambda a: {"v": a["v"][:3]}, ValueError, "v"),
    "gqa": (lambda a: {"q": a["q"][:, :3]}, ValueError, "num_kv_heads"),
    "cu dtype": (lambda a: {"cu_seqlens_q": a["cu_seqlens_q"].astype(np.int64)}, TypeError, "cu_seqlens_q"),
    "cu length": (lambda a: {"cu_seqlens_k": a["cu_seqlens_k"][:2]}, ValueError, "cu_seqlens"),
    "out shape": (lambda a: {"out": np.zeros((33, 4, 64), F16)}, ValueError, "out"),
    "v head 512": (lambda a: {"v": np.zeros((40, 2, 512), F16)}, NotImplementedError, "v_head_size"),
    "window_size one int": (lambda a: {"window_size": 4}, ValueError, "window_size"),
    "window_size -2": (lambda a: {"window_size": (-2, 0)}, ValueError, "window_size"),
    "seqused_k dtype": (lambda a: {"seqused_k": np.array([3, 4], np.int64)}, TypeError, "seqused_k"),
    "seqused_k length": (lambda a: {"seqused_k": np.array([3], np.int32)}, ValueError, "seqused_k"),
    "sinks length": (lambda a: {"sinks": np.zeros(3, np.float32)}, ValueError, "sinks"),
    "softcap < 0": (lambda a: {"softcap": -1.0}, ValueError, "softcap"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input(backend, case):
    q, k, v, cq, ck = make(np.random.default_rng(2), [3, 30], [10, 30], (4, 2), 64, 32, F16)
    a = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck)
    change, exc, match = BAD[case]
    a.update(change(a))
    a = {name: backend.asarray(x) if isinstance(x, np.ndarray) else x for name, x in a.items()}
    with pytest.raises(exc, match=match):
        cupaged.varlen_attention(**a)


# FlashAttention's options on long runs (the tensor-core prefill kernel for 16-bit q, paged_decode_kernel for
# float32): bottom-right aligned windows on both sides, causal or not, softcap, ALiBi, sinks and seqused_k, whose
# count also sets the queries' positions. Lengths: 17, 63, 64, 65 and 130 query rows over longer key runs.
OPTIONS = {
    "window (5, 3) full": dict(causal=False, window_size=(5, 3)),
    "window (0, 0) full": dict(causal=False, window_size=(0, 0)),
    "window (-1, 7) full": dict(causal=False, window_size=(-1, 7)),
    "window (40, 9) causal": dict(causal=True, window_size=(40, 9)),  # causal caps the right side at 0
    "softcap alibi sinks": dict(causal=True, softcap=20.0, alibi=True, sinks=True),
    "seqused_k": dict(causal=True, seqused=True),
    "seqused_k window full": dict(causal=False, seqused=True, window_size=(9, 2), sinks=True),
}


@pytest.mark.parametrize("option", OPTIONS, ids=list(OPTIONS))
@pytest.mark.parametrize("dtype, heads, qk, vd", [(BF16, (8, 2), 192, 128), (F16, (4, 1), 128, 128),
                                                  (F32, (2, 2), 64, 64)], ids=["bf16-192x128", "f16-mqa", "f32"])
def test_flash_attention_options(backend, option, dtype, heads, qk, vd):
    rng = np.random.default_rng(len(option) + qk)
    opt = dict(OPTIONS[option])
    lq, lk = [17, 63, 64, 65, 130], [40, 63, 100, 65, 150]
    q, k, v, cq, ck = make(rng, lq, lk, heads, qk, vd, dtype)
    used = rng.integers(np.minimum(lq, lk) // 2, np.array(lk) + 1).astype(np.int32) if opt.pop("seqused", False) else None
    if used is not None:
        k, v = k.copy(), v.copy()
        for b, n in enumerate(used):  # rows past the used count: NaN, never read
            k[ck[b] + n:ck[b + 1]] = np.nan
            v[ck[b] + n:ck[b + 1]] = np.nan
    extra = dict(sinks=rng.uniform(-1, 3, heads[0]).astype(np.float32) if opt.pop("sinks", False) else None,
                 alibi_slopes=(2.0 ** -np.arange(1, heads[0] + 1)).astype(np.float32) if opt.pop("alibi", False)
                 else None, seqused_k=used, **opt)
    args = [backend.asarray(a) for a in (q, k, v, cq, ck)]
    out, lse = cupaged.varlen_attention(*args, return_lse=True, validate=True,
                                        **{n: backend.asarray(x) if isinstance(x, np.ndarray) else x
                                           for n, x in extra.items()})
    ref_out, ref_lse = reference.varlen_attention(q, k, v, cq, ck, **extra)
    assert_close(backend.to_numpy(out), ref_out, dtype, "out")
    assert_close(backend.to_numpy(lse), ref_lse, "lse", "lse")


def test_validate_checks_seqused_k(backend):
    q, k, v, cq, ck = make(np.random.default_rng(3), [3, 30], [10, 30], (4, 2), 64, 32, F16)
    with pytest.raises(ValueError, match="seqused_k"):
        cupaged.varlen_attention(*(backend.asarray(a) for a in (q, k, v, cq, ck)),
                                 seqused_k=backend.asarray(np.array([3, 31], np.int32)), validate=True)


def test_validate_checks_cu_seqlens(backend):
    q, k, v, cq, ck = make(np.random.default_rng(3), [3, 30], [10, 30], (4, 2), 64, 32, F16)
    bad = ck.copy()
    bad[-1] = 10**6
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        cupaged.varlen_attention(*(backend.asarray(a) for a in (q, k, v, cq, bad)), validate=True)
