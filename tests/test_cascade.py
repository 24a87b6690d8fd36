"""cascade_attention (cupaged/cascade.py) against cupaged.reference.cascade_attention, on the sim (and cuda with a
GPU): shared levels of groups of requests (block-aligned or not, one or two levels, a group of one, an empty
prefix, more queries than shared keys), each request's own blocks holding decode tokens or prefill chunks, GQA,
fp8 caches, sinks and softcap; random block ids and poisoned unused slots (cupaged.testing.paged_kv)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import CascadeLevel, reference
from cupaged.testing import assert_close, paged_kv, tolerance
from tests.conftest import Backend

F16, BF16, F32 = np.float16, ml_dtypes.bfloat16, np.float32


@dataclasses.dataclass
class Case:
    levels: tuple  # per shared level: (requests per group, shared keys per group)
    own: tuple     # per request: (queries, own keys)
    heads: tuple = (8, 2)
    head_size: int = 64
    block_size: int = 16
    dtype: type = F16
    kv_cache_dtype: str = "auto"
    layout: str = "NHD"
    sinks: bool = False
    softcap: float | None = None

    def id(self):
        lv = "+".join("g" + ".".join(f"{n}x{k}" for n, k in zip(*level)) for level in self.levels) or "nolevel"
        own = ".".join(f"{q}-{s}" for q, s in self.own)
        extra = [x for x, on in (("sinks", self.sinks), (f"cap{self.softcap}", self.softcap)) if on]
        return "-".join([lv, own, f"h{self.heads[0]}-{self.heads[1]}", f"bs{self.block_size}",
                         np.dtype(self.dtype).name, self.kv_cache_dtype, self.layout, *extra])


def build(case: Case, seed=0):
    """(inputs, options, reference (out, lse)): one paged_kv segment per group of each level, then one per
    request's own keys."""
    rng = np.random.default_rng(seed)
    segments = [k for sizes, lens in case.levels for k in lens] + [s for _, s in case.own]
    kv = paged_kv(segments, block_size=case.block_size, head_size=case.head_size, num_kv_heads=case.heads[1],
                  dtype=case.dtype, layout=case.layout, kv_cache_dtype=case.kv_cache_dtype, spare_blocks=3,
                  spare_columns=2, rng=rng)
    levels, row = [], 0
    for sizes, lens in case.levels:
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        levels.append(CascadeLevel(starts, kv.block_tables[row:row + len(lens)].copy(), np.array(lens, np.int32)))
        row += len(lens)
    q_lens = [q for q, _ in case.own]
    q = (0.6 * rng.standard_normal((sum(q_lens), case.heads[0], case.head_size))).astype(case.dtype)
    qsl = None if all(n == 1 for n in q_lens) else np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    inputs = dict(q=q, key_cache=kv.key_cache, value_cache=kv.value_cache, shared_levels=levels,
                  block_tables=kv.block_tables[row:].copy(), seq_lens=np.array([s for _, s in case.own], np.int32),
                  query_start_loc=qsl)
    options = dict(sinks=rng.uniform(-1, 3, case.heads[0]).astype(np.float32) if case.sinks else None,
                   softcap=case.softcap, kv_cache_dtype=case.kv_cache_dtype, k_scale=kv.k_scale, v_scale=kv.v_scale,
                   layout=case.layout)
    return inputs, options, reference.cascade_attention(**inputs, **options)


def on(backend, inputs, options):
    put = backend.asarray
    args = {k: None if v is None else put(v) for k, v in inputs.items() if k != "shared_levels"}
    args["shared_levels"] = [CascadeLevel(*(put(a) for a in level)) for level in inputs["shared_levels"]]
    return args, {k: put(v) if isinstance(v, np.ndarray) else v for k, v in options.items()}


C = Case
CASES = [
    C(levels=(((6,), (100,)),), own=((1, 1), (1, 17), (1, 33), (1, 5), (1, 16), (1, 64))),  # decode behind a prompt
    C(levels=(((5,), (37,)), ((2, 3), (16, 5))), own=((7, 20), (1, 9), (1, 1), (3, 3), (16, 40)), dtype=BF16,
      sinks=True, softcap=30.0),  # two levels, not block-aligned, prefill chunks and decode
    C(levels=(((3, 1), (48, 0)),), own=((1, 2), (1, 31), (1, 1), (1, 7)), heads=(8, 1), layout="HND",
      kv_cache_dtype="fp8_e4m3"),  # an empty prefix for a group of one
    C(levels=(((4,), (3,)),), own=((2, 2), (2, 5), (1, 1), (3, 4)), heads=(4, 4), block_size=5, dtype=F32),
    C(levels=(((2, 2), (33, 80)),), own=((1, 3), (1, 1), (1, 16), (1, 2)), heads=(16, 2), head_size=128,
      kv_cache_dtype="fp8_e5m2", dtype=BF16, sinks=True),
    C(levels=(), own=((5, 9), (1, 30))),  # no shared level: plain paged attention
]


