"""paged_attention against cupaged.reference.paged_attention, on the sim (and cuda with a GPU).

Every case builds its caches with cupaged.testing.paged_kv: a shuffled block table whose entries
past each sequence's last block are garbage (far outside the pool: a read of one faults on the sim),
caches whose every unused slot is poisoned (NaN, 0xFF in fp8), and for single-query windowed cases
the out-of-window positions poisoned too: masking is by selection, so any leak shows up as NaN. The
default run is a covering set that touches every value of the full grid at least once; `-m slow`
runs the full product.
"""

from __future__ import annotations

import dataclasses
import itertools

import ml_dtypes
import numpy as np
import pytest

import cupaged
from cupaged import reference
from cupaged.testing import assert_close, paged_kv, tolerance

F16, BF16, F32 = np.float16, ml_dtypes.bfloat16, np.float32
SHAPE_MIXED = ((1, 1328), (5, 18), (129, 463))  # (query len, context len): decode + prefill chunks
SHAPE_DECODE = ((1, 523), (1, 37), (1, 2011))


@dataclasses.dataclass
class Case:
    heads: tuple = (8, 2)
    head_size: int = 128
    block_size: int = 16
    seqs: tuple = SHAPE_MIXED
    dtype: type = F16
    layout: str = "NHD"
    kv_cache_dtype: str = "auto"
    causal: bool = True
    window: int | None = None
    window_size: tuple | None = None  # FlashAttention's (left, right)
    softcap: float | None = None
    sinks: bool = False
    alibi: bool = False
    per_head_scales: bool = False
    kv_split_size: int | None = None
    decode: bool | None = None  # None: decode when every query length is 1

    def id(self):
        fields = [f"h{self.heads[0]}-{self.heads[1]}", f"d{self.head_size}", f"bs{self.block_size}",
                  "x".join(f"{q}-{s}" for q, s in self.seqs), np.dtype(self.dtype).name, self.layout]
        for name in ("kv_cache_dtype", "window", "window_size", "softcap", "kv_split_size"):
            value = getattr(self, name)
            if value not in (None, "auto"):
                fields.append(f"{name}={value}")
        fields += [n for n in ("sinks", "alibi", "per_head_scales") if getattr(self, n)]
        if not self.causal:
            fields.append("noncausal")
        return "-".join(fields)


def build(case: Case, seed=0):
    """Inputs of one case (numpy) and the reference's (out, lse). For a single-query window the keys it
    never reads stay poisoned too."""
    rng = np.random.default_rng(seed)
    num_heads, num_kv_heads = case.heads
    q_lens = [q for q, _ in case.seqs]
    kv = paged_kv([s for _, s in case.seqs], block_size=case.block_size, head_size=case.head_size,
                  num_kv_heads=num_kv_heads, dtype=case.dtype, layout=case.layout, kv_cache_dtype=case.kv_cache_dtype,
                  per_head_scales=case.per_head_scales, spare_blocks=7, spare_columns=3, rng=rng,
                  poison_before=[s - case.window if case.window and q == 1 else 0 for q, s in case.seqs])
    q = (rng.standard_normal((sum(q_lens), num_heads, case.head_size)) * 0.6).astype(case.dtype)
    decode = case.decode if case.decode is not None else all(q == 1 for q in q_lens)
    qsl = None if decode else np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    sinks = rng.uniform(-1, 3, num_heads).astype(np.float32) if case.sinks else None
    alibi = (2.0 ** -np.arange(1, num_heads + 1) * 4).astype(np.float32) if case.alibi else None
    inputs = dict(q=q, key_cache=kv.key_cache, value_cache=kv.value_cache, block_tables=kv.block_tables,
                  seq_lens=kv.seq_lens, query_start_loc=qsl)
    options = dict(causal=case.causal, sliding_window=case.window, window_size=case.window_size, sinks=sinks, alibi_slopes=alibi,
                   softcap=case.softcap, kv_cache_dtype=case.kv_cache_dtype, k_scale=kv.k_scale, v_scale=kv.v_scale,
                   layout=case.layout)
    return inputs, options, reference.paged_attention(**inputs, **options)


def run(backend, case: Case, seed=0, **extra):
    inputs, options, (ref_out, ref_lse) = build(case, seed)
    args = {k: (None if v is None else backend.asarray(v)) for k, v in inputs.items()}
    for k in ("sinks", "alibi_slopes"):
        if options[k] is not None:
            options[k] = backend.asarray(options[k])
    out, lse = cupaged.paged_attention(**args, **options, kv_split_size=case.kv_split_size, return_lse=True, **extra)
    return backend.to_numpy(out), backend.to_numpy(lse), ref_out, ref_lse


