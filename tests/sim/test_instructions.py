"""The sim's issued-instruction count (``warp_instructions``, ``instruction_mix``,
``instructions_by_line`` of ``prof.launches``) against counts done by hand from the kernels' own SASS.

Each kernel here is compiled for sm_90 by NVRTC with ``-lineinfo`` and disassembled by ``nvdisasm -c
-g``; the tests read the listing with their own small parser (not the sim's), cut it where ptxas put
the kernel's branches and loops, and derive the expected count as a formula of those static counts:
warps x (instructions on the path each warp takes, a loop body once per trip). SIMT rules: a warp
issues an instruction once for all its active lanes, a branch that diverges inside a warp issues both
sides, predicated-off instructions still issue (``@!P0 EXIT`` of a CTA that goes on), and BSSY, BSYNC,
BRA and EXIT are instructions; the padding after the last EXIT (a ``BRA`` to itself, NOPs) never runs.
The count must come within 10% of the hand count; the comments say where the hand count is exact.

Mix classes as ``instruction_mix`` defines them (profiling/README.md): ``memory`` = LDG/STG/LDS/STS/LDC/ULDC/LDGSTS/LDSM/atomics/bulk
copies, ``fp32`` = FFMA/FADD/FMUL/FMNMX/FSETP/HFMA2/..., ``mufu`` = MUFU, ``mma`` = HMMA and the GMMA
family (``HFMA2.MMA``, a constant move on the FMA pipe, is no MMA), ``int_control`` = the rest.

The count needs nvdisasm and scipy (the ``profiling`` extra; a ``[sim]``-only install records
``warp_instructions = None``): without them the module is skipped — the one skip besides "no GPU".
"""

from __future__ import annotations

import collections
import functools
import re
import subprocess

import numpy as np
import pytest

from cupaged import sim
from cupaged.sim.profiler._sass import nvdisasm

pytest.importorskip("scipy")
pytestmark = pytest.mark.skipif(nvdisasm() is None, reason="nvdisasm (the profiling extra) is not installed")

SRC = r"""
extern "C" __global__ void straight(const float* x, float* y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;  // the grid covers x exactly: no bounds check
  float v = x[i];
  v = v * 1.5f + 2.0f;
  v = v * v + 0.25f;
  y[i] = v;
}
// x: [32 * (blockDim.x * gridDim.x / 32 + trips - 1)]; every lane runs the same `trips`
extern "C" __global__ void rolled(const float* x, float* y, int trips) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float acc = 0.f;
#pragma unroll 1
  for (int k = 0; k < trips; ++k) acc = acc * 0.5f + x[i + 32 * k];
  y[i] = acc;
}
// x: [blockDim.x * gridDim.x + 64 * 15]
extern "C" __global__ void unrolled(const float* x, float* y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < 16; ++k) acc = acc * 0.5f + x[i + 64 * k];
  y[i] = acc;
}
extern "C" __global__ void even_ctas(const float* x, float* y) {
  if (blockIdx.x & 1) return;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  y[i] = x[i] * 3.0f + 1.0f;
}
// mask 1: odd and even lanes of every warp part (divergence); mask 32: whole warps part (uniform)
extern "C" __global__ void split(const float* x, float* y, unsigned mask) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = x[i];
  if (threadIdx.x & mask) {
#pragma unroll
    for (int k = 0; k < 24; ++k) v = v * 0.5f + 1.0f;
  } else {
#pragma unroll
    for (int k = 0; k < 40; ++k) v = v * 0.5f - 3.0f;
  }
  y[i] = v;
}
// a 64-bit division by a run-time divisor: ptxas tests whether both operands fit 32 bits (a short
// inline path) and calls CUDA's __cuda_sm20_div_s64 subroutine for the others
extern "C" __global__ void div64(const long long* a, long long* out, long long d) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = a[i] / d;
}
"""

# instruction_mix's classes, by the opcode before its first dot
MEMORY = {"LDG", "STG", "LDS", "STS", "LD", "ST", "LDC", "ULDC", "LDGSTS", "LDSM", "ATOM", "ATOMG", "ATOMS",
          "RED", "REDG", "UBLKCP", "UTMALDG", "UTMASTG"}
FP32 = {"FFMA", "FADD", "FMUL", "FMNMX", "FSETP", "FSEL", "FSET", "HFMA2", "HADD2", "HMUL2"}
MMA = {"HMMA", "HGMMA", "QGMMA", "IGMMA", "BGMMA"}
CLASSES = ("mma", "fp32", "mufu", "memory", "int_control")