@pytest.mark.parametrize("case", CASES, ids=[c.id() for c in CASES])
def test_cascade_equals_attention_over_the_whole_context(backend, case):
    inputs, options, (ref_out, ref_lse) = build(case)
    args, opts = on(backend, inputs, options)
    out, lse = cupaged.cascade_attention(**args, **opts, return_lse=True, validate=True)
    # each level's state is rounded to q's dtype once before the LSE merge: one rounding more per level
    atol, rtol = tolerance(case.dtype, case.kv_cache_dtype)
    rounds = 1 + len(case.levels)
    assert_close(backend.to_numpy(out), ref_out, (rounds * atol, rounds * rtol), "out")
    assert_close(backend.to_numpy(lse), ref_lse, "lse", "lse")


def test_a_block_aligned_prefix_gives_what_paged_attention_gives_over_the_joined_table(backend):
    """Requests whose prefix is whole blocks: cascade_attention and paged_attention over the table that joins the
    shared blocks and the request's own agree within the tolerance table."""
    case = C(levels=(((4,), (64,)),), own=((1, 10), (1, 1), (1, 33), (1, 16)), heads=(8, 2))
    inputs, options, _ = build(case, seed=1)
    shared = inputs["shared_levels"][0].block_tables[0, :4]
    joined = np.stack([np.concatenate([shared, row]) for row in inputs["block_tables"]])
    args, opts = on(backend, inputs, options)
    got = backend.to_numpy(cupaged.cascade_attention(**args, **opts))
    plain = cupaged.paged_attention(args["q"], args["key_cache"], args["value_cache"], backend.asarray(joined),
                                    backend.asarray(inputs["seq_lens"] + 64), **opts)
    assert_close(got, backend.to_numpy(plain), tuple(2 * x for x in tolerance(F16)), "cascade vs joined table")


_SIM = Backend("sim")


def _bad_cases(inputs):
    level = inputs["shared_levels"][0]
    starts, tables, lens = level
    yield {"shared_levels": level}, TypeError, "shared_levels must be a list of CascadeLevel"
    yield {"shared_levels": [(starts, tables)]}, TypeError, r"shared_levels\[0\] must be a CascadeLevel"
    yield {"shared_levels": [(starts.astype(np.int64), tables, lens)]}, TypeError, \
        r"shared_levels\[0\].group_start_loc must have dtype int32"
    yield {"shared_levels": [(starts[:1], tables[:0], lens[:0])]}, ValueError, "num_groups \\+ 1 >= 2"
    yield {"shared_levels": [(starts, tables, np.concatenate([lens, lens]))]}, ValueError, \
        r"shared_levels\[0\].kv_lens must have num_groups=2 rows"
    yield {"shared_levels": [(starts, tables[:1], lens)]}, ValueError, r"shared_levels\[0\].block_tables must have"
    yield {"shared_levels": [(np.array([0, 1, 3], np.int32), tables, lens)]}, ValueError, \
        r"group_start_loc must start at 0, be non-decreasing and end at num_seqs=4"
    yield {"shared_levels": [(np.array([0, 3, 2], np.int32), tables, lens)]}, ValueError, "non-decreasing"
    yield {"shared_levels": [(starts, tables, np.array([20, -1], np.int32))]}, ValueError, \
        r"shared_levels\[0\].kv_lens must be >= 0"
    yield {"shared_levels": [(starts, tables, np.array([20, 900], np.int32))]}, ValueError, \
        r"shared_levels\[0\].kv_lens\[1\] = 900 needs 57 blocks, but shared_levels\[0\].block_tables has"
    bad_ids = tables.copy()
    bad_ids[0, 0] = 10**6
    yield {"shared_levels": [(starts, bad_ids, lens)]}, ValueError, r"shared_levels\[0\].block_tables\[0\] holds block"
    yield {"seq_lens": inputs["seq_lens"] * 0}, ValueError, "q_len <= seq_len"
    yield {"sinks": np.ones(3, np.float32)}, ValueError, r"sinks must be \[num_heads\]"
    yield {"out": np.empty((1, 8, 64), F16)}, ValueError, "out"


def test_bad_input_is_named_before_any_launch():
    case = C(levels=(((2, 2), (20, 17)),), own=((1, 3), (2, 4), (1, 1), (1, 9)))
    inputs, options, _ = build(case, seed=2)
    out = np.full((5, 8, 64), 7, F16)
    caches = [inputs["key_cache"].copy(), inputs["value_cache"].copy()]
    for change, exc, match in _bad_cases(inputs):
        given = {**inputs, **options, "out": out, **change}
        with pytest.raises(exc, match=match):
            cupaged.cascade_attention(**given, validate=True)
        assert (out == 7).all(), change  # nothing written
    for got, want in zip((inputs["key_cache"], inputs["value_cache"]), caches):
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    cupaged.cascade_attention(**inputs, **options, out=out, validate=True)  # the good call writes
    assert not (out == 7).any()


