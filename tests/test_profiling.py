"""The benchmark scripts run (a smoke run on the sim without a GPU) and print their table."""

from __future__ import annotations

import glob
import os
import re
import runpy

import pytest

BENCHES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "profiling", "bench_*.py")))


@pytest.mark.parametrize("path", BENCHES, ids=[os.path.basename(p) for p in BENCHES])
def test_bench_smoke_run(path, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", [path])  # the scripts parse their own command line
    runpy.run_path(path, run_name="__main__")
    out = capsys.readouterr().out
    assert "median µs" in out and re.search(r"v\d+\b", out)  # a version (of the kernel file, or an op's v1 / v2)