Insn = collections.namedtuple("Insn", "labels op target line")  # labels: those that name its address

_SECTION = re.compile(r"^//-+ \.text\.(\w+)")
_LINE = re.compile(r'^\s*//## File "[^"]*", line (\d+)')
_LABEL = re.compile(r"^(\.L_x_\d+):")
_OP = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T\d]\s+)?([A-Z][A-Z0-9_.]*)[^;]*?(?:`\((\.L_x_\d+)\))?\s*;")


def parse(listing):
    """Kernel name -> its instructions from the first through the last EXIT (the padding dropped)."""
    kernels, name, labels, line = {}, None, set(), None
    for row in listing.splitlines():
        if m := _SECTION.match(row):
            name, kernels[m.group(1)], labels = m.group(1), [], set()
        elif m := _LINE.match(row):
            line = int(m.group(1))
        elif m := _LABEL.match(row):
            labels.add(m.group(1))
        elif name and (m := _OP.match(row)):
            kernels[name].append(Insn(frozenset(labels), m.group(1), m.group(2), line))
            labels = set()
    for name, insns in kernels.items():
        last_exit = max(k for k, insn in enumerate(insns) if insn.op == "EXIT")
        kernels[name] = insns[:last_exit + 1]
    return kernels


@pytest.fixture(scope="module")
def sass(tmp_path_factory):
    from cupaged._nvrtc import compile_cubin

    cubin = tmp_path_factory.mktemp("sass") / "program.cubin"
    cubin.write_bytes(compile_cubin(SRC, arch="sm_90", options=("-std=c++17", "-lineinfo"), name_expressions=()).cubin)
    listing = subprocess.run([nvdisasm(), "-c", "-g", str(cubin)], capture_output=True, text=True, check=True).stdout
    return parse(listing)


def at(insns, label):
    """Index of the instruction ``label`` names."""
    (index,) = [k for k, insn in enumerate(insns) if label in insn.labels]
    return index


def kind(op):
    base = op.split(".")[0]
    return ("memory" if base in MEMORY else "fp32" if base in FP32 else "mufu" if base == "MUFU"
            else "mma" if base in MMA else "int_control")


def issued(*segments):
    """Instructions issued over ``(instructions, times)`` segments of a path: their count by source line
    and their mix (``total`` and instruction_mix's classes)."""
    by_line, mix = collections.Counter(), dict.fromkeys(CLASSES, 0)
    for insns, times in segments:
        for insn in insns:
            by_line[insn.line] += times
            mix[kind(insn.op)] += times
    mix["total"] = sum(by_line.values())
    return {line: n for line, n in by_line.items() if n}, mix


@functools.lru_cache(maxsize=None)
def kernel(name):
    return sim.RawModule(code=SRC, options=("-std=c++17",)).get_function(name)


def launch(name, grid, block, args, out, want):
    """One profiled launch, its result checked; its record, whose mix must add up to its count."""
    with sim.profile() as prof:
        kernel(name)((grid,), (block,), args)
    np.testing.assert_array_equal(out, want)
    rec = prof.launches[0]
    mix = rec.instruction_mix
    assert isinstance(rec.warp_instructions, int) and mix["total"] == rec.warp_instructions
    assert sum(mix[k] for k in CLASSES) == mix["total"]
    return rec


def agrees(rec, by_line, mix):
    """The record within 10% of the hand count: in total, in each class, on each line."""
    assert rec.warp_instructions == pytest.approx(mix["total"], rel=0.10)
    assert {k: rec.instruction_mix[k] for k in mix} == pytest.approx(mix, rel=0.10)
    assert rec.instructions_by_line == pytest.approx(by_line, rel=0.10)


def f32(values):
    return sim.asarray(np.asarray(values, np.float32))


def test_straight_line_code(sass):
    code = sass["straight"]
    # One basic block: the index, LDG, HFMA2.MMA (a move of 1.5f), two FFMA, STG, EXIT; no branch.
    assert not [insn for insn in code if insn.op.startswith("BRA")] and [i.op for i in code].count("EXIT") == 1
    x, y = f32(np.arange(192)), sim.zeros(192, np.float32)
    v = 1.5 * np.arange(192) + 2  # dyadic, a few bits: exact whether or not the FMAs fuse
    rec = launch("straight", 3, 64, (x, y), y, v * v + 0.25)
    warps = 3 * 2
    by_line, mix = issued((code, warps))
    # exact: every warp issues every instruction once
    assert mix["total"] == warps * len(code) and mix["mma"] == 0  # HFMA2.MMA is an fp32 move
    agrees(rec, by_line, mix)


@pytest.mark.parametrize("trips", [0, 1, 7, 50])
def test_loop_with_a_run_time_trip_count(sass, trips):
    code = sass["rolled"]
    # ptxas: a prologue that tests trips > 0 and branches past the loop (`@!P0 BRA` to the store) when
    # not, the set-up of the pointer and acc, then the body (from its label: the LDG, the counter and
    # pointer steps, the FFMA, up to the backward `@!P0 BRA` to that label), then the STG and EXIT.
    (back,) = [k for k, insn in enumerate(code) if insn.target and at(code, insn.target) <= k]
    top, after = at(code, code[back].target), back + 1
    (guard,) = [k for k, insn in enumerate(code[:top]) if insn.target and at(code, insn.target) == after]
    body, epilogue = code[top:after], code[after:]
    assert [insn.op for insn in body].count("LDG.E") == 1
    rows = 32 * (128 // 32 + max(trips, 1) - 1)
    x, y = f32(np.arange(rows) % 5), sim.zeros(128, np.float32)
    want = np.zeros(128, np.float32)
    for k in range(trips):  # acc * 0.5 is exact: fused or not, the same rounding as numpy's
        want = want * np.float32(0.5) + x[np.arange(128) + 32 * k]
    rec = launch("rolled", 2, 64, (x, y, np.int32(trips)), y, want)
    warps = 2 * 2
    if trips == 0:  # the guard's branch is taken: the loop's set-up never runs
        by_line, mix = issued((code[:guard + 1], warps), (epilogue, warps))
    else:  # the guard issues (not taken), the body once per trip, its last back edge falls through
        by_line, mix = issued((code[:top], warps), (body, warps * trips), (epilogue, warps))
    # exact: all lanes take the same trips, so each warp runs one path
    agrees(rec, by_line, mix)


def test_fully_unrolled_loop(sass):
    code = sass["unrolled"]
    # ptxas unrolled all 16 trips into one block: 16 LDG up front (the loads all in flight), an FADD
    # (acc = 0 + x[i]) and 15 FFMA, one STG; besides them LDCs of the parameters and stack pointer.
    ops = [insn.op for insn in code]
    assert ops.count("LDG.E") == 16 and ops.count("FFMA") == 15 and not [op for op in ops if op.startswith("BRA")]
    x, y = f32(np.arange(128 + 64 * 15) % 7), sim.zeros(128, np.float32)
    want = np.zeros(128, np.float32)
    for k in range(16):
        want = want * np.float32(0.5) + x[np.arange(128) + 64 * k]
    rec = launch("unrolled", 2, 64, (x, y), y, want)
    warps = 2 * 2
    by_line, mix = issued((code, warps))
    # exact: one path; never 16 x the loop line's instructions (the loop ran once, as SASS, per warp)
    assert mix["total"] == warps * len(code)
    agrees(rec, by_line, mix)
    memory = sum(kind(op) == "memory" for op in ops)  # 16 LDG, STG, and the LDC / ULDC of the parameters
    assert rec.instruction_mix["memory"] == warps * memory == mix["memory"]
    assert rec.instruction_mix["fp32"] == warps * 16 == mix["fp32"]  # FADD + 15 FFMA


def test_odd_ctas_return_at_once(sass):
    code = sass["even_ctas"]
    # ptxas: blockIdx.x & 1 into P0, then `@!P0 EXIT` — an odd CTA's warps leave on it; an even
    # CTA's issue it predicated off and go on through the body to the last EXIT.
    (leave,) = [k for k, insn in enumerate(code) if insn.op == "EXIT" and k < len(code) - 1]
    x, y = f32(np.arange(320)), sim.zeros(320, np.float32)
    ran = np.repeat(np.arange(5) % 2 == 0, 64)
    rec = launch("even_ctas", 5, 64, (x, y), y, np.where(ran, 3 * np.arange(320) + 1, 0))
    even, odd = 3 * 2, 2 * 2  # CTAs 0, 2, 4 and 1, 3; two warps each
    by_line, mix = issued((code, even), (code[:leave + 1], odd))
    # exact: each CTA's warps run one path
    assert mix["total"] == even * len(code) + odd * (leave + 1)
    agrees(rec, by_line, mix)


def split_code(code):
    """ptxas's if / else: the prologue (through `BSSY` and the conditional `BRA` to the else side), the
    fall-through side (ending in a `BRA` to the join), the branch target's side, then the join (`BSYNC`)
    through EXIT."""
    (cond,) = [k for k, insn in enumerate(code) if insn.target and at(code, insn.target) > k + 1 and
               code[at(code, insn.target) - 1].op == "BRA"]
    other = at(code, code[cond].target)
    join = at(code, code[other - 1].target)
    assert code[join].op == "BSYNC"
    return code[:cond + 1], code[cond + 1:other], code[other:join], code[join:]


def want_split(x, mask):
    v = x.astype(np.float32)
    odd = (np.arange(v.size) % 64 & mask) != 0
    for k in range(40):  # * 0.5 is exact: fused or not, the same rounding
        v = np.where(odd & (k < 24), v * np.float32(0.5) + np.float32(1), v)
        v = np.where(~odd, v * np.float32(0.5) - np.float32(3), v)
    return v


def test_lanes_of_a_warp_split_into_two_branches(sass):
    head, fall, taken, tail = split_code(sass["split"])
    # ptxas: BSSY to the join, `@P0 BRA` to the `else` side when threadIdx.x & mask is 0; the `if` side
    # falls through (a move of 0.5f, 24 FFMA, BRA to the join), then the `else` side (a move of 0.5f,
    # 40 FFMA), the join: BSYNC, the STG, EXIT.
    assert sorted([insn.op for insn in side].count("FFMA") for side in (fall, taken)) == [24, 40]
    x, y = f32(np.arange(256) % 9), sim.zeros(256, np.float32)
    rec = launch("split", 4, 64, (x, y, np.uint32(1)), y, want_split(x, 1))
    warps = 4 * 2
    # exact: every warp diverges, so each runs both sides: all of the kernel's code, once
    by_line, mix = issued((head + fall + taken + tail, warps))
    assert mix["total"] == warps * len(sass["split"])
    agrees(rec, by_line, mix)


@pytest.mark.parametrize("mask", [32, 0])
def test_whole_warps_take_one_branch(sass, mask):
    head, fall, taken, tail = split_code(sass["split"])
    x, y = f32(np.arange(256) % 9), sim.zeros(256, np.float32)
    rec = launch("split", 4, 64, (x, y, np.uint32(mask)), y, want_split(x, mask))
    ctas = 4
    # exact: no warp diverges. Mask 32: warp 1 of each CTA (threadIdx.x & 32) runs the `if` side, warp 0
    # the `else` side, neither both; mask 0: every warp runs the `else` side (the 40 FFMA).
    runs = (1, 1) if mask else (0, 2)  # warps per CTA on each side
    chain_24, chain_40 = sorted((fall, taken), key=lambda side: [insn.op for insn in side].count("FFMA"))
    by_line, mix = issued((head + tail, 2 * ctas), (chain_24, runs[0] * ctas), (chain_40, runs[1] * ctas))
    agrees(rec, by_line, mix)


def test_a_64_bit_division_on_its_32_bit_path(sass):
    code = sass["div64"]  # through the last EXIT: the subroutine after it is not in the listing's path
    # ptxas: a prologue ending in `@!P0 BRA` past the call when both operands fit 32 bits; the call
    # (MOV of the return address, CALL.REL) and a BRA over the inline path; the inline 32-bit division;
    # then the join (BSYNC), the STG and EXIT. Operands under 2^31 take the inline path, never the call.
    (branch,) = [k for k, insn in enumerate(code) if insn.op == "BRA" and insn.target and at(code, insn.target) > k
                 and any(c.op.startswith("CALL") for c in code[k + 1:at(code, insn.target)])]
    skipped = code[branch + 1:at(code, code[branch].target)]
    path = code[:branch + 1] + code[at(code, code[branch].target):]
    a = sim.asarray(np.arange(1, 129, dtype=np.int64) * 1000003)
    out = sim.zeros(128, np.int64)
    rec = launch("div64", 2, 64, (a, out, np.int64(7)), out, np.arange(1, 129, dtype=np.int64) * 1000003 // 7)
    assert any(insn.op.startswith("CALL") for insn in skipped)
    by_line, mix = issued((path, 4))
    agrees(rec, by_line, mix)
