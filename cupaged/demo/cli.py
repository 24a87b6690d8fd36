"""``python -m cupaged demo [--verify] [sizes]``: serve requests of random prompt lengths on the tiny decoder with
continuous batching (cupaged/demo/engine.py), a progress bar, and a closing table. ``--verify`` checks every sampled
position teacher-forced against a float64 numpy forward of the same model on the same token history."""

from __future__ import annotations

import argparse
import sys
import time

import ml_dtypes
import numpy as np
from tqdm import tqdm

from cupaged.demo.engine import Engine, Request
from cupaged.demo.model import DecoderConfig, TinyDecoder, random_weights
from cupaged.kv_cache import KVCache
from cupaged.reference.layers import decoder_logits

__all__ = ["main"]

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LOGIT_TOL = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 2.5e-1}  # max |logit - float64| that passes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cupaged demo", description=__doc__)
    a = p.add_argument
    a("--verify", action="store_true", help="check every sampled position against a float64 numpy forward")
    a("--backend", choices=("sim", "cuda"), help="default: cuda when a GPU is present, else sim")
    a("--seed", type=int, default=0)
    a("--dtype", choices=tuple(DTYPES), default="float32", help="weights, activations and KV cache (default float32)")
    g = p.add_argument_group("sizes (defaults: ~11 s on the sim with a warm compile cache)")
    for flag, default in (("layers", 2), ("dim", 256), ("heads", 8), ("kv-heads", 2), ("head-dim", 64),
                          ("hidden", 512), ("vocab", 512), ("requests", 16), ("max-new-tokens", 32), ("system-len", 40),
                          ("prompt-len", 96), ("block-size", 16), ("num-blocks", 40), ("token-budget", 64),
                          ("max-num-seqs", 8)):
        g.add_argument(f"--{flag}", type=_count(0 if flag == "system-len" else 1), default=default, metavar="N")
    return p


def _count(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "count"  # argparse names the type in its messages
    return parse


def _xp(backend):
    from cupaged._backend import gpu_module, require_gpu

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
        user = rng.integers(0, args.vocab, int(rng.integers(4, args.prompt_len + 1))).tolist()
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
            top2 = np.sort(ref[pos])[-2:]
            if top2[1] - top2[0] <= gap_min:
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
            ("tokens/s", f"{s['generated'] / seconds:.1f} over {seconds:.1f} s on the {backend} (the first step, which "
                         f"compiles kernels not cached yet, {first:.1f} s)"),
            ("steps", f"{s['steps']} ({s['mixed_steps']} mixing prefill chunks with decode tokens)"),
            ("tokens computed", f"{s['computed_tokens']} (largest step {s['max_batch_tokens']})"),
            ("prefix-cache hit rate", f"{100 * s['hit_tokens'] / max(s['prompt_tokens'], 1):.1f}% "
                                      f"({s['hit_tokens']} of {s['prompt_tokens']} prompt tokens)"),
            ("pool waste", f"{100 * s['waste_sum'] / max(s['steps'], 1):.1f}% (mean over steps)"),
            ("peak blocks used", f"{s['peak_blocks']} of {pool.num_blocks} (block size {pool.block_size})"),
            ("preemptions", f"{s['preemptions']} (recomputed)"),
            ("copy-on-write copies", str(s["copies"]))]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}} | {v}" for k, v in rows)


def build(args):
    """(engine with every request added, float32 weights, config) for parsed ``args``."""
    xp = _xp(args.backend)
    config = DecoderConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                           n_kv_heads=args.kv_heads, head_dim=args.head_dim, hidden_dim=args.hidden)
    weights = random_weights(config, args.seed)
    dtype = DTYPES[args.dtype]
    model = TinyDecoder(config, weights, xp, dtype)
    kv = KVCache(config.n_layers, args.num_blocks, args.block_size, config.n_kv_heads, config.head_dim, dtype, xp=xp)
    engine = Engine(model, kv, token_budget=args.token_budget, max_num_seqs=args.max_num_seqs)
    for r in make_requests(args):
        engine.add(r)
    return engine, weights, config


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    engine, weights, config = build(args)
    backend = "sim" if engine.model.xp is np else "GPU"
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


if __name__ == "__main__":
    sys.exit(main())
