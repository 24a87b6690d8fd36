"""The sim's compiler check and compile cache: only g++ >= 12 is accepted, the cache is keyed by
the compiler's identity, an object that does not load is never cached, and a compile is announced
on stderr (once, and never under CUPAGED_QUIET)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from cupaged import sim
from cupaged.sim import _compile

SRC = r"""
extern "C" __global__ void fill(float* out, float v) { out[threadIdx.x] = v; }
"""


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    """A private cache directory, and compiler() looked up again under each test's CXX."""
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUPAGED_QUIET", raising=False)
    _compile.compiler.cache_clear()
    yield tmp_path / "cache" / "sim"
    _compile.compiler.cache_clear()


def _cached(d) -> list[str]:
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _works(module) -> None:
    out = sim.zeros(4)
    module.get_function("fill")((1,), (4,), (out, np.float32(2.5)))
    np.testing.assert_array_equal(out, 2.5)


def _script(path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_a_c_compiler_driver_is_rejected_up_front(fresh_cache, monkeypatch):
    """CXX=gcc compiles C++ but does not link libstdc++: its module failed to load (undefined
    symbol), and was cached under the key g++ would use, poisoning every later run."""
    monkeypatch.setenv("CXX", "gcc")
    with pytest.raises(sim.SimCompileError, match=r"CXX=gcc \(.*gcc\) is a C compiler driver.*set CXX to g\+\+"):
        sim.RawModule(code=SRC)
    assert _cached(fresh_cache) == []
    monkeypatch.delenv("CXX")
    _compile.compiler.cache_clear()
    _works(sim.RawModule(code=SRC))


@pytest.mark.parametrize("macros, found", [("#define __clang__ 1\n#define __GNUC__ 4", "is clang"),
                                           ("#define __GNUC__ 11", "is GCC 11"), ("", "is not GCC")])
def test_clang_and_old_gcc_are_rejected(tmp_path, monkeypatch, macros, found):
    fake = _script(tmp_path / "fake-cxx", f"printf '{macros}\\n'\n")
    monkeypatch.setenv("CXX", fake)
    with pytest.raises(sim.SimCompileError, match=rf"needs g\+\+ >= 12; CXX={re.escape(fake)} .* {found}$"):
        _compile.compiler()


def test_a_missing_compiler_is_named(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-anywhere")
    with pytest.raises(sim.SimCompileError, match="CXX=no-such-compiler-anywhere is not on PATH"):
        _compile.compiler()


def test_cache_is_keyed_by_the_compiler(fresh_cache, tmp_path, monkeypatch):
    _works(sim.RawModule(code=SRC))
    assert len(_cached(fresh_cache)) == 2  # .so and .smem
    wrapper = _script(tmp_path / "my-g++", f'exec {shutil.which("g++")} "$@"\n')
    monkeypatch.setenv("CXX", wrapper)
    _compile.compiler.cache_clear()
    assert _compile.compiler()[1].startswith(wrapper + "\n")
    _works(sim.RawModule(code=SRC))
    assert len(_cached(fresh_cache)) == 4  # the same source, a second object


def test_an_object_that_does_not_load_is_not_cached(fresh_cache):
    """gcc, let past the check, links an object with undefined C++ runtime symbols. In a fresh
    process: once something in this one has loaded the C++ runtime globally, such an object loads."""
    script = f"""
import shutil
from cupaged import sim
from cupaged.sim import _compile
_compile.compiler = lambda: (shutil.which("gcc"), "gcc, unchecked")
try:
    sim.RawModule(code={SRC!r})
except sim.SimCompileError as e:
    print(e)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert re.search("does not load, so it was not cached: .*undefined symbol", run.stdout, re.S), run.stdout + run.stderr
    assert _cached(fresh_cache) == []  # no object, no metadata, no temp directory


def test_a_cached_object_that_no_longer_loads_is_rebuilt(fresh_cache):
    _works(sim.RawModule(code=SRC))
    (so,) = [f for f in _cached(fresh_cache) if f.endswith(".so")]
    broken = fresh_cache / "broken"
    broken.write_bytes(b"not an ELF file")
    broken.chmod(0o700)
    os.replace(broken, fresh_cache / so)  # a new inode: the loader cannot reuse the loaded one
    _works(sim.RawModule(code=SRC))
    assert (fresh_cache / so).read_bytes()[:4] == b"\x7fELF"


def test_a_compile_is_announced_once(capfd):
    _works(sim.RawModule(code=SRC, label="kernels_cu/tiny.cu"))
    err = capfd.readouterr().err
    assert re.fullmatch(r"cupaged: compiling kernels_cu/tiny\.cu for the sim \(g\+\+, 1 kernel\) \.\.\. "
                        r"\d+\.\d s\n", err), err
    _works(sim.RawModule(code=SRC, label="kernels_cu/tiny.cu"))  # a cache hit: silent
    assert capfd.readouterr().err == ""


def test_a_failed_compile_finishes_its_notice(capfd):
    with pytest.raises(sim.SimCompileError, match="undeclared_value"):
        sim.RawModule(code="extern \"C\" __global__ void k(float* o) { o[0] = undeclared_value; }")
    err = capfd.readouterr().err
    assert re.fullmatch(r"cupaged: compiling a 1-line CUDA source for the sim \(g\+\+, 1 kernel\) \.\.\. "
                        r"failed after \d+\.\d s\n", err), err


def test_quiet_silences_the_notice(capfd, monkeypatch):
    monkeypatch.setenv("CUPAGED_QUIET", "1")
    _works(sim.RawModule(code=SRC))
    assert capfd.readouterr().err == ""
