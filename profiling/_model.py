"""Model rows of the benches (``--model``): a production shape projected through the sim's profiler
and the H200 model v2 (cupaged/sim/model.py), a proxy and never a benchmark.

Projection: the shape's real plan (split size and grid, forced explicitly) is run on a subset of
its sequences, and of those only a sample of CTAs (``block_stride``) is profiled; per-CTA figures
are scaled to the production grid (``batch_factor`` times the profiled grid's CTAs). The sample
represents the grid (the benches' ``block_stride``): one KV head (every head does the same work),
every sequence of the subset (one length), every split, and a causal prefill's row tiles by a
stride symmetric about the middle (exact when a tile's work grows linearly with its index;
tests/test_projection.py holds it to the fully profiled model within 3%). Invalid for ragged batches;
it over-counts distinct bytes that CTAs not profiled would share in L2.
"""

from __future__ import annotations

import json
import os
import sys

from cupaged._cost import Cost
from cupaged.sim import profile
from cupaged.sim.profiler import _launch_model
from cupaged.sim.model import H200

ROW_KEYS = ("op", "batch", "context", "q_len", "num_heads", "num_kv_heads", "head_size", "kv_dtype", "causal",
            "source", "time_us", "gbps", "pct_of_peak_bw", "tflops")


def row(shape: dict, source: str, time_us: float, cost, **extra) -> dict:
    """A bench row: the shape's keys, the time, and bandwidth / FLOP rates against the op's declared
    minimum bytes and FLOPs (``cost``: cupaged._cost.Cost of the production shape). Bandwidth is in %
    of the 4.8 TB/s spec (``pct_of_peak_bw``) and of the 4.3 TB/s an H200 copy reaches
    (``pct_of_achievable_bw``; ``pct_of_copy_bw`` is model v1's name for it)."""
    gbps = cost.min_bytes / time_us / 1e3
    achievable = 100 * gbps * 1e9 / H200.achievable_bytes_per_s
    out = dict(shape, source=source, time_us=time_us, gbps=gbps,
               pct_of_peak_bw=100 * gbps * 1e9 / H200.hbm_bytes_per_s, tflops=cost.flops / time_us / 1e6,
               pct_of_achievable_bw=achievable, pct_of_copy_bw=achievable, min_bytes=cost.min_bytes, flops=cost.flops)
    out.update(extra)
    missing = [k for k in ROW_KEYS if k not in out]
    assert not missing, missing
    return out


def project(shape: dict, run, cost, batch_factor: int, block_stride=(1, 1, 1), fallback_bytes=0, warm=False) -> dict:
    """Profile ``run()`` (the subset) and model every launch over ``batch_factor`` times its CTAs.
    ``cost`` None: the launches' declared minimum bytes and FLOPs, scaled (``fallback_bytes`` when
    no launch was declared). ``warm``: run once unprofiled first, every CTA, so a later launch (a
    split merge) reads what the sampled launch's skipped CTAs would have written."""
    if warm:
        run()
    with profile(block_stride=block_stride) as prof:
        run()
    print(f"  modeling {label(shape)}", file=sys.stderr, flush=True)
    launches, total = [], 0.0
    for launch in prof.launches:
        m = _launch_model.model_of(launch, ctas=launch.ctas * batch_factor)
        total += m.time_us
        launches.append(dict(kernel=launch.kernel, grid=list(launch.grid), block=list(launch.block),
                             shared_mem=launch.shared_mem, ctas=m.ctas, ctas_profiled=launch.ctas_profiled,
                             ctas_per_sm=m.ctas_per_sm, registers=m.registers, unique_bytes=m.unique_bytes,
                             bytes=m.bytes, min_bytes=m.min_bytes, traffic_ratio=m.traffic_ratio,
                             sector_efficiency=m.sector_efficiency, wavefronts=m.wavefronts,
                             bank_conflicts=m.bank_conflicts, modeled_us=m.time_us, bound=m.bound, flops=m.flops,
                             terms_us=m.terms_us, warp_instructions=m.warp_instructions,
                             instruction_mix=m.instruction_mix))
    if cost is None:
        declared = [x for x in launches if x["min_bytes"] is not None]
        cost = Cost(sum(x["min_bytes"] for x in declared) or fallback_bytes,
                    sum(m for x in declared if (m := x.get("flops")) is not None))
    return row(shape, "model", total, cost, launches=launches)


