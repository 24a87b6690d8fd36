"""profiling/report.py and its _report_plots.py on synthetic rows (the real benches are too slow for
the suite), and --help of every profiling script."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

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


# model v2's terms of a launch (µs): issue bounds it, as the SASS instruction counts say decode's do
TERMS_V2 = dict(hbm=6.0, latency=7.5, shared=0.25, mma=0.0, issue=10.0, mufu=0.5)


def launch(kernel, block, shared_mem, traffic_ratio, bank_conflicts, terms_us=TERMS_V2):
    return dict(kernel=kernel, grid=[8, 8, 1], block=block, shared_mem=shared_mem, ctas=64, ctas_per_sm=3,
                registers=144, unique_bytes=1000, bytes=1100, min_bytes=900, traffic_ratio=traffic_ratio,
                sector_efficiency=0.9, wavefronts=500, bank_conflicts=bank_conflicts, modeled_us=12.0,
                bound=max(terms_us, key=terms_us.get), terms_us=dict(terms_us),
                warp_instructions=None if "fp32" in terms_us else 4096)


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
    missing = report.write_report(rows, str(tmp_path), records(), notes=["bench_mla FAILED (exit 1)"])
    assert missing == {}
    for name in ("decode_bandwidth.png", "prefill_tflops.png", "kernel_traffic.png", "model_terms.png",
                 "resources.png"):
        png_ok(tmp_path / name)
    assert json.loads((tmp_path / "rows.json").read_text()) == rows  # launches keep their terms_us
    index = (tmp_path / "index.md").read_text()
    assert "proxy, not a benchmark" in index and "## Incomplete\n\n- bench_mla FAILED (exit 1)" in index
    assert all(f"[{n}]({n})" in index for n in report.READING)
    terms = (tmp_path / "model_terms.md").read_text().splitlines()
    assert terms[0] == ("| config | kernel | modeled µs | bound | hbm µs | latency µs | shared µs | mma µs "
                        "| issue µs | mufu µs |")
    assert len(terms) == 2 + 48  # 24 decode rows of 2 launches; prefill and merge rows launched nothing
    assert terms[2] == (f"| decode b=1 ctx=512 h=8/8 d=128 fp16 | `{DECODE_KERNEL}` | 12.00 | issue "
                        "| 6.00 | 7.50 | 0.25 | 0.00 | 10.00 | 0.50 |")

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


def test_missing_data_names_the_plots_not_drawn(report, plots, tmp_path):
    measured = [row("prefill", 1, 2048, 2048, 32, 8, "bf16", 40.0, 300.0, source="measured")
                | {"device": "NVIDIA H200"}]
    missing = report.write_report(measured, str(tmp_path))
    assert missing == {"resources.png": "no compile-gate results (resources.md / .json not written either)",
                       "decode_bandwidth.png": "no decode rows",
                       "kernel_traffic.png": "no model rows with launches",
                       "model_terms.png": "no model rows with launches"}
    assert sorted(os.listdir(tmp_path)) == ["index.md", "model_terms.md", "prefill_tflops.png", "rows.json"]
    index = (tmp_path / "index.md").read_text()
    assert "## Incomplete\n\n- resources.png NOT DRAWN: no compile-gate results" in index
    assert "- decode_bandwidth.png NOT DRAWN: no decode rows" in index
    assert plots._title("x", measured) == "x\nmeasured on NVIDIA H200"
    assert plots._title("x", measured + [{"source": "model"}]).endswith(
        "measured on NVIDIA H200 and modeled (H200 model, not a measurement)")


def test_launch_terms_read_model_v1_rows(plots):
    """A row of model v1 has fp32 and no issue or mufu: those read as 0, fp32 is not a term."""
    v1 = dict(hbm=3.0, latency=4.0, shared=1.0, mma=2.0, fp32=9.0)
    r = row("decode", 2, 1024, 1, 8, 8, "fp16", 10.0, 0.1, [launch(DECODE_KERNEL, [128, 1, 1], 0, 1.0, 0, v1)])
    old_launch = r["launches"][0]
    no_terms = {k: v for k, v in old_launch.items() if k != "terms_us"}
    measured = row("decode", 2, 1024, 1, 8, 8, "fp16", 10.0, 0.1, [old_launch], source="measured")
    items = plots.launch_terms([r, r | {"launches": [no_terms]}, measured])
    assert [(c, k) for c, k, _ in items] == [("decode b=2 ctx=1024 h=8/8 d=128 fp16", DECODE_KERNEL)] * 2
    assert items[0][2] == dict(modeled_us=12.0, bound="fp32", counted=False, hbm=3.0, latency=4.0, shared=1.0,
                               mma=2.0, issue=0.0, mufu=0.0)
    assert items[1][2] == dict(modeled_us=12.0, bound="fp32", counted=False, hbm=0.0, latency=0.0, shared=0.0,
                               mma=0.0, issue=0.0, mufu=0.0)
    assert plots.terms_markdown([r]).splitlines()[2].endswith("| 12.00 | fp32 | 3.00 | 4.00 | 1.00 | 2.00 | - | - |")
    assert plots.short_kernel(DECODE_KERNEL) == "paged_decode"


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


FAKE_BENCH = """import json, subprocess, sys, time
print("started", flush=True)
if {sleep}:  # with a compiler of its own running, which must be stopped with it
    print(subprocess.Popen(["sleep", "60"]).pid, flush=True)
    time.sleep(60)