@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_launches_of_a_step_with_one_shared_level(monkeypatch, step):
    """Decode: the shared level's kernel (partials only; no idle decode-kernel launch: the group's run is past 16
    queries), then the own level's decode kernel, which folds those partials into each row: two launches. A mixed
    step (query runs given): the own level (its plan's kernels: without a hint both, the prefill kernel's CTAs
    idle here), the shared level's kernel and its merge, which folds the own state in. Nothing else, and the
    result matches the reference."""
    from cupaged import attention

    launched = []
    real = attention.FAMILY.function

    class Recording:  # the kernel, its launches named (attributes such as the shared-memory opt-in go to it)
        def __init__(self, name, xp):
            object.__setattr__(self, "kernel", real(name, xp))
            object.__setattr__(self, "name", name.split("<")[0].removeprefix("cupaged::"))

        def __setattr__(self, key, value):
            setattr(self.kernel, key, value)

        def __call__(self, *args, **kwargs):
            launched.append(self.name)
            return self.kernel(*args, **kwargs)

    monkeypatch.setattr(attention.FAMILY, "function", Recording)
    monkeypatch.setattr(attention, "_OPTED_IN", {})
    case = C(levels=(((20,), (300,)),), own=tuple((1, 3 + i) for i in range(20)))
    inputs, options, (ref_out, ref_lse) = build(case, seed=4)
    inputs["block_tables"] = inputs["block_tables"][:, :3].copy()  # own tables as narrow as decode's: no split
    if step == "mixed":
        inputs["query_start_loc"] = np.arange(21, dtype=np.int32)
    out, lse = cupaged.cascade_attention(**inputs, **options, return_lse=True)
    want = {"decode": ["paged_prefill_kernel", "paged_decode_mma_kernel"],
            "mixed": ["paged_prefill_kernel", "paged_decode_mma_kernel", "paged_prefill_kernel",
                      "paged_attention_reduce_kernel"]}[step]
    assert launched == want
    atol, rtol = tolerance(case.dtype)
    assert_close(out, ref_out, (2 * atol, 2 * rtol), "out")
    assert_close(lse, ref_lse, "lse", "lse")


def test_run_attention_takes_a_prior_state_only_with_a_plan_made_for_one():
    case = C(levels=(((4,), (40,)),), own=((1, 3), (1, 1), (1, 9), (1, 2)))
    inputs, _, _ = build(case, seed=5)
    q = inputs["q"]
    level = inputs["shared_levels"][0]
    kv = cupaged.KvView.paged(inputs["key_cache"], inputs["value_cache"], q)
    runs = np.array([0, 4], np.int32)
    out = np.zeros_like(q)
    lse = np.zeros((q.shape[1], q.shape[0]), np.float32)
    with_prior = cupaged.plan_attention(q, kv, level.block_tables, level.kv_lens, runs, prior_state=True)
    plain = cupaged.plan_attention(q, kv, level.block_tables, level.kv_lens, runs)
    args = (q, kv, out, lse, level.block_tables, level.kv_lens, runs)
    with pytest.raises(ValueError, match=r"prior_lse \(or merge=False\) goes with a plan made with prior_state"):
        cupaged.run_attention(with_prior, *args)
    with pytest.raises(ValueError, match=r"prior_lse \(or merge=False\) goes with a plan made with prior_state"):
        cupaged.run_attention(plain, *args, prior_lse=lse.copy())
    with pytest.raises(ValueError, match="prior_lse must not be lse"):
        cupaged.run_attention(with_prior, *args, prior_lse=lse)
    with pytest.raises(ValueError, match="prior_lse"):
        cupaged.run_attention(with_prior, *args, prior_lse=lse[:, :2].copy())
    with pytest.raises(ValueError, match="pass partials"):
        cupaged.run_attention(with_prior, *args, merge=False)
    partials = tuple(np.zeros(s, np.float32) for s in with_prior.partial_shapes)
    with pytest.raises(ValueError, match="prior_partials go to a plan whose one decode kernel does not split"):
        cupaged.run_attention(with_prior, *args, merge=False, partials=partials, prior_partials=partials)
    own = cupaged.plan_attention(q, kv, inputs["block_tables"], inputs["seq_lens"])
    own_args = (q, kv, out, lse, inputs["block_tables"], inputs["seq_lens"])
    with pytest.raises(TypeError, match="prior_partials must be"):
        cupaged.run_attention(own, *own_args, prior_partials=partials[0])
    with pytest.raises(ValueError, match="prior_partials' tmp_output"):
        cupaged.run_attention(own, *own_args, prior_partials=(*partials[:2], partials[2][..., :8].copy()))
