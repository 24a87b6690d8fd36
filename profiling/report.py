"""One report of every kernel benchmark: the rows as JSON and the plots as PNG, in one directory.

    python profiling/report.py --out report/ [--quick] [--budget 480]
    python profiling/report.py --out report/ --replot     # redraw from report/bench_*.json

Runs each profiling/bench_<family>.py in a subprocess with ``--json DIR/<stem>.json`` (paged
attention also with ``--sweep``, or its ``--quick`` configs under ``--quick``): measured with CUDA
events on a GPU, modeled with ``--model`` without one (the fixed H200 model of cupaged/sim/model.py
applied to the sim's traffic counts: a proxy, never a benchmark). Then writes rows.json, the plots,
the resource table (resources.json, .md, .png) and index.md, which says how to read each file.
profiling/README.md has the details.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

import matplotlib

matplotlib.use("Agg")  # files only: no display on the machines this runs on
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _bench  # noqa: E402

# Cheap benches first: each gets an equal share of the budget left, so the time the small ones do
# not use rolls over to the paged-attention sweep, the longest.
BENCHES = ("bench_merge", "bench_cache_ops", "bench_mla", "bench_paged_attention")
BUDGET_S = 480.0
ARCHS = ("sm_80", "sm_90")
MODEL_NOTE = "modeled (H200 model, not a measurement)"
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


# ---- plots: each returns None when written, else why it was skipped


def _field(row, key):
    if key == "gqa":
        return row["num_heads"] // row["num_kv_heads"] if row.get("num_kv_heads") else None
    return row.get(key)


def _series(rows, x, y, always, maybe) -> dict:
    """{label: [(x, y)] sorted}: one line per value of ``always`` and of those ``maybe`` fields that
    take several values at one x (a field that only follows x, like a chunk sized with its context,
    splits no line)."""
    xs = {r[x] for r in rows}
    split = [k for k in maybe if any(len({_field(r, k) for r in rows if r[x] == v}) > 1 for v in xs)]
    lines = {}
    for r in rows:
        label = " ".join(f"{k}={_field(r, k)}" for k in (*always, *split)) or "all"
        lines.setdefault(label, []).append((r[x], r[y]))
    return {label: sorted(pts) for label, pts in sorted(lines.items())}


def _title(what: str, rows) -> str:
    parts = []
    devices = sorted({r.get("device") or "a GPU" for r in rows if r.get("source") == "measured"})
    if devices:
        parts.append("measured on " + ", ".join(devices))
    if any(r.get("source") == "model" for r in rows):
        parts.append(MODEL_NOTE)
    return f"{what}\n{' and '.join(parts) or 'source unknown'}"


def _save(fig, path):
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _config(row) -> str:
    q = f" q={row.get('q_len')}" if row.get("q_len", 1) != 1 else ""
    kv = f" {row['kv_dtype']}" if row.get("kv_dtype") else ""
    return row.get("config") or (f"{row.get('op')} b={row.get('batch')} ctx={row.get('context')}{q} "
                                 f"h={row.get('num_heads')}/{row.get('num_kv_heads')} d={row.get('head_size')}{kv}")


def _line_plot(rows, path, y, ylabel, title, xlabel, maybe, panel=None):
    """``y`` vs context on a log2 axis, one line per GQA ratio and KV dtype (and per ``maybe`` field
    that varies at one context), one panel per value of ``panel``."""
    keys = sorted({r.get(panel) for r in rows}) if panel else [None]
    fig, axes = plt.subplots(1, len(keys), figsize=(2.5 + 4.5 * len(keys), 4.2), sharey=True, squeeze=False)
    for ax, key in zip(axes[0], keys):
        lines = _series([r for r in rows if not panel or r.get(panel) == key], "context", y, ("gqa", "kv_dtype"), maybe)
        for i, (label, pts) in enumerate(lines.items()):  # styles cycle so equal lines stay visible
            ax.plot(*zip(*pts), marker="os^vD"[i % 5], ls=("-", "--", ":", "-.")[i % 4], label=label)
        ax.set_xscale("log", base=2)
        ax.set(title=f"{panel} {key}" if panel else "", xlabel=xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(_title(title, rows), fontsize=10)
    _save(fig, path)


def plot_decode_bandwidth(rows, path):
    rows = [r for r in rows if r.get("op") == "decode" and r.get("pct_of_peak_bw") is not None]
    if not rows:
        return "no decode rows"
    _line_plot(rows, path, "pct_of_peak_bw", "% of 4.8 TB/s (H200 HBM peak)",
               "paged attention decode: % of peak bandwidth", "context (keys per sequence)",
               ("head_size", "q_len", "causal", "source"), panel="batch")


def plot_prefill_tflops(rows, path):
    rows = [r for r in rows if r.get("op") == "prefill" and r.get("tflops") is not None]
    if not rows:
        return "no prefill rows"
    _line_plot(rows, path, "tflops", "TFLOP/s", "paged attention prefill: TFLOP/s", "length (keys per sequence)",
               ("batch", "q_len", "num_heads", "head_size", "causal", "source"))


def kernel_launches(rows) -> list[tuple[str, str, dict]]:
    """(kernel, row config, launch) of every model row's launches, a kernel's launches together."""
    items = [(l["kernel"], _config(r), l) for r in rows if r.get("source") == "model" for l in r.get("launches") or ()]
    return sorted(items, key=lambda t: t[0])  # stable: rows keep their order within a kernel


def plot_kernel_traffic(rows, path):
    items = kernel_launches(rows)
    if not items:
        return "no model rows with launches"
    kernels = list(dict.fromkeys(k for k, _, _ in items))
    colours = {k: plt.cm.tab10(i % 10) for i, k in enumerate(kernels)}
    fig, axes = plt.subplots(1, 3, figsize=(15, 2 + 0.2 * len(items)), sharey=True, layout="constrained")
    ys = range(len(items))
    panels = (("traffic_ratio", "traffic ratio (unique / min bytes)", 1.0),
              ("sector_efficiency", "sector efficiency", 1.0), ("bank_conflicts", "bank conflicts", None))
    for ax, (key, xlabel, ideal) in zip(axes, panels):
        values = [math.nan if l.get(key) is None else float(l[key]) for _, _, l in items]
        ax.barh(ys, [0 if math.isnan(v) else v for v in values], color=[colours[k] for k, _, _ in items])
        for y, v in zip(ys, values):
            ax.annotate("n/a" if math.isnan(v) else f"{v:.3g}", (0 if math.isnan(v) else v, y), fontsize=6,
                        xytext=(2, 0), textcoords="offset points", va="center")
        if ideal is not None:
            ax.axvline(ideal, color="k", lw=0.8, ls="--")
        if key == "bank_conflicts":
            ax.set_xscale("symlog")  # counts span decades; 0 stays at 0
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(list(ys), [c for _, c, _ in items], fontsize=7)
    axes[0].set_ylim(len(items) - 0.5, -0.5)  # first launch on top, no margin
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[k]) for k in kernels]
    fig.legend(handles, kernels, loc="outside lower center", fontsize=7)
    fig.suptitle(_title("per kernel launch: global traffic and shared-memory conflicts",
                        [r for r in rows if r.get("source") == "model"]), fontsize=10)
    _save(fig, path)


# ---- the resource table


def resource_table(records, rows) -> list[dict]:
    """One entry per kernel: ptxas's figures per arch (records: cupaged.resources.KernelResources) and
    CTAs/SM for each (threads, dynamic shared bytes) the model rows launched it with."""
    from cupaged.sim.model import ctas_per_sm

    shapes = {}
    for kernel, _, launch in kernel_launches(rows):
        block = launch["block"]
        threads = math.prod(block) if isinstance(block, (list, tuple)) else int(block)
        shapes.setdefault(kernel, set()).add((threads, int(launch.get("shared_mem") or 0)))
    table = {}
    for rec in records:
        launched = sorted(shapes.get(rec.name_expression, ()))
        entry = table.setdefault((rec.family, rec.name_expression), {
            "family": rec.family, "kernel": rec.name_expression, "archs": {},
            "launches": [{"threads": t, "dynamic_shared_bytes": d} for t, d in launched]})
        entry["archs"][rec.arch] = {
            "registers": rec.registers, "spill_stores": rec.spill_stores, "spill_loads": rec.spill_loads,
            "static_shared_bytes": rec.shared_bytes, "stack_bytes": rec.stack_bytes,
            "ctas_per_sm": [ctas_per_sm(rec.registers, t, rec.shared_bytes + d, rec.arch) for t, d in launched]}
    return list(table.values())


_COLUMNS = ("family", "kernel", "registers", "spills st/ld B", "static smem B", "CTAs/SM",
            "launched as (threads, dyn smem B)")


def _cells(entry) -> list[str]:
    def per_arch(fmt):
        return " / ".join(fmt(entry["archs"][a]) if a in entry["archs"] else "?" for a in ARCHS)

    return [entry["family"], entry["kernel"], per_arch(lambda a: str(a["registers"])),
            per_arch(lambda a: f"{a['spill_stores']}/{a['spill_loads']}"),
            per_arch(lambda a: str(a["static_shared_bytes"])),
            per_arch(lambda a: ",".join(map(str, a["ctas_per_sm"])) or "-"),
            "; ".join(f"({s['threads']}, {s['dynamic_shared_bytes']})" for s in entry["launches"]) or "-"]


def _head(sep):
    return [c if c in ("family", "kernel") or c.startswith("launched") else f"{c}{sep}{' / '.join(ARCHS)}"
            for c in _COLUMNS]


def resources_markdown(table) -> str:
    lines = ["| " + " | ".join(_head(" ")) + " |", "|" + "---|" * len(_COLUMNS)]
    for entry in table:
        cells = _cells(entry)
        cells[1] = f"`{cells[1]}`"  # template brackets would read as HTML
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_resources(table, path):
    launched = [e for e in table if e["launches"]]
    if not launched:
        return "no kernel launched by a model row (CTAs/SM unknown): see resources.md"
    fig, ax = plt.subplots(figsize=(16, 0.8 + 0.3 * len(launched)))
    ax.axis("off")
    cells = ax.table(cellText=[_cells(e) for e in launched], colLabels=_head("\n"), loc="center", cellLoc="left")
    cells.auto_set_font_size(False)
    cells.set_fontsize(7)
    cells.auto_set_column_width(list(range(len(_COLUMNS))))
    cells.scale(1, 1.4)
    ax.set_title("kernel resources (ptxas) and occupancy of the launches in the model rows", fontsize=10)
    _save(fig, path)


# ---- the report


def write_report(rows, out, records=None, notes=()) -> list[str]:
    """Write rows.json, the plots, the resource table (when ``records``) and index.md into ``out``;
    returns the notes index.md lists (skipped plots, failed benches)."""
    notes = list(notes)
    with open(os.path.join(out, "rows.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
    plots = [("decode_bandwidth.png", plot_decode_bandwidth, rows), ("prefill_tflops.png", plot_prefill_tflops, rows),
             ("kernel_traffic.png", plot_kernel_traffic, rows)]
    if records is None:
        notes.append("resource table skipped: no compile-gate results")
    else:
        table = resource_table(records, rows)
        with open(os.path.join(out, "resources.json"), "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1)
        with open(os.path.join(out, "resources.md"), "w", encoding="utf-8") as f:
            f.write(resources_markdown(table))
        plots.append(("resources.png", plot_resources, table))
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
