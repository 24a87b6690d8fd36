"""The demo (cupaged/demo): the serving loop on a small model, checked step by step against the pool's invariants
and at the end teacher-forced against the float64 forward (cupaged.reference.layers.decoder_logits)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cupaged.demo import cli
from cupaged.demo.engine import drop_cached
from cupaged.pool import BlockPool
from cupaged.reference.layers import decoder_logits

# A small model and a tight pool: 6 requests (one forked) over 14 blocks of 8 must preempt.
SMALL = ["--layers", "2", "--dim", "64", "--heads", "4", "--kv-heads", "1", "--head-dim", "32", "--hidden", "96",
         "--vocab", "97", "--requests", "6", "--max-new-tokens", "7", "--system-len", "19", "--prompt-len", "30",
         "--block-size", "8", "--num-blocks", "14", "--token-budget", "24", "--max-num-seqs", "4"]

pytestmark = pytest.mark.kernel


@pytest.fixture(scope="module")
def served():
    """Run the small demo to the end, checking the pool's invariants after every step."""
    args = cli.parser().parse_args([*SMALL, "--backend", "sim"])
    engine, weights, config = cli.build(args)
    requests = list(engine.waiting)
    while not engine.done:
        engine.step()
        engine.pool.check()
    return engine, weights, config, requests


def test_every_request_finishes_with_its_tokens_and_frees_its_blocks(served):
    engine, _, _, requests = served
    assert len(engine.finished) == len(requests) + 1  # the fork's child
    for r in engine.finished:
        assert r.generated == r.max_new_tokens and len(r.logits) == r.max_new_tokens
        assert r.tokens[:len(r.prompt)] == list(r.prompt)
    usage = engine.pool.usage()
    assert usage.num_seqs == 0 and usage.blocks_in_use == 0


def test_the_run_exercises_prefix_hits_fork_preemption_and_mixed_steps(served):
    s = served[0].stats
    assert s["hit_tokens"] > 0 and s["forks"] == 1 and s["copies"] >= 1
    assert s["preemptions"] >= 1 and s["mixed_steps"] >= 1
    assert s["max_batch_tokens"] <= 24 and s["peak_blocks"] <= 14


def test_the_fork_samples_differently_from_the_same_cached_prompt(served):
    parent, child = (next(r for r in served[0].finished if r.seq_id == i) for i in (1, 6))
    assert parent.prompt == child.prompt and parent.temperature == child.temperature == 0.8
    assert parent.logits[0][0] == child.logits[0][0]  # both sampled from the prompt's last position
    np.testing.assert_array_equal(parent.logits[0][1], child.logits[0][1])
    assert parent.tokens != child.tokens


def test_verify_passes_and_every_logit_matches_the_float64_forward(served, capsys):
    engine, weights, config, _ = served
    assert cli.verify(engine.finished, weights, config, "float32")
    assert "PASS" in capsys.readouterr().out
    r = next(r for r in engine.finished if r.temperature == 0)
    ref = decoder_logits(weights, config, r.tokens[:-1])
    for pos, row, token in r.logits:
        np.testing.assert_allclose(row, ref[pos], rtol=0, atol=1e-4)
        assert token == int(np.argmax(row))


def test_verify_fails_on_a_wrong_logit_or_a_wrong_greedy_token(served, capsys):
    engine, weights, config, _ = served
    r = next(r for r in engine.finished if r.temperature == 0)
    pos, row, token = r.logits[0]
    try:
        r.logits[0] = (pos, row + np.float32(0.01), token)
        assert not cli.verify(engine.finished, weights, config, "float32")
        ref = decoder_logits(weights, config, r.tokens[:-1])[pos]
        r.logits[0] = (pos, row, int(np.argsort(ref)[-2]))  # the runner-up (the test's tokens have clear gaps)
        assert not cli.verify(engine.finished, weights, config, "float32")
    finally:
        r.logits[0] = (pos, row, token)
    assert capsys.readouterr().out.count("FAIL") == 2


def test_main_prints_the_table_and_verifies(capsys):
    threads = set(threading.enumerate())
    assert cli.main([*SMALL, "--backend", "sim", "--requests", "3", "--verify"]) == 0
    assert set(threading.enumerate()) == threads  # no thread left behind (tqdm's monitor) beside later sim launches
    out = capsys.readouterr().out
    for label in ("requests", "tokens generated", "tokens/s", "prefix-cache hit rate", "pool waste",
                  "peak blocks used", "PASS"):
        assert label in out


def test_drop_cached_removes_the_prefix_hits_and_keeps_the_context():
    pool = BlockPool(16, 4, enable_prefix_caching=True)
    first = np.arange(11)
    pool.plan([("a", first)])
    assert pool.cached_prefix_len(np.r_[first[:8], 50, 51]) == 8
    plan = pool.plan([("b", np.r_[first[:8], 50, 51]), ("a", [7])])
    trimmed, keep = drop_cached(plan)
    np.testing.assert_array_equal(keep, [8, 9, 10])
    np.testing.assert_array_equal(trimmed.query_start_loc, [0, 2, 3])
    np.testing.assert_array_equal(trimmed.positions, [8, 9, 11])
    np.testing.assert_array_equal(trimmed.slot_mapping, plan.slot_mapping[keep])
    np.testing.assert_array_equal(trimmed.seq_lens, [10, 12])
    assert trimmed.max_query_len == 2 and trimmed.seq_ids == ("b", "a")
    assert drop_cached(trimmed)[0] is trimmed


@pytest.mark.parametrize("seed, blocks, block_size, budget", [(1, 12, 8, 9), (2, 9, 16, 40), (3, 30, 4, 17),
                                                             (4, 11, 8, 1)])
def test_other_seeds_pools_and_budgets_serve_every_request_correctly(seed, blocks, block_size, budget, capsys):
    """Tighter pools (more preemption), other block sizes and budgets (a budget of 1: one token a step)."""
    args = cli.parser().parse_args([*SMALL, "--backend", "sim", "--seed", str(seed), "--num-blocks", str(blocks),
                                    "--block-size", str(block_size), "--token-budget", str(budget),
                                    "--requests", "4", "--max-new-tokens", "5"])
    engine, weights, config = cli.build(args)
    wanted = {r.seq_id: r.max_new_tokens for r in engine.waiting} | {4: engine.waiting[1].max_new_tokens}
    while not engine.done:
        engine.step()
        engine.pool.check()
        assert engine.stats["max_batch_tokens"] <= budget
    assert {r.seq_id: r.generated for r in engine.finished} == wanted
    assert engine.pool.usage().blocks_in_use == 0
    assert cli.verify(engine.finished, weights, config, "float32"), capsys.readouterr().out
