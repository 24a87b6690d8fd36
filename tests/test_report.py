"""profiling/report.py and its _report_plots.py on synthetic rows (the real benches are too slow for
the suite), and --help of every profiling script."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from cupaged.resources import KernelResources
from cupaged.sim.model import ctas_per_sm

PROFILING = os.path.join(os.path.dirname(__file__), "..", "profiling")
DECODE_KERNEL = "cupaged::paged_decode_kernel<__half, 0, 128, false>"
REDUCE_KERNEL = "cupaged::paged_attention_reduce_kernel<__half>"
NEVER_KERNEL = "cupaged::never_launched<float>"


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(PROFILING, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report():
    return load("report")


@pytest.fixture(scope="module")
def plots():
    return load("_report_plots")


def launch(kernel, block, shared_mem, traffic_ratio, bank_conflicts):
    return dict(kernel=kernel, grid=[8, 8, 1], block=block, shared_mem=shared_mem, ctas=64, ctas_per_sm=3,
                registers=144, unique_bytes=1000, bytes=1100, min_bytes=900, traffic_ratio=traffic_ratio,
                sector_efficiency=0.9, wavefronts=500, bank_conflicts=bank_conflicts, modeled_us=12.0,
                bound="hbm")


def row(op, batch, context, q_len, heads, kv_heads, kv_dtype, pct, tflops, launches=(), source="model"):
    return dict(op=op, batch=batch, context=context, q_len=q_len, num_heads=heads, num_kv_heads=kv_heads,
                head_size=128, kv_dtype=kv_dtype, causal=True, source=source, time_us=10.0, gbps=pct * 48,
                pct_of_peak_bw=pct, tflops=tflops, launches=list(launches))


@pytest.fixture(scope="module")
def rows():
    out = []
    for batch in (1, 64):
        for context in (512, 4096, 32768):
            for heads in (8, 64):
                for kv in ("fp16", "fp8_e4m3"):
                    pct = 20 + 10 * (context.bit_length() - 10) + (5 if kv == "fp16" else 0)
                    out.append(row("decode", batch, context, 1, heads, 8, kv, pct, 0.1,
                                   [launch(DECODE_KERNEL, [128, 1, 1], 4096, 1.25, 0),
                                    launch(REDUCE_KERNEL, [64, 1, 1], 0, None, 7)]))
    for context in (1024, 4096):  # the chunk follows the length: one line, not two
        out.append(row("prefill", 1, context, context // 2, 32, 8, "fp16", 50.0, context / 100))
    out.append(row("merge_attn_states", 4, 1, 1, 32, 32, None, 30.0, 0.0, [], source="model"))
    return out


def records():
    """sm_80 with more registers than sm_90, so the two archs' CTAs/SM differ."""
    def rec(name, arch, registers, shared):
        return KernelResources("paged_attention", name, arch, registers, 0, 0, shared, 0, "_Z" + name[-8:])

    return [rec(DECODE_KERNEL, "sm_80", 255, 528), rec(DECODE_KERNEL, "sm_90", 144, 528),
            rec(REDUCE_KERNEL, "sm_80", 38, 0), rec(REDUCE_KERNEL, "sm_90", 38, 0),
            rec(NEVER_KERNEL, "sm_80", 40, 16), rec(NEVER_KERNEL, "sm_90", 40, 16)]


