"""Which CUDA headers the cuda path hands CuPy's NVRTC: only those of CuPy's own CUDA major.

Fake site-packages trees in tmp_path hold both wheel layouts at once (cupy-cuda12x next to the sim
extra's CUDA 13 headers); a fake ``cupy`` records the options ``RawModule`` receives. No GPU needed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os

import pytest

from cupaged import _runtime
from tests import fake_cupy

# Where each wheel puts its headers (checked against the wheels' RECORDs:
# nvidia-cuda-runtime-cu12 12.9.79, nvidia-cuda-cccl-cu12 12.9.27, nvidia-cuda-runtime 13.0.96,
# nvidia-cuda-cccl 13.0.85 -- the latter two share nvidia/cu13/include, CCCL also under cccl/).
_CU12_DIRS = ("cuda_runtime/include", "cuda_cccl/include", "cuda_nvrtc/include", "cublas/include")
_CU13_DIRS = ("cu13/include", "cu13/include/cccl")


def _runtime_headers(inc, cudart_version: int) -> None:
    inc.mkdir(parents=True, exist_ok=True)
    (inc / "cuda_fp16.h").write_text("")
    (inc / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION  {cudart_version}\n")


def _site_packages(tmp_path, cu12: int | None = 12090, cu13: bool = True):
    """A site-packages/nvidia tree; ``cu12`` the CUDART_VERSION of the splayed runtime wheel."""
    nvidia = tmp_path / "site-packages" / "nvidia"
    for d in _CU12_DIRS if cu12 else ():
        (nvidia / d).mkdir(parents=True)
    if cu12:
        _runtime_headers(nvidia / "cuda_runtime" / "include", cu12)
        (nvidia / "cuda_cccl" / "include" / "nv").mkdir()
        (nvidia / "cuda_cccl" / "include" / "nv" / "target").write_text("")
    if cu13:
        _runtime_headers(nvidia / "cu13" / "include", 13000)
        (nvidia / "cu13" / "include" / "cccl" / "nv").mkdir(parents=True)
        (nvidia / "cu13" / "lib").mkdir()
    return nvidia


@pytest.fixture
def nvidia_at(monkeypatch):
    """Point the lookup of the ``nvidia`` namespace package at a fake tree."""
    real = importlib.util.find_spec

    def install(nvidia):
        def find_spec(name, *args, **kwargs):
            if name != "nvidia":
                return real(name, *args, **kwargs)
            spec = importlib.machinery.ModuleSpec("nvidia", None, is_package=True)
            spec.submodule_search_locations = [str(nvidia)]
            return spec

        monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    return install


def _include_options(tmp_path, monkeypatch, cudart_version: int) -> list[str]:
    seen = fake_cupy.install(monkeypatch, cudart_version).options_seen
    source = f"// {tmp_path} {cudart_version}\n"  # unique: _cuda_module is memoized
    _runtime._cuda_module(0, source, ("-std=c++17",), ("k",), "test")
    return [o[2:] for o in seen[0] if o.startswith("-I")]


def _under(nvidia, rel_dirs) -> list[str]:
    return [os.path.join(str(nvidia), d) for d in rel_dirs]


def test_cuda12_cupy_gets_the_splayed_cuda12_wheel_headers_not_cuda13s(tmp_path, monkeypatch, nvidia_at):
    nvidia = _site_packages(tmp_path)
    nvidia_at(nvidia)
    dirs = _include_options(tmp_path, monkeypatch, 12080)
    assert dirs[:2] == _under(nvidia, _CU12_DIRS[:2])  # runtime first, CCCL's <nv/target> next
    assert sorted(dirs) == sorted(_under(nvidia, _CU12_DIRS))
    assert not any("cu13" in d for d in dirs)


def test_cuda13_cupy_gets_the_cu13_wheel_headers_only(tmp_path, monkeypatch, nvidia_at):
    nvidia = _site_packages(tmp_path)
    nvidia_at(nvidia)
    assert _include_options(tmp_path, monkeypatch, 13000) == _under(nvidia, _CU13_DIRS)


def test_no_headers_of_cupys_major_passes_none(tmp_path, monkeypatch, nvidia_at):
    from cupaged._cuda_paths import cupy_include_dirs

    nvidia_at(_site_packages(tmp_path, cu12=None))
    assert cupy_include_dirs(12) == ()
    nvidia_at(_site_packages(tmp_path / "cu11", cu12=11080, cu13=False))  # splayed, but CUDA 11
    assert cupy_include_dirs(12) == ()
    assert cupy_include_dirs(11) != ()


@pytest.mark.parametrize("var", ["CUDA_PATH", "CUDA_HOME"])
def test_a_system_toolkit_leaves_header_finding_to_cupy(tmp_path, monkeypatch, nvidia_at, var):
    from cupaged._cuda_paths import cupy_include_dirs

    nvidia_at(_site_packages(tmp_path))
    monkeypatch.setenv(var, str(tmp_path / "cuda"))
    assert cupy_include_dirs(12) == () and cupy_include_dirs(13) == ()
