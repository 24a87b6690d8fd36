"""The one GPU probe (cupaged._backend.probe_gpu): no cupy or no device is the sim, silently; cupy
installed but unusable (here a fake cupy whose device query raises cudaErrorInsufficientDriver, as
cupy-cuda13x does on a driver older than r580) warns or fails loudly, naming the cause, the driver
version and the extra to install, in every caller: default_array_module, the benchmarks, selftest
--backend cuda and the tests' --backend cuda / CUPAGED_REQUIRE_GPU=1."""

from __future__ import annotations

import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

from cupaged import _backend, sim
from cupaged.__main__ import main as cupaged_main
from cupaged.pool._batch_plan import default_array_module

REPO = Path(__file__).resolve().parent.parent


class CUDARuntimeError(RuntimeError):
    """What cupy_backends.cuda.api.runtime.CUDARuntimeError reads like."""


def _fake_cupy(device_count=None, error=None, driver=12040):
    def get_device_count():
        if error is not None:
            raise CUDARuntimeError(error)
        return device_count

    runtime = types.SimpleNamespace(getDeviceCount=get_device_count, driverGetVersion=lambda: driver,
                                    CUDARuntimeError=CUDARuntimeError)
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=runtime)
    return cupy


@pytest.fixture
def probe(monkeypatch):
    """Installs a fake cupy (None: cupy absent) and returns the fresh probe; the memo is cleared around it."""
    _backend.probe_gpu.cache_clear()

    def install(cupy):
        monkeypatch.setitem(sys.modules, "cupy", cupy)  # None in sys.modules: `import cupy` raises ModuleNotFoundError
        _backend.probe_gpu.cache_clear()
        return _backend.probe_gpu()

    yield install
    monkeypatch.undo()
    _backend.probe_gpu.cache_clear()


INSUFFICIENT = "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version"


def test_old_driver_is_unusable_and_names_cause_driver_and_extra(probe):
    result = probe(_fake_cupy(error=INSUFFICIENT, driver=12040))
    assert result.state == "unusable" and result.cupy is None
    message = result.message()
    assert "cudaErrorInsufficientDriver" in message
    assert "CUDA 12.4" in message
    assert "cupaged[cuda12]" in message and "r580" in message


def test_zero_devices_and_absent_cupy_are_the_sim_silently(probe):
    for cupy, state in ((_fake_cupy(device_count=0), "no_device"), (_fake_cupy(error="cudaErrorNoDevice: no CUDA"),
                                                                       "no_device"), (None, "absent")):
        result = probe(cupy)
        assert result.state == state and result.cupy is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert _backend.gpu_module() is None
            assert default_array_module() is sim


def test_a_usable_device_is_cupy(probe):
    cupy = _fake_cupy(device_count=1, driver=13000)
    assert probe(cupy).cupy is cupy
    assert _backend.gpu_module() is cupy


def test_probe_is_memoized(probe):
    calls = []
    cupy = _fake_cupy(device_count=0)
    count = cupy.cuda.runtime.getDeviceCount
    cupy.cuda.runtime.getDeviceCount = lambda: calls.append(1) or count()
    probe(cupy)
    _backend.probe_gpu()
    _backend.gpu_module()
    assert len(calls) == 1


def test_unreadable_driver_version_still_names_both_extras(probe):
    cupy = _fake_cupy(error=INSUFFICIENT)
    cupy.cuda.runtime.driverGetVersion = lambda: (_ for _ in ()).throw(CUDARuntimeError("cudaErrorUnknown"))
    message = probe(cupy).message()
    assert "version unreadable" in message and "cupaged[cuda12]" in message and "cupaged[cuda13]" in message


def test_default_array_module_and_benches_warn_then_fall_back(probe):
    probe(_fake_cupy(error=INSUFFICIENT))
    sys.path.insert(0, str(REPO / "profiling"))
    try:
        import _bench
    finally:
        sys.path.remove(str(REPO / "profiling"))
    with pytest.warns(_backend.GpuUnavailableWarning, match=r"cudaErrorInsufficientDriver.*CUDA 12\.4.*cuda12"):
        assert default_array_module() is sim
    with pytest.warns(_backend.GpuUnavailableWarning, match="cudaErrorInsufficientDriver"):
        assert _bench.gpu() is None


def test_selftest_backend_cuda_fails_naming_the_cause(probe, capsys):
    probe(_fake_cupy(error=INSUFFICIENT, driver=12020))
    assert cupaged_main(["selftest", "--backend", "cuda"]) != 0
    out, err = capsys.readouterr()
    assert "ok on" not in out
    assert "cudaErrorInsufficientDriver" in err and "CUDA 12.2" in err and "cupaged[cuda12]" in err


def test_selftest_backend_cuda_without_cupy_fails(probe, capsys):
    probe(None)
    assert cupaged_main(["selftest", "--backend", "cuda"]) != 0
    assert "cupy is not installed" in capsys.readouterr().err


SKIPPED_FOR_NO_GPU = """
import pytest

@pytest.mark.skipif(True, reason="no GPU")
def test_marked():
    pass

def test_skips():
    pytest.skip("no GPU")

def test_other_skip():
    pytest.skip("needs something else")
"""


@pytest.mark.parametrize("require", [(), ("--backend", "cuda"), ("env",)], ids=["default", "option", "env"])
def test_require_gpu_turns_no_gpu_skips_into_failures(tmp_path, require):
    (tmp_path / "test_tiny.py").write_text(SKIPPED_FOR_NO_GPU)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUPAGED_QUIET": "1"}
    env.pop("CUPAGED_REQUIRE_GPU", None)
    args = [a for a in require if a != "env"]
    if "env" in require:
        env["CUPAGED_REQUIRE_GPU"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
                           "-rs", str(tmp_path / "test_tiny.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    if not require:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "3 skipped" in done.stdout
        return
    assert done.returncode != 0
    assert "1 failed, 1 skipped, 1 error" in done.stdout, done.stdout
    assert "under --backend cuda / CUPAGED_REQUIRE_GPU=1" in done.stdout
