"""The attention engine's public plan/run (cupaged/attention.py): one plan serves every layer, a plan
and its K/V must agree, plan_attention and run_attention reject bad arguments by name, and a failed
attention call writes nothing."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import reference
from cupaged._attention_kernels import decode_mma_smem_bytes, kernel_constants, resident_ctas
from cupaged._backend import NOMINAL_SM_SHARED, NOMINAL_SMS
from cupaged._launch import Launch
from cupaged._plan import MIN_SPLIT
from cupaged.testing import assert_close
from tests.test_bad_input import _read_only
from tests.test_paged_attention import C, build

F16 = np.float16
MIXED = C(seqs=((1, 300), (40, 90), (3, 700)), heads=(4, 2), head_size=64)


def test_plan_once_run_every_layer(backend):
    """Two layers (two caches over one block table) with one plan, split-KV forced: each matches the op
    and the reference."""
    inputs0, options, ref0 = build(MIXED)
    inputs1 = dict(inputs0, key_cache=(inputs0["key_cache"] * 0.5).astype(F16), value_cache=-inputs0["value_cache"])
    layers = [(inputs0, options, ref0), (inputs1, options, reference.paged_attention(**inputs1, **options))]
    q = backend.asarray(inputs0["q"])
    index = {k: backend.asarray(inputs0[k]) for k in ("block_tables", "seq_lens", "query_start_loc")}
    kv0 = cupaged.KvView.paged(backend.asarray(inputs0["key_cache"]), backend.asarray(inputs0["value_cache"]), q)
    plan = cupaged.plan_attention(q, kv0, index["block_tables"], index["seq_lens"], index["query_start_loc"],
                                  max_query_len=40, max_seq_len=700, kv_split_size=128)
    assert (plan.op, plan.kv_split_size, plan.max_splits, plan.tiles) == ("prefill", 128, 6, 1)  # 40 x 2 rows: one
    prefill, decode = plan.launches                                                                # tile of 128
    assert "paged_prefill_kernel" in prefill.kernel and "paged_decode_mma_kernel" in decode.kernel  # GQA 2
    assert prefill.grid == (1 * 6, 2, 3) and plan.partial_shapes[2] == (44, 4, 6, 64)
    for inputs, _, (ref_out, ref_lse) in layers:
        layer_q = backend.asarray(inputs["q"])
        kv = cupaged.KvView.paged(backend.asarray(inputs["key_cache"]), backend.asarray(inputs["value_cache"]), layer_q)
        out, lse = backend.empty(layer_q.shape, F16), backend.empty((4, 44), np.float32)
        cupaged.run_attention(plan, layer_q, kv, out, lse, index["block_tables"], index["seq_lens"],
                              index["query_start_loc"], scale=0.125)
        assert_close(backend.to_numpy(out), ref_out, F16, "out")
        assert_close(backend.to_numpy(lse), ref_lse, "lse", "lse")
        op_out = cupaged.paged_attention(layer_q, kv.key, kv.value, **index, **options, kv_split_size=128,
                                         max_query_len=40, max_seq_len=700)
        np.testing.assert_array_equal(backend.to_numpy(op_out), backend.to_numpy(out))  # the op is plan + run


def test_run_rejects_a_plan_made_for_other_shapes(backend):
    inputs, _, _ = build(MIXED)
    q = backend.asarray(inputs["q"])
    kv = cupaged.KvView.paged(backend.asarray(inputs["key_cache"]), backend.asarray(inputs["value_cache"]), q)
    plan = cupaged.plan_attention(q, kv, inputs["block_tables"], inputs["seq_lens"], inputs["query_start_loc"])
    fp8 = dataclasses.replace(kv, kv_cache_dtype="fp8")
    out = backend.empty(q.shape, F16)
    for bad_q, bad_kv in ((q[:3], kv), (q, fp8)):
        with pytest.raises(ValueError, match="do not match the plan"):
            cupaged.run_attention(plan, bad_q, bad_kv, out, None, backend.asarray(inputs["block_tables"]),
                                  backend.asarray(inputs["seq_lens"]), backend.asarray(inputs["query_start_loc"]))


def test_a_failed_attention_call_writes_nothing(backend):
    """Bad input raises before any launch: out, lse and the caches keep every byte."""
    inputs, options, _ = build(MIXED)
    args = {k: backend.asarray(v) for k, v in inputs.items()}
    out = backend.asarray(np.full(inputs["q"].shape, 7.0, F16))
    caches = [backend.to_numpy(args[k]).copy() for k in ("key_cache", "value_cache")]
    for bad in (dict(sinks=np.zeros(3, np.float32)), dict(scale="x"), dict(sliding_window=-2),
                dict(kv_split_size=0), dict(layout="vllm")):
        with pytest.raises((ValueError, TypeError)):
            cupaged.paged_attention(**args, **{**options, **bad}, out=out)
        np.testing.assert_array_equal(backend.to_numpy(out), 7.0)
        for c, k in zip(caches, ("key_cache", "value_cache")):
            np.testing.assert_array_equal(backend.to_numpy(args[k]).view(np.uint8), c.view(np.uint8))


def test_varlen_max_seqlen_k_is_a_grid_hint():
    """Dense varlen: with max_seqlen_k a long key range is split across CTAs (few sequences), without
    it one pass; both equal the reference."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((8, 4, 64)).astype(F16)
    k, v = (rng.standard_normal((2400, 2, 64)).astype(F16) for _ in range(2))
    cu_q = np.array([0, 3, 8], np.int32)  # 3 and 5 queries over 1500 and 900 keys
    cu_k = np.array([0, 1500, 2400], np.int32)
    kv = cupaged.KvView.dense(k, v)
    assert cupaged.plan_attention(q, kv, None, cu_k, cu_q, max_seq_len=1500).max_splits > 1
    assert cupaged.plan_attention(q, kv, None, cu_k, cu_q).max_splits == 1
    ref_out, ref_lse = reference.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    for hint in (None, 1500):
        out, lse = cupaged.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_k=hint, return_lse=True)
        assert_close(out, ref_out, F16, "out")
        assert_close(lse, ref_lse, "lse", "lse")


