"""merge_attn_states against cupaged.reference, on the sim (and cuda when a GPU is present).

Outputs start poisoned (NaN) so an element the kernel skips shows up; rows that must be copied
(both sides empty, tokens without a prefix) are compared bit for bit with their source.
"""

from __future__ import annotations

import sys
import types

import ml_dtypes
import numpy as np
import pytest

from cupaged import reference
from cupaged._checks import CTYPE
from cupaged.merge_attn_states import FAMILY, _kernel, merge_attn_states
from tests.conftest import assert_close

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
NUM_HEADS = 4


def dtype_id(d):
    return np.dtype(d).name


def states(rng, num_tokens, num_heads, head_size, dtype, inf_fraction=0.1):
    """(prefix_output, prefix_lse, suffix_output, suffix_lse); ``inf_fraction`` of each side's LSEs
    are +inf (FA2's empty rows), never both at one position."""
    po = rng.standard_normal((num_tokens, num_heads, head_size)).astype(dtype)
    so = rng.standard_normal((num_tokens, num_heads, head_size)).astype(dtype)
    pl = (rng.standard_normal((num_heads, num_tokens)) * 4).astype(np.float32)
    sl = (rng.standard_normal((num_heads, num_tokens)) * 4).astype(np.float32)
    n = int(round(inf_fraction * pl.size))
    if n:
        cells = rng.permutation(pl.size)[:2 * n]
        pl.reshape(-1)[cells[:n]] = np.inf
        sl.reshape(-1)[cells[n:]] = np.inf
    return po, pl, so, sl


def poisoned(shape, dtype):
    return np.full(shape, np.nan, dtype)


def run(backend, po, pl, so, sl, *, with_lse=True, prefill_tokens_with_context=None, out=None, out_lse=None):
    """Merge on the backend; returns (output, output_lse or None) as numpy."""
    out = backend.asarray(poisoned(po.shape, po.dtype)) if out is None else out
    if with_lse and out_lse is None:
        out_lse = backend.asarray(poisoned(pl.shape, np.float32))
    args = [a if backend.name == "sim" else backend.asarray(a) for a in (po, pl, so, sl)]
    assert merge_attn_states(out, args[0], args[1], args[2], args[3], out_lse if with_lse else None,
                             prefill_tokens_with_context) is None
    return backend.to_numpy(out), (backend.to_numpy(out_lse) if with_lse else None)


def check(got, got_lse, po, pl, so, sl, prefill_tokens_with_context=None):
    ref, ref_lse = reference.merge_attn_states(po, pl, so, sl, prefill_tokens_with_context)
    assert not np.isnan(got.astype(np.float32)).any(), "NaN in output"
    assert_close(got, ref, po.dtype)
    if got_lse is not None:
        assert not np.isnan(got_lse).any(), "NaN in output_lse"
        assert_close(got_lse, ref_lse, "lse", "output_lse")


def assert_bits(got, want, what):
    got, want = np.ascontiguousarray(got), np.ascontiguousarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{what}: not a bitwise copy"


# ---------------------------------------------------------------- the grid
@pytest.mark.parametrize("num_tokens", [1, 17, 97])
@pytest.mark.parametrize("head_size", [8, 64, 128, 256, 512])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_merge(backend, dtype, head_size, num_tokens):
    rng = np.random.default_rng(head_size * 1000 + num_tokens)
    po, pl, so, sl = states(rng, num_tokens, NUM_HEADS, head_size, dtype)
    got, got_lse = run(backend, po, pl, so, sl)
    check(got, got_lse, po, pl, so, sl)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_merge_without_output_lse(backend, dtype):
    po, pl, so, sl = states(np.random.default_rng(1), 17, NUM_HEADS, 128, dtype)
    got, _ = run(backend, po, pl, so, sl, with_lse=False)
    check(got, None, po, pl, so, sl)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_both_sides_empty_copies_prefix(backend, dtype):
    """Both LSEs -inf (or +inf beside -inf, or both +inf): output = prefix output bit for bit,
    output LSE -inf, no NaN anywhere, neighbours merged normally."""
    rng = np.random.default_rng(2)
    po, pl, so, sl = states(rng, 17, NUM_HEADS, 64, dtype, inf_fraction=0.0)
    empty = [(0, 0, -np.inf, -np.inf), (1, 5, np.inf, -np.inf), (2, 16, -np.inf, np.inf), (3, 9, np.inf, np.inf)]
    for h, t, p, s in empty:
        pl[h, t], sl[h, t] = p, s
    for with_lse in (True, False):
        got, got_lse = run(backend, po, pl, so, sl, with_lse=with_lse)
        check(got, got_lse, po, pl, so, sl)
        for h, t, _, _ in empty:
            assert_bits(got[t, h], po[t, h], f"output[{t}, {h}]")
            if with_lse:
                assert got_lse[h, t] == -np.inf


