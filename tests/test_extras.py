"""pyproject.toml's GPU extras ask for what the project uses, of one CUDA major each."""

from __future__ import annotations

import os

import pytest

tomllib = pytest.importorskip("tomllib")
from packaging.requirements import Requirement  # noqa: E402

_PYPROJECT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")


def _project() -> dict:
    with open(_PYPROJECT, "rb") as f:
        return tomllib.load(f)["project"]


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