def check(backend, case: Case, seed=0, **extra):
    out, lse, ref_out, ref_lse = run(backend, case, seed, **extra)
    assert_close(out, ref_out, tolerance(case.dtype, case.kv_cache_dtype), "out")
    assert_close(lse, ref_lse, "lse", "lse")
    return out, lse


C = Case
SMALL = ((1, 1), (1, 15), (1, 16), (1, 17), (3, 17), (16, 16))  # seq_len 1, block_size -1 / = / +1
COVERING = [
    # dtypes x layouts on the mixed prefill + decode shape
    *(C(dtype=dt, layout=lay) for dt in (F16, BF16, F32) for lay in ("NHD", "HND")),
    # head counts (large ones only with short shapes)
    C(heads=(4, 4), head_size=64, block_size=5, seqs=SMALL),
    C(heads=(5, 1), head_size=80, block_size=5, seqs=SMALL, dtype=BF16),
    C(heads=(40, 40), head_size=64, block_size=16, seqs=((1, 40), (7, 30))),
    C(heads=(64, 8), head_size=128, block_size=32, seqs=((1, 70), (4, 33)), dtype=BF16),
    C(heads=(64, 8), head_size=64, block_size=16, seqs=((1, 100),) * 3),
    # GQA groups (paged_decode_mma_kernel): every mask, fp8 with per-head scales, a head size that is
    # not a multiple of 16, splits, and groups of 6 whose row tiles of 8 span two tokens
    C(heads=(8, 1), seqs=SHAPE_DECODE, window=64, sinks=True, alibi=True, softcap=50.0, dtype=BF16),
    C(heads=(8, 1), kv_cache_dtype="fp8_e4m3", per_head_scales=True, seqs=SHAPE_DECODE, layout="HND"),
    C(heads=(16, 2), kv_cache_dtype="fp8_e5m2", dtype=BF16, head_size=72, block_size=5, seqs=SMALL),
    C(heads=(8, 1), kv_split_size=100, sinks=True, seqs=SHAPE_DECODE),
    C(heads=(12, 2), head_size=64, block_size=48, seqs=((2, 50), (3, 40), (1, 97)), alibi=True),
    # head sizes and block sizes
    *(C(heads=(4, 2), head_size=hs, block_size=bs, seqs=SHAPE_DECODE if hs <= 80 else SMALL)
      for hs, bs in ((32, 1), (64, 5), (80, 16), (256, 32), (256, 5))),
    C(heads=(4, 4), head_size=32, block_size=1, seqs=((1, 1), (2, 2), (9, 40))),
    C(heads=(4, 2), head_size=64, block_size=256, seqs=((1, 255), (3, 256), (2, 600))),
    C(heads=(4, 2), head_size=128, block_size=64, seqs=((1, 65), (5, 129)), kv_cache_dtype="fp8", layout="HND"),
    # decode shapes
    C(seqs=SHAPE_DECODE), C(seqs=SHAPE_DECODE, layout="HND", dtype=F32),
    C(seqs=SHAPE_DECODE, dtype=BF16, kv_split_size=256),
    # masks: window, softcap, sinks, ALiBi, non-causal
    C(seqs=SHAPE_DECODE, window=64), C(seqs=SHAPE_DECODE, window=256, dtype=BF16, layout="HND"),
    C(window=64), C(window=256, dtype=F32, block_size=5, heads=(4, 1)),
    C(softcap=50.0), C(softcap=50.0, seqs=SHAPE_DECODE, dtype=F32),
    C(sinks=True), C(sinks=True, window=64, seqs=SHAPE_DECODE), C(sinks=True, window=256, heads=(4, 2)),
    C(alibi=True), C(alibi=True, seqs=SHAPE_DECODE, dtype=F32),
    C(causal=False, seqs=((1, 40), (6, 50), (33, 33))), C(causal=False, alibi=True, seqs=((4, 30), (1, 9))),
    C(softcap=50.0, sinks=True, alibi=True, window=256, dtype=BF16),
    # fp8 caches, per-tensor and per-head scales
    C(kv_cache_dtype="fp8"), C(kv_cache_dtype="fp8_e4m3", layout="HND", seqs=SHAPE_DECODE),
    C(kv_cache_dtype="fp8_e5m2", dtype=BF16), C(kv_cache_dtype="fp8", per_head_scales=True, seqs=SHAPE_DECODE),
    C(kv_cache_dtype="fp8_e5m2", per_head_scales=True, head_size=80, block_size=5, seqs=SMALL, dtype=F32),
    C(kv_cache_dtype="fp8", head_size=40, heads=(4, 2), seqs=SMALL),  # head size not a multiple of 16
    # split-KV
    C(kv_split_size=64), C(kv_split_size=100, sinks=True), C(kv_split_size=1000, seqs=SHAPE_DECODE),
    C(kv_split_size=32, window=64, seqs=SHAPE_DECODE, sinks=True), C(kv_split_size=1, seqs=((1, 5), (3, 7))),
    # long prefill runs (paged_prefill_kernel for 16-bit q): awkward lengths, chunks continuing a cached prefix,
    # GQA 1 / 4 / 8, head sizes below their bucket, block sizes 8 / 48 / 96, fp8 with both scale kinds, splits
    C(heads=(8, 2), seqs=((17, 17), (63, 100), (64, 64), (65, 300), (1, 40)), dtype=BF16),
    C(heads=(4, 4), head_size=72, block_size=8, seqs=((65, 65), (17, 80))),
    C(heads=(8, 2), head_size=80, block_size=32, seqs=((66, 70), (1, 33)), dtype=BF16, softcap=30.0),
    C(heads=(8, 1), head_size=96, block_size=48, seqs=((64, 200), (63, 63)), dtype=BF16, layout="HND", sinks=True),
    C(heads=(4, 1), head_size=112, block_size=96, seqs=((65, 65), (20, 130)), kv_cache_dtype="fp8_e4m3",
      per_head_scales=True),
    C(heads=(4, 2), head_size=120, seqs=((33, 40), (70, 75)), kv_cache_dtype="fp8_e5m2", dtype=BF16, alibi=True),
    C(heads=(2, 1), head_size=192, seqs=((40, 2100),), kv_cache_dtype="fp8_e5m2", window=700, softcap=30.0),
    C(heads=(2, 2), head_size=256, seqs=((130, 200),), kv_cache_dtype="fp8_e4m3", dtype=BF16, kv_split_size=64),
    C(heads=(4, 1), head_size=64, seqs=((1000, 1000),), dtype=BF16, layout="HND"),
    # FlashAttention's window_size: bottom-right aligned, both sides, causal (right capped at 0) or not
    C(window_size=(50, 20), causal=False, seqs=((65, 65), (17, 200), (1, 90))),
    C(window_size=(30, -1), causal=False, dtype=BF16, seqs=((70, 100),), kv_split_size=40),
    C(window_size=(-1, 3), causal=False, dtype=F32, seqs=((20, 30), (1, 20))),
    C(window_size=(100, 5), sinks=True, seqs=((130, 400), (1, 300))),
]


