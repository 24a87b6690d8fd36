"""vLLM-compatible paged_attention_v1 / v2 on the vLLM cache layout: against the reference, against
each other and against paged_attention on the same data in the flash layout; v2's per-partition
exp_sums / max_logits / tmp_output against the reference's; validation of every argument."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import reference
from cupaged.testing import assert_close, tolerance
from tests.test_paged_attention import SHAPE_DECODE, Case, build

F16, BF16, F32 = np.float16, ml_dtypes.bfloat16, np.float32


def to_vllm(cache_nhd, kind):
    """A flash NHD cache [nb, bs, H, D] in vLLM's layout (K [nb, H, D/x, bs, x], V [nb, H, D, bs])."""
    nb, bs, h, d = cache_nhd.shape
    if kind == "v":
        return np.ascontiguousarray(cache_nhd.transpose(0, 2, 3, 1))
    x = 16 // cache_nhd.itemsize
    return np.ascontiguousarray(cache_nhd.reshape(nb, bs, h, d // x, x).transpose(0, 2, 3, 1, 4))


def vllm_inputs(case: Case, seed=0):
    inputs, options, _ = build(case, seed)
    inputs["key_cache"] = to_vllm(inputs["key_cache"], "k")
    inputs["value_cache"] = to_vllm(inputs["value_cache"], "v")
    return inputs, options


CASES = [
    Case(seqs=SHAPE_DECODE, head_size=128, block_size=16, dtype=F16),
    Case(seqs=SHAPE_DECODE, head_size=80, block_size=8, dtype=BF16, alibi=True),
    Case(seqs=((1, 1), (1, 512), (1, 513), (1, 0), (1, 1100)), head_size=64, block_size=32, dtype=F32, heads=(4, 4)),
    Case(seqs=SHAPE_DECODE, head_size=120, block_size=16, dtype=F16, heads=(6, 2)),
    Case(seqs=SHAPE_DECODE, head_size=256, block_size=32, dtype=BF16, heads=(4, 1)),
    Case(seqs=SHAPE_DECODE, head_size=128, block_size=16, dtype=F16, kv_cache_dtype="fp8"),
    Case(seqs=SHAPE_DECODE, head_size=96, block_size=8, dtype=BF16, kv_cache_dtype="fp8_e5m2", alibi=True),
    # paged_decode_mma_kernel's V^T tiles: fp8 codes of 16 keys a run (block 32), GQA 8, a head size under 64
    Case(seqs=SHAPE_DECODE, head_size=48, block_size=32, dtype=BF16, kv_cache_dtype="fp8_e4m3", heads=(8, 1)),
    Case(seqs=((1, 9), (1, 700), (1, 33)), head_size=128, block_size=8, dtype=F16, heads=(8, 2)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_v1_v2_match_reference_and_flash_layout(backend, case):
    inputs, options = vllm_inputs(case)
    q, seq_lens, tables = inputs["q"], inputs["seq_lens"], inputs["block_tables"]
    num_seqs, num_heads, head_size = q.shape
    num_kv_heads, block_size = case.heads[1], case.block_size
    max_seq_len = int(seq_lens.max())
    scale = 1.0 / np.sqrt(head_size)
    alibi = options["alibi_slopes"]
    ref_out = reference.paged_attention_v1(q, inputs["key_cache"], inputs["value_cache"], num_kv_heads, scale, tables,
                                           seq_lens, alibi, case.kv_cache_dtype, options["k_scale"], options["v_scale"])
    tol = tolerance(case.dtype, case.kv_cache_dtype)
    dev = {k: backend.asarray(inputs[k]) for k in ("q", "key_cache", "value_cache", "block_tables", "seq_lens")}
    dev_alibi = None if alibi is None else backend.asarray(alibi)
    common = (dev["key_cache"], dev["value_cache"], num_kv_heads, scale, dev["block_tables"], dev["seq_lens"],
              block_size, max_seq_len, dev_alibi, case.kv_cache_dtype, options["k_scale"], options["v_scale"])

    out1 = backend.asarray(np.full(q.shape, np.nan, case.dtype))
    cupaged.paged_attention_v1(out1, dev["q"], *common)
    assert_close(backend.to_numpy(out1), ref_out, tol, "v1 out")

    partitions = max(1, -(-max_seq_len // 512))
    exp_sums = backend.asarray(np.full((num_seqs, num_heads, partitions), np.nan, np.float32))
    max_logits = backend.asarray(np.full((num_seqs, num_heads, partitions), np.nan, np.float32))
    tmp_output = backend.asarray(np.full((num_seqs, num_heads, partitions, head_size), np.nan, case.dtype))
    out2 = backend.asarray(np.full(q.shape, np.nan, case.dtype))
    cupaged.paged_attention_v2(out2, exp_sums, max_logits, tmp_output, dev["q"], *common)
    assert_close(backend.to_numpy(out2), ref_out, tol, "v2 out")

    ref_es, ref_ml, ref_tmp = reference.paged_attention_v2_partitions(
        q, inputs["key_cache"], inputs["value_cache"], scale, tables, seq_lens, partitions, alibi,
        case.kv_cache_dtype, options["k_scale"], options["v_scale"])
    got_es, got_ml, got_tmp = (backend.to_numpy(a) for a in (exp_sums, max_logits, tmp_output))
    written = ~np.isnan(ref_es)
    assert np.array_equal(~np.isnan(got_es), written), "v2 wrote exactly the partitions below ceil(seq_len / 512)"
    assert_close(got_ml[written], ref_ml[written], "lse", "max_logits")
    assert_close(got_es[written], ref_es[written], "lse", "exp_sums")
    assert_close(got_tmp[written], ref_tmp[written], tol, "tmp_output")

    flash = {k: backend.asarray(v) for k, v in build(case)[0].items() if v is not None}
    out_flash = cupaged.paged_attention(**flash, scale=scale, alibi_slopes=dev_alibi,
                                       kv_cache_dtype=case.kv_cache_dtype, k_scale=options["k_scale"],
                                       v_scale=options["v_scale"])
    for name, got in (("v1", out1), ("v2", out2)):
        assert_close(backend.to_numpy(got), backend.to_numpy(out_flash).astype(np.float64), tol,
                     f"{name} vs paged_attention")


def _valid_v2(backend, case=Case(seqs=SHAPE_DECODE, head_size=64, block_size=16, heads=(4, 2))):
    inputs, _ = vllm_inputs(case)
    n, h, d = inputs["q"].shape
    a = dict(out=np.zeros((n, h, d), F16), exp_sums=np.zeros((n, h, 4), np.float32),
             max_logits=np.zeros((n, h, 4), np.float32), tmp_output=np.zeros((n, h, 4, d), F16), query=inputs["q"],
             key_cache=inputs["key_cache"], value_cache=inputs["value_cache"], num_kv_heads=2, scale=0.125,
             block_tables=inputs["block_tables"], seq_lens=inputs["seq_lens"], block_size=16, max_seq_len=2011,
             alibi_slopes=None)
    return {k: backend.asarray(v) if isinstance(v, np.ndarray) else v for k, v in a.items()}


BAD = {
    "blocksparse": (dict(blocksparse_vert_stride=4), NotImplementedError, "blocksparse_vert_stride"),
    "num_kv_heads": (dict(num_kv_heads=4), ValueError, "num_kv_heads"),
    "block_size": (dict(block_size=8), ValueError, "block_size"),
    "partitions": (dict(max_seq_len=5000), ValueError, "max_num_partitions"),
    "tmp dtype": (lambda a: dict(tmp_output=a["tmp_output"].astype(np.float32)), TypeError, "tmp_output"),
    "exp_sums shape": (lambda a: dict(exp_sums=a["exp_sums"][:, :, :3]), ValueError, "exp_sums"),
    "out dtype": (lambda a: dict(out=a["out"].astype(np.float32)), TypeError, "out"),
    "flash cache": (lambda a: dict(key_cache=a["key_cache"].reshape(a["key_cache"].shape[0], 2, 16, 64)),
                    ValueError, "key_cache"),
    "scale array": (dict(kv_cache_dtype="fp8", k_scale=np.ones(2, np.float32)), (ValueError, TypeError), "k_scale|key_cache"),
}


@pytest.mark.parametrize("name", BAD, ids=list(BAD))
def test_v2_bad_input(backend, name):
    change, exc, match = BAD[name]
    a = _valid_v2(backend)
    a.update(change(a) if callable(change) else change)
    with pytest.raises(exc, match=match):
        cupaged.paged_attention_v2(**a)
    assert not np.any(backend.to_numpy(a["out"]) != 0) or name == "out dtype"


def test_v1_rejects_blocksparse(backend):
    a = _valid_v2(backend)
    for k in ("exp_sums", "max_logits", "tmp_output"):
        a.pop(k)
    with pytest.raises(NotImplementedError, match="blocksparse_local_blocks"):
        cupaged.paged_attention_v1(**a, blocksparse_local_blocks=2)
