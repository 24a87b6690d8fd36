"""Shared test fixtures: the backend parametrization. The one tolerance table and assert_close live in
cupaged.testing (docs/conventions.md §4)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from cupaged import _backend, sim, testing
from cupaged.sim import _env

assert_close = testing.assert_close  # for the tests that import it from here


def gpu_available() -> bool:
    """cupy sees a usable GPU (cupaged._backend.probe_gpu, memoized there)."""
    return _backend.probe_gpu().cupy is not None


def pytest_addoption(parser):
    parser.addoption("--backend", choices=("auto", "cuda"), default="auto",
                     help="cuda: a test skipped for 'no GPU' fails, naming why cupy cannot use the GPU "
                          "(also CUPAGED_REQUIRE_GPU=1); auto (default): such tests are skipped")


def _require_gpu(config) -> bool:
    return config.getoption("--backend") == "cuda" or os.environ.get("CUPAGED_REQUIRE_GPU", "0") not in ("", "0")


def pytest_report_header(config):
    if _require_gpu(config):
        return f"cupaged GPU required: {_backend.probe_gpu().message()}"


def pytest_runtest_logstart(nodeid, location):
    _env.breadcrumb("CUPAGED_TEST_TRACE", nodeid)  # the test a crash report names (.ci/run)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and "no GPU" in str(report.longrepr) and _require_gpu(item.config):
        report.outcome = "failed"
        report.longrepr = (f"skipped for 'no GPU' under --backend cuda / CUPAGED_REQUIRE_GPU=1: "
                           f"{_backend.probe_gpu().message()}")
    return report


class Backend:
    """Puts test data where a backend's kernels read it: guarded numpy (sim) or cupy (cuda).
    ``order``: the sim's scheduling order the test runs under (None: the environment's)."""

    def __init__(self, name: str, order: str | None = None):
        self.name, self.order = name, order

    @property
    def xp(self):
        if self.name == "sim":
            return np
        import cupy

        return cupy

    def asarray(self, a):
        a = np.asarray(a)
        return sim.asarray(a) if self.name == "sim" else self.xp.asarray(a)

    def empty(self, shape, dtype):
        return sim.empty(shape, dtype) if self.name == "sim" else self.xp.empty(shape, dtype)

    def to_numpy(self, a) -> np.ndarray:
        return a if isinstance(a, np.ndarray) else a.get()

    def __repr__(self):
        return self.name if self.order in (None, "natural") else f"{self.name}-{self.order.partition(':')[0]}"


# Every kernel test runs on the sim in three scheduling orders (natural: warps in lockstep; reverse:
# each warp runs ahead between barriers; random: both, seeded), so a missing barrier shows up. The
# other sim modes (CUPAGED_SIM_POISON=large, CUPAGED_SIM_FMA=1, CUPAGED_SIM_BOUNDS=1) are one more
# pass each over the kernel tests (`-m kernel`) in natural order: a sum of modes, not a product.
_OTHER_MODE = (os.environ.get("CUPAGED_SIM_POISON", "nan") != "nan" or os.environ.get("CUPAGED_SIM_FMA", "0") != "0"
               or os.environ.get("CUPAGED_SIM_BOUNDS", "0") != "0")
SIM_ORDERS = ("natural",) if _OTHER_MODE else ("natural", "reverse", "random:2024")
BACKENDS = [*(pytest.param(("sim", o), id=repr(Backend("sim", o))) for o in SIM_ORDERS),
            pytest.param(("cuda", None), id="cuda", marks=pytest.mark.skipif(not gpu_available(), reason="no GPU"))]


SLOW_ORDERS = {"test_paged_attention_sm90.py": "[sim-reverse-"}  # modules whose default run skips an order


def pytest_collection_modifyitems(items):
    for item in items:  # a kernel test: one that runs on a backend
        if "backend" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kernel)
            order = SLOW_ORDERS.get(item.path.name)
            if order and order in item.name.replace("[sim-reverse]", "[sim-reverse-"):
                item.add_marker(pytest.mark.slow)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> Backend:
    name, order = request.param
    if order is not None:
        monkeypatch.setenv("CUPAGED_SIM_ORDER", order)
    return Backend(name, order)


def raw_module(backend: Backend, code: str, name_expressions=(), options=("-std=c++17",)):
    """``code`` compiled for ``backend``: a cupaged.sim.RawModule, or a cupy.RawModule on device 0
    (with the CUDA headers of CuPy's CUDA major). Both have ``get_function(name)``."""
    from cupaged import _runtime

    names, options = tuple(name_expressions), tuple(options)
    if backend.name == "sim":
        return _runtime.sim_module(code, options, names, None)
    return _runtime._cuda_module(0, code, options, names, None)


def hopper_module(backend: Backend, code: str, name_expressions=(), options=("-std=c++17",)):
    """``code`` (wgmma, setmaxnreg, TMA: sm_90a) compiled for ``backend`` as raw_module does, but on cuda
    for sm_90a (cupaged._runtime.cuda_arch_options); skipped "no GPU ..." unless device 0 has compute
    capability 9.0, the one that loads sm_90a code."""
    from cupaged import _runtime

    names, options = tuple(name_expressions), tuple(options)
    if backend.name == "sim":
        return _runtime.sim_module(code, options, names, None)
    import cupy

    cc = str(cupy.cuda.Device(0).compute_capability)
    if cc != "90":
        pytest.skip(f"no GPU of compute capability 9.0 for sm_90a code: device 0 is sm_{cc}")
    return _runtime._cuda_module(0, code, options, names, None, _runtime.HOPPER)


def cuda_arch_at_least(backend: Backend, cc: int) -> bool:
    """True on the sim (it runs every instruction it knows); on cuda, compute capability >= cc."""
    if backend.name == "sim":
        return True
    import cupy

    return int(cupy.cuda.Device(0).compute_capability) >= cc
