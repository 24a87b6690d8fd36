"""Host-side hints that understate the truth (max_query_len, max_seq_len, max_seqlen_q/k).

A hint only sizes the grid and the split buffers. With validate=True an understated hint is a
ValueError naming it; without, the result is still right: a sequence with more query rows than
the hint said is finished by its CTAs' later iterations, and one longer than max_seq_len gets fewer,
larger splits (never more than the buffers hold), so no kernel touches another sequence's rows or
partials. Before, rows past the hint were left unwritten (NaN), and mla_decode / paged_attention_v2
read or wrote other rows' partials (errors of 0.53 and 0.17).
"""

from __future__ import annotations

import numpy as np
import pytest

import cupaged
from cupaged import reference
from tests.conftest import assert_close
from tests.test_mla import latent_pool
from tests.test_paged_attention import C, build
from tests.test_paged_attention_vllm import vllm_inputs
from tests.test_varlen_attention import make

F16 = np.float16
MIXED = C(seqs=((1, 300), (40, 90), (3, 700)), heads=(4, 2), head_size=64)  # 40 * 2 rows: five tiles of 16


def _paged(backend, **hints):
    inputs, options, ref = build(MIXED)
    args = {k: backend.asarray(v) for k, v in inputs.items()}
    out = cupaged.paged_attention(**args, **options, **hints, return_lse=True)
    return [backend.to_numpy(a) for a in out], ref


@pytest.mark.parametrize("hints", [
    dict(max_query_len=2), dict(max_query_len=17, kv_split_size=64), dict(max_seq_len=100, kv_split_size=64),
    dict(max_query_len=3, max_seq_len=64, kv_split_size=32), dict(max_query_len=40, max_seq_len=700),
], ids=["q2", "q17-split64", "seq100-split64", "q3-seq64-split32", "exact"])
def test_paged_attention_understated_hints_still_right(backend, hints):
    (out, lse), (ref_out, ref_lse) = _paged(backend, **hints)
    assert_close(out, ref_out, F16, "out")
    assert_close(lse, ref_lse, "lse", "lse")


@pytest.mark.parametrize("min_query_len", [17, 40, 10**6], ids=["17", "exact", "overstated"])
def test_paged_attention_min_query_len_drops_the_decode_launch_and_never_a_row(backend, min_query_len):
    """min_query_len past 16: the plan launches the prefill kernel alone, which then takes every run, the short
    ones too (MIXED has runs of 1 and 3): an overstated hint costs speed, never a row."""
    inputs, _, _ = build(MIXED)
    q = inputs["q"]
    kv = cupaged.KvView.paged(inputs["key_cache"], inputs["value_cache"], q)
    plan = cupaged.plan_attention(q, kv, inputs["block_tables"], inputs["seq_lens"], inputs["query_start_loc"],
                                  min_query_len=min_query_len)
    assert [x.kernel.split("<")[0] for x in plan.launches] == [  # sm_90's or the others' prefill kernel
        "cupaged::paged_prefill_sm90_kernel" if plan.arch == "sm_90" else "cupaged::paged_prefill_kernel"]
    assert plan.decode_max_q == 0
    (out, lse), (ref_out, ref_lse) = _paged(backend, min_query_len=min_query_len)
    assert_close(out, ref_out, F16)
    assert_close(lse, ref_lse, "lse", "lse")


@pytest.mark.parametrize("hint, value", [("max_query_len", 39), ("max_seq_len", 699)])
def test_paged_attention_validate_rejects_understated_hints(backend, hint, value):
    inputs, options, _ = build(MIXED)
    args = {k: backend.asarray(v) for k, v in inputs.items()}
    with pytest.raises(ValueError, match=f"{hint}={value} understates"):
        cupaged.paged_attention(**args, **options, **{hint: value}, validate=True)
    cupaged.paged_attention(**args, **options, **{hint: value + 1}, validate=True)  # the truth passes


def test_mla_decode_understated_max_seq_len(backend):
    rng = np.random.default_rng(4)
    seq_lens = np.array([40, 900, 300], np.int32)
    cache, table, _ = latent_pool(rng, seq_lens, 16, F16, "auto")
    q = (rng.standard_normal((3, 16, 576)) * 0.5).astype(F16)
    args = [backend.asarray(a) for a in (q, cache, table, seq_lens)]
    out = cupaged.mla_decode(*args, scale=0.05, kv_split_size=128, max_seq_len=300)
    ref, _ = reference.mla_decode(q, cache, table, seq_lens, scale=0.05)
    assert_close(backend.to_numpy(out), ref, F16, "out")
    with pytest.raises(ValueError, match="max_seq_len=300 understates seq_lens\\[1\\] = 900"):
        cupaged.mla_decode(*args, scale=0.05, kv_split_size=128, max_seq_len=300, validate=True)


