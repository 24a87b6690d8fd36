"""pyproject.toml: the GPU extras ask for what the project uses, of one CUDA major each, and the wheel
ships what the kernels and the sim compile from."""

from __future__ import annotations

import os

import pytest

tomllib = pytest.importorskip("tomllib")
from packaging.requirements import Requirement  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PYPROJECT = os.path.join(_ROOT, "pyproject.toml")


def _pyproject() -> dict:
    with open(_PYPROJECT, "rb") as f:
        return tomllib.load(f)


def _project() -> dict:
    return _pyproject()["project"]


def _extra(name: str) -> dict[str, Requirement]:
    return {r.name: r for r in map(Requirement, _project()["optional-dependencies"][name])}


def _admits(req: Requirement, version: str) -> bool:
    return req.specifier.contains(version, prereleases=True)


def test_numpy_is_at_least_2_1_2():
    numpy = next(r for r in map(Requirement, _project()["dependencies"]) if r.name == "numpy")
    assert not _admits(numpy, "2.1.1") and _admits(numpy, "2.1.2")


@pytest.mark.parametrize("extra,cupy", [("cuda12", "cupy-cuda12x"), ("cuda13", "cupy-cuda13x")])
def test_gpu_extras_take_cupy_14_2_without_ctk(extra, cupy):
    reqs = _extra(extra)
    assert not any(r.extras for r in reqs.values()), "no [ctk]: its cuSOLVER/cuFFT/... are unused"
    assert not _admits(reqs[cupy], "14.1.0") and _admits(reqs[cupy], "14.2.0")


@pytest.mark.parametrize("extra,major,wheels", [
    ("cuda12", 12, ["nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12", "nvidia-cuda-cccl-cu12",
                    "nvidia-cublas-cu12"]),
    ("cuda13", 13, ["nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cuda-crt", "nvidia-cuda-cccl",
                    "nvidia-cublas"]),
])
def test_gpu_extras_take_nvrtc_headers_and_cublas_of_their_cuda_major(extra, major, wheels):
    reqs = _extra(extra)
    assert sorted(n for n in reqs if n.startswith("nvidia-")) == sorted(wheels)
    for name in wheels:
        assert _admits(reqs[name], f"{major}.0.0") and _admits(reqs[name], f"{major}.9.99"), name
        assert not _admits(reqs[name], f"{major - 1}.9.99") and not _admits(reqs[name], f"{major + 1}.0.0"), name


def test_wheel_ships_kernels_and_every_sim_header_directory():
    """The sim compiles against headers in several packages (the engine's, the PTX layer's, the
    profiler's): each must sit inside a package the wheel takes whole, and kernels_cu is mapped in."""
    from cupaged.sim import _compile

    wheel = _pyproject()["tool"]["hatch"]["build"]["targets"]["wheel"]
    packages = [os.path.join(_ROOT, p) for p in wheel["packages"]]
    assert not {"only-include", "exclude"} & set(wheel), "the wheel takes its packages whole"
    for d in _compile.INCLUDE_DIRS:
        assert os.listdir(d), d
        assert any(os.path.commonpath([d, p]) == p for p in packages), f"{d} is in no wheel package"
    assert wheel["force-include"]["kernels_cu"] == "cupaged/kernels_cu"