if {fail}:
    sys.exit("no kernel today")
if {rows!r} is not None:
    rows = [dict(r, args=sys.argv[3:]) for r in json.loads({rows!r})]
    json.dump({{"device": "sim", "rows": rows}}, open(sys.argv[2], "w"))
"""


def fake_benches(report, monkeypatch, tmp_path, **benches):
    """Stand-ins for the benches: name=(Bench, rows or None for no JSON, fail, sleep); the report runs
    them in place of the real ones, with a compile gate of synthetic records and no GPU."""
    for name, (_, rows, fail, sleep) in benches.items():
        script = FAKE_BENCH.format(rows=None if rows is None else json.dumps(rows), fail=fail, sleep=sleep)
        (tmp_path / f"{name}.py").write_text(script)
    monkeypatch.setattr(report, "HERE", str(tmp_path))
    monkeypatch.setattr(report, "BENCHES", {name: b[0] for name, b in benches.items()})
    monkeypatch.setattr(report, "compile_gate", lambda: (records(), None))
    monkeypatch.setattr(report._bench, "gpu", lambda: None)


def gone(pid, wait_s=5.0) -> bool:
    """The process ``pid`` has ended (a zombie no one reaps counts as ended)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_share_s_weighs_what_is_left(report, monkeypatch):
    monkeypatch.setattr(report, "BENCHES", {"bench_a": report.Bench(1), "bench_b": report.Bench(3)})
    assert report.share_s(100.0, ["bench_a", "bench_b"]) == 25.0  # 1 / (1 + 3) of it
    assert report.share_s(100.0, ["bench_b"]) == 100.0  # the last takes all that is left
    assert report.share_s(2.0, ["bench_a", "bench_b"]) == report.share_s(-9.0, ["bench_b"]) == 1.0


def test_default_budget_covers_a_cold_run_twice(report):
    """When the gate and each bench before it took their measured cold time, a bench still gets at
    least twice its own (the default is twice the cold run: room for a machine twice as busy)."""
    stems = list(report.BENCHES)
    left = report.BUDGET_S - report.GATE_COLD_S
    for i, stem in enumerate(stems):
        assert report.share_s(left, stems[i:]) >= 2 * report.BENCHES[stem].cold_s - 1e-9, stem
        left -= report.BENCHES[stem].cold_s


def test_run_benches_names_failures_and_stops_a_slow_one_whole(report, tmp_path, monkeypatch, capsys):
    """The report passes its flags, stops a bench past its share with what it started (subprocess.run's
    timeout left its compiler running), and names the failures with their output kept. The slow one
    weighs 1 of 21 s: its share is 1 s, the others' 10 s and more, room for a busy machine."""
    Bench = report.Bench
    fake_benches(report, monkeypatch, tmp_path, bench_slow=(Bench(1), None, False, True),
                 bench_ok=(Bench(10), [{"op": "decode"}], False, False), bench_fail=(Bench(10), None, True, False))
    (tmp_path / "bench_fail.json").write_text("[]")  # stale: must not survive the run
    failed = report.run_benches(str(tmp_path), quick=False, budget_s=21.0, model=True)
    assert sorted(failed) == ["bench_fail", "bench_slow"]
    assert re.fullmatch(r"FAILED \(exit 1\) after \d+ s: see bench_fail.log", failed["bench_fail"])
    assert re.fullmatch(r"TIMED OUT \(its share: 1.0 s\) after 1 s: see bench_slow.log", failed["bench_slow"])
    progress = [line.rsplit(" in ", 1) for line in capsys.readouterr().err.splitlines()]
    assert [p[0] for p in progress] == ["[1/3] bench_slow TIMED OUT (its share: 1.0 s)", "[2/3] bench_ok done",
                                        "[3/3] bench_fail FAILED (exit 1)"]
    assert 1.0 <= float(progress[0][1].removesuffix(" s")) < 1.5  # stopped at its share, not at its end
    assert report.load_rows(str(tmp_path / "bench_ok.json"), "bench_ok") == [
        {"bench": "bench_ok", "device": "sim", "op": "decode", "args": ["--model"]}]
    assert not (tmp_path / "bench_fail.json").exists()
    assert "no kernel today" in (tmp_path / "bench_fail.log").read_text()
    log = (tmp_path / "bench_slow.log").read_text().split()
    assert log[0] == "started" and gone(int(log[1]))


def errors(err: str) -> list[str]:
    return [re.sub(r"after \d+ s", "after N s", line) for line in err.splitlines()
            if line.startswith(("error:", "report INCOMPLETE"))]


