"""The block fit's anchors on the run's cp.async copies and wgmma FLOPs (cupaged/sim/profiler/_block_fit.py,
``_anchors``).

The sim counts every lane's cp.async bytes (``Launch.cp_async_bytes``); a warp-level LDGSTS of 16 bytes
(``.128``) moves at most 32 x 16 = 512 of them, so the LDGSTS issued hold at least cp_async_bytes / 512
warp-wide copies, and exactly that many when every copying warp copies with all its lanes (the attention
kernels' 16-byte tiles). Hand-made control-flow graphs check the rule; a profiled fp8 decode launch checks
it against the SASS of a kernel whose helper lines (a cp.async pipeline's issue, in one host function
called from its prologue and its loop) left the fit free to count twice its copies. A warpgroup's wgmma is
issued by each of its 4 warps as a GMMA doing a quarter of its 2 M N K FLOPs: ``gmma_flops`` and
``gmma_fp8_flops`` fix the HGMMA and QGMMA exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupaged.sim.profiler import _block_fit, _sass

pytest.importorskip("scipy")

COPY = "LDGSTS.E.BYPASS.128"


def block(start, opcodes, succs, lines=None, exits=False):
    return _sass.SassBlock(start, tuple(opcodes), tuple(lines or (None,) * len(opcodes)), tuple(succs), exits, False)


def fit(blocks, line_executions, warps, copy_bytes, **run):
    running = list(range(len(blocks)))
    copies = {}
    for k, b in enumerate(blocks):
        for line in b.lines:
            if line is not None:
                copies.setdefault(line, {})[k] = 1
    run = {"cp_async_bytes": copy_bytes, **run}
    x, detail = _block_fit.fit(blocks, running, copies, line_executions, warps, (), run)
    assert x is not None, detail
    return np.round(x, 6)


# entry (line 1) -> a loop of one block copying 16 bytes a lane (no line of its own the host build saw, as an
# asm statement's SASS line is not its host line) -> exit
LOOP = [block(0, ("S2R", "IMAD"), (1,), (1, 1)), block(32, (COPY, "IADD3", "ISETP", "BRA"), (1, 2)),
        block(96, ("EXIT",), (), exits=True)]


@pytest.mark.parametrize("trips", [1, 3, 7])
def test_copies_set_a_loop_nobody_else_counts(trips):
    # 4 warps, each copying trips x 32 lanes x 16 bytes: the loop runs `trips` times a warp. Without the
    # anchor (copy_bytes None) nothing says how often: the fit takes the fewest instructions, one trip.
    warps = 4
    assert fit(LOOP, {1: warps}, warps, None)[1] == 1
    assert fit(LOOP, {1: warps}, warps, trips * warps * 512)[1] == trips


# entry -> (a block copying twice, with line 5 | a block without copies) -> exit
BRANCH = [block(0, ("ISETP", "BRA"), (1, 2)), block(32, (COPY, COPY, "IADD3"), (3,), (None, None, 5)),
          block(80, ("IADD3",), (3,)), block(96, ("EXIT",), (), exits=True)]


def test_no_copies_outweigh_a_line():
    # Line 5 ran once a warp, so the copying branch looks taken (a miss of it costs its 1 instruction); the
    # run copied nothing, and two warp-wide copies too many cost 3 instructions / 2 copies each: the other path.
    warps = 2
    assert list(fit(BRANCH, {5: warps}, warps, None)[1:3]) == [1, 0]
    assert list(fit(BRANCH, {5: warps}, warps, 0)[1:3]) == [0, 1]
    assert list(fit(BRANCH, {5: warps}, warps, 2 * warps * 512)[1:3]) == [1, 0]


def test_copy_sizes():
    assert [_block_fit._copy_bytes(op) for op in (COPY, "LDGSTS.E.BYPASS.128.ZFILL", "LDGSTS.E.64", "LDGSTS.E",
                                                  "LDGSTS.E.LTC128B")] == [16, 16, 8, 4, 4]
    # 8-byte copies: a warp-wide LDGSTS.E.64 moves 256 bytes, so 3 trips of 4 warps copied 3 x 4 x 256
    loop8 = [LOOP[0], block(32, ("LDGSTS.E.64", "IADD3", "ISETP", "BRA"), (1, 2)), LOOP[2]]
    assert fit(loop8, {1: 4}, 4, 3 * 4 * 256)[1] == 3


def test_gmma_flops_fix_the_gmma():
    # Each warp's HGMMA.64x128x16 does a quarter of its warpgroup's 2 x 64 x 128 x 16 FLOPs: 65,536; a
    # QGMMA.64x64x32 as many. 4 warps (a warpgroup) going round 3 times: 3 x 4 x 65,536 of each.
    assert _block_fit._gmma_flops("HGMMA.64x128x16.F32.BF16") == 65536 == _block_fit._gmma_flops("QGMMA.64x64x32.F32")
    assert _block_fit._gmma_flops("HMMA.16816.F32.BF16") is None
    gmma = [LOOP[0], block(32, ("HGMMA.64x128x16.F32.BF16", "QGMMA.64x64x32.F32.E4M3.E4M3", "ISETP", "BRA"), (1, 2)),
            LOOP[2]]
    assert fit(gmma, {1: 4}, 4, None)[1] == 1
    assert fit(gmma, {1: 4}, 4, None, gmma_flops=3 * 4 * 65536, gmma_fp8_flops=3 * 4 * 65536)[1] == 3
    # no wgmma ran: the branch holding one is not taken, though its line says so (one instruction's miss)
    branch = [BRANCH[0], block(32, ("HGMMA.64x128x16.F32.BF16", "IADD3"), (3,), (None, 5)), *BRANCH[2:]]
    assert list(fit(branch, {5: 2}, 2, None)[1:3]) == [1, 0]
    assert list(fit(branch, {5: 2}, 2, None, gmma_flops=0)[1:3]) == [0, 1]


def test_fp8_decode_ldgsts_are_its_copies():
    # Decode of one sequence of 256 fp8 keys, 4 query heads on 1 KV head (head 128): paged_decode_mma_kernel,
    # one CTA of 4 warps, K and V tiles of 64 keys brought in by 16-byte cp.async copies of all 128 threads.
    # Before the anchor the fit counted 200 warp-level LDGSTS for the run's 128 (256 keys x 128 bytes x 2 / 512).
    import cupaged
    from cupaged import sim
    from cupaged.testing import paged_kv

    if _sass.nvdisasm() is None:
        pytest.skip("nvdisasm (the profiling extra) is not installed")
    rng = np.random.default_rng(0)
    cache = paged_kv([256], block_size=16, head_size=128, num_kv_heads=1, dtype=np.float16,
                     kv_cache_dtype="fp8_e4m3", rng=rng, device="sim")
    q = sim.asarray(rng.standard_normal((1, 4, 128)).astype(np.float16))
    with sim.profile() as prof:
        cupaged.paged_attention(q, cache.key_cache, cache.value_cache, cache.block_tables, cache.seq_lens,
                                kv_cache_dtype="fp8_e4m3", k_scale=cache.k_scale, v_scale=cache.v_scale)
    (launch,) = [x for x in prof.launches if "paged_decode_mma_kernel" in x.kernel]
    assert launch.cp_async_bytes == 256 * 128 * 2
    assert launch.instructions.by_opcode["LDGSTS"] == launch.cp_async_bytes // 512 == 128