def test_a_plan_too_big_for_the_device_is_a_clear_error():
    """MLA decode with 64 query heads a CTA needs ~150 KB of shared memory per block: on an sm_86/sm_89 GPU
    (99 KB) the launch would fail inside the driver; the engine says why first. With 16 heads (a CTA of 16)
    it fits 99 KB (the CUDA-core kernel's 576/512 float32 tiles needed ~113 KB, on every GPU)."""
    from cupaged.attention import check_fits

    rng = np.random.default_rng(0)
    cache = rng.standard_normal((4, 16, 576)).astype(F16)
    kv = cupaged.KvView.mla(cache, 512)
    for heads, fits_99k in ((64, False), (16, True)):
        q = rng.standard_normal((2, heads, 576)).astype(F16)
        plan = cupaged.plan_attention(q, kv, np.zeros((2, 2), np.int32), np.array([20, 30], np.int32))
        (launch,) = plan.launches
        assert "mla_decode_kernel" in launch.kernel
        need = launch.shared_mem
        assert (need <= 99 * 1024) == fits_99k and need <= 163 * 1024
        check_fits(plan, 163 * 1024, "an A100")  # fits
        if fits_99k:
            check_fits(plan, 99 * 1024, "an RTX 4090")
        else:
            with pytest.raises(NotImplementedError, match=r"needs \d+ bytes of shared memory per block; an RTX 4090"):
                check_fits(plan, 99 * 1024, "an RTX 4090")


