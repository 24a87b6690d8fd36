"""The sim's inline-asm rewrite itself: statement parsing, operand binding, line numbers, scoping of
the rewrite to kernel and project code, and the warp-wide synchronization of .sync.aligned
instructions. (Each instruction's semantics: test_ptx.py, test_ptx_mma.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from cupaged import sim
from cupaged.sim.ptx import _asm
from cupaged.sim.ptx._base import split_commas


def test_statement_sections_and_strings():
    text = 'x; asm volatile("add.u32 %0, %1, " "%2;\\n" : "=r"(a[f(1, 2)]) :: "memory"); y'
    end, sections = _asm._statement(text, 3)
    assert text[end:] == " y"
    assert [s.strip() for s in sections] == ['"add.u32 %0, %1, " "%2;\\n"', '"=r"(a[f(1, 2)])', "", '"memory"']
    assert _asm._strings(sections[0]) == "add.u32 %0, %1, %2;\n"
    assert _asm._strings(r'"\x41\102\t\"q\""') == 'AB\t"q"'
    assert split_commas(' "r"(f(a, b)), [n] "l"(p + 1)') == [' "r"(f(a, b))', ' [n] "l"(p + 1)']


SRC = r"""
#define ADD3(d, a, b, c) asm("add.u32 %0, %1, %2;\n\t" \
                             "add.u32 %0, %0, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c))
extern "C" __global__ void bind(const unsigned* in, unsigned* out, float* fout) {
  const unsigned t = threadIdx.x;
  unsigned d, acc = in[t];
  ADD3(d, in[t], 7u, t);
  asm volatile("add.u32 %0, %0, %[k];" : "+r"(acc) : [k] "n"(1000));
  asm volatile("" ::: "memory");
  float f = 0.0f;
  asm("mov.b32 %0, %1;"
      : "=f"(f)
      : "r"(0x3f800000u + t));
  unsigned lo, hi;
  asm("mov.b64 {%0, %1}, %2;" : "=r"(lo), "=r"(hi) : "l"(0x1122334455667788ull));
  out[3 * t] = d; out[3 * t + 1] = acc; out[3 * t + 2] = lo ^ hi; fout[t] = f;
}

// A multi-line asm statement must not shift the lines below it: the barrier error names line 27.
extern "C" __global__ void lines(unsigned* out) {
  unsigned l;
  asm volatile(
      "mov.u32 %0,"
      " %%laneid;"
      : "=r"(l));
  if (l & 1) __syncthreads();
  else __syncthreads();
  out[threadIdx.x] = l;
}
"""


def test_operands_bind_by_constraint():
    mod = sim.RawModule(code=SRC, options=("-std=c++17",))
    x = np.arange(64, dtype=np.uint32) * 3
    out, fout = sim.zeros(192, np.uint32), sim.zeros(64, np.float32)
    mod.get_function("bind")((1,), (64,), (sim.asarray(x), out, fout))
    t = np.arange(64, dtype=np.uint32)
    o = out.reshape(64, 3)
    np.testing.assert_array_equal(o[:, 0], x + 7 + t)
    np.testing.assert_array_equal(o[:, 1], x + 1000)
    np.testing.assert_array_equal(o[:, 2], np.uint32(0x55667788 ^ 0x11223344))
    np.testing.assert_array_equal(fout.view(np.uint32), 0x3F800000 + t)


def test_lines_after_a_multiline_statement_are_kept():
    mod = sim.RawModule(code=SRC, options=("-std=c++17",))
    with pytest.raises(sim.SimSyncError, match=r"line 2[67]\).*line 2[67]\)"):
        mod.get_function("lines")((1,), (32,), (sim.zeros(32, np.uint32),))


def test_project_headers_are_rewritten_and_named(tmp_path):
    (tmp_path / "mine.cuh").write_text('#pragma once\n\n\ninline void f(unsigned& x) { asm("nada.u32 %0;" : "+r"(x)); }\n')
    code = '#include "mine.cuh"\nextern "C" __global__ void k(unsigned* p) { f(p[0]); }\n'
    with pytest.raises(sim.SimCompileError, match=r"line 4 of .*mine\.cuh: .*`nada\.u32`"):
        sim.RawModule(code=code, options=("-std=c++17", f"-I{tmp_path}"))
    (tmp_path / "macro.cuh").write_text('#pragma once\n#define BAD(x) asm("nope.b32 %0;" : "+r"(x))\n')
    code = '#include "macro.cuh"\n\nextern "C" __global__ void k(unsigned* p) {\n  BAD(p[0]);\n}\n'
    with pytest.raises(sim.SimCompileError, match=r"inline PTX at line 4: .*`nope\.b32`"):
        sim.RawModule(code=code, options=("-std=c++17", f"-I{tmp_path}"))


WARP = r"""
#include <cuda_fp16.h>
__device__ unsigned ldm(const unsigned short* row) {
  unsigned r;
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];"
               : "=r"(r) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(row))));
  return r;
}
__device__ unsigned ldm_other(const unsigned short* row) {
  unsigned r;
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];"
               : "=r"(r) : "r"(static_cast<unsigned>(__cvta_generic_to_shared(row))));
  return r;
}
// mode 0: every lane at one statement; 1: the halves at two statements; 2: half the warp at a barrier
extern "C" __global__ void k(const int* mode, unsigned* out) {
  __shared__ __align__(16) unsigned short m[64];
  for (int i = threadIdx.x; i < 64; i += blockDim.x) m[i] = (unsigned short)i;
  __syncthreads();
  const unsigned short* row = m + 8 * (threadIdx.x % 8);
  unsigned r = 0;
  if (mode[0] == 0 || threadIdx.x % 32 < 16) r = ldm(row);
  else if (mode[0] == 1) r = ldm_other(row);
  else __syncthreads();
  out[threadIdx.x] = r;
}
"""


@pytest.mark.parametrize("mode, error, match", [
    (1, sim.SimSyncError, r"different warp collectives: ldmatrix \(line \d+\) and ldmatrix"),
    (2, sim.SimSyncError, r"deadlock.*wait at ldmatrix \(line 5\) for lanes 0xffff0000"),
])
def test_warp_wide_instructions_need_the_whole_warp_at_one_statement(mode, error, match):
    mod = sim.RawModule(code=WARP, options=("-std=c++17",))
    out = sim.zeros(32, np.uint32)
    mod.get_function("k")((1,), (32,), (sim.asarray(np.array([0], np.int32)), out))
    lane = np.arange(32)
    want = (2 * (lane % 4) + 8 * (lane // 4)) | (2 * (lane % 4) + 1 + 8 * (lane // 4)) << 16
    np.testing.assert_array_equal(out, want)
    with pytest.raises(error, match=match):
        mod.get_function("k")((1,), (32,), (sim.asarray(np.array([mode], np.int32)), out))
