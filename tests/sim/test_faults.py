"""Wild addresses on the sim: a huge index must be reported with the real address and, where the
faulting instruction's registers allow, the argument it started from.

A non-canonical address (bits 63..47 not all equal) raises a general-protection fault, which
Linux delivers as SIGSEGV with si_addr 0: the engine decodes the faulting instruction's memory
operand instead (cupaged/sim/include/cupaged_sim_fault.h), tested here on real faults and on a
table of encodings.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from cupaged import sim

SRC = r"""
extern "C" __global__ void read_at(const float* src_vals, float* dst, long long i) {
  if (threadIdx.x == 3 && blockIdx.x == 1) dst[0] = src_vals[i];
}
extern "C" __global__ void write_at(float* dst_vals, long long i) {
  if (threadIdx.x == 3 && blockIdx.x == 1) dst_vals[i] = 9.0f;
}
// Constant indices: the offset is an immediate in a register or in the displacement.
extern "C" __global__ void read_far_above(const float* p, float* out) { out[0] = p[1LL << 60]; }
extern "C" __global__ void read_far_below(const float* p, float* out) { out[0] = p[-(1LL << 40)]; }

// General-protection faults the decoder cannot or need not resolve, written in x86 assembly
// (sim-only code, spelled `__asm`, which the inline-PTX rewrite leaves alone): an FS-relative
// operand, and an aligned SSE load from a misaligned address.
extern "C" __global__ void fs_relative(float* out) {
  float v;
  __asm volatile("movss %%fs:(%1), %0" : "=x"(v) : "r"(1ull << 60));
  out[0] = v;
}
extern "C" __global__ void misaligned_movaps(const float* p, float* out) {
  float v;
  __asm volatile("movaps (%1), %0" : "=x"(v) : "r"(p + 1));
  out[0] = v;
}

// A call through a bad function pointer faults on the instruction fetch: nothing to decode there.
extern "C" __global__ void call_at(long long target) { reinterpret_cast<void (*)()>(target)(); }