def test_the_kernel_is_opted_in_for_shared_memory_once(monkeypatch):
    """The dynamic shared memory attribute is a driver call on a GPU: set once per kernel, not per call."""
    from cupaged import attention

    sets = []

    class Counting:
        def __init__(self, kernel):
            object.__setattr__(self, "kernel", kernel)

        def __setattr__(self, name, value):
            sets.append((name, value))
            setattr(self.kernel, name, value)

        def __call__(self, *args, **kwargs):
            return self.kernel(*args, **kwargs)

    real = attention.FAMILY.function
    wrapped = {}
    monkeypatch.setattr(attention.FAMILY, "function", lambda name, xp: wrapped.setdefault(name, Counting(real(name, xp))))
    monkeypatch.setattr(attention, "_OPTED_IN", {})
    inputs, options, (ref_out, _) = build(dataclasses.replace(MIXED, seqs=((1, 300), (1, 90))))
    for _ in range(3):
        out = cupaged.paged_attention(**inputs, **options)
        assert_close(out, ref_out, F16, "out")
    # a decode batch (GQA 2: on tensor cores): the decode kernel alone, its pipeline stages (3 x 64 fp16 K and V
    # rows of the 64 bucket, each padded by 16 bytes)
    assert sets == [("max_dynamic_shared_size_bytes", decode_mma_smem_bytes(2, 64))] == [
        ("max_dynamic_shared_size_bytes", 3 * 2 * 64 * (64 * 2 + 16))]


def test_memoized_views_and_plans_tell_layouts_apart():
    """KvView.paged and plan_attention are memoized on what they read: a cache of the same shape and
    strides at a misaligned address loses its 16-byte loads, another layout or cache dtype gets its
    own geometry, and a plan follows every hint."""
    raw = np.zeros(2 * 16 * 2 * 64 * 2 + 16, np.uint8)
    aligned_at = (-raw.__array_interface__["data"][0]) % 16

    def cache(offset):
        return raw[offset:offset + 2 * 16 * 2 * 64 * 2].view(F16).reshape(2, 16, 2, 64)
    q = np.zeros((1, 4, 64), F16)
    aligned = cupaged.KvView.paged(cache(aligned_at), cache(aligned_at), q)
    misaligned = cupaged.KvView.paged(cache(aligned_at + 2), cache(aligned_at + 2), q)
    assert (aligned.vec_k, aligned.vec_v, misaligned.vec_k, misaligned.vec_v) == (True, True, False, False)
    assert cupaged.KvView.paged(cache(aligned_at), cache(aligned_at), q).vec_k  # a hit keeps the aligned answer
    hnd = cupaged.KvView.paged(cache(aligned_at), cache(aligned_at), q, layout="HND")
    assert (hnd.block_size, hnd.num_kv_heads, hnd.strides["k_page_stride"]) == (2, 16, 64)
    assert (aligned.block_size, aligned.num_kv_heads, aligned.strides["k_page_stride"]) == (16, 2, 128)
    with pytest.raises(TypeError, match="key_cache must have dtype uint8"):  # the cached geometry is not reused
        cupaged.KvView.paged(cache(aligned_at), cache(aligned_at), q, kv_cache_dtype="fp8")
    tables, lens = np.zeros((1, 2), np.int32), np.ones(1, np.int32)
    plans = [cupaged.plan_attention(q, aligned, tables, lens, max_seq_len=m, kv_split_size=s)
             for m, s in ((None, 8), (16, 8), (None, 0))]
    assert [p.max_splits for p in plans] == [4, 2, 1] and plans[0] is cupaged.plan_attention(
        q, aligned, tables, lens, kv_split_size=8)


