"""The decode kernels' memory traffic (paged_decode_kernel, paged_decode_mma_kernel, mla_decode_kernel), counted
exactly by the sim's profiler (cupaged.sim.profile) -- the counts the decode kernels are held to: every visible K/V byte read once
(unique bytes of key_cache and value_cache within 2% of the visible tokens' bytes), coalesced (sector efficiency
>= 0.95 on both), shared memory without bank conflicts in the main loop (<= 5% of its wavefronts; the one-off
merge of the warps' states at the end is not the loop) and >= 32 KB in flight per SM (the cp.async pipeline, at
the H200 model's occupancy). Counts, not times: they are the same on every machine."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import sim
from cupaged.attention import FAMILY
from cupaged.testing import paged_kv


def _merge_lines() -> set:
    """Source lines of the end-of-CTA merge (pd_finish, pm_finish, pd_store) in the compiled module's text."""
    lines = FAMILY.source.splitlines()
    merge = set()
    for name in ("pd_finish", "pm_finish", "pd_store"):
        first = next(i for i, x in enumerate(lines) if f"void {name}(" in x) + 1
        last = next(i for i in range(first, len(lines)) if lines[i].startswith("}")) + 1
        merge.update(range(first, last + 1))
    return merge


def _assert_read_once_coalesced(launch, visible: int):
    """key_cache and value_cache: the visible bytes read once (within 2%), in whole sectors (>= 0.95); the main
    loop's shared memory without bank conflicts (<= 5% of its wavefronts)."""
    for name in ("key_cache", "value_cache"):
        arg = launch.args[name]
        assert visible <= arg.unique_bytes_read <= 1.02 * visible, name
        assert arg.sector_efficiency >= 0.95, (name, arg.sector_efficiency)
    merge = _merge_lines()
    loop = [t for line, t in launch.shared.by_line.items() if line not in merge]
    assert loop
    assert sum(t.bank_conflicts for t in loop) <= 0.05 * sum(t.wavefronts for t in loop)


@pytest.mark.parametrize("heads, dtype, kv_cache_dtype, layout", [
    ((16, 4), np.float16, "auto", "NHD"),       # GQA 4: paged_decode_kernel, 4 query rows per CTA
    ((32, 4), np.float16, "auto", "HND"),       # GQA 8: paged_decode_mma_kernel, 8 rows
    ((16, 4), np.float16, "fp8", "NHD"),        # fp8 codes, half the bytes
    ((32, 4), ml_dtypes.bfloat16, "fp8_e5m2", "NHD"),  # tensor cores over fp8 codes (ldmatrix of byte pairs)
], ids=["gqa4-fp16", "gqa8-fp16-hnd", "gqa4-fp8", "gqa8-bf16-fp8"])
def test_decode_reads_each_visible_kv_byte_once_coalesced(heads, dtype, kv_cache_dtype, layout):
    num_heads, num_kv_heads = heads
    seq_lens = [517, 300]
    rng = np.random.default_rng(3)
    kv = paged_kv(seq_lens, block_size=16, head_size=128, num_kv_heads=num_kv_heads, dtype=dtype, layout=layout,
                  kv_cache_dtype=kv_cache_dtype, rng=rng)
    q = sim.asarray(rng.standard_normal((len(seq_lens), num_heads, 128)).astype(dtype))
    caches = (sim.asarray(kv.key_cache), sim.asarray(kv.value_cache))
    with sim.profile() as prof:
        cupaged.paged_attention(q, *caches, kv.block_tables, kv.seq_lens, kv_cache_dtype=kv_cache_dtype,
                                k_scale=kv.k_scale, v_scale=kv.v_scale, layout=layout)
    (launch,) = [x for x in prof.launches if "paged_decode" in x.kernel]
    _assert_read_once_coalesced(launch, sum(seq_lens) * num_kv_heads * 128 * caches[0].itemsize)
    assert launch.max_inflight_bytes_per_cta * launch.model.ctas_per_sm >= 32 * 1024  # per SM, on an H200


@pytest.mark.parametrize("num_heads, kv_cache_dtype", [(16, "auto"), (64, "auto"), (16, "fp8")],
                         ids=["h16-bf16", "h64-bf16", "h16-fp8"])
def test_mla_decode_reads_each_latent_byte_once_coalesced(num_heads, kv_cache_dtype):
    """mla_decode_kernel: every visible latent row read once through key_cache (value_cache, the same array,
    never: the value is the row's prefix, already in shared memory), coalesced, bank conflicts <= 5% of the
    wavefronts (none with 16-bit caches: ldmatrix rows padded, the score and P arrays swizzled; fp8's conversion
    pass has a few where a warp's chunks cross a padded row), >= 32 KB in flight per SM."""
    import ml_dtypes

    seq_lens = [517, 300]
    rng = np.random.default_rng(5)
    kv = paged_kv(seq_lens, block_size=16, head_size=576, dtype=ml_dtypes.bfloat16, layout="mla",
                  kv_cache_dtype=kv_cache_dtype, rng=rng)
    q = sim.asarray(rng.standard_normal((len(seq_lens), num_heads, 576)).astype(ml_dtypes.bfloat16))
    with sim.profile() as prof:
        cupaged.mla_decode(q, sim.asarray(kv.key_cache), kv.block_tables, kv.seq_lens, scale=0.05,
                           kv_cache_dtype=kv_cache_dtype, k_scale=kv.k_scale)
    (launch,) = [x for x in prof.launches if "mla_decode_kernel" in x.kernel]
    visible = sum(seq_lens) * 576 * kv.key_cache.itemsize
    arg = launch.args["key_cache"]
    assert visible <= arg.unique_bytes_read <= 1.02 * visible
    assert arg.sector_efficiency >= 0.95, arg.sector_efficiency
    assert launch.args["value_cache"].bytes_read == 0
    assert launch.shared.bank_conflicts <= (0.05 * launch.shared.wavefronts if kv_cache_dtype == "fp8" else 0)
    assert launch.max_inflight_bytes_per_cta * launch.model.ctas_per_sm >= 32 * 1024


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_vllm_layout_decode_reads_each_visible_byte_once_coalesced(kv_cache_dtype):
    """vLLM's layout on the decode path: paged_decode_mma_kernel copies its values [.., head_size, block_size]
    as V^T tiles, 16-byte runs of one dimension (whole sectors of a block's row), its keys as 16-byte chunks."""
    from tests.test_paged_attention_vllm import to_vllm

    seq_lens, heads, block = [517, 300], (16, 4), 16
    rng = np.random.default_rng(5)
    kv = paged_kv(seq_lens, block_size=block, head_size=128, num_kv_heads=heads[1], dtype=np.float16,
                  kv_cache_dtype=kv_cache_dtype, rng=rng)
    q = sim.asarray(rng.standard_normal((len(seq_lens), heads[0], 128)).astype(np.float16))
    caches = (sim.asarray(to_vllm(kv.key_cache, "k")), sim.asarray(to_vllm(kv.value_cache, "v")))
    out = sim.zeros(q.shape, np.float16)
    with sim.profile() as prof:
        cupaged.paged_attention_v1(out, q, *caches, heads[1], 0.1, kv.block_tables, kv.seq_lens, block, 517, None,
                                   kv_cache_dtype, kv.k_scale, kv.v_scale)
    (launch,) = [x for x in prof.launches if "paged_decode_mma" in x.kernel]
    _assert_read_once_coalesced(launch, sum(seq_lens) * heads[1] * 128 * caches[0].itemsize)
