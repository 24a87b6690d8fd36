"""Shared benchmark plumbing: CUDA-event timing with an L2 flush between reps, NVTX ranges, the
device's peak bandwidth, and the one-table output of docs/adding-a-kernel.md §6."""

from __future__ import annotations

import contextlib
import time

import numpy as np

PEAK_GBPS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0,
             "A100-SXM4-80GB": 2039.0, "A100 80GB PCIe": 1935.0, "A100": 1555.0, "L40S": 864.0, "L4": 300.0}


def gpu():
    """cupy when a GPU is usable, else None; cupy installed but unusable warns (GpuUnavailableWarning)
    with the cause, so a benchmark does not silently measure the sim."""
    from cupaged._backend import gpu_module

    return gpu_module()


def peak_bandwidth_gbps(cp) -> tuple[str, float | None]:
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    for key, bw in PEAK_GBPS.items():
        if key in name:
            return name, bw
    return name, None


@contextlib.contextmanager
def nvtx_range(label: str):
    try:
        import nvtx
    except ImportError:  # some GPU images lack nvtx: annotations become no-ops
        yield
        return
    with nvtx.annotate(label):
        yield


def time_gpu(cp, fn, reps=20, warmup=3, flush_bytes=256 << 20):
    """Per-rep milliseconds of fn(), each rep after overwriting a buffer larger than L2."""
    flush = cp.empty(flush_bytes, dtype=cp.uint8)
    for _ in range(warmup):
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        flush.fill(1)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return np.array(times)


def time_cpu(fn, reps=3, warmup=0):
    """Per-call milliseconds of fn() on the CPU, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return np.array(times)


def print_table(rows, title, extra=()):
    head = ("config", "version", "median µs", "p20–p80 µs", "GB/s", "% of peak", *extra)
    rows = [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    print(title)
    for r in [head] + rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))


def summarize(label, version, ms, nbytes, peak):
    med = float(np.median(ms)) * 1e3
    p20, p80 = (float(np.percentile(ms, q)) * 1e3 for q in (20, 80))
    gbps = nbytes / (med * 1e-6) / 1e9
    pct = f"{100 * gbps / peak:.0f}%" if peak else "-"
    return (label, version, f"{med:.1f}", f"{p20:.1f}–{p80:.1f}", f"{gbps:.0f}", pct)


def run_bandwidth_table(gpu_cases, sim_cases, model_cases=(), bench="", argv=None, doc=""):
    """The main of a bandwidth benchmark: each case is (make, args) with make(xp, alloc, *args) ->
    (label, run, bytes moved). On a GPU: CUDA-event timings and % of peak, and rows (``--json``) of
    the model cases' shapes; ``--model`` on the sim: the H200 model of each model case, (shape, make,
    full args, profiled args, batch factor): ``make(*profiled args)`` run, scaled by the factor (see
    profiling/_model.py); else a sim smoke run."""
    import _model

    from cupaged import sim
    from cupaged._cost import Cost

    args = _model.bench_parser(doc).parse_args(argv)
    cp = gpu()
    rows = []
    if cp is None and args.model:
        for shape, make, _, subset, factor in model_cases:
            _, run, nbytes = make(np, sim.empty, *subset)
            rows.append(_model.project(shape, run, None, factor, fallback_bytes=nbytes * factor))
        _model.finish_model(bench, rows, args.json)
        return
    if cp is None:
        for make, cfg in sim_cases:
            label, run, nbytes = make(np, sim.empty, *cfg)
            with nvtx_range(label):
                rows.append(summarize(label, "v1", time_cpu(run), nbytes, None))
        print_table(rows, "SIM SMOKE RUN (no GPU): CPU timings of the simulator, not GPU timings")
        return
    device, peak = peak_bandwidth_gbps(cp)
    table = []
    for make, cfg in gpu_cases:
        label, run, nbytes = make(cp, cp.empty, *cfg)
        with nvtx_range(label):
            table.append(summarize(label, "v1", time_gpu(cp, run), nbytes, peak))
    print_table(table, f"{device} (peak {peak or '?'} GB/s)")
    for shape, make, full, _, _ in model_cases:
        label, run, nbytes = make(cp, cp.empty, *full)
        with nvtx_range(label):
            ms = time_gpu(cp, run)
        rows.append(_model.row(shape, "measured", float(np.median(ms)) * 1e3, Cost(nbytes, 0), device=device))
    _model.finish_measured(bench, rows, args.json, device=device)