def test_report_names_what_is_missing_and_exits_1(report, rows, tmp_path, monkeypatch, capsys):
    Bench, model_plots = report.Bench, report.MODEL_PLOTS
    merge = row("merge_attn_states", 4, 1, 1, 32, 32, None, 30.0, 0.0, [launch(DECODE_KERNEL, [128, 1, 1], 0, 1.0, 0)])
    fake_benches(report, monkeypatch, tmp_path,
                 bench_ok=(Bench(1, model_plots), [merge], False, False),
                 bench_fail=(Bench(1, ("decode_bandwidth.png", "prefill_tflops.png")), None, True, False),
                 bench_empty=(Bench(1, model_plots), [], False, False),
                 bench_silent=(Bench(1, ("prefill_tflops.png",)), None, False, False),
                 bench_quiet=(Bench(1, rows=False), [], False, False))
    assert report.main(["--out", str(tmp_path), "--budget", "30"]) == 1
    want = ["error: bench_fail FAILED (exit 1) after N s: see bench_fail.log; missing from decode_bandwidth.png, "
            "prefill_tflops.png",
            "error: bench_empty wrote no rows: see bench_empty.log; missing from kernel_traffic.png, "
            "model_terms.png, resources.png",
            "error: bench_silent wrote no rows (no bench_silent.json): see bench_silent.log; missing from "
            "prefill_tflops.png",
            "error: decode_bandwidth.png NOT DRAWN: no decode rows",
            "error: prefill_tflops.png NOT DRAWN: no prefill rows",
            "report INCOMPLETE: 3 bench(es) failed, 2 plot(s) not drawn"]
    assert errors(capsys.readouterr().err) == want
    for name in ("kernel_traffic.png", "model_terms.png", "resources.png"):  # bench_ok's launches
        png_ok(tmp_path / name)
    index = (tmp_path / "index.md").read_text()
    assert all(f"- {line.removeprefix('error: ')}" in re.sub(r"after \d+ s", "after N s", index)
               for line in want[:-1])


def test_report_whose_gate_ate_the_budget_is_no_success(report, tmp_path, monkeypatch, capsys):
    """A run seen in practice: a cold compile gate took the budget, every bench ran out of its share, and
    the report exited 0 with rows.json and resources.json and no plot."""
    Bench = report.Bench
    fake_benches(report, monkeypatch, tmp_path, bench_mla=(Bench(5, report.MODEL_PLOTS), None, False, True),
                 bench_paged_attention=(Bench(20, ("decode_bandwidth.png",)), None, False, True))
    assert report.main(["--out", str(tmp_path), "--budget", "0"]) == 1
    assert errors(capsys.readouterr().err) == [
        "error: bench_mla TIMED OUT (its share: 1.0 s) after N s: see bench_mla.log; missing from "
        "kernel_traffic.png, model_terms.png, resources.png",
        "error: bench_paged_attention TIMED OUT (its share: 1.0 s) after N s: see bench_paged_attention.log; "
        "missing from decode_bandwidth.png",
        "error: decode_bandwidth.png NOT DRAWN: no decode rows",
        "error: prefill_tflops.png NOT DRAWN: no prefill rows",
        "error: kernel_traffic.png NOT DRAWN: no model rows with launches",
        "error: model_terms.png NOT DRAWN: no model rows with launches",
        "error: resources.png NOT DRAWN: no kernel launched by a model row (CTAs/SM unknown): see resources.md",
        "report INCOMPLETE: 2 bench(es) failed, 5 plot(s) not drawn"]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".png")]


def test_whole_report_exits_0_and_replots(report, rows, tmp_path, monkeypatch, capsys):
    paged = report.Bench(1, ("decode_bandwidth.png", "prefill_tflops.png") + report.MODEL_PLOTS)
    rows = [r for r in rows if r["op"] == "prefill" or (r["batch"] == 1 and r["num_heads"] == 8)]
    fake_benches(report, monkeypatch, tmp_path, bench_paged_attention=(paged, rows, False, False))
    assert report.main(["--out", str(tmp_path)]) == 0
    assert "error" not in capsys.readouterr().err
    for name in report.READING:
        png_ok(tmp_path / name)
    assert "## " not in (tmp_path / "index.md").read_text()  # neither notes nor an incomplete section
    os.remove(tmp_path / "bench_paged_attention.py")  # --replot runs nothing
    assert report.main(["--out", str(tmp_path), "--replot"]) == 0
    assert len(json.loads((tmp_path / "rows.json").read_text())) == len(rows)


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
    and bench_layers were missing); a bench with rows names the plots they feed."""
    stems = {os.path.basename(p)[:-3] for p in SCRIPTS if os.path.basename(p).startswith("bench_")}
    assert set(report.BENCHES) | set(report.HOST_BENCHES) == stems
    assert not set(report.BENCHES) & set(report.HOST_BENCHES)
    assert list(report.BENCHES)[-1] == "bench_paged_attention"  # the longest last: the others' time rolls over
    assert {s for s, b in report.BENCHES.items() if not b.rows} == {"bench_cache_gather", "bench_layers"}
    assert all(set(b.plots) <= set(report.READING) and (b.plots or not b.rows) for b in report.BENCHES.values())
