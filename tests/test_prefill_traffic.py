"""The prefill kernels' counts from the sim's profiler (cupaged.sim.profile): paged_prefill_kernel (sm_80's plans)
and paged_prefill_sm90_kernel (sm_90's), held to the same bounds: key_cache bytes requested <= 1.1 x the sum over
64-row query tiles of (keys up to the tile's last row, rounded up to 128) x the K row bytes, i.e. each K tile read
once per query tile of >= 64 rows; tensor-core FLOPs (mma.sync's or wgmma's) >= 95% of the op's declared FLOPs, and
for mma.sync the SASS HMMA instructions counted (model v2) x 4096 equal to them; shared-memory bank conflicts <= 5%
of the wavefronts. Counts, not times: the same on every machine."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import sim
from cupaged.testing import paged_kv


def _key_bound(seq_lens, q_lens, group, num_kv_heads, row_bytes, causal=True) -> int:
    """The issue's bound before its 1.1: per sequence and kv head, each 64-row tile of (token, head) rows reads the
    keys up to its last row's position (all keys when not causal), rounded up to 128, of row_bytes each."""
    total = 0
    for seq_len, q_len in zip(seq_lens, q_lens):
        for r0 in range(0, q_len * group, 64):
            last = (min(r0 + 64, q_len * group) - 1) // group + seq_len - q_len
            keys = last + 1 if causal else seq_len
            total += min(-(-keys // 128) * 128, -(-seq_len // 128) * 128) * row_bytes
    return total * num_kv_heads


def _check_counts(launch):
    cost = launch.declared
    flops = launch.mma_flops + launch.gmma_flops
    assert flops >= 0.95 * cost.flops, (flops, cost.flops)
    if launch.instruction_mix is not None and launch.mma_flops:  # model v2's: a SASS HMMA.16816 is 2*16*8*16 FLOPs
        assert launch.instruction_mix["mma"] * 4096 == launch.mma_flops, (launch.instruction_mix, launch.mma_flops)
    assert launch.shared.bank_conflicts <= 0.05 * launch.shared.wavefronts


@pytest.mark.parametrize("heads, dtype, kv_cache_dtype, head_size, q_lens, seq_lens", [
    ((8, 2), ml_dtypes.bfloat16, "auto", 128, [300, 190], [300, 190]),   # whole prompts, GQA 4
    ((8, 1), np.float16, "fp8_e4m3", 64, [130, 65], [400, 65]),         # a chunk over a cached prefix, GQA 8, fp8
    ((4, 4), np.float16, "auto", 256, [100], [260]),                    # head 256: one m16 tile a warp
], ids=["bf16-gqa4-d128", "fp16-gqa8-fp8-d64", "fp16-mha-d256"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_prefill_reads_each_k_tile_once_per_query_tile(monkeypatch, arch, heads, dtype, kv_cache_dtype, head_size,
                                                       q_lens, seq_lens):
    monkeypatch.setenv("CUPAGED_SIM_ARCH", arch)
    num_heads, num_kv_heads = heads
    rng = np.random.default_rng(7)
    kv = paged_kv(seq_lens, block_size=16, head_size=head_size, num_kv_heads=num_kv_heads, dtype=dtype,
                  kv_cache_dtype=kv_cache_dtype, rng=rng)
    q = sim.asarray((rng.standard_normal((sum(q_lens), num_heads, head_size)) * 0.5).astype(dtype))
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    with sim.profile() as prof:
        cupaged.paged_attention(q, sim.asarray(kv.key_cache), sim.asarray(kv.value_cache), kv.block_tables,
                                kv.seq_lens, qsl, kv_cache_dtype=kv_cache_dtype, k_scale=kv.k_scale,
                                v_scale=kv.v_scale, kv_split_size=4096)
    (launch,) = [x for x in prof.launches if "paged_prefill" in x.kernel]
    itemsize = 1 if kv_cache_dtype != "auto" else np.dtype(dtype).itemsize
    bound = _key_bound(seq_lens, q_lens, num_heads // num_kv_heads, num_kv_heads, head_size * itemsize)
    assert launch.args["key_cache"].bytes_read <= 1.1 * bound, (launch.args["key_cache"].bytes_read, bound)
    _check_counts(launch)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_varlen_192_128_prefill_counts(monkeypatch, arch):
    """MLA prefill's shape on dense rows (QK 192, V 128, non-causal): the same bounds."""
    monkeypatch.setenv("CUPAGED_SIM_ARCH", arch)
    rng = np.random.default_rng(8)
    lens = [200, 77]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    bf16 = ml_dtypes.bfloat16
    q = sim.asarray((rng.standard_normal((cu[-1], 8, 192)) * 0.3).astype(bf16))
    k = sim.asarray(rng.standard_normal((cu[-1], 8, 192)).astype(bf16))
    v = sim.asarray(rng.standard_normal((cu[-1], 8, 128)).astype(bf16))
    with sim.profile() as prof:
        cupaged.varlen_attention(q, k, v, cu, cu, causal=False)
    (launch,) = [x for x in prof.launches if "paged_prefill" in x.kernel]
    bound = _key_bound(lens, lens, 1, 8, 192 * 2, causal=False)
    assert launch.args["key_cache"].bytes_read <= 1.1 * bound  # the kernel parameter's name
    _check_counts(launch)