@pytest.mark.parametrize("case", COVERING, ids=[c.id() for c in COVERING])
def test_covering_set(backend, case):
    check(backend, case)


def test_padded_decode_slots_and_empty_rows(backend):
    """seq_len 0 (padded decode slot): out 0, LSE -inf; with sinks: out 0, LSE = the sink logit."""
    for sinks in (False, True):
        case = C(seqs=((1, 0), (1, 20), (1, 0)), sinks=sinks, heads=(4, 2), head_size=64)
        out, lse = check(backend, case)
        assert np.all(out[[0, 2]] == 0)
        inputs, options, _ = build(case)
        want = np.broadcast_to(options["sinks"][:, None], (4, 2)) if sinks else np.full((4, 2), -np.inf)
        assert np.array_equal(lse[:, [0, 2]], want)


@pytest.mark.parametrize("split", [None, 64, 512])
def test_batch_invariance(backend, split):
    """For a fixed kv_split_size a sequence's output is bitwise the same alone and inside a batch."""
    alone = C(seqs=((1, 700),), kv_split_size=split or 300, heads=(8, 2))
    batch = C(seqs=((3, 50), (1, 700), (1, 2000)), kv_split_size=split or 300, heads=(8, 2), decode=False)
    out_a, lse_a, *_ = run(backend, alone, seed=1)
    inputs, options, _ = build(batch, seed=1)
    solo, _, _ = build(alone, seed=1)
    # put the lone sequence's data at token 3 / sequence 1 of the batch
    for name in ("q",):
        inputs[name][3] = solo[name][0]
    kc, vc = inputs["key_cache"], inputs["value_cache"]
    s_tab = solo["block_tables"][0]
    n = -(-700 // 16)
    kc[inputs["block_tables"][1, :n]] = solo["key_cache"][s_tab[:n]]
    vc[inputs["block_tables"][1, :n]] = solo["value_cache"][s_tab[:n]]
    args = {k: (None if v is None else backend.asarray(v)) for k, v in inputs.items()}
    out_b, lse_b = cupaged.paged_attention(**args, **options, kv_split_size=split or 300, return_lse=True)
    assert np.array_equal(backend.to_numpy(out_b)[3].view(np.uint16), out_a[0].view(np.uint16))
    assert np.array_equal(backend.to_numpy(lse_b)[:, 3], lse_a[:, 0])


def test_split_and_no_split_agree(backend):
    case = C(seqs=SHAPE_DECODE, heads=(4, 1), head_size=64)
    outs = [run(backend, dataclasses.replace(case, kv_split_size=s))[:2] for s in (None, 64, 300, 4096)]
    for out, lse in outs[1:]:
        assert_close(out, outs[0][0].astype(np.float64), F16, "out")
        assert_close(lse, outs[0][1], "lse", "lse")


def test_strided_q_and_out_views(backend):
    """q as a slice of a fused QKV buffer and out as a slice of a wider buffer (any token stride)."""
    case = C(seqs=((1, 50), (4, 30)), heads=(4, 2), head_size=64)
    inputs, options, (ref_out, ref_lse) = build(case)
    fused = np.zeros((5, 8 * 64), F16)
    fused[:, :4 * 64] = inputs["q"].reshape(5, -1)
    q = backend.asarray(fused)[:, :4 * 64].reshape(5, 4, 64)
    wide = backend.asarray(np.full((5, 6, 64), np.nan, F16))
    args = {k: (None if v is None else backend.asarray(v)) for k, v in inputs.items() if k != "q"}
    out, lse = cupaged.paged_attention(q, **args, **options, out=wide[:, 1:5], return_lse=True)
    got = backend.to_numpy(wide)
    assert_close(got[:, 1:5], ref_out, F16)
    assert np.isnan(got[:, [0, 5]].astype(np.float32)).all(), "out's neighbours were written"
    assert_close(backend.to_numpy(lse), ref_lse, "lse", "lse")


def test_hints_and_caller_buffers(backend):
    """max_query_len / max_seq_len hints, a caller workspace and out buffer give the same result."""
    case = C(seqs=((1, 300), (7, 90)), heads=(4, 2), head_size=64, kv_split_size=64)
    inputs, options, (ref_out, _) = build(case)
    args = {k: (None if v is None else backend.asarray(v)) for k, v in inputs.items()}
    out = backend.asarray(np.full((8, 4, 64), np.nan, F16))
    ws = backend.asarray(np.zeros(1 << 20, np.uint8))
    got = cupaged.paged_attention(**args, **options, kv_split_size=64, max_query_len=7, max_seq_len=300,
                                  workspace=ws, out=out)
    assert got is out
    assert_close(backend.to_numpy(out), ref_out, F16)
    with pytest.raises(ValueError, match="workspace"):
        cupaged.paged_attention(**args, **options, kv_split_size=64, workspace=ws[:100])


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    C(heads=h, head_size=hs, block_size=bs, dtype=dt, seqs=SMALL)
    for h, hs, bs, dt in itertools.product(((4, 4), (8, 2), (5, 1), (40, 40), (64, 8)),
                                           (32, 64, 80, 96, 112, 120, 128, 192, 256), (1, 5, 16, 32), (F16, BF16, F32))
], ids=lambda c: c.id())
def test_full_grid(backend, case):
    check(backend, case)


