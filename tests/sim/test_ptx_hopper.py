"""Hopper's (sm_90a) copy and synchronisation instructions on the sim, against the PTX ISA and the numpy models
of ``hopper_isa.py``. The sources are in ``hopper_sources.py``; each also compiles with NVRTC for sm_90a, and
on cuda runs through ``conftest.hopper_module`` (skipped "no GPU" without a compute capability 9.0 device).

Rules pinned (PTX ISA: mbarrier, cp.async.bulk, cp.async.bulk.tensor, cp.async.mbarrier.arrive, bar / barrier,
elect.sync, setmaxnreg, special registers; driver API: cuTensorMapEncodeTiled):

* mbarrier: a phase completes when its pending arrival count and its tx-count are both 0; the pending count is
  then reset to the expected count. ``try_wait.parity P`` / ``test_wait.parity P`` test the completion of the
  phase of parity P (the current or the preceding one): at phase 0, parity 1 is complete at once, parity 0 not.
  ``arrive`` returns a state token of its phase; ``test_wait`` / ``try_wait`` with it test that phase.
  ``arrive`` with a count counts that many arrivals; ``arrive.expect_tx`` raises the tx-count before arriving,
  ``complete_tx`` lowers it, ``expect_tx`` alone does not arrive; ``arrive_drop`` lowers the expected count of
  this and every later phase. After ``inval`` the 8 bytes are ordinary memory, and ``init`` starts over. Each
  CTA starts with no mbarrier. Producer / consumer rings (full / empty mbarriers) pass data in every order.
* cp.async.bulk global -> shared signals complete_tx with its byte count on the mbarrier; its destination is
  undefined until the phase completes (poison on the sim while no thread waits) and holds the data after.
  shared -> global bulk stores read shared memory through the async proxy: a generic store must be ordered
  before them by ``fence.proxy.async`` -- a store after the last fence too.
* cp.async.bulk.tensor (tile): the box of ``tensor_tile`` / ``tensor_store`` (zero fill / no write out of
  bounds, element strides on outer dimensions, swizzle by shared address bits), 1D-5D, every swizzle.
* cp.async.mbarrier.arrive.noinc: an arrival counted by the mbarrier when the thread's cp.async copies are done;
  without .noinc the pending count is raised first (net zero).
* bar / barrier: ``bar.sync a, b`` waits until b threads arrived at barrier a, ``bar.arrive`` does not wait; no
  count: the whole CTA; b a multiple of the warp size; ``barrier{.cta}.sync.aligned 0`` is __syncthreads.
  elect.sync elects the lowest lane of the member mask. setmaxnreg takes an immediate, a multiple of 8 in
  24..256, the same across the warpgroup. Without a cluster launch each CTA is a one-CTA cluster
  (``%is_explicit_cluster`` a false .pred). ptxas rejects a tensor copy whose coordinates do not match .Nd.
* Hangs are SimSyncErrors naming the barrier and the waiting warps; unknown forms are SimCompileErrors.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cupaged import _nvrtc, make_tensor_map, sim
from cupaged.sim._memory import poison_byte
from tests.conftest import Backend, hopper_module, raw_module
from tests.sim import hopper_isa as isa
from tests.sim import hopper_sources as hs


def run(backend, src, kernel, grid, block, args, shared_mem=0):
    f = hopper_module(backend, src).get_function(kernel)
    if shared_mem > 48 * 1024:
        f.max_dynamic_shared_size_bytes = shared_mem
    f(grid, block, args, shared_mem=shared_mem)


# ------------------------------------------------------------------------------------------------ mbarriers
def test_mbarrier_phases_tokens_tx_drop_inval(backend):
    out = backend.asarray(np.full(128, -1, np.int32))
    run(backend, hs.MBAR, "phases", (2,), (64,), (out,))  # two blocks: each starts afresh
    got = backend.to_numpy(out)
    want = {0: 1, 1: 0, 2: 0, 3: 1, 4: 0,           # 64 arrivals; parity 1 at phase 0 is complete at once
            5: 0, 6: 3, 7: 2, 8: 3,                 # arrive with a count, tokens of the current / preceding phase
            9: 0, 10: 0, 11: 1, 12: 0, 13: 1,       # arrive.expect_tx + complete_tx; expect_tx, then the arrival
            14: 0, 15: 1, 16: 1, 17: 1,             # arrive_drop: phase 0 needs 2, phases 1 and 2 need 1
            18: 1, 19: 0, 20: 1,                    # inval, the bytes reused, init again: phase 0 anew
            21: 0, 22: 1}                           # test_wait false before the go, loops until true
    assert {k: int(got[k]) for k in want} == want
    assert got[23] >= (1 if backend.name == "sim" else 0)  # the sim yields to warp 1: at least one false
    np.testing.assert_array_equal(got[64:], 3)  # every thread's token: try_wait ends, test_wait true


def test_cutlass_spellings(backend):
    out = backend.asarray(np.full(64, -1, np.int32))
    run(backend, hs.MBAR, "cutlass_forms", (1,), (32,), (out,))
    np.testing.assert_array_equal(backend.to_numpy(out), np.r_[1, np.zeros(31, int), np.ones(32, int)])


@pytest.mark.parametrize("mode", [0, 1], ids=["generic", "bulk"])
def test_mbarrier_ring(backend, mode):
    iters = 8  # 3 stages: the parity of every stage flips twice or three times
    x = np.random.default_rng(mode).standard_normal(32 * iters).astype(np.float32)
    out = backend.asarray(np.zeros_like(x))
    run(backend, hs.MBAR, "ring", (2,), (64,), (backend.asarray(x), out, np.int32(iters), np.int32(mode)))
    np.testing.assert_array_equal(backend.to_numpy(out), x * (1 if mode else 2))


@pytest.mark.parametrize("noinc", [1, 0], ids=["noinc", "inc"])
def test_cp_async_mbarrier_arrive(backend, noinc):
    x = np.arange(128, dtype=np.int32).reshape(32, 4) * 7 + noinc
    out = backend.asarray(np.zeros_like(x))
    run(backend, hs.MBAR, "cp_arrive", (1,), (64,), (backend.asarray(x), out, np.int32(noinc)))
    np.testing.assert_array_equal(backend.to_numpy(out), x)


# ------------------------------------------------------------------------------------------------ bulk copies
def run_bulk(backend, fence=1):
    src = np.random.default_rng(1).integers(0, 256, 256, dtype=np.uint8)
    dst, seen = backend.asarray(np.zeros(256, np.uint8)), backend.asarray(np.zeros(512, np.uint8))
    run(backend, hs.BULK, "bulk", (1,), (64,), (backend.asarray(src), dst, seen, np.int32(fence)), shared_mem=640)
    return src, backend.to_numpy(dst), backend.to_numpy(seen)


def test_bulk_copies(backend):
    src, dst, seen = run_bulk(backend)
    if backend.name == "sim":  # undefined before the phase completes: poison on the sim (no thread waits yet)
        np.testing.assert_array_equal(seen[:256], poison_byte())
    np.testing.assert_array_equal(seen[256:], src)
    np.testing.assert_array_equal(dst, src ^ 0x5A)


# ------------------------------------------------------------------------------------------------ tensor copies
DT = {"u8": np.uint8, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f32": np.float32, "u16": np.uint16}
TENSOR_CASES = [  # (shape, dtype, box, coords, element_strides, swizzle): numpy order, outermost first
    ((100,), "f32", (16,), (-4,), None, "none"),
    ((100,), "f32", (16,), (92,), None, "none"),
    ((20, 72), "f16", (8, 64), (-3, 16), None, "128B"),
    ((16, 48), "u8", (8, 32), (12, 8), None, "32B"),
    ((3, 10, 40), "bf16", (2, 8, 32), (1, 5, 0), None, "64B"),
    ((2, 3, 5, 8), "f32", (2, 2, 4, 8), (0, 1, 1, 0), (1, 1, 2, 1), "none"),
    ((9, 16), "u16", (5, 64), (2, -40), (3, 1), "128B"),
    ((2, 2, 3, 4, 64), "u16", (1, 2, 3, 3, 64), (1, -1, 1, 2, 0), (1, 1, 2, 1, 1), "128B"),
]


def tensor_args(backend, case, seed=0):
    hopper_module(backend, hs.TENSOR)  # on a GPU without sm_90a: skipped before make_tensor_map refuses
    shape, dt, box, coords, strides, swizzle = case
    rng = np.random.default_rng(seed)
    g = rng.integers(1, 255, int(np.prod(shape)), dtype=np.uint8 if dt == "u8" else np.uint16)
    g = (g.astype(np.float32) if dt == "f32" else g).astype(DT[dt]).reshape(shape)
    garr = backend.asarray(g)
    tmap = make_tensor_map(garr, box, element_strides=strides, swizzle=swizzle)
    c = [np.int32(v) for v in coords[::-1]] + [np.int32(0)] * (5 - len(coords))
    want = isa.tensor_tile(g, box, coords, strides, swizzle)
    return g, garr, tmap, c, want


@pytest.mark.parametrize("case", TENSOR_CASES, ids=lambda c: f"{len(c[0])}d-{c[5]}-{'x'.join(map(str, c[3]))}")
def test_tensor_load(backend, case):
    g, garr, tmap, c, want = tensor_args(backend, case)
    out = backend.asarray(np.zeros(want.size, np.uint8))
    run(backend, hs.TENSOR, "tma_load", (1,), (64,), (tmap, np.int32(len(g.shape)), *c, np.int32(want.size), out),
        shared_mem=want.size + 1024)
    np.testing.assert_array_equal(backend.to_numpy(out), want)


@pytest.mark.parametrize("case", [c for c in TENSOR_CASES if c[4] is None] + [TENSOR_CASES[-1]],
                         ids=lambda c: f"{len(c[0])}d-{c[5]}-{'x'.join(map(str, c[3]))}")
def test_tensor_store(backend, case):
    g, garr, tmap, c, want = tensor_args(backend, case, seed=1)
    image = np.random.default_rng(2).integers(0, 256, want.size, dtype=np.uint8)
    run(backend, hs.TENSOR, "tma_store", (1,), (64,), (tmap, np.int32(g.ndim), *c, np.int32(want.size),
                                                           backend.asarray(image)), shared_mem=want.size + 1024)
    expect = isa.tensor_store(g.copy(), case[2], case[3], image, case[5], case[4])
    np.testing.assert_array_equal(backend.to_numpy(garr).view(np.uint8), expect.view(np.uint8))


def test_tensor_ring(backend):
    iters = 6
    hopper_module(backend, hs.TENSOR)
    g = np.random.default_rng(3).integers(0, 1 << 16, (8 * iters, 64), dtype=np.uint16)
    tmap = make_tensor_map(backend.asarray(g), (8, 64), swizzle="128B")
    out = backend.asarray(np.zeros(1024 * iters, np.uint8))
    run(backend, hs.TENSOR, "tma_ring", (1,), (96,), (tmap, out, np.int32(iters)), shared_mem=3072)
    want = [isa.tensor_tile(g, (8, 64), (8 * i, 0), None, "128B") for i in range(iters)]
    np.testing.assert_array_equal(backend.to_numpy(out), np.concatenate(want))


# ------------------------------------------------------------------------------------------------ CTA sync, misc
def test_named_barriers(backend):
    iters = 3
    x = np.arange(128 * iters, dtype=np.int32) * 3
    out = backend.asarray(np.full(128 * iters + 192, -1, np.int32))
    run(backend, hs.SYNC, "named", (1,), (256,), (backend.asarray(x), out, np.int32(iters)))
    got = backend.to_numpy(out)
    np.testing.assert_array_equal(got[:128 * iters], x + 1)
    np.testing.assert_array_equal(got[128 * iters:], np.r_[np.tile(1000 + np.arange(32), 3),
                                                           np.tile(2000 + np.arange(32), 3)])


@pytest.mark.parametrize("mask", [0xFFFFFFFF, 0xF0F0F0F0, 0x80000000, 0x00010006])
def test_elect_sync(backend, mask):
    leader, pred = (backend.asarray(np.full(32, -1, np.int32)) for _ in range(2))
    run(backend, hs.SYNC, "elect", (1,), (32,), (np.uint32(mask), leader, pred))
    lanes = np.array([(mask >> i) & 1 for i in range(32)], bool)
    low = (mask & -mask).bit_length() - 1
    want_leader = np.where(lanes, low, -1)
    want_pred = np.where(lanes, np.where(np.arange(32) == low, 3, 0), -1)
    np.testing.assert_array_equal(backend.to_numpy(leader), want_leader)
    np.testing.assert_array_equal(backend.to_numpy(pred), want_pred)


def test_barrier_zero_spellings(backend):
    out = backend.asarray(np.full(64, -1, np.int32))
    run(backend, hs.BARRIER0, "bar0", (1,), (64,), (out,))
    np.testing.assert_array_equal(backend.to_numpy(out), 2 * np.arange(64))


def test_cluster_registers(backend):
    out = backend.asarray(np.full((2, 3, 8), -1, np.int32))
    run(backend, hs.CLUSTER, "clusters", (3, 2), (32,), (out,))
    by, bx = np.meshgrid(np.arange(2), np.arange(3), indexing="ij")
    want = np.stack(np.broadcast_arrays(0, 1, 0, 0, 1, bx, 3, by), axis=-1)
    np.testing.assert_array_equal(backend.to_numpy(out), want)


def test_setmaxnreg_and_hints(backend):
    out = backend.asarray(np.zeros(256, np.int32))
    run(backend, hs.SYNC, "regs", (2,), (256,), (out, np.int32(0)))
    np.testing.assert_array_equal(backend.to_numpy(out), np.arange(1, 257))


# ------------------------------------------------------------------------------------------------ errors (sim)
ORDERS = ["natural", "reverse", "random:7"]


def sim_run(monkeypatch, order, src, kernel, block, args, shared_mem=0):
    monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    run(Backend("sim"), src, kernel, (1,), block, args, shared_mem)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode, block, match", [
    (0, 64, r"(?s)warp 0 lanes 0-31 wait.*mbarrier at shared 0x[0-9a-f]+.*warp 1 lanes 0-31 wait"),
    (1, 64, r"test_wait.*spins on the mbarrier at shared 0x[0-9a-f]+"),
    (2, 128, r"bar.sync 1, 256.*multiple of 32 in 32\.\.128"),
    (3, 128, r"named barrier 1\b.*64 of its 128"),
    (4, 32, r"0x[0-9a-f]+, which holds no mbarrier"),
    (5, 64, r"fence\.proxy\.async"),
    (6, 48, r"multiple of 32"),
    (7, 32, r"mbarrier\.inval on shared 0x[0-9a-f]+ while a bulk copy"),
], ids=["never-completes", "test-wait-spins", "count-too-big", "count-unmet", "uninitialised", "store-after-fence",
        "count-48", "inval-in-flight"])
def test_sync_faults(monkeypatch, order, mode, block, match):
    with pytest.raises(sim.SimSyncError, match=match):
        sim_run(monkeypatch, order, hs.FAULTS, "faults", (block,), (np.int32(mode), sim.zeros(block, np.int32)))


@pytest.mark.parametrize("order", ORDERS)
def test_bulk_store_reads_its_stage_at_the_wait(monkeypatch, order):
    """A store out of shared memory reads its source as late as a GPU may, at cp.async.bulk.wait_group.read:
    a stage rewritten before that wait is what gets written (on a GPU, a race the sim makes visible)."""
    out = sim.zeros(64 + 4, np.int32)
    sim_run(monkeypatch, order, hs.FAULTS, "faults", (64,), (np.int32(8), out))
    np.testing.assert_array_equal(np.asarray(out)[64:], 3)


@pytest.mark.parametrize("order", ORDERS)
def test_bulk_store_needs_proxy_fence(monkeypatch, order):
    monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    with pytest.raises(sim.SimSyncError, match="fence.proxy.async"):
        run_bulk(Backend("sim"), fence=0)


@pytest.mark.parametrize("order", ORDERS)
def test_setmaxnreg_differing_in_a_warpgroup(monkeypatch, order):
    with pytest.raises(sim.SimSyncError, match="setmaxnreg"):
        sim_run(monkeypatch, order, hs.SYNC, "regs", (256,), (sim.zeros(256, np.int32), np.int32(1)))


@pytest.mark.parametrize("regs, rank, error", [(40, 0, None), (20, 0, "multiple of 8 in 24..256"),
                                               (40, 1, "clusters of one CTA")])
def test_templated_counts_and_mapa(regs, rank, error):
    """setmaxnreg's count from a template parameter is checked when the instantiation runs; mapa maps to
    CTA rank 0 of a one-CTA cluster (another rank is an error)."""
    f = raw_module(Backend("sim"), hs.TEMPLATED, name_expressions=(f"regs<{regs}>",)).get_function(f"regs<{regs}>")
    out = sim.zeros(128, np.int32)
    if error:
        with pytest.raises(sim.SimSyncError, match=error):
            f((1,), (128,), (out, np.uint32(rank)))
        return
    f((1,), (128,), (out, np.uint32(rank)))
    np.testing.assert_array_equal(np.asarray(out), np.arange(128) + regs)


def test_templated_source_compiles_for_sm90a():
    _nvrtc.compile_cubin(hs.TEMPLATED, arch="sm_90a", options=("-std=c++17",), name_expressions=("regs<40>",))


@pytest.mark.parametrize("kind", ["bulk", "tensor"])
def test_stores_under_the_profiler(kind):
    """A profiled launch (sim.profile: the ThreadSanitizer build) runs bulk and tensor stores like a plain one and
    counts their bytes: 256 bulk-stored bytes of dst; 5 rows x 56 in-bound f16 of the tensor box."""
    be, case = Backend("sim"), TENSOR_CASES[2]
    with sim.profile() as prof:
        if kind == "bulk":
            src, dst, seen = run_bulk(be)
        else:
            g, garr, tmap, c, want = tensor_args(be, case, seed=1)
            image = np.random.default_rng(2).integers(0, 256, want.size, dtype=np.uint8)
            run(be, hs.TENSOR, "tma_store", (1,), (64,), (tmap, np.int32(g.ndim), *c, np.int32(want.size),
                                                          be.asarray(image)), shared_mem=want.size + 1024)
    if kind == "bulk":
        np.testing.assert_array_equal(dst, src ^ 0x5A)
        assert prof.launches[0].args["dst"].bytes_written == 256
    else:
        np.testing.assert_array_equal(garr, isa.tensor_store(g.copy(), case[2], case[3], image, case[5]))
        assert prof.launches[0].args["map.address"].bytes_written == 5 * 56 * 2


@pytest.mark.parametrize("name", list(hs.BAD_STATEMENTS))
def test_forms_rejected_at_compile(name):
    stmt, opcode = hs.BAD_STATEMENTS[name]
    with pytest.raises(sim.SimCompileError, match=opcode):
        sim.RawModule(code=hs.BAD_FORM.replace("STATEMENT", stmt), options=("-std=c++17",))


@pytest.mark.parametrize("name", ["MBAR", "BULK", "TENSOR", "SYNC", "FAULTS", "BARRIER0", "CLUSTER", "multicast",
                                  "im2col"])
def test_sources_compile_for_sm90a(name):
    """Valid PTX for ptxas (sm_90a), the not-emulated multicast / im2col forms included."""
    src = getattr(hs, name, None) or hs.BAD_FORM.replace("STATEMENT", hs.BAD_STATEMENTS[name][0])
    _nvrtc.compile_cubin(src, arch="sm_90a", options=("-std=c++17",))
