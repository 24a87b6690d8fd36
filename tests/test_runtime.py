"""The kernel runtime: source loading, header inlining, module memoization, backend selection."""

from __future__ import annotations

import os
import re
import sys
import types

import numpy as np
import pytest

from cupaged import _runtime
from cupaged._backend import array_module
from cupaged._runtime import KernelFamily, families, kernels_dir
from tests import fake_cupy


def test_kernels_dir_holds_every_family_source():
    stems = {f.stem for f in families()}
    assert "cache_ops" in stems
    for stem in stems:
        assert os.path.isfile(os.path.join(kernels_dir(), stem + ".cu"))


def test_own_headers_are_inlined_once_and_system_headers_kept():
    src = families()[0].source
    assert '#include "' not in src
    assert src.count("struct alignas(sizeof(T) * N) Vec") == 1  # common.cuh, inlined once
    assert "#include <cuda_fp16.h>" in src


def test_nested_and_repeated_includes(tmp_path, monkeypatch):
    (tmp_path / "a.cuh").write_text('#pragma once\n#include "b.cuh"\nint a;\n')
    (tmp_path / "b.cuh").write_text("#pragma once\nint b;\n")
    (tmp_path / "fam.cu").write_text('#include "a.cuh"\n#include "b.cuh"\nint c;\n')
    monkeypatch.setattr(_runtime, "kernels_dir", lambda: str(tmp_path))
    fam = KernelFamily.__new__(KernelFamily)
    fam.stem, fam.name_expressions, fam._functions = "fam", (), {}
    src = fam.source
    assert src.count("int b;") == 1 and src.count("int a;") == 1 and "int c;" in src
    assert src.index("int b;") < src.index("int a;") < src.index("int c;")


def test_modules_are_memoized():
    fam = next(f for f in families() if f.stem == "cache_ops")
    name = fam.name_expressions[0]
    assert fam.function(name, np) is fam.function(name, np)
    with pytest.raises(KeyError, match="not a name expression"):
        fam.function("cupaged::no_such_kernel<float>", np)


def test_array_module():
    a = np.zeros(3)
    assert array_module(x=a, y=None) is np
    with pytest.raises(TypeError, match="x must be a numpy or cupy array, got list"):
        array_module(x=[1, 2])


def test_array_module_rejects_a_mix(monkeypatch):
    fake = types.ModuleType("cupy")
    fake.ndarray = type("ndarray", (), {})
    monkeypatch.setitem(sys.modules, "cupy", fake)
    assert array_module(q=fake.ndarray()) is fake
    with pytest.raises(TypeError, match=r"cupy: q; numpy: k, v"):
        array_module(q=fake.ndarray(), k=np.zeros(1), v=np.zeros(1))


def test_selftest_passes_on_the_sim(capsys):
    from cupaged.selftest import run

    assert run("sim") == 0
    out = capsys.readouterr().out
    assert "reshape_and_cache_flash float16 NHD" in out and "FAIL" not in out and "ERROR" not in out


def test_selftest_reports_failures(monkeypatch, capsys):
    from cupaged import selftest

    monkeypatch.setattr(selftest, "CASES", {"wrong": lambda asarray, rng: (1.0, 0.5),
                                            "raises": lambda asarray, rng: 1 / 0})
    assert selftest.run("sim") == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "ERROR ZeroDivisionError" in out and "0 of 2 kernels ok" in out


