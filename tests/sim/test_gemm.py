"""tests/sim/gemm_tile.cu, a worked example of cp.async + ldmatrix + mma.sync, on the sim and NVRTC.

* NVRTC compiles it for sm_80 and sm_90 without register spills (no GPU needed);
* C = A @ B (fp16 in, fp32 out) matches numpy on the sim in every scheduling order, and on a GPU;
* the sim catches the kernel built with -DGEMM_SKIP_WAIT, which reads each shared-memory tile
  before its cp.async copy has landed (the sim keeps a pending copy's destination 0xFF, fp16 NaN),
  and the one built with -DGEMM_SKIP_WAR_BARRIER, whose warps overwrite a stage others still read
  (the sim's reverse order runs each warp ahead alone between barriers).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from cupaged.resources import ARCHS, compile_resources

from tests.conftest import Backend, assert_close, raw_module

SRC_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemm_tile.cu")
OPTIONS = ("-std=c++17",)
SKIP_WAIT = (*OPTIONS, "-DGEMM_SKIP_WAIT")


def source() -> str:
    with open(SRC_PATH, encoding="utf-8") as f:
        return f.read()


def run_gemm(backend, a: np.ndarray, b: np.ndarray, options=OPTIONS) -> np.ndarray:
    (M, K), (_, N) = a.shape, b.shape
    assert M % 64 == 0 and N % 64 == 0 and K % 32 == 0, "the kernel's tiling contract"
    kernel = raw_module(backend, source(), ("gemm_tile",), options).get_function("gemm_tile")
    c = backend.empty((M, N), np.float32)
    kernel((N // 64, M // 64), (128,), (backend.asarray(a), backend.asarray(b), c,
                                        np.int32(M), np.int32(N), np.int32(K)))
    return backend.to_numpy(c)


def random_inputs(M: int, N: int, K: int, seed: int):
    rng = np.random.default_rng(seed)
    a = rng.uniform(-1.0, 1.0, (M, K)).astype(np.float16)
    b = rng.uniform(-1.0, 1.0, (K, N)).astype(np.float16)
    return a, b


def fp32_accumulation_atol(a: np.ndarray, b: np.ndarray) -> float:
    """Error bound of any fp32 accumulation of A @ B's products, in any order.

    A product of two fp16 values (11-bit significands) has at most 22 significant bits, so it is
    exact in fp32 (24) and only the K - 1 additions round. Each addition of a recursive (or tree)
    sum contributes a relative error of at most u = 2^-24 of a partial sum bounded by
    S = sum_k |a_k b_k|, so |got - ref| <= (K - 1) u S (Higham, gamma_{K-1}); doubling u allows an
    adder that truncates instead of rounding to nearest (tensor cores are not bound to round each
    addition the IEEE way). The bound is taken at the largest S of the output: about 3.6e-4 for
    K = 96 and entries uniform in [-1, 1], where accumulating in fp16 instead (u = 2^-11) or
    dropping or misplacing a single product (|a b| ~ 0.25) would be off by 1e-2 or more.
    """
    K = a.shape[1]
    s = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    return float((K - 1) * 2.0 ** -23 * s.max())


@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_without_spills(arch):
    for options in (OPTIONS, SKIP_WAIT):
        (rec,) = compile_resources(source(), ["gemm_tile"], arch, options, family="gemm_tile")
        assert rec.name_expression == "gemm_tile"
        assert rec.spill_stores == 0 and rec.spill_loads == 0, rec
        assert rec.stack_bytes == 0, rec  # no local memory at all: the accumulators stay in registers
        # 32 accumulators + 16 fragment registers + addresses: about 80. At most 128 keeps 4 CTAs of
        # 128 threads resident per SM (65536 registers); more would mean duplicated fragments.
        assert rec.registers <= 128, rec
        assert rec.shared_bytes == 2 * (64 * 40 + 32 * 72) * 2, rec  # two padded stages of A and B


@pytest.mark.parametrize("order", ["natural", "reverse", "random:7"])
@pytest.mark.parametrize("M,N,K", [(64, 64, 64), (128, 192, 96)])
def test_gemm_matches_numpy(backend, monkeypatch, order, M, N, K):
    if backend.name == "sim":
        monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    elif order != "natural":
        pytest.skip("the scheduling order is a sim setting")
    a, b = random_inputs(M, N, K, seed=M + N + K)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    got = run_gemm(backend, a, b)
    assert_close(got, ref, (fp32_accumulation_atol(a, b), 0.0), what=f"C[{M}, {N}] (K = {K})")


def test_sim_catches_reads_before_cp_async_lands():
    """Without the waits every ldmatrix reads a tile whose copies are still pending: on the sim
    that is all 0xFF (fp16 NaN) bytes, so every output is NaN. (On a GPU it is a race with no
    defined result: a sim-only test.)"""
    backend = Backend("sim")
    a, b = random_inputs(64, 128, 96, seed=1)
    got = run_gemm(backend, a, b, SKIP_WAIT)
    assert np.isnan(got).all(), f"{int(np.isnan(got).sum())} of {got.size} outputs NaN"
    # and the same inputs with the waits in place are right, so the NaN is the missing wait's doing
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert_close(run_gemm(backend, a, b), ref, (fp32_accumulation_atol(a, b), 0.0))


@pytest.mark.parametrize("order", ["reverse", "random:7"])
def test_sim_catches_a_stage_overwritten_while_read(monkeypatch, order):
    """Without the barrier after the mma, a warp that runs ahead issues the copies of tile kt+2
    into the stage other warps are still reading (write-after-read). In lockstep (natural order)
    that goes unseen; the sim's reverse and random orders let warps run ahead between barriers."""
    monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    a, b = random_inputs(64, 128, 96, seed=2)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    got = run_gemm(Backend("sim"), a, b, (*OPTIONS, "-DGEMM_SKIP_WAR_BARRIER"))
    with pytest.raises(AssertionError, match="out of tolerance"):
        assert_close(got, ref, (fp32_accumulation_atol(a, b), 0.0))


def test_counted_hmma_matches_the_emulated_flops():
    """Model v2's mma term cross-checked: the SASS HMMA instructions the profiled launch issues
    (instruction_mix["mma"], counted from the cubin's blocks) x 4096 FLOPs each (m16n8k16: 2 * 16 * 8 *
    16) are the FLOPs the sim's mma.sync emulation counted; 2 * M * N * K in all."""
    pytest.importorskip("scipy")
    from cupaged import sim
    from cupaged.sim.profiler._sass import nvdisasm

    if nvdisasm() is None:
        pytest.skip("nvdisasm (the profiling extra) is not installed")
    rng = np.random.default_rng(3)
    a = rng.standard_normal((128, 64)).astype(np.float16)
    b = rng.standard_normal((64, 128)).astype(np.float16)
    with sim.profile() as prof:
        c = run_gemm(Backend("sim"), a, b)
    assert_close(c, a.astype(np.float64) @ b.astype(np.float64), (fp32_accumulation_atol(a, b), 0.0))
    (launch,) = prof.launches
    assert launch.mma_flops == 2 * 128 * 128 * 64
    assert launch.instruction_mix["mma"] * 4096 == launch.mma_flops
    by_opcode = launch.instructions.by_opcode  # the same count by SASS opcode (profiling/issue_report.py's)
    assert by_opcode["HMMA"] == launch.instruction_mix["mma"]
    assert abs(sum(by_opcode.values()) - launch.warp_instructions) <= len(by_opcode)  # each rounded once