def test_paged_attention_v2_understated_max_seq_len(backend):
    """Partition buffers sized for max_seq_len=600 (2 partitions) while a context has 1100 tokens: that
    sequence's output is still right, and only its own rows of the buffers are written."""
    case = C(seqs=((1, 1100), (1, 37), (1, 520)), heads=(4, 2), head_size=64)
    inputs, options = vllm_inputs(case)
    ref = reference.paged_attention_v1(inputs["q"], inputs["key_cache"], inputs["value_cache"], 2, 0.125,
                                       inputs["block_tables"], inputs["seq_lens"])
    shape = (3, 4, 2)
    exp_sums, max_logits = (backend.asarray(np.full(shape, np.nan, np.float32)) for _ in range(2))
    tmp_output = backend.asarray(np.full(shape + (64,), np.nan, F16))
    out = backend.asarray(np.full((3, 4, 64), np.nan, F16))
    dev = [backend.asarray(inputs[k]) for k in ("q", "key_cache", "value_cache")]
    rest = (2, 0.125, backend.asarray(inputs["block_tables"]), backend.asarray(inputs["seq_lens"]), 16, 600, None)
    cupaged.paged_attention_v2(out, exp_sums, max_logits, tmp_output, *dev, *rest)
    assert_close(backend.to_numpy(out), ref, F16, "out")
    es = backend.to_numpy(exp_sums)
    assert np.isnan(es[1, :, 1]).all(), "sequence 1 (one partition) had its second partition written"
    assert not np.isnan(es[[0, 2]]).any()
    with pytest.raises(ValueError, match="max_seq_len=600 understates"):
        cupaged.paged_attention_v2(out, exp_sums, max_logits, tmp_output, *dev, *rest, validate=True)


def test_varlen_attention_understated_max_seqlen_q(backend):
    q, k, v, cq, ck = make(np.random.default_rng(5), [3, 40, 17], [30, 40, 50], (4, 2), 64, 64, F16)
    args = [backend.asarray(a) for a in (q, k, v, cq, ck)]
    out = cupaged.varlen_attention(*args, max_seqlen_q=4)
    ref, _ = reference.varlen_attention(q, k, v, cq, ck)
    assert_close(backend.to_numpy(out), ref, F16, "out")
    for hint in ("max_seqlen_q", "max_seqlen_k"):
        with pytest.raises(ValueError, match=f"{hint}=4 understates"):
            cupaged.varlen_attention(*args, **{hint: 4}, validate=True)


def test_mla_query_runs_longer_than_the_hint(backend):
    """An MLA latent cache through run_attention with runs of 2 and 1 queries under max_query_len=1: the grid holds
    one query a sequence, and mla_decode_kernel's CTAs take the run's later queries in turn. Before v5, the hint
    sent the run to a kernel that computed its first token at the last position and left its second unwritten."""
    rng = np.random.default_rng(4)
    cache, table, _ = latent_pool(rng, [300, 40], 16, F16, "auto")
    q = rng.standard_normal((3, 16, 576)).astype(F16)
    qsl, lens = np.array([0, 2, 3], np.int32), np.array([300, 40], np.int32)
    kv = cupaged.KvView.mla(backend.asarray(cache), 512)
    dev = [backend.asarray(x) for x in (q, table, lens, qsl)]
    plan = cupaged.plan_attention(dev[0], kv, dev[1], dev[2], dev[3], max_query_len=1)
    out = backend.asarray(np.full((3, 16, 512), np.nan, F16))
    cupaged.run_attention(plan, dev[0], kv, out, None, dev[1], dev[2], dev[3], scale=0.05)
    # token i of a run of q_len sits at position seq_len - q_len + i: a decode over that prefix
    ref, _ = reference.mla_decode(q, cache, table[[0, 0, 1]], np.array([299, 300, 40], np.int32), scale=0.05)
    assert_close(backend.to_numpy(out), ref, F16)
