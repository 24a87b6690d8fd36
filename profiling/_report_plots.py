"""The plots and the resource table of profiling/report.py, drawn from the rows it collected;
profiling/README.md says how to read each file.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # files only: no display on the machines this runs on
import matplotlib.pyplot as plt  # noqa: E402

from cupaged.sim.model import TERM_NAMES  # noqa: E402

ARCHS = ("sm_80", "sm_90")
MODEL_NOTE = "modeled (H200 model, not a measurement)"


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


def short_kernel(name: str) -> str:
    """cupaged::paged_decode_kernel<__half, 0, 128, false> -> paged_decode."""
    return name.split("<")[0].removeprefix("cupaged::").removesuffix("_kernel")


def launch_terms(rows) -> list[tuple[str, str, dict]]:
    """(row config, kernel, {modeled_us, bound, counted, each of the model's TERM_NAMES in µs, summed
    over the waves}) per launch of the model rows, in row order. ``counted``: the launch's warp
    instructions were counted (else its issue and mufu terms are 0 for want of a count, not a
    measurement of 0). Rows of model v1 have fp32 in place of issue and mufu: a term a launch's
    terms_us lacks reads as 0."""
    return [(_config(r), l["kernel"], {"modeled_us": l.get("modeled_us"), "bound": l.get("bound"),
                                       "counted": l.get("warp_instructions") is not None,
                                       **{t: float((l.get("terms_us") or {}).get(t) or 0.0) for t in TERM_NAMES}})
            for r in rows if r.get("source") == "model" for l in r.get("launches") or ()]


def terms_markdown(rows) -> str:
    """model_terms.md: a line per launch of the model rows; issue and mufu are '-' where the launch's
    instructions were not counted."""
    lines = ["| config | kernel | modeled µs | bound | " + " | ".join(f"{t} µs" for t in TERM_NAMES) + " |",
             "|" + "---|" * (4 + len(TERM_NAMES))]
    for config, kernel, terms in launch_terms(rows):
        modeled = "?" if terms["modeled_us"] is None else f"{terms['modeled_us']:.2f}"
        cells = ["-" if t in ("issue", "mufu") and not terms["counted"] else f"{terms[t]:.2f}" for t in TERM_NAMES]
        lines.append(f"| {config} | `{kernel}` | {modeled} | {terms['bound'] or '?'} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_model_terms(rows, path):
    items = launch_terms(rows)
    if not items:
        return "no model rows with launches"
    fig, ax = plt.subplots(figsize=(11, 2 + 0.45 * len(items)), layout="constrained")
    height = 0.8 / len(TERM_NAMES)
    for k, term in enumerate(TERM_NAMES):  # a term of 0 draws no bar on the log axis
        ys = [i - 0.4 + (k + 0.5) * height for i in range(len(items))]
        ax.barh(ys, [terms[term] for _, _, terms in items], height=height, color=plt.cm.tab10(k), label=term)
    modeled = [(i, terms["modeled_us"]) for i, (_, _, terms) in enumerate(items) if terms["modeled_us"]]
    if modeled:
        ax.scatter([t for _, t in modeled], [i for i, _ in modeled], marker="|", s=200, color="k",
                   label="modeled time", zorder=3)
    positive = [terms[t] for _, _, terms in items for t in TERM_NAMES if terms[t] > 0]
    ax.set_xscale("log")
    if positive:  # terms under 0.01 µs (a launch's overhead is 2 µs) would only stretch the axis
        ax.set_xlim(left=max(min(positive) / 2, 1e-2))
    ax.set_yticks(range(len(items)), [f"{config} · {short_kernel(kernel)}" for config, kernel, _ in items], fontsize=7)
    ax.set_ylim(len(items) - 0.5, -0.5)
    ax.set_xlabel("µs, each term summed over the launch's waves")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(_title("per kernel launch: the H200 model's terms (the largest bounds the launch)",
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
