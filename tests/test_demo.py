"""The demo (cupaged/demo): the serving loop on a small model, checked step by step against the pool's invariants
and at the end teacher-forced against the float64 forward (cupaged.reference.layers.decoder_logits)."""

from __future__ import annotations

import errno
import re
import threading

import numpy as np
import pytest

from cupaged.__main__ import main as cupaged_main
from cupaged.demo import cli
from cupaged import KVCache
from cupaged.demo import engine as demo_engine
from cupaged.demo.engine import Request, drop_cached
from cupaged.demo.speculative import DraftTree, accept, compact, tree_mask
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


def test_the_shared_system_prompt_is_read_through_cascade_attention(monkeypatch, capsys):
    """Once the system prompt's blocks are cached, every running request holds them: the layers read them once a
    step through cascade_attention (the demo's layers take cascade=True), and --verify still passes."""
    import cupaged.layers

    calls, real = [], cupaged.layers.cascade_attention
    monkeypatch.setattr(cupaged.layers, "cascade_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert cli.main([*SMALL, "--backend", "sim", "--verify"]) == 0  # 6 requests: decode steps of 4 behind the prompt
    assert "PASS" in capsys.readouterr().out and len(calls) > 0


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gpt-oss"])
def test_each_family_serves_and_verifies(family, capsys):
    """--family picks the layers' options (biases; windows, softcap and scale; sinks, windows and YaRN); the float64
    forward reads the same options from the config, and prompts of up to 49 tokens outrun the local layers' window."""
    assert cli.main([*SMALL, "--backend", "sim", "--requests", "3", "--family", family, "--verify"]) == 0
    assert "PASS" in capsys.readouterr().out
    config = cli.build(cli.parser().parse_args([*SMALL, "--backend", "sim", "--family", family]))[2]
    options = [config.attention_options(i) for i in range(config.n_layers)]
    assert options[0] != options[1] if family != "qwen2" else options[0] == {"bias": True}


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


# -- --speculative K: draft trees verified under a tree mask ------------------------------------------------------

SPECULATIVE = [*SMALL, "--backend", "sim", "--max-new-tokens", "12", "--num-blocks", "13"]  # 3 preemptions at K=4


def _serve_checked(argv):
    """(engine, weights, config) of ``argv`` served to the end, the pool's invariants checked after every step."""
    engine, weights, config = cli.build(cli.parser().parse_args(argv))
    while not engine.done:
        engine.step()
        engine.pool.check()
    return engine, weights, config


@pytest.fixture(scope="module")
def speculated():
    """SPECULATIVE served plainly and with --speculative 4 (the draft's top 2, then a chain of 2 under the best), and
    how many key / value rows compaction moved (an accepted runner-up's, drafted last)."""
    moved = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr(demo_engine, "compact", lambda kv, src, dst: moved.append(len(src)) or compact(kv, src, dst))
        spec = _serve_checked([*SPECULATIVE, "--speculative", "4"])
    return _serve_checked(SPECULATIVE)[0], spec, sum(moved)


def test_speculative_greedy_requests_emit_exactly_plain_greedy_decoding(speculated):
    plain, (spec, _, _), _ = speculated
    greedy = {r.seq_id: r.tokens for r in plain.finished if r.temperature == 0}
    assert len(greedy) == 5 and greedy == {r.seq_id: r.tokens for r in spec.finished if r.temperature == 0}
    assert {r.seq_id: r.generated for r in spec.finished} == {r.seq_id: r.generated for r in plain.finished}
    assert spec.pool.usage().blocks_in_use == 0 and spec.stats["steps"] < plain.stats["steps"]


def test_speculative_run_verifies_every_emitted_token(speculated, capsys):
    _, (engine, weights, config), _ = speculated
    assert cli.verify(engine.finished, weights, config, "float32")
    assert "PASS" in capsys.readouterr().out
    r = next(r for r in engine.finished if r.temperature == 0)
    ref = decoder_logits(weights, config, r.tokens[:-1])
    assert [pos for pos, _, _ in r.logits] == list(range(len(r.prompt) - 1, len(r.tokens) - 1))
    for pos, row, token in r.logits:
        np.testing.assert_allclose(row, ref[pos], rtol=0, atol=1e-4)


def test_speculative_run_accepts_drafts_and_a_runner_up_beside_preemption_and_the_fork(speculated):
    _, (engine, _, _), moved = speculated
    s, spec = engine.stats, engine.speculator
    assert 0 < spec.accepted < spec.drafted <= 4 * spec.verified and moved >= 1
    assert s["preemptions"] >= 1 and s["forks"] == 1 and s["mixed_steps"] >= 1 and s["max_batch_tokens"] <= 24


def test_main_with_speculative_prints_the_acceptance_line_and_verifies(capsys):
    assert cli.main([*SPECULATIVE, "--requests", "3", "--speculative", "2", "--verify"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"speculative decoding +\| \d+ drafted / \d+ accepted tokens \(.*%\), \d+\.\d\d accepted per "
                     r"verify step \(\d+ tree verifications of up to 2 tokens; draft: layer 0 of 2\)", out), out
    assert "PASS" in out
    assert cli.main([*SPECULATIVE, "--requests", "3"]) == 0
    assert "speculative" not in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--family", "qwen2"], ["--vocab", "1"], ["--token-budget", "2"],
                                   ["--max-new-tokens", "1"], ["--speculative", "9", "--layers", "3"]],
                         ids=["qwen2", "vocab-of-one", "budget-of-two", "one-new-token", "deep-chain-of-3-layers"])