def bench_parser(doc: str):
    """A bench's command line: ``--json FILE`` and ``--model`` (callers may add their own)."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="FILE", help="write the rows to FILE ({'rows': [...]})")
    parser.add_argument("--model", action="store_true", help="H200 model rows of the production shapes (sim)")
    return parser


def finish_model(bench: str, rows, path) -> None:
    """The end of a ``--model`` run: rows cached for a later GPU run, printed, written to ``path``."""
    store_model_rows(bench, rows)
    print_model_table(rows)
    write_json(path, rows, device="sim", model="H200")


def finish_measured(bench: str, rows, path, **meta) -> None:
    """The end of a GPU run: the cached model rows printed beside, both written to ``path``."""
    cached = cached_model_rows(bench)
    if cached:
        print_model_table(cached)
    write_json(path, rows + cached, **meta)


def label(r: dict) -> str:
    kv = f" {r['kv_dtype']}" if r.get("kv_dtype") else ""
    return (f"{r['op']} b={r['batch']} ctx={r['context']} q={r['q_len']} h={r['num_heads']}/{r['num_kv_heads']} "
            f"d={r['head_size']}{kv}{' causal' if r['causal'] else ''}")


def kernels(r: dict) -> str:
    """The row's kernels, in launch order, by their short names (paged_decode+paged_attention_reduce): which
    version of an op a row measured."""
    names = [x["kernel"].split("<")[0].removeprefix("cupaged::").removesuffix("_kernel") for x in r.get("launches", [])]
    return "+".join(dict.fromkeys(names)) or "-"


def _issue_us(r: dict) -> str:
    """The row's issue term: its launches' terms_us["issue"] summed ("-": no launch was counted, or a
    row cached by model v1)."""
    counted = [x for x in r.get("launches", []) if x.get("warp_instructions") is not None]
    return f"{sum(x['terms_us']['issue'] for x in counted):.1f}" if counted else "-"


def print_model_table(rows, title="MODEL: H200 model v2 applied to the sim's counts (a proxy, not a measurement)"):
    head = ("config", "kernels", "modeled µs", "issue µs", "GB/s", "% of peak", "% of achievable", "% of copy",
            "TFLOP/s", "bound")
    lines = [(label(r), kernels(r), f"{r['time_us']:.1f}", _issue_us(r), f"{r['gbps']:.0f}",
              f"{r['pct_of_peak_bw']:.1f}%", f"{r.get('pct_of_achievable_bw', r['pct_of_copy_bw']):.1f}%",
              f"{r['pct_of_copy_bw']:.1f}%", f"{r['tflops']:.2f}",
              "+".join(sorted({x['bound'] for x in r.get('launches', [])})) or "-") for r in rows]
    widths = [max(len(x[i]) for x in lines + [head]) for i in range(len(head))]
    print(title)
    for x in [head] + lines:
        print(" | ".join(c.ljust(w) for c, w in zip(x, widths)))


def write_json(path: str | None, rows, **meta) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


def cached_model_rows(bench: str) -> list:
    """Model rows a ``--model`` run left in the per-user cache (a GPU run prints them beside its
    measurements without re-profiling)."""
    from cupaged.sim._cache import cache_dir, usable

    path = os.path.join(cache_dir("model_rows"), f"{bench}.json")
    if not usable(path):
        return []
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def store_model_rows(bench: str, rows) -> None:
    from cupaged.sim._cache import cache_dir, write_private

    write_private(os.path.join(cache_dir("model_rows"), f"{bench}.json"), json.dumps(rows).encode())