def test_a_plan_holds_its_launches_in_order_and_its_merge():
    """A plan's main kernels are Launch values in launch order (paged_prefill_kernel for the long runs, then the decode
    kernel: GQA 2 on tensor cores), each grid's x its row tiles times max_splits; the merge is a Launch when the plan
    splits, else None."""
    q, cache = np.empty((44, 4, 64), F16), np.empty((1, 16, 2, 64), F16)
    kv = cupaged.KvView.paged(cache, cache, q)
    args = (q, kv, np.empty((3, 44), np.int32), np.empty(3, np.int32), np.empty(4, np.int32))
    plan = cupaged.plan_attention(*args, max_query_len=40, kv_split_size=128)
    c = kernel_constants()
    prefill, decode = plan.launches
    assert (plan.tiles, plan.decode_tiles, plan.max_splits) == (1, 4, 6)  # 40 x 2 rows in 128; 16 x 2 in 8s
    assert prefill == Launch("cupaged::paged_prefill_kernel<__half, cupaged::KV_AUTO, 64, 64>", (1 * 6, 2, 3),
                             (c["PD_THREADS"], 1, 1), prefill.shared_mem)
    assert decode == Launch("cupaged::paged_decode_mma_kernel<__half, cupaged::KV_AUTO, 64, false, false>",
                            (4 * 6, 2, 3),
                            (c["PD_THREADS"], 1, 1), decode_mma_smem_bytes(2, 64))
    assert plan.merge == Launch("cupaged::paged_attention_reduce_kernel<__half>", (44, 1, 1), (c["PA_THREADS"], 1, 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        prefill.grid = (1, 1, 1)
    whole = cupaged.plan_attention(*args, max_query_len=40, kv_split_size=0)
    assert whole.merge is None and whole.partial_shapes is None and whole.workspace_bytes == 0
    assert whole.launches == tuple(dataclasses.replace(x, grid=(x.grid[0] // 6, *x.grid[1:])) for x in plan.launches)


def test_plans_are_memoized_on_a_plan_key():
    """make_plan takes one immutable PlanKey (what plan_attention reads of its arguments and the device): an equal key
    gets the same plan object, a key differing in a field its own."""
    from cupaged._plan import PlanKey, make_plan

    key = PlanKey(q_shape=(1, 4, 64), q_dtype=np.dtype(F16), kind="paged", kv_cache_dtype="auto", num_kv_heads=2,
                  v_head_size=64, block_size=16, table_width=256, index_len=1, decode=True, max_query_len=None,
                  max_seq_len=None, kv_split_size=None, max_splits=None, always_partials=False, sms=NOMINAL_SMS,
                  sm_shared=NOMINAL_SM_SHARED, decode_layout="rows", prefill_rows=True)
    plan = make_plan(key)
    assert make_plan(PlanKey(*key)) is plan and hash(PlanKey(*key)) == hash(key)
    with pytest.raises(AttributeError):
        key.sms = 8
    assert (key.num_seqs, key.group, key.max_q, key.max_kv) == (1, 2, 1, 4096) and plan.max_splits == 16
    assert make_plan(key._replace(max_seq_len=256)).max_splits == 1 and make_plan(key._replace(sms=8)) is not plan
    dense = key._replace(kind="dense", table_width=None, index_len=3, block_size=1)
    assert (dense.num_seqs, dense.max_kv) == (2, 0)  # cu_seqlens_k of 2 sequences; no hint: one pass
    q, cache = np.empty((1, 4, 64), F16), np.empty((1, 16, 2, 64), F16)
    kv = cupaged.KvView.paged(cache, cache, q)
    assert cupaged.plan_attention(q, kv, np.empty((1, 256), np.int32), np.empty(1, np.int32)) is plan


def test_run_launches_the_plans_launches_then_its_merge(monkeypatch):
    """run_attention launches what the plan holds, in its order, and nothing else."""
    from cupaged import attention

    launched = []

    class Recording:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, shared_mem=0):
            launched.append(Launch(self.name, grid, block, shared_mem))

    monkeypatch.setattr(attention.FAMILY, "function", lambda name, xp: Recording(name))
    monkeypatch.setattr(attention, "_OPTED_IN", {})
    a = _planned()
    a["plan"] = cupaged.plan_attention(a["q"], a["kv"], a["block_tables"], a["seq_lens"], a["query_start_loc"],
                                       max_query_len=3, kv_split_size=16)
    cupaged.run_attention(**a)
    assert a["plan"].merge is not None and launched == [*a["plan"].launches, a["plan"].merge]


def _decode_waves(plan) -> float:
    """The plan's decode grid in waves of the decode kernel's resident CTAs on the sim's nominal H200."""
    (decode,) = plan.launches
    budget = kernel_constants()["PM_REGISTERS" if "decode_mma" in decode.kernel else "PD_REGISTERS"]
    per_sm = resident_ctas(decode.block[0], decode.shared_mem, NOMINAL_SM_SHARED, budget)
    return math.prod(decode.grid) / (NOMINAL_SMS * per_sm)


@pytest.mark.parametrize("heads, kv_cache_dtype", [((32, 8), "auto"), ((64, 8), "auto"), ((64, 8), "fp8")])
def test_splits_come_from_the_decode_kernels_occupancy(heads, kv_cache_dtype):
    """kv_split_size=None: a grid under a wave of resident CTAs splits its long contexts into the fewest splits
    that fill >= 90% of a wave (or splits of MIN_SPLIT keys), the last wave >= 90% full; one that fills a wave
    (64 x 4096) is not split, nor a short context."""
    q1, q64 = (np.empty((n, heads[0], 128), F16) for n in (1, 64))
    cache = np.empty((1, 16, heads[1], 128), np.uint8 if kv_cache_dtype == "fp8" else F16)
    kv = cupaged.KvView.paged(cache, cache, q1, kv_cache_dtype)
    long = cupaged.plan_attention(q1, kv, np.empty((1, 2048), np.int32), np.empty(1, np.int32), max_seq_len=32768)
    waves = _decode_waves(long)
    assert long.max_splits > 1 and waves >= 0.9 and waves / math.ceil(waves) >= 0.9, waves
    fewer = cupaged.plan_attention(q1, kv, np.empty((1, 2048), np.int32), np.empty(1, np.int32), max_seq_len=32768,
                                   kv_split_size=math.ceil(32768 / (long.max_splits - 1)))
    assert _decode_waves(fewer) < 0.9, "not the fewest splits that fill the wave"
    tiny = cupaged.plan_attention(q1, kv, np.empty((1, 2048), np.int32), np.empty(1, np.int32), max_seq_len=4096)
    assert tiny.kv_split_size == MIN_SPLIT and tiny.max_splits == 4096 // MIN_SPLIT  # splits of >= 256 keys
    batch = cupaged.plan_attention(q64, kv, np.empty((64, 256), np.int32), np.empty(64, np.int32), max_seq_len=4096)
    assert batch.max_splits == 1 and _decode_waves(batch) >= 0.9
    short = cupaged.plan_attention(q1, kv, np.empty((1, 16), np.int32), np.empty(1, np.int32), max_seq_len=256)
    assert short.max_splits == 1


def test_mla_decode_filling_a_wave_is_not_split():
    """128-head MLA decode of 64 sequences: 256 CTAs of 256 threads (32 heads each), one resident an SM (its
    shared memory), fill 97% of two waves over the 132 SMs: a split would only add the merge."""
    q = np.empty((64, 128, 576), F16)
    kv = cupaged.KvView.mla(np.empty((1, 64, 576), F16), 512)
    plan = cupaged.plan_attention(q, kv, np.empty((64, 64), np.int32), np.empty(64, np.int32), max_seq_len=4096)
    (decode,) = plan.launches
    assert plan.max_splits == 1 and math.prod(decode.grid) == 256 and decode.block == (256, 1, 1)


@pytest.mark.parametrize("dtype, head, kind", [(np.float32, 256, "decode"), (F16, 256, "prefill"),
                                               (ml_dtypes.bfloat16, 192, "prefill"), (F16, 576, "mla")])
def test_every_kernel_fits_a_100_kb_sm(monkeypatch, dtype, head, kind):
    """On a GPU with 100 KB of shared memory an SM (sm_86 / sm_89) every kernel a plan launches fits: float32
    head-256 decode stages of 16 keys (96 KB; 32 keys took 128 KB, and v5 left those rows to the kernel v6 deleted),
    the prefill kernel's 2 stages where 3 would pass 99 KB, MLA's 16-head CTAs (83 KB) where 32-head ones (130 KB)
    would not fit."""
    from cupaged import attention

    monkeypatch.setattr(attention, "sm_shared_bytes", lambda xp: 100 * 1024)
    q = np.empty((40, 128 if kind == "mla" else 16, head), dtype)
    if kind == "mla":
        kv = cupaged.KvView.mla(np.empty((1, 16, head), dtype), 512)
    else:
        cache = np.empty((1, 16, 2, head), dtype)
        kv = cupaged.KvView.paged(cache, cache, q)
    qsl = np.empty(3, np.int32) if kind == "prefill" else None
    plan = cupaged.plan_attention(q[:2] if qsl is None else q, kv, np.empty((2, 4), np.int32), np.empty(2, np.int32),
                                  qsl)
    assert plan.launches and all(launch.shared_mem + 1024 <= 100 * 1024 for launch in plan.launches)
    assert [launch.kernel.split("<")[0] for launch in plan.launches[:-1]] == (
        ["cupaged::paged_prefill_kernel"] if kind == "prefill" else [])


def _planned():
    """A small mixed batch's arguments of plan_attention / run_attention (sim arrays), its plan and an out of 7s."""
    inputs, _, _ = build(C(seqs=((1, 40), (3, 20)), heads=(4, 2), head_size=64))
    a = {k: cupaged.sim.asarray(v) for k, v in inputs.items()}
    kv = cupaged.KvView.paged(a.pop("key_cache"), a.pop("value_cache"), a["q"])
    plan = cupaged.plan_attention(a["q"], kv, a["block_tables"], a["seq_lens"], a["query_start_loc"])
    return dict(plan=plan, q=a["q"], kv=kv, out=cupaged.sim.asarray(np.full((4, 4, 64), 7, F16)), lse=None,
                block_tables=a["block_tables"], seq_lens=a["seq_lens"], query_start_loc=a["query_start_loc"])


BAD_PLAN = {
    "kv_split_size -1": (lambda a: {"kv_split_size": -1}, ValueError, "kv_split_size must be >= 0"),
    "max_splits 0": (lambda a: {"max_splits": 0}, ValueError, "max_splits must be >= 1"),
    "max_splits -2": (lambda a: {"max_splits": -2}, ValueError, "max_splits must be >= 1"),
    "max_query_len -1": (lambda a: {"max_query_len": -1}, ValueError, "max_query_len must be >= 0"),
    "max_seq_len str": (lambda a: {"max_seq_len": "12"}, TypeError, "max_seq_len must be an int"),
    "always_partials 1": (lambda a: {"always_partials": 1}, TypeError, "always_partials must be a bool"),
    "always_partials str": (lambda a: {"always_partials": "yes"}, TypeError, "always_partials must be a bool"),
    "q list": (lambda a: {"q": a["q"].tolist()}, TypeError, "q must be a numpy or cupy array"),
    "kv tuple": (lambda a: {"kv": (a["kv"].key, a["kv"].value)}, TypeError, "kv must be a KvView"),
    "3 heads over 2": (lambda a: {"q": a["q"][:, :3]}, ValueError, "num_heads=3 .* multiple of num_kv_heads=2"),
    "head size": (lambda a: {"q": a["q"][..., :32]}, ValueError, "head size"),
    "q dtype": (lambda a: {"q": a["q"].astype(np.float32)}, TypeError, "q must have dtype"),
    "no block_tables": (lambda a: {"block_tables": None}, TypeError, "block_tables must be a numpy or cupy array"),
    "seq_lens list": (lambda a: {"seq_lens": a["seq_lens"].tolist()}, TypeError, "seq_lens must be"),
    "query_start_loc short": (lambda a: {"query_start_loc": a["query_start_loc"][:2]}, ValueError, "query_start_loc"),
}


@pytest.mark.parametrize("case", BAD_PLAN, ids=list(BAD_PLAN))
def test_plan_attention_rejects_bad_arguments(case):
    a = _planned()
    a = dict(q=a["q"], kv=a["kv"], block_tables=a["block_tables"], seq_lens=a["seq_lens"],
             query_start_loc=a["query_start_loc"])
    change, exc, match = BAD_PLAN[case]
    with pytest.raises(exc, match=match):
        cupaged.plan_attention(**{**a, **change(a)})


BAD_RUN = {
    "plan None": (lambda a: {"plan": None}, TypeError, "plan must be an AttentionPlan"),
    "plan dict": (lambda a: {"plan": dataclasses.asdict(a["plan"])}, TypeError, "plan must be an AttentionPlan"),
    "q list": (lambda a: {"q": a["q"].tolist()}, TypeError, "q must be a numpy or cupy array"),
    "kv tuple": (lambda a: {"kv": (a["kv"].key, a["kv"].value)}, TypeError, "kv must be a KvView"),
    "out None": (lambda a: {"out": None}, TypeError, "out must be a numpy or cupy array"),
    "out read-only": (lambda a: {"out": _read_only(a["out"])}, ValueError, "out is read-only"),
    "out shape": (lambda a: {"out": a["out"][:2]}, ValueError, r"out must have shape \(4, 4, 64\)"),
    "out dtype": (lambda a: {"out": a["out"].view(np.int16)}, TypeError, "out must have dtype float16"),
    "out strided": (lambda a: {"out": cupaged.sim.zeros((4, 4, 128), F16)[..., ::2]}, ValueError,
                    "out must be contiguous in its last dimension"),
    "lse shape": (lambda a: {"lse": cupaged.sim.zeros((4, 3), np.float32)}, ValueError,
                  r"lse must have shape \(4, 4\)"),
    "lse dtype": (lambda a: {"lse": cupaged.sim.zeros((4, 4), F16)}, TypeError, "lse must have dtype float32"),
    "lse read-only": (lambda a: {"lse": _read_only(cupaged.sim.zeros((4, 4), np.float32))}, ValueError,
                      "lse is read-only"),
    "lse transposed": (lambda a: {"lse": cupaged.sim.zeros((4, 4), np.float32).T}, ValueError,
                       "lse must be contiguous"),
    "scale inf": (lambda a: {"scale": math.inf}, ValueError, "scale must be"),
    "scale 1e39": (lambda a: {"scale": 1e39}, ValueError, "scale must be"),
    "scale list": (lambda a: {"scale": [0.1]}, TypeError, "scale must be a float"),
    "softcap nan": (lambda a: {"softcap": math.nan}, ValueError, "softcap must be"),
    "causal 1": (lambda a: {"causal": 1}, TypeError, "causal must be a bool"),
    "window past int32": (lambda a: {"window_size": (2**40, 0)}, ValueError, "window_size must be"),
}


@pytest.mark.parametrize("case", BAD_RUN, ids=list(BAD_RUN))
def test_run_attention_rejects_bad_buffers_flags_and_plans(case):
    """What costs nothing to check on the hot path: the plan, out / lse (shape, dtype, contiguity, writable),
    finite float32 scales, a bool causal, an int32 window. Nothing is written."""
    a = _planned()
    change, exc, match = BAD_RUN[case]
    a.update(change(a))
    written = [(x, x.copy()) for x in (a["out"], a["lse"]) if isinstance(x, np.ndarray)]
    with pytest.raises(exc, match=match):
        cupaged.run_attention(**a)
    for x, was in written:
        np.testing.assert_array_equal(x, was)