// The decoder itself: registers in x86 encoding order (rax, rcx, rdx, rbx, rsp, rbp, rsi, rdi, r8..r15).
extern "C" __global__ void decode(const unsigned char* code, const long long* regs, unsigned long long* out) {
  greg_t gregs[NGREG] = {};
  for (int i = 0; i < 16; ++i) gregs[cupaged_sim::kGreg[i]] = regs[i];
  cupaged_sim::MemOperand op{};
  out[0] = cupaged_sim::decode_mem_operand(code, gregs, &op);
  out[1] = op.addr;
  out[2] = op.base;
  out[3] = op.index;
}
"""


@pytest.fixture(scope="module")
def fn():
    return sim.RawModule(code=SRC).get_function


def _message(launch) -> str:
    with pytest.raises(sim.SimMemoryError) as e:
        launch()
    return str(e.value)


def _address(msg: str) -> int:
    return int(re.search(r"address (0x[0-9a-f]+)", msg).group(1), 16)


@pytest.mark.parametrize("kind", ["guarded", "plain"])
@pytest.mark.parametrize("index", [1 << 60, -(1 << 60), 1 << 45, -(1 << 40)])
def test_wild_read_names_the_argument_and_the_real_address(fn, kind, index):
    x = np.arange(64, dtype=np.float32)
    x = sim.asarray(x) if kind == "guarded" else x
    msg = _message(lambda: fn("read_at")((2,), (32,), (x, sim.zeros(1), np.int64(index))))
    assert f"out-of-bounds access of src_vals at byte offset {4 * index}: address 0x" in msg, msg
    assert "thread (3,0,0) of block (1,0,0)" in msg, msg
    assert _address(msg) != 0
    non_canonical = abs(4 * index) >= 1 << 47
    assert ("non-canonical" in msg) == non_canonical, msg
    if kind == "guarded":
        assert _address(msg) == (x.ctypes.data + 4 * index) % (1 << 64), msg


def test_wild_write_names_the_argument(fn):
    x = sim.zeros(64)
    msg = _message(lambda: fn("write_at")((2,), (32,), (x, np.int64(-(1 << 61)))))
    assert "of dst_vals at byte offset -9223372036854775808" in msg, msg
    assert _address(msg) == (x.ctypes.data - (1 << 63)) % (1 << 64)


@pytest.mark.parametrize("kernel, offset", [("read_far_above", 4 << 60), ("read_far_below", -(4 << 40))])
def test_constant_wild_index(fn, kernel, offset):
    x = sim.asarray(np.arange(64, dtype=np.float32))
    msg = _message(lambda: fn(kernel)((1,), (1,), (x, sim.zeros(1))))
    assert f"out-of-bounds access of p at byte offset {offset}: address {(x.ctypes.data + offset) % (1 << 64):#x}" \
        in msg, msg


def test_undecodable_general_protection_fault_says_so(fn):
    msg = _message(lambda: fn("fs_relative")((1,), (1,), (sim.zeros(1),)))
    assert "address unknown: general-protection fault" in msg and "0x0" not in msg, msg


def test_misaligned_aligned_load_is_not_called_out_of_bounds(fn):
    x = sim.asarray(np.arange(64, dtype=np.float32))
    msg = _message(lambda: fn("misaligned_movaps")((1,), (1,), (x, sim.zeros(1))))
    assert f"general-protection fault at address {x.ctypes.data + 4:#x} (p at byte offset 4)" in msg, msg
    assert "misaligned" in msg and "out-of-bounds" not in msg, msg


@pytest.mark.parametrize("target", [0, 0x1234])
def test_a_jump_to_a_bad_address_is_reported_at_that_address(fn, target):
    msg = _message(lambda: fn("call_at")((1,), (1,), (np.int64(target),)))
    assert f"invalid memory access at address {target:#x} (not inside any argument)" in msg, msg


REGS = {name: 0x1000 * (i + 1) for i, name in enumerate(
    "rax rcx rdx rbx rsp rbp rsi rdi r8 r9 r10 r11 r12 r13 r14 r15".split())}
# (bytes as GNU as encodes them, AT&T syntax, expected (address, base, index) or None: not decodable)
ENCODINGS = [
    ("8b 04 b7", "mov (%rdi,%rsi,4),%eax", (REGS["rdi"] + 4 * REGS["rsi"], REGS["rdi"], REGS["rsi"])),
    ("f3 43 0f 10 44 ec 10", "movss 0x10(%r12,%r13,8),%xmm0",
     (REGS["r12"] + 8 * REGS["r13"] + 0x10, REGS["r12"], REGS["r13"])),
    ("48 8b 45 80", "mov -0x80(%rbp),%rax", (REGS["rbp"] - 0x80, REGS["rbp"], 0)),
    ("48 8b 88 78 56 34 12", "mov 0x12345678(%rax),%rcx", (REGS["rax"] + 0x12345678, REGS["rax"], 0)),
    ("8b 04 5d 00 01 00 00", "mov 0x100(,%rbx,2),%eax", (0x100 + 2 * REGS["rbx"], 0, REGS["rbx"])),
    ("41 8b 45 00", "mov 0x0(%r13),%eax", (REGS["r13"], REGS["r13"], 0)),
    ("0f 28 1c 24", "movaps (%rsp),%xmm3", (REGS["rsp"], REGS["rsp"], 0)),
    ("f0 0f b1 0f", "lock cmpxchg %ecx,(%rdi)", (REGS["rdi"], REGS["rdi"], 0)),
    ("66 0f 38 00 00", "pshufb (%rax),%xmm0", (REGS["rax"], REGS["rax"], 0)),
    ("c4 81 7c 10 04 88", "vmovups (%r8,%r9,4),%ymm0", (REGS["r8"] + 4 * REGS["r9"], REGS["r8"], REGS["r9"])),
    ("c5 fa 10 4a 08", "vmovss 0x8(%rdx),%xmm1", (REGS["rdx"] + 8, REGS["rdx"], 0)),
    ("a0 88 77 66 55 44 33 22 11", "movabs 0x1122334455667788,%al", (0x1122334455667788, 0, 0)),
    ("f3 a4", "rep movsb (%rsi),(%rdi)", (REGS["rdi"], REGS["rdi"], 0)),
    ("67 8b 08", "mov (%eax),%ecx", (REGS["rax"] & 0xFFFFFFFF, REGS["rax"], 0)),
    ("64 8b 00", "mov %fs:(%rax),%eax", None),
    ("89 c1", "mov %eax,%ecx", None),
    ("8b 05 10 00 00 00", "mov 0x10(%rip),%eax", None),
    ("c5 f8 77", "vzeroupper", None),
    ("62 f1 7c 48 10 00", "vmovups (%rax),%zmm0", None),
]


@pytest.mark.parametrize("code, asm, want", ENCODINGS, ids=[e[1] for e in ENCODINGS])
def test_decoder(fn, code, asm, want):
    out = sim.zeros(4, np.uint64)
    regs = np.array(list(REGS.values()), np.int64)
    fn("decode")((1,), (1,), (np.frombuffer(bytes.fromhex(code) + bytes(16), np.uint8), regs, out))
    got = tuple(int(v) for v in out[1:]) if out[0] else None
    assert got == want, asm


def test_decoder_picks_the_faulting_string_operand(fn):
    """movsb reads (rsi) and writes (rdi): the non-canonical one is the one that faulted."""
    out = sim.zeros(4, np.uint64)
    regs = np.array([1 << 60 if name == "rsi" else v for name, v in REGS.items()], np.int64)
    fn("decode")((1,), (1,), (np.frombuffer(bytes.fromhex("a4") + bytes(16), np.uint8), regs, out))
    assert out.tolist() == [1, 1 << 60, 1 << 60, 0]
