"""wgmma.mma_async on the sim, bit-exact against the independent numpy models of ``hopper_isa.py``.

Each case builds A and B in a shared-memory image at the addresses the model gives for its descriptor
(layout, swizzle, LBO/SBO), the kernel copies the image into shared memory (generic stores, then
``fence.proxy.async``), runs one wgmma and writes every thread's accumulator registers out; the test
scatters them through the model's fragment layout and compares with float64 ``C + (sa A)(sb B)^T``
rounded once (f32 or f16), the rounding rule the sim documents. Every source also compiles under
NVRTC for sm_90a. The full product of shapes, types, swizzles and majors runs under ``-m slow``.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from cupaged import _nvrtc, sim
from cupaged.sim._memory import poison_byte
from tests.conftest import Backend, hopper_module, raw_module
from tests.sim import hopper_isa as isa

DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16, "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def layout(rows: int, eb: int, major: str, swizzle: str) -> tuple[int, int, int]:
    """(lbo, sbo, bytes) of a canonical operand of ``rows`` rows: core matrices / atoms packed densely."""
    t, w = 16 // eb, isa.SWIZZLE_SPAN[swizzle] // 16
    if major == "K" and swizzle == "none":
        return 128, 256, rows // 8 * 256 if rows % 8 == 0 else (rows // 8 + 1) * 256
    if major == "K":
        return 16, 128 * w, -(-rows // 8) * 128 * w
    if swizzle == "none":
        groups = -(-rows // t)
        return 128 * groups, 128, 2 * 128 * groups
    atoms = -(-rows // (t * w))
    return 2 * 128 * w, 128 * w, atoms * 2 * 128 * w


def source(n, ta, tb, acc, a_regs, trans_a=0, trans_b=0, neg_a=1, neg_b=1, fence_proxy=True, fence_wgmma=True,
           between="", extra=""):
    """A kernel running one wgmma; ``between``: code between its commit_group and its wait_group; ``extra``: more
    code in the module."""
    fp8 = ta in ("e4m3", "e5m2")
    nd, k = (n // 4 if acc == "f16" else n // 2), (32 if fp8 else 16)
    dt, con = ("unsigned", "+r") if acc == "f16" else ("float", "+f")
    a_op = "{%%%d, %%%d, %%%d, %%%d}" % tuple(range(nd, nd + 4)) if a_regs else f"%{nd}"
    j = nd + (4 if a_regs else 1)
    imms = f"{neg_a}, {neg_b}" + ("" if fp8 else f", {trans_b}" if a_regs else f", {trans_a}, {trans_b}")
    outs = ", ".join(f'"{con}"(d[{i}])' for i in range(nd))
    ins = ", ".join([*(f'"r"(a[{i}])' for i in range(4))] if a_regs else ['"l"(da)']) + ', "l"(db), "r"(scale_d)'
    return f"""
