"""One report of every kernel benchmark: the rows as JSON and the plots as PNG, in one directory.

    python profiling/report.py --out report/ [--quick] [--budget 480]
    python profiling/report.py --out report/ --replot     # redraw from report/bench_*.json

Runs each profiling/bench_<family>.py in a subprocess with ``--json DIR/<stem>.json`` (paged
attention also with ``--sweep``, or its ``--quick`` configs under ``--quick``): measured with CUDA
events on a GPU, modeled with ``--model`` without one (the fixed H200 model of cupaged/sim/model.py
applied to the sim's traffic counts: a proxy, never a benchmark). Then writes rows.json, the plots,
the resource table (resources.json, .md, .png; drawn by _report_plots.py) and index.md, which says
how to read each file. profiling/README.md has the details.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _bench  # noqa: E402
import _report_plots  # noqa: E402

# Cheap benches first: each gets an equal share of the budget left, so the time the small ones do
# not use rolls over to the paged-attention sweep, the longest.
# Every kernel family's bench; bench_layers has rows only on a GPU (its projections are cuBLAS GEMMs,
# which the model does not cover). HOST_BENCHES time host code and are not part of the report.
BENCHES = ("bench_merge_attn_states", "bench_cache_ops", "bench_cache_gather", "bench_rope", "bench_layers",
           "bench_mla", "bench_paged_attention")
HOST_BENCHES = ("bench_pool", "bench_host_overhead", "bench_sim")
BUDGET_S = 480.0
PROXY = ("Model rows are a proxy, not a benchmark: they are the fixed H200 model of cupaged/sim/model.py "
         "applied to the traffic the sim counted; only a GPU measurement says how fast a kernel is.")
READING = {  # one line per plot for index.md; profiling/README.md says more
    "decode_bandwidth.png": "decode: % of the H200 HBM peak (4.8 TB/s) vs keys per sequence, a panel per batch, "
                            "a line per GQA ratio and KV dtype; the goal is >= 80% once a call reads >= 256 MB.",
    "prefill_tflops.png": "prefill: TFLOP/s vs length, a line per config; the H200's mma.sync peak is ~660 TFLOP/s.",
    "kernel_traffic.png": "per launch (colour: kernel, label: row): unique / minimum bytes (1 = each byte once), "
                          "sector efficiency (1 = coalesced), bank conflicts (extra wavefronts, 0 is ideal).",
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


def run_benches(out: str, quick: bool, budget_s: float, model: bool) -> list[str]:
    """Run every bench with its share of ``budget_s``; one progress line each on stderr. Returns
    notes on the benches that failed or ran out of time (their output is in DIR/<stem>.log)."""
    notes, deadline = [], time.monotonic() + budget_s
    for i, stem in enumerate(BENCHES):
        share = max(1.0, (deadline - time.monotonic()) / (len(BENCHES) - i))
        json_path = os.path.join(out, stem + ".json")
        if os.path.exists(json_path):  # a stale file must not pass for this run's rows
            os.remove(json_path)
        start = time.monotonic()
        try:
            proc = subprocess.run(bench_command(stem, out, model, quick), capture_output=True, text=True,
                                  timeout=share)
            status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
            log = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:  # its output is bytes whatever text= says
            status = f"TIMED OUT (limit {share:.0f} s)"
            log = "".join((b or b"").decode(errors="replace") for b in (err.stdout, err.stderr))
        took = time.monotonic() - start
        with open(os.path.join(out, stem + ".log"), "w", encoding="utf-8") as f:
            f.write(log)
        print(f"[{i + 1}/{len(BENCHES)}] {stem} {status} in {took:.1f} s", file=sys.stderr, flush=True)
        if status != "done":
            notes.append(f"{stem} {status} after {took:.0f} s: see {stem}.log")
    return notes


def load_rows(path: str, bench: str) -> list[dict]:
    """A bench's rows: its JSON is a list of rows or {"rows": [...], "device": ..., ...}."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    rows, meta = (data, {}) if isinstance(data, list) else (data.get("rows", []), data)
    extra = {"device": meta["device"]} if meta.get("device") else {}
    return [{"bench": bench, **extra, **r} for r in rows]


# ---- the report


def write_report(rows, out, records=None, notes=()) -> list[str]:
    """Write rows.json, the plots, the resource table (when ``records``) and index.md into ``out``;
    returns the notes index.md lists (skipped plots, failed benches)."""
    notes = list(notes)
    with open(os.path.join(out, "rows.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    plots = [("decode_bandwidth.png", _report_plots.plot_decode_bandwidth, rows),
             ("prefill_tflops.png", _report_plots.plot_prefill_tflops, rows),
             ("kernel_traffic.png", _report_plots.plot_kernel_traffic, rows)]
    if records is None:
        notes.append("resource table skipped: no compile-gate results")
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
        written += [name] if why is None else []
        notes += [] if why is None else [f"{name} skipped: {why}"]
    sources = sorted({r.get("source") or "?" for r in rows})
    lines = ["# cupaged benchmark report", "",
             f"{len(rows)} rows ({', '.join(sources) or 'none'}), {datetime.date.today()}; "
             "how to read everything: profiling/README.md.", "", PROXY, "", "| file | how to read it |", "|---|---|"]
    lines += [f"| [{name}]({name}) | {READING[name]} |" for name in written]
    lines += ["| rows.json | every row of every bench; bench_*.json as each bench wrote them, bench_*.log its output |"]
    if records is not None:
        lines += ["| resources.md / .json | the resource table for every kernel |"]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    with open(os.path.join(out, "index.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return notes


def compile_gate():
    """(KernelResources of every kernel, None) or (None, why not); one progress line on stderr. A cold
    compile takes ~2 minutes on 2 cores, cached afterwards; the model benches need the same results."""
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
                        help=f"seconds for the compile gate and the benches (default {BUDGET_S:.0f}); each bench "
                             "gets an equal share of what is left and is stopped when it runs past it")
    parser.add_argument("--replot", action="store_true", help="run no bench: redraw from DIR/bench_*.json")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    deadline = time.monotonic() + args.budget
    records, why = compile_gate()  # first: it warms the cache the model benches read
    notes = [why] if why else []
    if not args.replot:
        notes += run_benches(args.out, args.quick, deadline - time.monotonic(), model=_bench.gpu() is None)
    rows = []
    for stem in BENCHES:
        path = os.path.join(args.out, stem + ".json")
        if os.path.exists(path):
            rows += load_rows(path, stem)
        else:
            notes.append(f"{stem}: no {stem}.json, no rows")
    for note in write_report(rows, args.out, records, notes):
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {os.path.join(args.out, 'index.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