def png_ok(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 5000


def test_write_report(report, rows, tmp_path):
    notes = report.write_report(rows, str(tmp_path), records(), notes=["bench_mla FAILED (exit 1)"])
    assert notes == ["bench_mla FAILED (exit 1)"]
    for name in ("decode_bandwidth.png", "prefill_tflops.png", "kernel_traffic.png", "resources.png"):
        png_ok(tmp_path / name)
    assert json.loads((tmp_path / "rows.json").read_text()) == rows
    index = (tmp_path / "index.md").read_text()
    assert "proxy, not a benchmark" in index and "- bench_mla FAILED (exit 1)" in index
    assert all(f"[{n}]({n})" in index for n in report.READING)

    table = {e["kernel"]: e for e in json.loads((tmp_path / "resources.json").read_text())}
    want = {a: ctas_per_sm(r, 128, 528 + 4096, a) for a, r in (("sm_80", 255), ("sm_90", 144))}
    assert want == {"sm_80": 2, "sm_90": 3}  # registers bound both: 255 -> 2 CTAs of 4 warps, 144 -> 3
    assert {a: table[DECODE_KERNEL]["archs"][a]["ctas_per_sm"] for a in want} == {a: [v] for a, v in want.items()}
    assert table[DECODE_KERNEL]["launches"] == [{"threads": 128, "dynamic_shared_bytes": 4096}]
    # 38 registers round up to 1,280 per warp: 65,536 // (2 warps x 1,280) = 25 CTAs of 64 threads
    assert table[REDUCE_KERNEL]["archs"]["sm_90"]["ctas_per_sm"] == [ctas_per_sm(38, 64, 0, "sm_90")] == [25]
    assert table[NEVER_KERNEL]["archs"]["sm_90"]["ctas_per_sm"] == []

    md = (tmp_path / "resources.md").read_text().splitlines()
    assert md[0].startswith("| family | kernel | registers sm_80 / sm_90 |")
    decode = next(line for line in md if DECODE_KERNEL in line)
    assert decode == (f"| paged_attention | `{DECODE_KERNEL}` | 255 / 144 | 0/0 / 0/0 | 528 / 528 | 2 / 3 "
                      "| (128, 4096) |")
    never = next(line for line in md if "never_launched" in line)
    assert never.endswith("| 40 / 40 | 0/0 / 0/0 | 16 / 16 | - / - | - |")


def test_series_splits_by_what_varies_at_one_x(plots, rows):
    decode = [r for r in rows if r["op"] == "decode" and r["batch"] == 1]
    lines = plots._series(decode, "context", "pct_of_peak_bw", ("gqa", "kv_dtype"), ("head_size", "source"))
    assert sorted(lines) == ["gqa=1 kv_dtype=fp16", "gqa=1 kv_dtype=fp8_e4m3", "gqa=8 kv_dtype=fp16",
                             "gqa=8 kv_dtype=fp8_e4m3"]
    assert lines["gqa=8 kv_dtype=fp16"] == [(512, 25), (4096, 55), (32768, 85)]
    prefill = [r for r in rows if r["op"] == "prefill"]
    lines = plots._series(prefill, "context", "tflops", (), ("q_len", "batch"))
    assert lines == {"all": [(1024, 10.24), (4096, 40.96)]}


def test_kernel_launches_grouped_by_kernel(plots, rows):
    items = plots.kernel_launches(rows)
    assert [k for k, _, _ in items] == [REDUCE_KERNEL] * 24 + [DECODE_KERNEL] * 24  # by name, rows in order
    assert items[0][1] == items[24][1] == "decode b=1 ctx=512 h=8/8 d=128 fp16"
    prefill = row("prefill", 8, 2048, 2048, 32, 8, "bf16", 1.0, 1.0)
    merge = row("merge_attn_states", 4, 1, 1, 32, 32, None, 1.0, 0.0)
    assert plots._config(prefill) == "prefill b=8 ctx=2048 q=2048 h=32/8 d=128 bf16"
    assert plots._config(merge) == "merge_attn_states b=4 ctx=1 h=32/32 d=128"
    assert plots._config(merge | {"config": "merge 4 tokens"}) == "merge 4 tokens"


def test_missing_data_skips_plots_with_a_note(report, plots, tmp_path):
    measured = [row("prefill", 1, 2048, 2048, 32, 8, "bf16", 40.0, 300.0, source="measured")
                | {"device": "NVIDIA H200"}]
    notes = report.write_report(measured, str(tmp_path))
    assert notes == ["resource table skipped: no compile-gate results",
                     "decode_bandwidth.png skipped: no decode rows",
                     "kernel_traffic.png skipped: no model rows with launches"]
    assert sorted(os.listdir(tmp_path)) == ["index.md", "prefill_tflops.png", "rows.json"]
    assert "decode_bandwidth.png skipped" in (tmp_path / "index.md").read_text()
    assert plots._title("x", measured) == "x\nmeasured on NVIDIA H200"
    assert plots._title("x", measured + [{"source": "model"}]).endswith(
        "measured on NVIDIA H200 and modeled (H200 model, not a measurement)")


def test_load_rows_accepts_both_layouts(report, tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"op": "decode"}]))
    (tmp_path / "b.json").write_text(json.dumps({"device": "NVIDIA H200", "rows": [{"op": "prefill"}]}))
    assert report.load_rows(str(tmp_path / "a.json"), "bench_a") == [{"bench": "bench_a", "op": "decode"}]
    assert report.load_rows(str(tmp_path / "b.json"), "bench_b") == [
        {"bench": "bench_b", "device": "NVIDIA H200", "op": "prefill"}]


