"""One report of every kernel benchmark: the rows as JSON and the plots as PNG, in one directory.

    python profiling/report.py --out report/ [--quick] [--budget 2522]
    python profiling/report.py --out report/ --replot     # redraw from report/bench_*.json

Runs each profiling/bench_<family>.py in a subprocess with ``--json DIR/<stem>.json`` (paged
attention also with ``--sweep``, or its ``--quick`` configs under ``--quick``): measured with CUDA
events on a GPU, modeled with ``--model`` without one (the fixed H200 model of cupaged/sim/model.py
applied to the sim's counts of traffic and issued instructions: a proxy, never a benchmark). Then
writes rows.json, the plots, the model's terms per launch (model_terms.md), the resource table
(resources.json, .md, .png; drawn by _report_plots.py) and index.md, which says how to read each
file. profiling/README.md has the details.

Never a silent success: a bench that fails, runs past its share of the budget or writes no rows is
named on stderr (and in index.md) with the plots it is missing from, each plot that could not be
drawn is named with why, and the exit status is 1 when either happened (0 only for a whole report).

The budget. A cold run (empty compile caches: the compile gate's NVRTC results and the sim's g++
modules; model v1) on 2 cores with a test run beside it (load 4) took 1,261 s: compile gate 288 s,
then merge_attn_states 14, cache_ops 32, cache_gather 1, rope 36, layers 2, mla 366 (it is the first
to need kernels_cu/paged_attention.cu on the sim: two g++ builds, 90 s and 233 s of it) and
paged_attention --sweep 522. Those figures are the benches' weights; the default budget is twice
their sum (~42 minutes; a warm run takes a fraction of it), room for model v2's instruction
counting (cold: an NVRTC -lineinfo build per launched kernel, ~1.3 s for a paged-attention one;
merge_attn_states took 19 s cold under v2) and a busier machine.
Each bench gets its weight's share of what is left, so what a fast one leaves rolls over to the rest.
The compile gate runs in-process and unbounded: when it eats the budget every bench still starts
with 1 s and is named when it runs out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from typing import NamedTuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _bench  # noqa: E402
import _report_plots  # noqa: E402


class Bench(NamedTuple):
    cold_s: float                # a cold --model run on 2 cores (the docstring): its weight in the budget
    plots: tuple[str, ...] = ()  # the plots its rows feed
    rows: bool = True            # False: it writes no rows (a timed table only), which is no failure


MODEL_PLOTS = ("kernel_traffic.png", "model_terms.png", "resources.png")  # drawn from model rows' launches
# Every kernel family's bench, cheap ones first and the longest last. HOST_BENCHES time host code and
# are not part of the report.
BENCHES = {
    "bench_merge_attn_states": Bench(14, MODEL_PLOTS),
    "bench_cache_ops": Bench(32, MODEL_PLOTS),
    "bench_cache_gather": Bench(1, rows=False),  # its model rows are bench_cache_ops'
    "bench_rope": Bench(36, MODEL_PLOTS),
    "bench_layers": Bench(2, rows=False),  # cuBLAS projections, which the model does not cover
    "bench_mla": Bench(366, MODEL_PLOTS),
    "bench_paged_attention": Bench(522, ("decode_bandwidth.png", "prefill_tflops.png") + MODEL_PLOTS),
}
HOST_BENCHES = ("bench_pool", "bench_host_overhead", "bench_sim")
GATE_COLD_S = 288.0
BUDGET_S = 2 * (GATE_COLD_S + sum(b.cold_s for b in BENCHES.values()))
PROXY = ("Model rows are a proxy, not a benchmark: they are the fixed H200 model of cupaged/sim/model.py "
         "applied to what the sim counted (traffic, issued instructions); only a GPU measurement says how fast "
         "a kernel is.")
READING = {  # one line per plot for index.md; profiling/README.md says more
    "decode_bandwidth.png": "decode: % of the H200 HBM peak (4.8 TB/s) vs keys per sequence, a panel per batch, "
                            "a line per GQA ratio and KV dtype; the goal is >= 80% once a call reads >= 256 MB.",
    "prefill_tflops.png": "prefill: TFLOP/s vs length, a line per config; the H200's mma.sync peak is ~660 TFLOP/s.",
    "kernel_traffic.png": "per launch (colour: kernel, label: row): unique / minimum bytes (1 = each byte once), "
                          "sector efficiency (1 = coalesced), bank conflicts (extra wavefronts, 0 is ideal).",
    "model_terms.png": "per launch: each term of the H200 model summed over its waves (hbm, latency, shared, mma, "
                       "issue, mufu; µs, log axis), the launch's modeled time marked; the largest term bounds it. "
                       "model_terms.md has the numbers.",
    "resources.png": "registers, spills, static shared memory, CTAs/SM (sm_80 / sm_90) of the kernels the model "
                     "rows launched; every kernel in resources.md / .json ('-': never launched).",
}


# ---- running the benches


def bench_command(stem: str, out: str, model: bool, quick: bool) -> list[str]:
    cmd = [sys.executable, os.path.join(HERE, stem + ".py"), "--json", os.path.join(out, stem + ".json")]
    if model:
        cmd.append("--model")
    if stem == "bench_paged_attention":
        cmd.append("--quick" if quick else "--sweep")
    return cmd


def run_bench(cmd: list[str], log_path: str, limit_s: float) -> str | None:
    """Run ``cmd`` with its output in ``log_path``; None when it exits 0 within ``limit_s``, else what
    went wrong. It runs in a session of its own, killed whole when stopped: a compiler it started
    would otherwise go on taking a core from the benches after it."""
    with open(log_path, "w", encoding="utf-8") as log:
        proc, code = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), None
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if code is None:  # past its share, or this process interrupted
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # the whole group is gone already
                    pass
                proc.wait()
    if code is None:
        return f"TIMED OUT (its share: {limit_s:.1f} s)"
    return None if code == 0 else f"FAILED (exit {code})"


def share_s(left_s: float, stems_left: list[str]) -> float:
    """The first of ``stems_left``'s share of the ``left_s`` seconds left: its weight over theirs, 1 s
    at least (a bench whose share the compile gate ate still starts, and its timeout is named)."""
    return max(1.0, left_s * BENCHES[stems_left[0]].cold_s / sum(BENCHES[s].cold_s for s in stems_left))


def run_benches(out: str, quick: bool, budget_s: float, model: bool) -> dict[str, str]:
    """Run every bench with its weight's share of what is left of ``budget_s``; one progress line
    each on stderr. Returns {stem: what went wrong} for those that failed or ran out of their share
    (their output is in DIR/<stem>.log, as every bench's is)."""
    failed, deadline = {}, time.monotonic() + budget_s
    stems = list(BENCHES)
    for i, stem in enumerate(stems):
        share = share_s(deadline - time.monotonic(), stems[i:])
        json_path = os.path.join(out, stem + ".json")
        if os.path.exists(json_path):  # a stale file must not pass for this run's rows
            os.remove(json_path)
        start = time.monotonic()
        why = run_bench(bench_command(stem, out, model, quick), os.path.join(out, stem + ".log"), share)
        took = time.monotonic() - start
        print(f"[{i + 1}/{len(stems)}] {stem} {why or 'done'} in {took:.1f} s", file=sys.stderr, flush=True)
        if why:
            failed[stem] = f"{why} after {took:.0f} s: see {stem}.log"
    return failed


def load_rows(path: str, bench: str) -> list[dict]:
    """A bench's rows: its JSON is a list of rows or {"rows": [...], "device": ..., ...}."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    rows, meta = (data, {}) if isinstance(data, list) else (data.get("rows", []), data)
    extra = {"device": meta["device"]} if meta.get("device") else {}
    return [{"bench": bench, **extra, **r} for r in rows]


def collect_rows(out: str, failed: dict[str, str]) -> list[dict]:
    """Every bench's rows from DIR/<stem>.json; a bench that should have rows and has none (no file,
    an unreadable one, an empty list) joins ``failed`` unless it is there already."""
    rows = []
    for stem, bench in BENCHES.items():
        path = os.path.join(out, stem + ".json")
        try:
            got = load_rows(path, stem) if os.path.exists(path) else []
        except (OSError, ValueError, AttributeError, TypeError) as err:  # not JSON, or not rows
            got = []
            failed.setdefault(stem, f"wrote an unreadable {stem}.json ({type(err).__name__}: {err})")
        rows += got
        if bench.rows and not got:
            failed.setdefault(stem, f"wrote no rows{'' if os.path.exists(path) else f' (no {stem}.json)'}: "
                                    f"see {stem}.log")
    return rows


def failure_note(stem: str, why: str) -> str:
    plots = BENCHES[stem].plots
    return f"{stem} {why}; " + (f"missing from {', '.join(plots)}" if plots else "it feeds no plot")


# ---- the report


def write_report(rows, out, records=None, notes=()) -> dict[str, str]:
    """Write rows.json, the plots, model_terms.md, the resource table (when ``records``) and index.md
    into ``out``; returns {plot: why} for each plot that could not be drawn (index.md lists them
    after ``notes``, what else went wrong)."""
    with open(os.path.join(out, "rows.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(out, "model_terms.md"), "w", encoding="utf-8") as f:
        f.write(_report_plots.terms_markdown(rows))
    plots = [("decode_bandwidth.png", _report_plots.plot_decode_bandwidth, rows),
             ("prefill_tflops.png", _report_plots.plot_prefill_tflops, rows),
             ("kernel_traffic.png", _report_plots.plot_kernel_traffic, rows),
             ("model_terms.png", _report_plots.plot_model_terms, rows)]
    missing = {}
    if records is None:
        missing["resources.png"] = "no compile-gate results (resources.md / .json not written either)"
    else:
        table = _report_plots.resource_table(records, rows)
        with open(os.path.join(out, "resources.json"), "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1)
        with open(os.path.join(out, "resources.md"), "w", encoding="utf-8") as f:
            f.write(_report_plots.resources_markdown(table))
        plots.append(("resources.png", _report_plots.plot_resources, table))
    written = []
    for name, plot, data in plots:
        why = plot(data, os.path.join(out, name))
        if why is None:
            written.append(name)
        else:
            missing[name] = why
    sources = sorted({r.get("source") or "?" for r in rows})
    lines = ["# cupaged benchmark report", "",
             f"{len(rows)} rows ({', '.join(sources) or 'none'}), {datetime.date.today()}; "
             "how to read everything: profiling/README.md.", "", PROXY, "", "| file | how to read it |", "|---|---|"]
    lines += [f"| [{name}]({name}) | {READING[name]} |" for name in written]
    lines += ["| rows.json | every row of every bench (a model row's launches with their terms_us); bench_*.json "
              "as each bench wrote them, bench_*.log its output |",
              "| [model_terms.md](model_terms.md) | the model's terms (µs) per launch of the model rows |"]
    if records is not None:
        lines += ["| resources.md / .json | the resource table for every kernel |"]
    problems = list(notes) + [f"{name} NOT DRAWN: {why}" for name, why in missing.items()]
    if problems:
        lines += ["", "## Incomplete", ""] + [f"- {n}" for n in problems]
    with open(os.path.join(out, "index.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return missing


def compile_gate():
    """(KernelResources of every kernel, None) or (None, why not); one progress line on stderr. A cold
    compile took ~5 minutes on 2 busy cores, cached afterwards; the model benches need the same results."""
    start = time.monotonic()
    try:
        from cupaged.resources import kernel_resources

        records, why = kernel_resources(), None
    except Exception as err:  # no NVRTC, or a compile error: the report goes on without the table
        records, why = None, f"compile gate failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
    print(f"[compile gate] {'done' if why is None else 'FAILED'} in {time.monotonic() - start:.1f} s",
          file=sys.stderr, flush=True)
    return records, why


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the JSON, PNG and Markdown files")
    parser.add_argument("--quick", action="store_true", help="paged attention's --quick configs instead of --sweep")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds for the compile gate and the benches (default {BUDGET_S:.0f}: twice a cold "
                             "run on 2 busy cores, see above); each bench gets its weight's share of what is left "
                             "and is stopped when it runs past it")
    parser.add_argument("--replot", action="store_true", help="run no bench: redraw from DIR/bench_*.json")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    deadline = time.monotonic() + args.budget
    records, why = compile_gate()  # first: it warms the cache the model benches read
    failed = {} if args.replot else run_benches(args.out, args.quick, deadline - time.monotonic(),
                                                model=_bench.gpu() is None)
    rows = collect_rows(args.out, failed)
    notes = ([why] if why else []) + [failure_note(stem, w) for stem, w in failed.items()]
    missing = write_report(rows, args.out, records, notes)
    for note in notes:
        print(f"error: {note}", file=sys.stderr)
    for name, reason in missing.items():
        print(f"error: {name} NOT DRAWN: {reason}", file=sys.stderr)
    print(f"wrote {os.path.join(args.out, 'index.md')}", file=sys.stderr)
    if failed or missing:
        print(f"report INCOMPLETE: {len(failed)} bench(es) failed, {len(missing)} plot(s) not drawn",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