def _valid(backend):
    inputs, options, _ = build(C(seqs=((1, 40), (3, 20)), heads=(4, 2), head_size=64))
    args = {k: backend.asarray(v) for k, v in inputs.items()}
    return args


BAD_INPUTS = {
    "q dtype": (lambda a: {"q": a["q"].astype(np.float64)}, TypeError, "q"),
    "q ndim": (lambda a: {"q": a["q"][0]}, ValueError, "q"),
    "q head_size 264": (lambda a: {"q": a["q"][:, :, :1].repeat(264, axis=2)}, NotImplementedError, "head_size"),
    "heads not a multiple": (lambda a: {"q": a["q"][:, :3]}, ValueError, "num_kv_heads"),
    "key_cache dtype": (lambda a: {"key_cache": a["key_cache"].astype(np.float32)}, TypeError, "key_cache"),
    "value_cache shape": (lambda a: {"value_cache": a["value_cache"][:2]}, ValueError, "value_cache"),
    "key_cache head_size": (lambda a: {"key_cache": a["key_cache"][..., :32]}, ValueError, "head_size"),
    "layout": (lambda a: {"layout": "vllm"}, ValueError, "layout"),
    "block_tables dtype": (lambda a: {"block_tables": a["block_tables"].astype(np.int64)}, TypeError, "block_tables"),
    "block_tables rows": (lambda a: {"block_tables": a["block_tables"][:1]}, ValueError, "block_tables"),
    "seq_lens dtype": (lambda a: {"seq_lens": a["seq_lens"].astype(np.float32)}, TypeError, "seq_lens"),
    "query_start_loc length": (lambda a: {"query_start_loc": a["query_start_loc"][:2]}, ValueError, "query_start_loc"),
    "decode token count": (lambda a: {"query_start_loc": None}, ValueError, "num_tokens"),
    "window without causal": (lambda a: {"sliding_window": 8, "causal": False}, ValueError, "sliding_window"),
    "negative window": (lambda a: {"sliding_window": -1}, ValueError, "sliding_window"),
    "both windows": (lambda a: {"sliding_window": 8, "window_size": (4, 0)}, ValueError, "window_size"),
    "window_size of 3": (lambda a: {"window_size": (1, 2, 3)}, ValueError, "window_size"),
    "softcap": (lambda a: {"softcap": -1.0}, ValueError, "softcap"),
    "sinks dtype": (lambda a: {"sinks": np.zeros(4)}, TypeError, "sinks"),
    "sinks shape": (lambda a: {"sinks": np.zeros(2, np.float32)}, ValueError, "sinks"),
    "alibi shape": (lambda a: {"alibi_slopes": np.zeros((4, 1), np.float32)}, ValueError, "alibi_slopes"),
    "kv_cache_dtype": (lambda a: {"kv_cache_dtype": "int4"}, ValueError, "kv_cache_dtype"),
    "fp8 with float caches": (lambda a: {"kv_cache_dtype": "fp8"}, TypeError, "key_cache"),
    "kv_split_size": (lambda a: {"kv_split_size": 0}, ValueError, "kv_split_size"),
    "out dtype": (lambda a: {"out": np.zeros(a["q"].shape, np.float32)}, TypeError, "out"),
    "out shape": (lambda a: {"out": np.zeros((1, 4, 64), np.float16)}, ValueError, "out"),
    "list for q": (lambda a: {"q": [[1.0]]}, TypeError, "q"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_raises_before_launch(backend, case):
    change, exc, name = BAD_INPUTS[case]
    args = _valid(backend)
    kwargs = {**args, **change(args)}
    if backend.name != "sim":
        kwargs = {k: backend.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    with pytest.raises(exc, match=name):
        cupaged.paged_attention(**kwargs)


def test_validate_checks_contents(backend, monkeypatch):
    args = _valid(backend)
    lens = backend.to_numpy(args["seq_lens"]).copy()
    for bad_lens, match in (([40, 2], "q_len <= seq_len"), ([40, 10**4], "blocks")):
        args["seq_lens"] = backend.asarray(np.array(bad_lens, np.int32))
        with pytest.raises(ValueError, match=match):
            cupaged.paged_attention(**args, validate=True)
    args["seq_lens"] = backend.asarray(lens)
    table = backend.to_numpy(args["block_tables"]).copy()
    table[0, 0] = 10**6
    args["block_tables"] = backend.asarray(table)
    monkeypatch.setenv("CUPAGED_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"block_tables\[0\]"):
        cupaged.paged_attention(**args)


@pytest.mark.parametrize("heads", [(8, 2), (8, 1)], ids=["gqa4", "gqa8"])
@pytest.mark.parametrize("order", ["reverse", "random:11"])
def test_no_race_bitwise_same_in_every_sim_order(monkeypatch, order, heads):
    """Block and thread scheduling order cannot change a result (a race would): paged_decode_kernel (GQA 4)
    and paged_decode_mma_kernel (GQA 8) with the 7-token run, paged_prefill_kernel with the 40-token one."""
    from tests.conftest import Backend

    case = C(seqs=((1, 300), (7, 40), (40, 90)), heads=heads, head_size=64, kv_split_size=64, sinks=True, window=200)
    natural = run(Backend("sim"), case)[:2]
    monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    other = run(Backend("sim"), case)[:2]
    assert np.array_equal(natural[0].view(np.uint16), other[0].view(np.uint16))
    assert np.array_equal(natural[1], other[1])
