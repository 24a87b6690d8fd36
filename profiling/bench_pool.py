"""Host-side cost of batch planning (cupaged/pool/): what the scheduler pays per step before any
kernel runs. CPU only -- nothing here touches a GPU.

  decode: 256 sequences of ~2k tokens (1,900..2,100, so block boundaries fall on different
          steps), one new token each; ``plan_decode`` (vectorized, target <= 100 µs per step on
          one core), the same with token ids and prefix caching (it hashes the ~16 blocks a step
          completes, in Python), and the general per-sequence ``plan``.
  prefill: 8 new sequences x 2,048 tokens, with token ids and prefix caching (hashing every block)
          and without.
Then the PagedAttention waste figure: the fraction of allocated slots holding no token.

    python profiling/bench_pool.py
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one CPU core, as the target says

import argparse  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

from cupaged import BlockPool  # noqa: E402

BLOCK_SIZE = 16
NUM_SEQS, CONTEXT = 256, 2048
STEPS = 200
TARGET_US = 100.0


def decode_pool(rng, prefix_caching=False):
    lens = rng.integers(CONTEXT - 148, CONTEXT + 52, NUM_SEQS)
    pool = BlockPool(int((lens.sum() + NUM_SEQS * (STEPS + 400)) // BLOCK_SIZE) + NUM_SEQS, BLOCK_SIZE,
                     enable_prefix_caching=prefix_caching)
    for i, n in enumerate(lens.tolist()):
        if prefix_caching:  # token ids, so that every block a step completes gets hashed
            pool.append(i, token_ids=rng.integers(0, 32000, n))
        else:
            pool.append(i, n)
    return pool


def per_step_us(fn, steps=STEPS, warmup=20):
    """Microseconds per call, after ``warmup`` untimed calls (the first builds the decode mirror
    and touches fresh memory)."""
    return _bench.time_cpu(fn, reps=steps, warmup=warmup) * 1e3


def row(label, version, us, target=None):
    med = float(np.median(us))
    p20, p80 = np.percentile(us, [20, 80])
    verdict = "-" if target is None else ("ok" if med <= target else "MISSED")
    return (label, version, f"{med:.1f}", f"{p20:.1f}–{p80:.1f}", f"{target:.0f}" if target else "-", verdict)


def main(argv=None):
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    seq_ids = np.arange(NUM_SEQS)

    pool = decode_pool(rng)
    rows.append(row(f"decode {NUM_SEQS} seqs x ~{CONTEXT} tok, plan_decode", "v1 vectorized",
                    per_step_us(lambda: pool.plan_decode(seq_ids)), TARGET_US))
    waste = pool.usage()
    pool.check()
    tokens = rng.integers(0, 32000, NUM_SEQS)
    pool = decode_pool(rng, prefix_caching=True)
    rows.append(row(f"decode {NUM_SEQS} seqs, plan_decode + token ids, prefix caching", "v1 vectorized",
                    per_step_us(lambda: pool.plan_decode(seq_ids, tokens))))
    pool = decode_pool(rng)
    batch = [(i, 1) for i in range(NUM_SEQS)]
    rows.append(row(f"decode {NUM_SEQS} seqs, general plan", "v1 per-sequence",
                    per_step_us(lambda: pool.plan(batch), steps=50, warmup=3)))

    for caching in (False, True):
        pool = BlockPool(8 * CONTEXT // BLOCK_SIZE, BLOCK_SIZE, enable_prefix_caching=caching)
        prompts = [rng.integers(0, 32000, CONTEXT) for _ in range(8)]

        def prefill():
            pool.plan([(i, p if caching else CONTEXT) for i, p in enumerate(prompts)])
            for i in range(8):
                pool.free(i)

        label = "prefill 8 x %d tok, %s" % (CONTEXT, "token ids, prefix caching" if caching else "counts")
        rows.append(row(label, "v1", per_step_us(prefill, steps=30, warmup=3)))

    head = ("config", "version", "median µs", "p20–p80 µs", "target µs", "")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    print(f"BlockPool planning, block_size={BLOCK_SIZE}, CPU timings (one core)")
    for r in [head] + rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"after the decode run: {waste.num_seqs} sequences, {waste.blocks_in_use} blocks in use, "
          f"{waste.tokens_stored} tokens, waste {100 * waste.waste:.2f}% of allocated slots "
          f"(PagedAttention reports under 4%)")


if __name__ == "__main__":
    main()