def test_one_side_empty_takes_the_other(backend):
    """One side -inf: the other side's output (to rounding) and LSE."""
    po, pl, so, sl = states(np.random.default_rng(3), 9, NUM_HEADS, 64, np.float32, inf_fraction=0.0)
    pl[:, :4] = -np.inf
    sl[:, 4:] = np.inf
    got, got_lse = run(backend, po, pl, so, sl)
    check(got, got_lse, po, pl, so, sl)
    assert_close(got[:4], so[:4], np.float32)
    assert_close(got[4:], po[4:], np.float32)
    assert_close(got_lse[:, :4], sl[:, :4], "lse")
    assert_close(got_lse[:, 4:], pl[:, 4:], "lse")


@pytest.mark.parametrize("with_lse", [True, False], ids=["lse", "no-lse"])
@pytest.mark.parametrize("prefill_tokens_with_context", [None, 0, 5, 17])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_prefill_tokens_with_context(backend, dtype, prefill_tokens_with_context, with_lse):
    """Tokens at or past prefill_tokens_with_context take the suffix verbatim, even a +inf LSE and a
    garbage (NaN) prefix row."""
    rng = np.random.default_rng(4)
    po, pl, so, sl = states(rng, 17, NUM_HEADS, 64, dtype)
    n = 17 if prefill_tokens_with_context is None else prefill_tokens_with_context
    po[n:] = np.nan
    pl[:, n:] = np.nan
    got, got_lse = run(backend, po, pl, so, sl, with_lse=with_lse,
                       prefill_tokens_with_context=prefill_tokens_with_context)
    check(got, got_lse, po, pl, so, sl, prefill_tokens_with_context)
    assert_bits(got[n:], so[n:], "tokens without context")
    if with_lse:
        assert_bits(got_lse[:, n:], sl[:, n:], "their LSE")


def test_numpy_integer_prefill_tokens_with_context(backend):
    po, pl, so, sl = states(np.random.default_rng(5), 17, NUM_HEADS, 64, np.float16)
    got, got_lse = run(backend, po, pl, so, sl, prefill_tokens_with_context=np.int64(5))
    check(got, got_lse, po, pl, so, sl, 5)


def test_merge_of_two_key_halves_is_full_attention(backend):
    """The oracle itself: attention over keys A and over keys B, merged, is attention over A ∪ B
    (computed by the reference's two-pass softmax, a different algorithm)."""
    rng = np.random.default_rng(6)
    q = rng.standard_normal((17, NUM_HEADS, 64))
    k, v = rng.standard_normal((2, 50, 64)), rng.standard_normal((2, 50, 64))
    pos = np.full(17, 49)
    parts = [[reference.attention_rows(q[:, h], k[i], v[i], pos, scale=0.125, causal=False) for h in range(NUM_HEADS)]
             for i in range(2)]
    full = [reference.attention_rows(q[:, h], np.concatenate(k), np.concatenate(v), pos, scale=0.125, causal=False)
            for h in range(NUM_HEADS)]
    outputs = [np.stack([o for o, _ in p], axis=1).astype(np.float32) for p in parts]
    lses = [np.stack([lse for _, lse in p]).astype(np.float32) for p in parts]
    got, got_lse = run(backend, outputs[0], lses[0], outputs[1], lses[1])
    assert_close(got, np.stack([o for o, _ in full], axis=1), np.float32)
    assert_close(got_lse, np.stack([lse for _, lse in full]), "lse")