extern "C" __global__ void wg(const unsigned char* image, int image_bytes, const unsigned* areg,
                              unsigned long long desc_a, unsigned long long desc_b, const {dt}* c_in, {dt}* out,
                              int scale_d) {{
  extern __shared__ unsigned char smem[];  // [image_bytes + 1024]: the image from a 1024-aligned address
  unsigned base = (unsigned)__cvta_generic_to_shared(smem), pad = (1024u - base % 1024u) % 1024u;
  for (int i = threadIdx.x; i < image_bytes; i += blockDim.x) smem[pad + i] = image[i];
  {'asm volatile("fence.proxy.async.shared::cta;" ::: "memory");' if fence_proxy else ''}
  __syncthreads();
  const int t = threadIdx.x;
  const unsigned long long da = desc_a + ((base + pad) >> 4), db = desc_b + ((base + pad) >> 4);
  {dt} d[{nd}];
  unsigned a[4];
  for (int i = 0; i < {nd}; ++i) d[i] = c_in[t * {nd} + i];
  for (int i = 0; i < 4; ++i) a[i] = areg[4 * t + i];
  {'asm volatile("wgmma.fence.sync.aligned;" ::: "memory");' if fence_wgmma else ''}
  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{j + 1}, 0;\\n"
               "wgmma.mma_async.sync.aligned.m64n{n}k{k}.{acc}.{ta}.{tb} {{{", ".join(f"%{i}" for i in range(nd))}}}, "
               "{a_op}, %{j}, p, {imms};\\n}}\\n" : {outs} : {ins});
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  {between}
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (int i = 0; i < {nd}; ++i) out[t * {nd} + i] = d[i];
}}
{extra}"""


def run_case(backend, n, ta, tb, acc, a_regs, major_a="K", major_b="K", swz_a="none", swz_b="none",
             neg_a=1, neg_b=1, scale_d=1, seed=0, described_swz_b=None, **kw):
    """One wgmma on random operands: (every thread's accumulators, the model's). ``described_swz_b``: B's
    descriptor claims this swizzle instead of the one B was stored with (a broken layout)."""
    rng = np.random.default_rng(seed)
    fp8 = ta in ("e4m3", "e5m2")
    eb, k = (1, 32) if fp8 else (2, 16)
    A = rng.normal(size=(64, k)).astype(DTYPES[ta])
    B = rng.normal(size=(n, k)).astype(DTYPES[tb])
    image = np.zeros(1 << 16, np.uint8)
    off_b, desc_a = 0, 0
    if not a_regs:
        lbo, sbo, size = layout(64, eb, major_a, swz_a)
        isa.store_operand(A, isa.operand_addresses(64, eb, major_a, swz_a, lbo, sbo), image)
        desc_a = isa.descriptor(0, lbo, sbo, swz_a)
        off_b = -(-size // 1024) * 1024
    lbo, sbo, size = layout(n, eb, major_b, swz_b)
    isa.store_operand(B, isa.operand_addresses(n, eb, major_b, swz_b, lbo, sbo, start=off_b), image)
    desc_b = isa.descriptor(off_b, lbo, sbo, described_swz_b or swz_b)
    image = image[:off_b + size]
    areg = np.zeros((128, 4), np.uint32)
    if a_regs:
        coords = isa.a_register_coords(eb)  # [128, 4, per, 2]
        bits = A.view(np.uint8 if fp8 else np.uint16)[coords[..., 0], coords[..., 1]].astype(np.uint32)
        areg = (bits << (8 * eb * np.arange(4 // eb, dtype=np.uint32))).sum(axis=-1).astype(np.uint32)
    cdt = np.float16 if acc == "f16" else np.float32
    C = rng.normal(size=(64, n)).astype(cdt)
    coords = isa.accumulator_coords(n)
    c_in = C[coords[..., 0], coords[..., 1]]  # [128, n / 2]
    D = (C.astype(np.float64) if scale_d else 0.0) + (neg_a * A.astype(np.float64)) @ (neg_b * B.astype(np.float64)).T
    want = D.astype(cdt)[coords[..., 0], coords[..., 1]]
    if acc == "f16":
        c_in = c_in.view(np.uint32)
        want = want.view(np.uint32)
    nd = c_in.shape[1]
    code = source(n, ta, tb, acc, a_regs, int(major_a == "MN"), int(major_b == "MN"), neg_a, neg_b, **kw)
    mod = hopper_module(backend, code)
    f = mod.get_function("wg")
    f.max_dynamic_shared_size_bytes = image.size + 1024
    out = backend.empty((128, nd), c_in.dtype)
    f((1,), (128,), (backend.asarray(image), np.int32(image.size), backend.asarray(areg), np.uint64(desc_a),
                     np.uint64(desc_b), backend.asarray(c_in), out, np.int32(scale_d)), shared_mem=image.size + 1024)
    return backend.to_numpy(out), want


CASES = [  # (n, ta, tb, acc, a_regs, major_a, major_b, swz_a, swz_b): each swizzle, major, type, A source
    (64, "bf16", "bf16", "f32", False, "K", "K", "128B", "128B"),
    (32, "f16", "f16", "f16", True, "K", "MN", "none", "64B"),
    (24, "e4m3", "e5m2", "f32", False, "K", "K", "none", "32B"),
    (16, "e5m2", "e4m3", "f16", True, "K", "K", "none", "128B"),
    (8, "bf16", "bf16", "f32", False, "MN", "MN", "128B", "none"),
    (40, "f16", "f16", "f32", False, "MN", "K", "32B", "64B"),
    (256, "bf16", "bf16", "f32", True, "K", "MN", "none", "128B"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[0]}-{c[1]}{c[2]}-{c[3]}-{'reg' if c[4] else c[5] + c[7]}-"
                                                      f"{c[6]}{c[8]}")
def test_wgmma_matches_isa_model(backend, case):
    n, ta, tb, acc, a_regs, ma, mb, sa, sb = case
    got, want = run_case(backend, n, ta, tb, acc, a_regs, ma, mb, sa, sb)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("neg_a, neg_b, scale_d", [(-1, 1, 1), (1, -1, 0)])
def test_wgmma_scales(backend, neg_a, neg_b, scale_d):
    got, want = run_case(backend, 32, "bf16", "bf16", "f32", False, "K", "K", "64B", "64B", neg_a, neg_b, scale_d)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("stored, described", [("64B", "128B"), ("128B", "none"), ("32B", "64B")])
def test_broken_layout_is_caught(stored, described):
    """The comparison is sensitive to the layout: B stored with one swizzle but described with another
    gives a result the model does not predict."""
    got, want = run_case(Backend("sim"), 32, "bf16", "bf16", "f32", False, "K", "K", "64B", stored,
                         described_swz_b=described)
    assert not np.array_equal(got, want)


ORDERS = ["natural", "reverse", "random:5"]


@pytest.mark.parametrize("order", ORDERS)
def test_missing_proxy_fence_is_an_error(monkeypatch, order):
    monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    with pytest.raises(sim.SimSyncError, match="fence.proxy.async"):
        run_case(Backend("sim"), 16, "bf16", "bf16", "f32", False, "K", "K", "none", "none", fence_proxy=False)


@pytest.mark.parametrize("order", ORDERS)
def test_missing_wgmma_fence_is_an_error(monkeypatch, order):
    monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    with pytest.raises(sim.SimSyncError, match="wgmma.fence"):
        run_case(Backend("sim"), 16, "bf16", "bf16", "f32", False, "K", "K", "none", "none", fence_wgmma=False)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("between, what", [("d[3] = 1.0f;", "accumulator"), ("a[2] = 7u;", "A fragment")])
def test_registers_written_in_flight_are_an_error(monkeypatch, order, between, what):
    monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    with pytest.raises(sim.SimSyncError, match=f"{what} register"):
        run_case(Backend("sim"), 16, "f16", "f16", "f32", True, between=between)


@pytest.mark.parametrize("order", ORDERS)
def test_registers_in_flight_read_poison(monkeypatch, order):
    """Until wait_group covers the wgmma, its accumulators and the variables A came from hold poison
    (the kernel traps otherwise), and the wait lands the results and restores A."""
    word = f"{poison_byte() * 0x01010101}u"
    monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    check = f"if (__float_as_uint(d[0]) != {word} || a[3] != {word}) __trap();"
    got, want = run_case(Backend("sim"), 16, "f16", "f16", "f32", True, between=check)
    np.testing.assert_array_equal(got, want)


def test_a_shared_window_past_the_descriptors_reach_is_an_error():
    """The sim keeps every kernel's static __shared__ of a module ahead of the dynamic buffer, so a launch's shared
    addresses can pass the 256 KB a descriptor's start reaches (no GPU kernel's can): the descriptor's address would
    wrap onto other bytes and the wgmma read garbage silently (paged_prefill_sm90_kernel's d256 instantiations did,
    beside 19 others' static rows). Now it is an error naming the cause."""
    pads = "".join(f'extern "C" __global__ void pad{i}(float* x) {{ __shared__ float s{i}[10240]; '
                   f's{i}[threadIdx.x] = 1.0f; __syncthreads(); x[threadIdx.x] = s{i}[threadIdx.x]; }}\n'
                   for i in range(7))  # 7 x 40 KB of static shared memory in the module
    with pytest.raises(sim.SimError, match="256 KB a matrix descriptor"):
        run_case(Backend("sim"), 16, "bf16", "bf16", "f32", False, extra=pads)
    run_case(Backend("sim"), 16, "bf16", "bf16", "f32", False, extra=pads.replace("10240", "1024"))


@pytest.mark.parametrize("order", ORDERS)
def test_a_warp_missing_the_wgmma_is_an_error(monkeypatch, order):
    """wgmma is warpgroup-wide: a warp that skips it leaves the other three waiting (never a hang)."""
    monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    code = source(16, "bf16", "bf16", "f32", False).replace('asm volatile("{\\n.reg .pred p;',
                                                             'if (threadIdx.x < 96) asm volatile("{\\n.reg .pred p;')
    assert "threadIdx.x < 96" in code
    lbo, sbo, size = layout(64, 2, "K", "none")
    f = raw_module(Backend("sim"), code).get_function("wg")
    image = sim.zeros(4096, np.uint8)
    args = (image, np.int32(4096), sim.zeros((128, 4), np.uint32), np.uint64(isa.descriptor(0, lbo, sbo, "none")),
            np.uint64(isa.descriptor(2048, lbo, sbo, "none")), sim.zeros((128, 8), np.float32),
            sim.empty((128, 8), np.float32), np.int32(1))
    with pytest.raises(sim.SimSyncError, match="warpgroup"):
        f((1,), (128,), args, shared_mem=4096 + 1024)


@pytest.mark.parametrize("case", CASES[:4])
def test_sources_compile_for_sm90a(case):
    n, ta, tb, acc, a_regs, ma, mb, *_ = case
    _nvrtc.compile_cubin(source(n, ta, tb, acc, a_regs, int(ma == "MN"), int(mb == "MN")), arch="sm_90a",
                         options=("-std=c++17",))


@pytest.mark.slow
@pytest.mark.parametrize("n", range(8, 257, 8))
@pytest.mark.parametrize("types", [("bf16", "bf16", "f32"), ("f16", "f16", "f16"), ("e4m3", "e4m3", "f32"),
                                   ("e5m2", "e4m3", "f16")])
def test_wgmma_every_shape(n, types):
    got, want = run_case(Backend("sim"), n, *types, False, "K", "K", "128B", "64B", seed=n)
    np.testing.assert_array_equal(got, want)


LAYOUTS = list(itertools.product(["K", "MN"], isa.SWIZZLES, ["K", "MN"], isa.SWIZZLES))


@pytest.mark.slow
@pytest.mark.parametrize("ma, sa, mb, sb", LAYOUTS)
def test_wgmma_every_layout(ma, sa, mb, sb):
    got, want = run_case(Backend("sim"), 48, "f16", "f16", "f32", False, ma, mb, sa, sb)
    np.testing.assert_array_equal(got, want)


CHAIN = r"""
// FlashAttention-3's register reuse: S = Q K^T (64 x 16, both operands in shared memory), then P = bf16(S)
// repacked from S's accumulator fragment straight into the A fragment of O = P V (A from registers, V
// MN-major: trans-b = 1). Accumulator registers 4j..4j+3 hold columns 8j..8j+7, so for a k-slice of 16:
// a0 = S(g, 2t..), a1 = S(g + 8, 2t..), a2 = S(g, 2t + 8..), a3 = S(g + 8, 2t + 8..).
extern "C" __global__ void chain(const unsigned char* image, int image_bytes, unsigned long long desc_q,
                                 unsigned long long desc_k, unsigned long long desc_v, float* out) {
  extern __shared__ unsigned char smem[];
  unsigned base = (unsigned)__cvta_generic_to_shared(smem), pad = (1024u - base % 1024u) % 1024u;
  for (int i = threadIdx.x; i < image_bytes; i += blockDim.x) smem[pad + i] = image[i];
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const unsigned long long shift = (base + pad) >> 4;
  float s[8], o[16];
  unsigned a[4];
  for (int i = 0; i < 8; ++i) s[i] = 0.0f;
  for (int i = 0; i < 16; ++i) o[i] = 0.0f;
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, "
               "0, 1, 1, 0, 0;"
               : "+f"(s[0]), "+f"(s[1]), "+f"(s[2]), "+f"(s[3]), "+f"(s[4]), "+f"(s[5]), "+f"(s[6]), "+f"(s[7])
               : "l"(desc_q + shift), "l"(desc_k + shift));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (int j = 0; j < 4; ++j) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(a[j]) : "f"(s[2 * j + 1]), "f"(s[2 * j]));
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
               "%11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, 1, 1, 1, 1;"
               : "+f"(o[0]), "+f"(o[1]), "+f"(o[2]), "+f"(o[3]), "+f"(o[4]), "+f"(o[5]), "+f"(o[6]), "+f"(o[7]),
                 "+f"(o[8]), "+f"(o[9]), "+f"(o[10]), "+f"(o[11]), "+f"(o[12]), "+f"(o[13]), "+f"(o[14]), "+f"(o[15])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_v + shift));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (int i = 0; i < 16; ++i) out[threadIdx.x * 16 + i] = o[i];
}
"""


def test_scores_feed_the_next_wgmma_from_registers(backend):
    """The accumulator fragment of S = Q K^T, rounded to bf16 pairs, is the A fragment of O = P V."""
    rng = np.random.default_rng(5)
    bf16 = ml_dtypes.bfloat16
    q, k, v = (rng.normal(size=s).astype(bf16) for s in ((64, 16), (16, 16), (16, 32)))
    image = np.zeros(8192, np.uint8)
    lbo, sbo, _ = layout(64, 2, "K", "none")
    isa.store_operand(q, isa.operand_addresses(64, 2, "K", "none", lbo, sbo), image)
    desc_q = isa.descriptor(0, lbo, sbo, "none")
    lbo, sbo, _ = layout(16, 2, "K", "none")
    isa.store_operand(k, isa.operand_addresses(16, 2, "K", "none", lbo, sbo, start=4096), image)
    desc_k = isa.descriptor(4096, lbo, sbo, "none")
    lbo, sbo, _ = layout(32, 2, "MN", "64B")  # B of P V: rows = d (N), k = keys; d contiguous
    isa.store_operand(v.T, isa.operand_addresses(32, 2, "MN", "64B", lbo, sbo, start=6144), image)
    desc_v = isa.descriptor(6144, lbo, sbo, "64B")
    f = hopper_module(backend, CHAIN).get_function("chain")
    f.max_dynamic_shared_size_bytes = image.size + 1024
    out = backend.empty((128, 16), np.float32)
    f((1,), (128,), (backend.asarray(image), np.int32(image.size), np.uint64(desc_q), np.uint64(desc_k),
                     np.uint64(desc_v), out), shared_mem=image.size + 1024)
    s = (q.astype(np.float64) @ k.astype(np.float64).T).astype(np.float32)
    o = (s.astype(bf16).astype(np.float64) @ v.astype(np.float64)).astype(np.float32)
    coords = isa.accumulator_coords(32)
    np.testing.assert_array_equal(backend.to_numpy(out), o[coords[..., 0], coords[..., 1]])


def test_chain_source_compiles_for_sm90a():
    _nvrtc.compile_cubin(CHAIN, arch="sm_90a", options=("-std=c++17",))