def test_selftest_streams_rows_in_fixed_columns(monkeypatch):
    """Each row is out before the next case starts; columns are sized from the labels up front."""
    import io

    from cupaged import selftest

    out = io.StringIO()

    def second(asarray, rng):
        assert out.getvalue().splitlines()[1].startswith("a long first label | sim ")
        return 0.25, 1.0

    monkeypatch.setattr(selftest, "CASES", {"a long first label": lambda asarray, rng: (1.5e-7, 1e-5),
                                            "second": second})
    assert selftest.run("sim", out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == "kernel             | backend | max abs error | tolerance | ok"
    assert lines[1] == "a long first label | sim     | 1.5e-07       | 1e-05     | ok"
    assert lines[2] == "second             | sim     | 0.25          | 1         | ok"
    assert lines[3].startswith("2 of 2 kernels ok on sim in ")


def test_struct_arg_for_each_backend(monkeypatch):
    """The sim gets the numpy scalar; CuPy gets a CPointer to the struct's bytes."""
    from cupaged._backend import struct_arg

    value = np.zeros((), np.dtype([("a", np.int64), ("b", np.float32)], align=True))
    assert isinstance(struct_arg(value, np), np.void) and struct_arg(value, np).dtype.itemsize == 16
    function = types.ModuleType("cupy.cuda.function")
    function.CPointer = lambda address: ("CPointer", address)
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setitem(sys.modules, "cupy.cuda", types.ModuleType("cupy.cuda"))
    monkeypatch.setitem(sys.modules, "cupy.cuda.function", function)
    assert struct_arg(value, sys.modules["cupy"]) == ("CPointer", value.ctypes.data)


def _tiny_family(tmp_path, monkeypatch, tag: str) -> KernelFamily:
    """A one-kernel family in a temporary kernels_cu (not registered); ``tag`` makes its source
    unique, so no module memoized by another test serves it."""
    (tmp_path / "tiny.cu").write_text(f'// {tag}\nextern "C" __global__ void k(float* out) {{ out[threadIdx.x] = 1.0f; }}\n')
    monkeypatch.setattr(_runtime, "kernels_dir", lambda: str(tmp_path))
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUPAGED_QUIET", raising=False)
    fam = KernelFamily.__new__(KernelFamily)
    fam.stem, fam.name_expressions, fam._functions = "tiny", ("k",), {}
    return fam


def test_first_compile_of_a_family_is_announced(tmp_path, monkeypatch, capfd):
    fam = _tiny_family(tmp_path, monkeypatch, "announced")
    kernel = fam.function("k", np)
    err = capfd.readouterr().err
    assert re.fullmatch(r"cupaged: compiling kernels_cu/tiny\.cu for the sim \(g\+\+, 1 kernel\) \.\.\. \d+\.\d s\n", err), err
    assert fam.function("k", np) is kernel and capfd.readouterr().err == ""  # memoized: silent


def test_quiet_family_compile(tmp_path, monkeypatch, capfd):
    fam = _tiny_family(tmp_path, monkeypatch, "quiet")
    monkeypatch.setenv("CUPAGED_QUIET", "1")
    fam.function("k", np)
    assert capfd.readouterr().err == ""


def test_cuda_compile_is_announced_only_when_slow(tmp_path, monkeypatch, capfd):
    """CuPy compiles lazily and caches on disk: the notice times RawModule.compile() and speaks
    only past CUDA_NOTICE_S (a fake cupy here: no GPU needed)."""
    cupy = fake_cupy.install(monkeypatch)
    for tag, threshold, notice in (("fast", 1e9, False), ("slow", 1e-9, True)):
        fam = _tiny_family(tmp_path, monkeypatch, tag)
        monkeypatch.setattr(_runtime, "CUDA_NOTICE_S", threshold)
        assert fam.function("k", cupy) == ("kernel", "k")
        err = capfd.readouterr().err
        if notice:
            assert re.fullmatch(r"cupaged: compiled kernels_cu/tiny\.cu for sm_90 \(NVRTC, 1 kernel\) in \d+\.\d s\n", err), err
        else:
            assert err == ""
    assert cupy.compiled == [("k",), ("k",)]


def test_cuda_compiles_one_instantiation_on_first_use(tmp_path, monkeypatch):
    """On a GPU the first call of an op builds only the instantiation it launches (a family's
    every name expression in one NVRTC program took 42-122 s on 2 cores), and later calls reuse
    the kernel object: no new module, no new RawKernel per call (a fake cupy: no GPU needed)."""
    cupy = fake_cupy.install(monkeypatch)
    (tmp_path / "two.cu").write_text('// two\ntemplate <int N> __global__ void k(float* out) { out[N] = 1.0f; }\n')
    monkeypatch.setattr(_runtime, "kernels_dir", lambda: str(tmp_path))
    monkeypatch.setenv("CUPAGED_QUIET", "1")
    fam = KernelFamily.__new__(KernelFamily)
    fam.stem, fam.name_expressions, fam._functions = "two", ("k<1>", "k<2>", "k<3>"), {}
    first = fam.function("k<2>", cupy)
    assert cupy.compiled == [("k<2>",)]
    assert fam.function("k<2>", cupy) is first and cupy.compiled == [("k<2>",)]
    fam.function("k<3>", cupy)
    assert cupy.compiled == [("k<2>",), ("k<3>",)]
