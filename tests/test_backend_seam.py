"""The backend seam: only ``cupaged/_backend.py`` tests which backend an array or array module belongs to, and
its helpers (``is_host_array``, ``on_sim``, ``device_key``, ``to_device``, ``resolve_array_module``) answer
as the branches they replaced did, on numpy and the sim (the cupy paths through a fake cupy, or a GPU)."""

from __future__ import annotations

import ast
import pathlib
import types

import numpy as np
import pytest

from cupaged import _backend, sim
from tests import fake_cupy
from tests.conftest import gpu_available

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "cupaged"

# _backend.py is the seam itself. cupaged/sim/ is the numpy backend's implementation: its arrays are numpy by
# definition, so telling numpy from something else there is input checking, not choosing a backend.
# cupaged/reference/ and testing.py need no exemption: the references are numpy throughout and testing.py
# places arrays through _backend.
ALLOWED = (PACKAGE / "_backend.py", PACKAGE / "sim")

_BACKEND_NAMES = {"np", "numpy", "cupy", "cp", "sim"}
_ARRAY_TYPES = {"ndarray", "generic"}


def _is_array_type(node) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in _ARRAY_TYPES


def _names_backend(node) -> bool:
    """A backend module (np, cupy, sim), an array type (np.ndarray) or a module's name (xp.__name__)."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_backend(e) for e in node.elts)
    if isinstance(node, ast.Name):
        return node.id in _BACKEND_NAMES
    return _is_array_type(node) or (isinstance(node, ast.Attribute) and node.attr == "__name__")


def _is_sys_modules(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def _is_cupy_string(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.split(".")[0] == "cupy"


def _presence_test(node) -> bool:
    """``cupy is None``: whether a module is there (gpu_module's answer), not which backend an array has."""
    return all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) and any(
        isinstance(o, ast.Constant) and o.value is None for o in (node.left, *node.comparators))


def backend_tests(tree) -> list[tuple[int, str]]:
    """(line, what) for every backend test in a module's syntax tree."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                and len(node.args) == 2:
            types = node.args[1]
            elts = types.elts if isinstance(types, ast.Tuple) else [types]
            if any(_is_array_type(t) for t in elts):
                found.append((node.lineno, f"isinstance(..., {ast.unparse(types)})"))
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if _presence_test(node):
                continue
            if any(_names_backend(o) for o in operands) or \
                    (any(_is_sys_modules(o) for o in operands) and any(_is_cupy_string(o) for o in operands)):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_sys_modules(node.func.value) \
                and any(_is_cupy_string(a) for a in node.args):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Subscript) and _is_sys_modules(node.value) and _is_cupy_string(node.slice):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def _scanned():
    for path in sorted(PACKAGE.rglob("*.py")):
        if not any(path == a or a in path.parents for a in ALLOWED):
            yield path


def test_only_backend_py_tests_the_backend():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}" for path in _scanned()
             for line, what in backend_tests(ast.parse(path.read_text(), str(path)))]
    assert not found, ("backend tests outside cupaged/_backend.py (ask _backend: is_host_array, is_device_array, "
                       "on_sim, device_key, ...):\n" + "\n".join(found))


@pytest.mark.parametrize("source, caught", [
    ("isinstance(a, np.ndarray)", True),
    ("isinstance(a, (np.ndarray, np.generic))", True),
    ("isinstance(a, cupy.ndarray)", True),
    ("isinstance(a, np.integer)", False),
    ("xp is np", True),
    ("xp is not numpy", True),
    ("self.xp is sim", True),
    ("xp in (np, sim)", True),
    ("type(a) is np.ndarray", True),
    ("module == xp.__name__", True),
    ("sys.modules.get('cupy')", True),
    ("sys.modules['cupy']", True),
    ("'cupy' in sys.modules", True),
    ("sys.modules.get('cupaged.sim')", False),
    ("cupy is None", False),
    ("cupy is not None and isinstance(a, cupy.ndarray)", True),
    ("a.dtype == np.float32", False),
    ("def f(a: np.ndarray) -> np.ndarray: pass", False),
    ("if __name__ == '__main__': pass", False),
])
def test_scanner_catches_backend_tests_and_nothing_else(source, caught):
    assert bool(backend_tests(ast.parse(source))) is caught


def test_is_host_array():
    assert _backend.is_host_array(np.zeros(3))
    assert _backend.is_host_array(sim.empty((3,), np.float32))
    for value in (np.float32(1), [1.0], 1.0, None):
        assert not _backend.is_host_array(value)


def test_on_sim():
    assert _backend.on_sim(np) and _backend.on_sim(sim)
    assert not _backend.on_sim(object())


def test_device_key():
    assert _backend.device_key(np) == "numpy"


def test_to_device_on_the_sim_is_guarded_memory():
    a = np.arange(6, dtype=np.float32)
    got = _backend.to_device(np, a, "a")
    np.testing.assert_array_equal(got, a)
    assert not np.shares_memory(got, a)
    assert sim.asarray(got) is got  # the sim takes it as it is: it lives in guarded memory
    assert _backend.to_device(np, got, "a") is got


def test_resolve_array_module():
    assert _backend.resolve_array_module(np) is sim
    assert _backend.resolve_array_module(sim) is sim
    assert _backend.resolve_array_module(None) is (_backend.gpu_module() or sim)
    with pytest.raises(TypeError, match=r"^kv must be None, numpy, cupaged.sim or cupy, got 'numpy'$"):
        _backend.resolve_array_module("numpy", "kv")
    with pytest.raises(TypeError, match=r"^xp must be None, numpy, cupaged.sim or cupy, got <module 'cupy'>$"):
        _backend.resolve_array_module(types.ModuleType("cupy"))  # not the cupy that is imported


def test_fake_cupy_paths(monkeypatch):
    cupy = fake_cupy.install(monkeypatch)
    assert _backend.resolve_array_module(cupy) is cupy
    assert not _backend.on_sim(cupy)
    assert _backend.device_key(cupy) == ("cupy", 0)
    uploaded = _backend.to_device(cupy, np.ones(2), "a")
    assert isinstance(uploaded, cupy.ndarray) and uploaded.via == "asarray"
    assert not _backend.is_host_array(uploaded)
    cupy.capturing = True
    with pytest.raises(ValueError, match="^a is a host"):
        _backend.to_device(cupy, np.ones(2), "a")


@pytest.mark.skipif(not gpu_available(), reason="no GPU")
def test_gpu_paths():
    cupy = _backend.require_gpu()
    a = np.arange(4, dtype=np.float32)
    got = _backend.to_device(cupy, a, "a")
    assert not _backend.is_host_array(got) and _backend.is_device_array(got)
    np.testing.assert_array_equal(got.get(), a)
    assert not _backend.on_sim(cupy)
    assert _backend.device_key(cupy) == ("cupy", cupy.cuda.Device().id)
    assert _backend.resolve_array_module(cupy) is cupy
