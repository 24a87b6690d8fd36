"""profiling/bench_host_overhead.py with a tiny rep count: one JSON row per measured op, with its keys,
and the stubbed KernelFamily.function restored afterwards."""

from __future__ import annotations

import json
import os
import runpy

from cupaged._runtime import KernelFamily

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "profiling", "bench_host_overhead.py")
OPS = ["reshape_and_cache_flash", "reshape_and_cache", "concat_and_cache_mla", "gather_and_maybe_dequant_cache",
       "cp_gather_cache", "copy_blocks", "paged_attention", "paged_attention", "paged_attention_v1",
       "paged_attention_v2", "varlen_attention", "mla_decode", "mla_chunked_prefill", "merge_attn_states",
       "run_attention"]
KEYS = {"op", "config", "backend", "source", "launches", "calls", "median_us", "p20_us", "p80_us"}


def test_rows_per_op(tmp_path, capsys, monkeypatch):
    real = KernelFamily.function
    path = tmp_path / "host.json"
    monkeypatch.setattr("sys.argv", [SCRIPT, "--reps", "20", "--number", "2", "--budget", "0.05",
                                     "--json", str(path)])
    runpy.run_path(SCRIPT, run_name="__main__")
    assert KernelFamily.function is real
    rows = json.loads(path.read_text())["rows"]
    assert [r["op"] for r in rows] == OPS
    assert [r["config"].split()[0] for r in rows if r["op"] == "paged_attention"] == ["decode", "prefill"]
    for r in rows:
        assert set(r) == KEYS, r
        assert r["launches"] >= 1 and r["calls"] >= 10, r
        assert 0 < r["p20_us"] <= r["median_us"] <= r["p80_us"], r
    assert "median µs" in capsys.readouterr().out
