"""Model v2 on Hopper SASS: the wgmma (GMMA), bulk-copy (UBLKCP), tensor-copy (UTMALDG) and mbarrier
(SYNCS) instructions of real sm_90a code, classified and counted as the model prices them.

No GPU and no sim launch: ``HOPPER`` is compiled by NVRTC for sm_90a (the H200 model's architecture;
wgmma does not compile for plain sm_90) and disassembled by nvdisasm, as ``launch.instructions`` does
for a profiled launch. The kernel is never run (the sim does not emulate wgmma yet): its counts come
from the fit with no line counts, which runs every block of the path once per warp (the retry loops of
the elected copies and of the mbarrier wait not at all) — the straight-line count of the SASS.
"""

from __future__ import annotations

import collections
import re
import subprocess
import types

import pytest

from cupaged.sim import model
from cupaged.sim.profiler import _instructions, _sass

pytest.importorskip("scipy")
pytestmark = pytest.mark.skipif(_sass.nvdisasm() is None, reason="nvdisasm (the profiling extra) is not installed")

OPTIONS = ("-std=c++17",)
HOPPER = r"""
struct alignas(64) TensorMap { unsigned char bytes[128]; };  // a CUtensorMap's size and alignment
extern "C" __global__ void hopper(const float* src, float* out, unsigned long long da, unsigned long long db,
                                  const __grid_constant__ TensorMap tmap) {
  __shared__ alignas(128) float tile[1024];
  __shared__ alignas(8) unsigned long long bar;
  const unsigned smem = static_cast<unsigned>(__cvta_generic_to_shared(tile));
  const unsigned mbar = static_cast<unsigned>(__cvta_generic_to_shared(&bar));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(mbar));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  // every thread issues the copies (the kernel is never run): no branch around them for the fit to skip
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(mbar), "r"(2048u));
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(smem), "l"(src), "r"(1024u), "r"(mbar) : "memory");
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3}], [%4];" :: "r"(smem + 1024u), "l"(&tmap), "r"(0), "r"(0), "r"(mbar)
               : "memory");
  asm volatile("{\n .reg .pred p;\n wait:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
               " @!p bra wait;\n}" :: "r"(mbar), "r"(0u) : "memory");
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, %4, %5, 1, 1, 1, 0, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db));
  asm volatile("wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, %4, %5, 1, 1, 1;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  out[threadIdx.x] = d[0] + d[1] + d[2] + d[3] + tile[threadIdx.x];
}
"""


@pytest.fixture(scope="module")
def opcodes(tmp_path_factory):
    """Every instruction of HOPPER's sm_90a SASS (the opcode before its first dot), once each."""
    from cupaged._nvrtc import compile_cubin

    cubin = tmp_path_factory.mktemp("hopper") / "hopper.cubin"
    cubin.write_bytes(compile_cubin(HOPPER, arch="sm_90a", options=OPTIONS).cubin)
    listing = subprocess.run([_sass.nvdisasm(), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    found = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", listing)
    return collections.Counter(found)


def test_wgmma_needs_sm_90a_and_the_model_compiles_for_it():
    from cupaged._nvrtc import NvrtcError, compile_cubin

    with pytest.raises(NvrtcError, match="wgmma"):
        compile_cubin(HOPPER, arch="sm_90", options=OPTIONS)
    assert model.H200.arch == "sm_90a" and model.ARCH_LIMITS["sm_90a"] == model.ARCH_LIMITS["sm_90"]


def test_hopper_opcodes_are_classified(opcodes):
    # ptxas's sm_90a SASS for the PTX above: HGMMA (bf16 wgmma), QGMMA (e4m3 wgmma), UBLKCP (cp.async.bulk),
    # UTMALDG (cp.async.bulk.tensor, a load), SYNCS (mbarrier init / expect_tx / try_wait), WARPGROUP (the
    # wgmma fence's ARRIVE and wait_group's DEPBAR)
    for op in ("HGMMA", "QGMMA", "UBLKCP", "UTMALDG", "SYNCS", "WARPGROUP"):
        assert opcodes[op] >= 1, (op, opcodes)
    assert opcodes["HGMMA"] == opcodes["QGMMA"] == 1
    classes = {op: _sass.opcode_class(op) for op in opcodes}
    assert classes["HGMMA"] == classes["QGMMA"] == "mma"
    assert classes["UBLKCP"] == classes["UTMALDG"] == classes["SYNCS"] == "memory"
    assert classes["WARPGROUP"] == "int_control"
    for op in ("IGMMA", "BGMMA", "HMMA"):
        assert _sass.opcode_class(op + ".64x8x32") == "mma"
    for op in ("UTMASTG", "UTMAPF", "UTMACCTL.IV", "SYNCS.ARRIVE.TRANS64.A1T0", "SYNCS.PHASECHK.TRANS64.TRYWAIT"):
        assert _sass.opcode_class(op) == "memory"
    assert _sass.opcode_class("WARPGROUP.DEPBAR.LE") == _sass.opcode_class("WARPSYNC.ALL") == "int_control"


def test_gmma_shapes_are_read():
    # nvdisasm writes a GMMA's shape into its opcode (HGMMA.64x8x16.F32.BF16); the blocks keep it, and each
    # warp's issue does a quarter of the warpgroup's 2 M N K FLOPs
    from cupaged.sim.profiler import _block_fit

    blocks = _sass.kernel_blocks(HOPPER, OPTIONS, "hopper", model.H200.arch)
    gmma = [op for b in blocks for op in b.opcodes if "GMMA" in op]
    assert gmma == ["HGMMA.64x8x16.F32.BF16", "QGMMA.64x8x32.F32.E4M3.E4M3"]
    assert [_block_fit._gmma_flops(op) for op in gmma] == [2 * 64 * 8 * 16 // 4, 2 * 64 * 8 * 32 // 4]


def test_hopper_kernel_is_counted_per_warp(opcodes):
    # A launch of one CTA of 128 threads (a warpgroup: 4 warps) whose run the fit knows nothing of (no line
    # counts, no cp.async bytes): each warp runs the path's blocks once, so every instruction of the
    # straight-line path issues 4 times. The default architecture is the model's: sm_90 would not compile.
    # The run's wgmma FLOPs (one m64n8k16 bf16 and one m64n8k32 e4m3 by the warpgroup) say as much.
    launch = types.SimpleNamespace(source=HOPPER, options=OPTIONS, kernel="hopper", block=(128, 1, 1), ctas_profiled=1,
                                   line_executions={}, host_blocks=(), cp_async_bytes=0, gmma_flops=2 * 64 * 8 * 16,
                                   gmma_fp8_flops=2 * 64 * 8 * 32)
    count = _instructions.launch_instructions(launch)
    assert count.note == "" and count.warp_instructions is not None
    by_opcode = count.by_opcode
    for op in ("HGMMA", "QGMMA", "UBLKCP", "UTMALDG", "WARPGROUP"):
        assert by_opcode[op] == 4 * opcodes[op], (op, by_opcode)
    assert count.instruction_mix["mma"] == 4 * 2  # one HGMMA and one QGMMA per warp
    assert count.instruction_mix["memory"] >= by_opcode["UBLKCP"] + by_opcode["UTMALDG"] + by_opcode["SYNCS"]
    assert sum(count.instruction_mix[c] for c in _sass.CLASSES) == count.warp_instructions