def test_bench_command(report):
    cmd = report.bench_command("bench_paged_attention", "out", model=True, quick=False)
    assert cmd[0] == sys.executable and cmd[1].endswith("bench_paged_attention.py")
    assert cmd[2:] == ["--json", os.path.join("out", "bench_paged_attention.json"), "--model", "--sweep"]
    assert report.bench_command("bench_merge_attn_states", "out", model=False, quick=True)[2:] == [
        "--json", os.path.join("out", "bench_merge_attn_states.json")]


FAKE_BENCH = """import json, sys, time
args = sys.argv[1:]
if "{name}" == "bench_slow":
    print("started", flush=True)
    time.sleep(60)
if "{name}" == "bench_fail":
    sys.exit("no kernel today")
json.dump({{"device": "sim", "rows": [{{"op": "decode", "args": args[2:]}}]}}, open(args[1], "w"))
"""


def test_run_benches_notes_failures_and_timeouts(report, tmp_path, monkeypatch, capsys):
    """Stand-in benches: the report passes its flags, stops one past its share of the budget, and
    notes the failures with their output kept."""
    names = ("bench_ok", "bench_fail", "bench_slow")
    for name in names:
        (tmp_path / f"{name}.py").write_text(FAKE_BENCH.format(name=name))
    (tmp_path / "bench_fail.json").write_text("[]")  # stale: must not survive the run
    monkeypatch.setattr(report, "HERE", str(tmp_path))
    monkeypatch.setattr(report, "BENCHES", names)
    notes = report.run_benches(str(tmp_path), quick=False, budget_s=1.5, model=True)
    assert [n.split(" after ")[0] for n in notes] == ["bench_fail FAILED (exit 1)", "bench_slow TIMED OUT (limit 1 s)"]
    progress = capsys.readouterr().err.splitlines()
    assert [line.rsplit(" in ", 1)[0] for line in progress] == [
        "[1/3] bench_ok done", "[2/3] bench_fail FAILED (exit 1)", "[3/3] bench_slow TIMED OUT (limit 1 s)"]
    assert report.load_rows(str(tmp_path / "bench_ok.json"), "bench_ok") == [
        {"bench": "bench_ok", "device": "sim", "op": "decode", "args": ["--model"]}]
    assert not (tmp_path / "bench_fail.json").exists()
    assert "no kernel today" in (tmp_path / "bench_fail.log").read_text()
    assert (tmp_path / "bench_slow.log").read_text() == "started\n"


SCRIPTS = sorted(glob.glob(os.path.join(PROFILING, "bench_*.py"))) + [os.path.join(PROFILING, "report.py")]


def test_help_of_every_profiling_script():
    """Started together: each pays its own interpreter start and imports."""
    procs = {os.path.basename(p): subprocess.Popen([sys.executable, p, "--help"], stdout=subprocess.PIPE,
                                                   stderr=subprocess.STDOUT, text=True) for p in SCRIPTS}
    failed = {}
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        if proc.returncode != 0 or not out.startswith("usage:"):
            failed[name] = (proc.returncode, out[-300:])
    assert not failed


def test_report_runs_every_kernel_bench(report):
    """Every bench script is in the report, or named as a host-side bench it leaves out (bench_rope
    and bench_layers were missing)."""
    stems = {os.path.basename(p)[:-3] for p in SCRIPTS if os.path.basename(p).startswith("bench_")}
    assert set(report.BENCHES) | set(report.HOST_BENCHES) == stems
    assert not set(report.BENCHES) & set(report.HOST_BENCHES)
    assert report.BENCHES[-1] == "bench_paged_attention"  # the longest last: the others' time rolls over to it
