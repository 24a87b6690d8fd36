"""profiling/gpu_check.sh without a GPU (here): every phase skipped, a non-zero exit within 60 s, and
nothing installed (a PYTHON wrapper logs every interpreter call: none runs pip). Its kernel helper's
cases run on the sim."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "profiling" / "gpu_check.sh"
BENCHES = sorted(p.stem for p in (ROOT / "profiling").glob("bench_*.py") if p.stem not in ("bench_pool", "bench_sim"))
PHASES = ["probe", "install", "selftest", "demo", "tests", *BENCHES, "ncu", "memcheck", "racecheck", "synccheck"]


def test_syntax_and_executable():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    assert os.access(SCRIPT, os.X_OK)
    subprocess.run(["bash", "-n", str(ROOT / "profiling" / "prepare_gpu_wheels.sh")], check=True)


def _run(tmp_path, fake_smi: bool):
    bin_dir, wheels, out = tmp_path / "bin", tmp_path / "wheels", tmp_path / "out"
    for d in (bin_dir, wheels):
        d.mkdir()
    calls = tmp_path / "python-calls.log"
    python = bin_dir / "python-wrapper"  # every interpreter call the script makes, logged
    python.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    for tool in ("pip", "pip3"):  # a bare pip on PATH would also be caught
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "pip $*" >> "{calls}"\nexit 1\n')
        (bin_dir / tool).chmod(0o755)
    if fake_smi:  # a driver that answers, but no cupy: still never green, nothing installed
        (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "NVIDIA H200, 580.00, 143771 MiB"\n')
        (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    path = env["PATH"] if fake_smi else ":".join(p for p in env["PATH"].split(":")
                                                 if not os.access(os.path.join(p, "nvidia-smi"), os.X_OK))
    env.update(OUT=str(out), PYTHON=str(python), PATH=f"{bin_dir}:{path}", CUPAGED_QUIET="1")
    start = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT), "--wheels", str(wheels)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=90)
    elapsed = time.monotonic() - start
    summary = (out / "summary.txt").read_text()
    return proc, elapsed, summary, calls.read_text() if calls.exists() else ""


def _phase_lines(summary):
    lines = {line.split()[0]: line for line in summary.splitlines() if line and line.split()[0] in PHASES}
    assert list(lines) == PHASES, summary
    return lines


def test_no_gpu_skips_everything_and_installs_nothing(tmp_path):
    proc, elapsed, summary, calls = _run(tmp_path, fake_smi=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert elapsed < 60
    for phase, line in _phase_lines(summary).items():
        assert "skipped (no GPU)" in line, line
    assert "RESULT: FAIL" in summary and "0 passed" in summary
    assert summary in proc.stdout  # the summary is printed
    assert "pip" not in calls and "gpu_check_wheels" not in calls, calls  # nothing installed, nothing looked up
    assert not any(tmp_path.joinpath("wheels").iterdir())


def test_driver_without_usable_cupy_fails_before_installing(tmp_path):
    proc, elapsed, summary, calls = _run(tmp_path, fake_smi=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert elapsed < 60
    lines = _phase_lines(summary)
    assert "FAILED" in lines["probe"] and "cupy cannot use it" in lines["probe"], summary
    assert all("skipped (probe failed)" in lines[p] for p in PHASES[1:]), summary
    assert "pip" not in calls, calls


@pytest.mark.kernel
def test_kernel_helper_cases_on_the_sim():
    env = dict(os.environ, GPU_CHECK_KERNELS_SIM="1", CUPAGED_QUIET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "profiling" / "gpu_check_kernels.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = ["decode", "prefill", "prefill80", "flash", "merge"]
    assert [line.split(":")[0] for line in proc.stdout.splitlines()] == names