# ---------------------------------------------------------------- strides, alignment, in place
def _view_of(kind, num_tokens, head_size, dtype):
    """(buffer shape, view): how an output sits in a bigger buffer. "fused": token-strided slices of
    one [num_tokens, 3, heads, head_size] buffer; "head_padded": vLLM's ``context_output[...,
    :v_head_dim]``; "unaligned": 2 (or 12) bytes off 16-byte alignment, which takes the scalar path."""
    shape = (num_tokens, NUM_HEADS, head_size)
    size = num_tokens * NUM_HEADS * head_size
    off = 1 if np.dtype(dtype).itemsize == 2 else 3
    return {
        "fused": ((num_tokens, 3, NUM_HEADS, head_size), lambda b, i=1: b[:, i]),
        "head_padded": ((3, num_tokens, NUM_HEADS, head_size + 64), lambda b, i=1: b[i, ..., :head_size]),
        "unaligned": ((3, size + 8), lambda b, i=1: b[i, off:off + size].reshape(shape)),
    }[kind]


@pytest.mark.parametrize("kind", ["fused", "head_padded", "unaligned"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_strided_views(backend, dtype, kind, monkeypatch):
    """prefix, suffix and output are views 0, 1, 2 of one buffer; the memory around the output view
    must come back untouched. Aligned views take the 16-byte path, the unaligned one the scalar path."""
    launched = []
    function = FAMILY.function
    monkeypatch.setattr(FAMILY, "function", lambda name, xp: launched.append(name) or function(name, xp))
    rng = np.random.default_rng(7)
    buf_shape, view = _view_of(kind, 17, 128, dtype)
    host = rng.standard_normal(buf_shape).astype(dtype)
    _, pl, _, sl = states(rng, 17, NUM_HEADS, 128, dtype)
    view(host, 2)[...] = np.nan
    buf = backend.asarray(host)
    got, got_lse = run(backend, view(host, 0), pl, view(host, 1), sl, out=view(buf, 2))
    check(got, got_lse, view(host, 0), pl, view(host, 1), sl)
    outside = np.ones(buf_shape, bool)
    view(outside, 2)[...] = False
    assert_bits(backend.to_numpy(buf)[outside], host[outside], "memory around the output view")
    assert launched == [_kernel(CTYPE[np.dtype(dtype)], kind != "unaligned")]


@pytest.mark.parametrize("layout", ["transposed", "padded"])
def test_lse_views(backend, layout):
    """LSEs [num_heads, num_tokens] stored token-major, or sliced from a padded [num_heads, 32]."""
    po, pl, so, sl = states(np.random.default_rng(8), 17, NUM_HEADS, 64, np.float16)
    if layout == "transposed":
        store, view = (lambda x: np.ascontiguousarray(x.T)), (lambda b: b.T)
    else:
        store, view = (lambda x: np.pad(x, ((0, 0), (0, 15)), constant_values=np.nan)), (lambda b: b[:, :17])
    prefix_lse, suffix_lse, out_lse = (view(backend.asarray(store(x))) for x in (pl, sl, np.full_like(pl, np.nan)))
    out = backend.asarray(poisoned(po.shape, po.dtype))
    merge_attn_states(out, backend.asarray(po), prefix_lse, backend.asarray(so), suffix_lse, out_lse)
    check(backend.to_numpy(out), backend.to_numpy(out_lse), po, pl, so, sl)


@pytest.mark.parametrize("into", ["prefix", "suffix"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_in_place(backend, dtype, into):
    """output is prefix_output (or suffix_output) and output_lse its LSE: 16 threads share a row
    here, so the LSE is overwritten while other threads of the row still need it unless the kernel
    reads every LSE first."""
    po, pl, so, sl = states(np.random.default_rng(9), 97, NUM_HEADS, 128, dtype)
    ref, ref_lse = reference.merge_attn_states(po, pl, so, sl)
    arrays = [backend.asarray(a) for a in (po, pl, so, sl)]
    out, out_lse = (arrays[0], arrays[1]) if into == "prefix" else (arrays[2], arrays[3])
    merge_attn_states(out, *arrays, out_lse)
    assert_close(backend.to_numpy(out), ref, dtype)
    assert_close(backend.to_numpy(out_lse), ref_lse, "lse", "output_lse")


def test_empty_problem_is_a_no_op(backend):
    po, pl, so, sl = states(np.random.default_rng(10), 0, NUM_HEADS, 64, np.float16)
    got, got_lse = run(backend, po, pl, so, sl)
    assert got.shape == (0, NUM_HEADS, 64) and got_lse.shape == (NUM_HEADS, 0)


# ---------------------------------------------------------------- validation: clear error, nothing written
def _valid(backend, dtype=np.float16):
    po, pl, so, sl = states(np.random.default_rng(11), 17, NUM_HEADS, 64, dtype)
    return dict(output=backend.asarray(poisoned(po.shape, dtype)), prefix_output=backend.asarray(po),
                prefix_lse=backend.asarray(pl), suffix_output=backend.asarray(so), suffix_lse=backend.asarray(sl),
                output_lse=backend.asarray(poisoned(pl.shape, np.float32)))


BAD = [
    ("output ndim", lambda a: {"output": a["output"][0]}, ValueError, "output must be 3-D"),
    ("output dtype", lambda a: {"output": a["output"].astype(np.float64)}, TypeError, "output must have dtype"),
    ("output int", lambda a: {"output": a["output"].view(np.int16)}, TypeError, "output must have dtype"),
    ("output last stride", lambda a: {"output": a["output"][..., ::2]}, ValueError, "output must be contiguous"),
    ("prefix_output shape", lambda a: {"prefix_output": a["prefix_output"][:16]}, ValueError, "prefix_output"),
    ("prefix_output dtype", lambda a: {"prefix_output": a["prefix_output"].astype(np.float32)}, TypeError,
     "prefix_output"),
    ("suffix_output heads", lambda a: {"suffix_output": a["suffix_output"][:, :3]}, ValueError, "suffix_output"),
    ("suffix_output dtype", lambda a: {"suffix_output": a["suffix_output"].astype(ml_dtypes.bfloat16)}, TypeError,
     "suffix_output"),
    ("suffix_output ndim", lambda a: {"suffix_output": a["suffix_output"].reshape(17, -1)}, ValueError,
     "suffix_output must be 3-D"),
    ("head_size 60", lambda a: {k: (v[..., :60] if v.ndim == 3 else v) for k, v in a.items()}, ValueError,
     "multiple of 8"),
    ("prefix_lse dtype", lambda a: {"prefix_lse": a["prefix_lse"].astype(np.float64)}, TypeError, "prefix_lse"),
    ("prefix_lse token-major", lambda a: {"prefix_lse": a["prefix_lse"].T.copy()}, ValueError,
     r"prefix_lse must be float32 \[num_heads, num_tokens\].*transpose"),
    ("suffix_lse short", lambda a: {"suffix_lse": a["suffix_lse"][:, :16]}, ValueError, "suffix_lse"),
    ("suffix_lse float16", lambda a: {"suffix_lse": a["suffix_lse"].astype(np.float16)}, TypeError, "suffix_lse"),
    ("suffix_lse 3-D", lambda a: {"suffix_lse": a["suffix_lse"][None]}, ValueError, "suffix_lse"),
    ("output_lse shape", lambda a: {"output_lse": a["output_lse"][:3]}, ValueError, "output_lse"),
    ("output_lse dtype", lambda a: {"output_lse": a["output_lse"].astype(np.float16)}, TypeError, "output_lse"),
    ("prefill negative", lambda a: {"prefill_tokens_with_context": -1}, ValueError, "prefill_tokens_with_context"),
    ("prefill too big", lambda a: {"prefill_tokens_with_context": 18}, ValueError, "prefill_tokens_with_context"),
    ("prefill float", lambda a: {"prefill_tokens_with_context": 5.0}, TypeError, "prefill_tokens_with_context"),
    ("prefill bool", lambda a: {"prefill_tokens_with_context": True}, TypeError, "prefill_tokens_with_context"),
    ("prefix_output list", lambda a: {"prefix_output": [[[0.0]]]}, TypeError, "prefix_output must be a numpy"),
]


@pytest.mark.parametrize("label, change, exc, match", BAD, ids=[b[0] for b in BAD])
def test_bad_input(backend, label, change, exc, match):
    args = _valid(backend)
    before = backend.to_numpy(args["output"]).copy()
    before_lse = backend.to_numpy(args["output_lse"]).copy()
    kwargs = {**args, **change(args)}
    with pytest.raises(exc, match=match):
        merge_attn_states(**kwargs)
    assert_bits(backend.to_numpy(args["output"]), before, "output after a rejected call")
    assert_bits(backend.to_numpy(args["output_lse"]), before_lse, "output_lse after a rejected call")


def test_partial_overlap_is_rejected(backend):
    """Written arrays may be the very same view as an input (in place) but may not partly overlap any
    argument: threads would read what others already wrote."""
    a = _valid(backend)
    lse_buf = backend.asarray(np.zeros((NUM_HEADS, 18), np.float32))
    with pytest.raises(ValueError, match="output_lse overlaps prefix_lse"):
        merge_attn_states(**{**a, "prefix_lse": lse_buf[:, :17], "output_lse": lse_buf[:, 1:]})
    big = backend.asarray(np.zeros((18, NUM_HEADS, 64), np.float16))
    with pytest.raises(ValueError, match="output overlaps suffix_output"):
        merge_attn_states(**{**a, "output": big[1:], "suffix_output": big[:17]})
    out32 = backend.asarray(np.zeros((17, NUM_HEADS, 64), np.float32))
    with pytest.raises(ValueError, match="output overlaps output_lse"):
        merge_attn_states(**{**a, "output": out32, "prefix_output": a["prefix_output"].astype(np.float32),
                             "suffix_output": a["suffix_output"].astype(np.float32),
                             "output_lse": out32[0, :, :17]})
    assert not backend.to_numpy(big).any() and not backend.to_numpy(lse_buf).any()


def test_overlap_edge_cases(backend):
    """What the interval comparison of each array's byte span must keep: a view at an input's very
    address but with other strides, and a reversed (negative-stride) view, are overlaps; inputs
    sharing memory (only read) are not."""
    a = _valid(backend)
    twice = backend.asarray(np.zeros((34, NUM_HEADS, 64), np.float16))
    with pytest.raises(ValueError, match="output overlaps prefix_output"):
        merge_attn_states(**{**a, "output": twice[:17], "prefix_output": twice[::2]})
    lse_buf = backend.asarray(np.zeros((NUM_HEADS, 17), np.float32))
    with pytest.raises(ValueError, match="output_lse overlaps suffix_lse"):
        merge_attn_states(**{**a, "suffix_lse": lse_buf, "output_lse": lse_buf[:, ::-1]})
    assert not backend.to_numpy(twice).any() and not backend.to_numpy(lse_buf).any()
    po, pl, _, _ = states(np.random.default_rng(12), 17, NUM_HEADS, 64, np.float16)
    got, got_lse = run(backend, po, pl, po, pl)
    check(got, got_lse, po, pl, po, pl)


def test_read_only_output_is_rejected():
    a = _valid(types.SimpleNamespace(asarray=np.asarray))
    a["output"].setflags(write=False)
    with pytest.raises(ValueError, match="output is read-only"):
        merge_attn_states(**a)


def test_backend_mix_names_the_arguments(monkeypatch):
    """numpy outputs beside a cupy LSE are a TypeError naming both sides (a stand-in cupy module
    lets this run without a GPU)."""
    fake = types.ModuleType("cupy")

    class FakeDeviceArray:
        ndim, shape, dtype = 2, (NUM_HEADS, 17), np.dtype(np.float32)

    fake.ndarray = FakeDeviceArray
    monkeypatch.setitem(sys.modules, "cupy", fake)
    a = _valid(types.SimpleNamespace(asarray=np.asarray))
    before = a["output"].copy()
    with pytest.raises(TypeError, match=r"cupy: suffix_lse; numpy: output, output_lse, prefix_output, prefix_lse, "
                                        r"suffix_output"):
        merge_attn_states(**{**a, "suffix_lse": FakeDeviceArray()})
    assert_bits(a["output"], before, "output after a rejected call")