def test_speculative_edge_flags_serve_and_verify(flags, capsys):
    """Qwen2's biases; a vocabulary of one (no runner-up: a chain); a budget of 2 (one draft a step); no token left
    to draft; drafts longer than the requests' remaining tokens (capped: a step never overshoots max-new-tokens)."""
    assert cli.main([*SPECULATIVE, "--requests", "3", "--speculative", "3", *flags, "--verify"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_tree_mask_shows_each_node_the_context_its_ancestors_and_itself():
    tree = DraftTree([5, 6, 7, 8], [-1, 0, 1, -1])  # best, its chain of 2, the runner-up
    want = [[1, 1, 1, 0, 0, 0, 0],   # the root at key index 2
            [1, 1, 1, 1, 0, 0, 0],   # node 0
            [1, 1, 1, 1, 1, 0, 0],   # node 1, below 0
            [1, 1, 1, 1, 1, 1, 0],   # node 2, below 1
            [1, 1, 1, 0, 0, 0, 1]]   # node 3, the root's second child
    np.testing.assert_array_equal(tree_mask(tree, 2), np.array(want, bool))
    assert [tree.depth(i) for i in range(4)] == [1, 2, 3, 1] and tree.children(-1) == [0, 3]


def test_greedy_acceptance_follows_the_targets_argmax_and_adds_its_bonus():
    tree = DraftTree([5, 6, 7, 8], [-1, 0, 1, -1])
    rows = np.zeros((5, 10), np.float32)
    rows[0, 8], rows[4, 2] = 1, 1  # the target takes the runner-up, then 2 (no child: the bonus)
    path, emitted = accept(Request(0, [1], 5), tree, rows)
    assert path == [3] and [t for _, t in emitted] == [8, 2] and np.array_equal(emitted[1][0], rows[4])
    rows[0, 8], rows[0, 5], rows[1, 6], rows[2, 1] = 0, 1, 1, 1  # best, its child, then 1 (not 7)
    path, emitted = accept(Request(0, [1], 5), tree, rows)
    assert path == [0, 1] and [t for _, t in emitted] == [5, 6, 1]


def test_sampled_acceptance_draws_the_targets_distribution():
    """The ratio rule over deterministic drafts (accept x with probability p(x), else drop x from p) leaves the first
    token distributed as p = softmax(row / temperature), whichever two tokens the draft proposes."""
    row = np.array([1.0, 0.5, -0.2, 0.9, 0.1], np.float32)
    p = np.exp(row / 0.8) / np.exp(row / 0.8).sum()
    request, n = Request(1, [1], 5, temperature=0.8, seed=3), 40000
    tree = DraftTree([2, 0], [-1, -1])
    first = [accept(request, tree, np.stack([row, row, row]))[1][0][1] for _ in range(n)]
    counts = np.bincount(first, minlength=5)
    assert np.all(np.abs(counts / n - p) < 4 * np.sqrt(p * (1 - p) / n)), (counts / n, p)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_compact_moves_every_layers_rows(layout):
    kv = KVCache(2, 4, 4, 2, 8, np.float32, layout=layout, xp=np)
    for c in kv.key_caches + kv.value_caches:
        c[...] = np.random.default_rng(0).standard_normal(c.shape)
    before = [c.copy() for c in kv.key_caches + kv.value_caches]
    compact(kv, [9, 5], [5, 6])  # slot 5 is read before it is written
    for c, old in zip(kv.key_caches + kv.value_caches, before):
        rows = (lambda a, s: a[s // 4, s % 4]) if layout == "NHD" else (lambda a, s: a[s // 4, :, s % 4])
        np.testing.assert_array_equal(rows(c, 5), rows(old, 9))
        np.testing.assert_array_equal(rows(c, 6), rows(old, 5))
        np.testing.assert_array_equal(rows(c, 7), rows(old, 7))


# A one-layer model of a few dimensions: the flag tests below that serve run in about a second.
TINY = ["--backend", "sim", "--layers", "1", "--dim", "16", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
        "--hidden", "8", "--vocab", "11", "--requests", "3", "--max-new-tokens", "3", "--system-len", "5",
        "--prompt-len", "9", "--block-size", "4", "--num-blocks", "16", "--token-budget", "8"]

BAD_FLAGS = {  # id: (flags after TINY, what the one-line error must say)
    "num-blocks-too-few": (["--num-blocks", "1"], r"argument --num-blocks: 1 is too few for blocks of 4 tokens: "
                                                  r"request \d+ .* needs (\d+)"),
    "heads-not-a-multiple-of-kv-heads": (["--heads", "3", "--kv-heads", "2"],
                                         "--heads 3 must be a multiple of --kv-heads 2"),
    "head-dim-past-the-kernels": (["--head-dim", "300"], "argument --head-dim: must be even, from 2 to 256, got 300"),
    "head-dim-odd": (["--head-dim", "7"], "argument --head-dim: must be even, from 2 to 256, got 7"),
    "head-dim-1": (["--head-dim", "1"], "argument --head-dim: must be even, from 2 to 256, got 1"),
    "seed-negative": (["--seed", "-1"], "argument --seed: must be at least 0, got -1"),
    "requests-0": (["--requests", "0"], "argument --requests: must be at least 1, got 0"),
    "token-budget-0": (["--token-budget", "0"], "argument --token-budget: must be at least 1, got 0"),
    "max-new-tokens-0": (["--max-new-tokens", "0"], "argument --max-new-tokens: must be at least 1, got 0"),
    "layers-negative": (["--layers", "-2"], "argument --layers: must be at least 1, got -2"),
    "prompt-len-0": (["--prompt-len", "0"], "argument --prompt-len: must be at least 1, got 0"),
    "system-len-negative": (["--system-len", "-1"], "argument --system-len: must be at least 0, got -1"),
    "num-blocks-past-int32": (["--num-blocks", str(2**31)], "argument --num-blocks: must be at most 2147483647"),
    "sizes-past-memory": (["--vocab", str(2**31 - 1), "--dim", "65536"], "these sizes need about .* GiB of memory"),
    "kv-cache-past-memory": (["--num-blocks", str(2**31 - 1), "--block-size", str(2**31 - 1)],
                             "these sizes need about .* GiB of memory"),
    "prompts-past-memory": (["--requests", str(2**31 - 1), "--prompt-len", str(2**31 - 1)],
                            "these sizes need about .* GiB of memory"),
    "dim-not-a-number": (["--dim", "1e3"], "argument --dim: invalid count value: '1e3'"),
    "dtype-float64": (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    "backend-unknown": (["--backend", "tpu"], "argument --backend: invalid choice: 'tpu'"),
    "speculative-negative": (["--speculative", "-1"], "argument --speculative: must be at least 0, got -1"),
    "speculative-one-layer": (["--speculative", "2"], "argument --speculative: the draft model is the first of "
                                                      "--layers 1: give --layers 2 or more"),
    "speculative-gemma2": (["--speculative", "2", "--layers", "2", "--family", "gemma2"],
                           "argument --speculative: --family gemma2's sliding-window layers take no tree mask"),
    "speculative-gpt-oss": (["--speculative", "2", "--layers", "2", "--family", "gpt-oss"],
                            "argument --speculative: --family gpt-oss's sliding-window layers take no tree mask"),
}


def _error_line(err: str) -> str:
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("flags, message", BAD_FLAGS.values(), ids=list(BAD_FLAGS))
def test_a_bad_flag_is_a_usage_error_not_a_traceback(flags, message, capsys):
    """A regression: these ended in a traceback from the model, the engine or numpy."""
    with pytest.raises(SystemExit) as exit_:
        cli.main([*TINY, *flags])
    assert exit_.value.code == 2
    line = _error_line(capsys.readouterr().err)
    assert line.startswith("python -m cupaged demo: error: ") and re.search(message, line), line


def test_too_few_blocks_names_the_real_minimum(capsys):
    """The minimum named serves every request (and verifies); one block fewer is refused with the same number."""
    with pytest.raises(SystemExit):
        cli.main([*TINY, "--num-blocks", "1"])
    need = int(re.search(BAD_FLAGS["num-blocks-too-few"][1], capsys.readouterr().err).group(1))
    with pytest.raises(SystemExit):
        cli.main([*TINY, "--num-blocks", str(need - 1)])
    assert f"needs {need}" in _error_line(capsys.readouterr().err)
    assert cli.main([*TINY, "--num-blocks", str(need), "--verify"]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [["--system-len", "0", "--prompt-len", "1"], ["--vocab", "1"], ["--seed", "7"],
                                   ["--max-new-tokens", "1", "--requests", "1"]],
                         ids=["prompt-of-one-token", "vocab-of-one", "seed-7", "one-token-of-one-request"])
def test_small_but_valid_flags_serve_and_verify(flags, capsys):
    """--system-len 0 --prompt-len 1 drew a user part of 4 or more tokens from [4, 1] (numpy: low >= high);
    --vocab 1 --verify took the top two of one logit."""
    assert cli.main([*TINY, *flags, "--verify"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_backend_cuda_without_a_gpu_is_one_line(capsys):
    from cupaged._backend import gpu_module

    if gpu_module() is not None:
        pytest.skip("a GPU is present")
    assert cli.main([*TINY, "--backend", "cuda"]) == 1
    line = _error_line(capsys.readouterr().err)
    assert line.startswith("python -m cupaged demo: error: --backend cuda: ") and len(
        capsys.readouterr().err.strip().splitlines()) <= 1


def test_running_out_of_memory_anyway_is_one_line(monkeypatch, capsys):
    """Sizes under the estimate whose allocation still fails (the sim's guarded memory: ENOMEM from mmap)."""
    def kv_cache(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(cli, "KVCache", kv_cache)
    assert cli.main(TINY) == 1
    assert "out of memory for these sizes ([Errno 12] Cannot allocate memory)" in _error_line(capsys.readouterr().err)


def test_help_shows_every_default_in_plain_text(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "``" not in text
    for action in cli.parser()._actions:
        if action.dest != "help":
            assert f"{action.option_strings[0]}" in text and f"(default: {action.default})" in text, action.dest


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"]])
def test_the_commands_help_is_plain_text(capsys, argv):
    """`python -m cupaged --help` printed its docstring's ``double backticks``."""
    with pytest.raises(SystemExit) as exit_:
        cupaged_main(argv)
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and "usage: python -m cupaged" in text


def test_a_warm_run_says_nothing_of_compiling(served, capsys):
    """Every kernel is in the compile cache (the fixture's run): the closing table said the first step "compiles
    kernels not cached yet" on every run; a compile is announced by the compiler's own notice, when one runs."""
    capsys.readouterr()
    assert cli.main([*SMALL, "--backend", "sim", "--requests", "2"]) == 0
    captured = capsys.readouterr()
    assert "compil" not in (captured.out + captured.err).lower(), captured
    assert "first step" in captured.out
