"""python -m cupaged demo [--verify] [sizes]: serve requests of random prompt lengths on the tiny decoder with
continuous batching (cupaged/demo/engine.py), a progress bar, and a closing table. --verify checks every sampled
position teacher-forced against a float64 numpy forward of the same model on the same token history."""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time

import ml_dtypes
import numpy as np
from tqdm import tqdm

from cupaged._attention_args import MAX_HEAD_SIZE
from cupaged._backend import GpuUnavailableError, gpu_module, on_sim, require_gpu
from cupaged.demo.engine import Engine, Request, blocks_needed
from cupaged.demo.model import FAMILIES, DecoderConfig, TinyDecoder, random_weights
from cupaged.kv_cache import KVCache
from cupaged.reference.layers import decoder_logits

__all__ = ["main"]

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LOGIT_TOL = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 2.5e-1}  # max |logit - float64| that passes


INT32_MAX = 2**31 - 1  # the kernels' index type
SIZES = (  # flag, default, smallest, help
    ("layers", 2, 1, "decoder layers"), ("dim", 256, 1, "model width"), ("heads", 8, 1, "query heads"),
    ("kv-heads", 2, 1, "key / value heads (a divisor of --heads)"), ("head-dim", 64, 2, "dimensions of a head (even)"),
    ("hidden", 512, 1, "SwiGLU hidden width"), ("vocab", 512, 1, "vocabulary size"),
    ("requests", 16, 1, "requests served (one more is forked from request 1)"),
    ("max-new-tokens", 32, 1, "most tokens a request generates (each draws from half of N to N)"),
    ("system-len", 40, 0, "tokens of the system prompt every request shares"),
    ("prompt-len", 96, 1, "most tokens of a request's own prompt (each draws from 4 to N)"),
    ("block-size", 16, 1, "tokens per KV cache block"), ("num-blocks", 40, 1, "KV cache blocks"),
    ("token-budget", 64, 1, "most tokens computed per step"), ("max-num-seqs", 8, 1, "most sequences per step"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cupaged demo", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--verify", action="store_true", help="check every sampled position against a float64 numpy forward")
    a("--backend", choices=("auto", "sim", "cuda"), default="auto", help="auto: cuda when a GPU is present, else sim")
    a("--seed", type=_count(0, None), default=0, help="seed of the weights and the requests")
    a("--dtype", choices=tuple(DTYPES), default="float32", help="weights, activations and KV cache")
    a("--family", choices=FAMILIES, default="llama", help="the attention of a model family (cupaged/demo/model.py)")
    a("--speculative", type=_count(0), default=0, metavar="K",
      help="speculative decoding: each decoding request drafts K tokens as a tree with the model's first layer, and "
           "the model verifies them in one step under a tree mask (0: off; llama and qwen2)")
    g = p.add_argument_group("sizes (the defaults take ~12 s on the sim with a warm compile cache)")
    for flag, default, minimum, text in SIZES:
        kind = _count(2, MAX_HEAD_SIZE, even=True) if flag == "head-dim" else _count(minimum)
        g.add_argument(f"--{flag}", type=kind, default=default, metavar="N", help=text)
    return p


def _count(minimum: int, maximum: int | None = INT32_MAX, even: bool = False):
    def parse(text: str) -> int:
        value = int(text)
        if even and (value % 2 or not minimum <= value <= maximum):
            raise argparse.ArgumentTypeError(f"must be even, from {minimum} to {maximum}, got {value}")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value

    parse.__name__ = "count"  # argparse names the type in its messages
    return parse


def memory_needed(args) -> int:
    """Host bytes the run holds at its peak, roughly: the weights (drawn in float64, kept in float32 and in the
    run's dtype), the KV cache (on the host unless --backend cuda), the pool's per-block state, every request's
    tokens (Python ints) and the float32 logits row it keeps per generated token."""
    itemsize = np.dtype(DTYPES[args.dtype]).itemsize
    per_layer = args.dim * args.head_dim * (2 * args.heads + 2 * args.kv_heads) + 3 * args.dim * args.hidden
    params = 2 * args.vocab * args.dim + args.layers * per_layer
    kv = 2 * args.layers * args.num_blocks * args.block_size * args.kv_heads * args.head_dim * itemsize
    sequences = args.requests + 1
    tokens = sequences * (args.system_len + args.prompt_len + args.max_new_tokens)
    rows = sequences * args.max_new_tokens * args.vocab * 4
    return params * (8 + 4 + itemsize) + (args.backend != "cuda") * kv + 64 * args.num_blocks + 40 * tokens + rows


def check_args(p: argparse.ArgumentParser, args) -> None:
    """What argparse cannot check flag by flag: ``p.error`` (exit 2) names the flags."""
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.speculative:
        check_speculative(p, args)
    need, have = memory_needed(args), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        p.error(f"these sizes need about {need / 2**30:.3g} GiB of memory, more than this machine's "
                f"{have / 2**30:.3g} GiB: lower --num-blocks, --block-size, --vocab, --dim, --hidden, --requests, "
                "--prompt-len or --max-new-tokens")
    requests = make_requests(args)
    longest = max(requests, key=lambda r: blocks_needed(r, args.block_size))
    least = blocks_needed(longest, args.block_size)
    if args.num_blocks < least:
        p.error(f"argument --num-blocks: {args.num_blocks} is too few for blocks of {args.block_size} tokens: request "
                f"{longest.seq_id} ({len(longest.prompt)} prompt tokens, {longest.max_new_tokens} new) needs {least}; "
                f"give --num-blocks {least} or more")


def check_speculative(p: argparse.ArgumentParser, args) -> None:
    """--speculative drafts with the first layer, so the model needs a second, and verifies under a tree mask, which
    sliding-window and ALiBi layers do not take (they measure distances by key index; a tree node's index is not its
    position)."""
    if args.layers < 2:
        p.error(f"argument --speculative: the draft model is the first of --layers {args.layers}: give --layers 2 or "
                "more")
    config = DecoderConfig(n_layers=args.layers, family=args.family)
    options = [config.attention_options(i) for i in range(args.layers)]
    if any(o.get("sliding_window") or o.get("alibi") for o in options):
        p.error(f"argument --speculative: --family {args.family}'s sliding-window layers take no tree mask (a draft "
                "node's key index is not its position): use --family llama or qwen2")


def _xp(backend):
    if backend == "cuda":
        return require_gpu()
    return np if backend == "sim" else gpu_module() or np


class _Bar(tqdm):
    """No monitor thread (tqdm's default wakes every 10 s for the life of the bar and longer): a process running
    sim launches keeps to its own thread."""

    monitor_interval = 0


def make_requests(args) -> list[Request]:
    """A shared system prompt, then a user part of random length; request 1 is sampled (temperature 0.8) and
    forked once its prompt is cached into a second, parallel sample; the others are greedy."""
    rng = np.random.default_rng(args.seed + 1)
    system = rng.integers(0, args.vocab, args.system_len).tolist()
    out = []
    for i in range(args.requests):
        user = rng.integers(0, args.vocab, int(rng.integers(min(4, args.prompt_len), args.prompt_len + 1))).tolist()
        new = int(rng.integers((args.max_new_tokens + 1) // 2, args.max_new_tokens + 1))
        sampled = i == 1
        out.append(Request(i, system + user, new, temperature=0.8 if sampled else 0.0, seed=args.seed + 100 * i,
                           fork_as=args.requests if sampled else None))
    return out


def verify(requests, weights, config, dtype: str) -> bool:
    """Teacher-forced check of every sampled position (see the module docstring); prints one line. A greedy
    token must be the float64 argmax wherever the float64 top-2 gap exceeds 1e-3 and twice the largest logit
    error seen (16-bit runs: a smaller gap can flip by rounding alone)."""
    pairs = []  # (request, float64 logits at every position)
    err = 0.0
    for r in requests:
        ref = decoder_logits(weights, config, r.tokens[:-1])
        pairs.append((r, ref))
        for pos, row, _ in r.logits:
            err = max(err, float(np.abs(row.astype(np.float64) - ref[pos]).max()))
    gap_min = max(1e-3, 2 * err)
    checked = agree = close = 0
    for r, ref in pairs:
        for pos, _, token in r.logits if not r.temperature else ():
            top2 = np.sort(ref[pos])[-2:]  # a vocabulary of one token has no runner-up: nothing is close
            if top2.size == 2 and top2[1] - top2[0] <= gap_min:
                close += 1
                continue
            checked += 1
            agree += int(token == int(np.argmax(ref[pos])))
    rows = sum(len(r.logits) for r in requests)
    ok = err <= LOGIT_TOL[dtype] and agree == checked
    print(f"verify: {rows} sampled positions of {len(requests)} requests against a float64 numpy forward: max "
          f"|logit - float64| = {err:.2e} (tolerance {LOGIT_TOL[dtype]:.0e}); greedy token = float64 argmax at "
          f"{agree} of {checked} positions with a top-2 gap > {gap_min:.0e} ({close} closer skipped; sampled "
          f"requests: logits only): {'PASS' if ok else 'FAIL'}")
    return ok


def table(engine: Engine, seconds: float, first: float, backend: str) -> str:
    s, pool = engine.stats, engine.pool
    rows = [("requests", f"{len(engine.finished)} ({s['forks']} forked for parallel sampling)"),
            ("tokens generated", str(s["generated"])),
            ("tokens/s", f"{s['generated'] / seconds:.1f} over {seconds:.1f} s on the {backend} (first step "
                         f"{first:.1f} s)"),
            ("steps", f"{s['steps']} ({s['mixed_steps']} mixing prefill chunks with decode tokens)"),
            ("tokens computed", f"{s['computed_tokens']} (largest step {s['max_batch_tokens']})"),
            ("prefix-cache hit rate", f"{100 * s['hit_tokens'] / max(s['prompt_tokens'], 1):.1f}% "
                                      f"({s['hit_tokens']} of {s['prompt_tokens']} prompt tokens)"),
            ("pool waste", f"{100 * s['waste_sum'] / max(s['steps'], 1):.1f}% (mean over steps)"),
            ("peak blocks used", f"{s['peak_blocks']} of {pool.num_blocks} (block size {pool.block_size})"),
            ("preemptions", f"{s['preemptions']} (recomputed)"),
            ("copy-on-write copies", str(s["copies"]))]
    spec = engine.speculator
    if spec is not None:
        rows.append(("speculative decoding", f"{spec.drafted} drafted / {spec.accepted} accepted tokens "
                                             f"({100 * spec.accepted / max(spec.drafted, 1):.1f}%), "
                                             f"{spec.accepted / max(spec.verified, 1):.2f} accepted per verify step "
                                             f"({spec.verified} tree verifications of up to {spec.k} tokens; draft: "
                                             f"layer 0 of {engine.model.config.n_layers})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}} | {v}" for k, v in rows)


def build(args):
    """(engine with every request added, float32 weights, config) for parsed ``args``."""
    xp = _xp(args.backend)
    config = DecoderConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                           n_kv_heads=args.kv_heads, head_dim=args.head_dim, hidden_dim=args.hidden,
                           family=args.family)
    weights = random_weights(config, args.seed)
    dtype = DTYPES[args.dtype]
    model = TinyDecoder(config, weights, xp, dtype)
    kv = KVCache(config.n_layers, args.num_blocks, args.block_size, config.n_kv_heads, config.head_dim, dtype, xp=xp)
    draft = model.first_layers(1) if args.speculative else None
    engine = Engine(model, kv, token_budget=args.token_budget, max_num_seqs=args.max_num_seqs,
                    speculative=args.speculative, draft=draft)
    for r in make_requests(args):
        engine.add(r)
    return engine, weights, config


def serve(args) -> int:
    """Build, serve every request with a progress bar, print the closing table (and the --verify line)."""
    engine, weights, config = build(args)
    backend = "sim" if on_sim(engine.model.xp) else "GPU"
    total = sum(r.max_new_tokens * (1 + (r.fork_as is not None)) for r in engine.waiting)
    start, first = time.perf_counter(), None
    with _Bar(total=total, unit="tok", desc=f"serving on the {backend}", file=sys.stderr, mininterval=0.5) as bar:
        while not engine.done:
            bar.update(engine.step())
            first = time.perf_counter() - start if first is None else first
            bar.set_postfix(running=len(engine.running), waiting=len(engine.waiting), refresh=False)
    print(table(engine, time.perf_counter() - start, first or 0.0, backend))
    if args.verify:
        return 0 if verify(engine.finished, weights, config, args.dtype) else 1
    return 0


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    check_args(p, args)
    try:
        return serve(args)
    except GpuUnavailableError as e:
        return _fail(p, f"--backend cuda: {e}")
    except (MemoryError, OSError) as e:  # MemoryError: numpy's and CuPy's; ENOMEM: the sim's guarded memory
        if isinstance(e, OSError) and e.errno != errno.ENOMEM:
            raise
        return _fail(p, f"out of memory for these sizes ({e}): lower --num-blocks, --block-size, --vocab, --dim, "
                        "--hidden or --token-budget")


def _fail(p: argparse.ArgumentParser, message: str) -> int:
    """One line on stderr, as argparse's errors read; exit status 1."""
    print(f"{p.prog}: error: {' '.join(message.split())}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
