"""CUPAGED_SIM_FMA=1 compiles sim modules with FMA contraction (as the GPU's compiler fuses a*b+c);
the default rounds every product (-ffp-contract=off). CI runs the kernel tests once in each."""

from __future__ import annotations

import numpy as np
import pytest

from cupaged import sim
from cupaged.sim import _compile

SRC = r"""
extern "C" __global__ void axpb(const float* a, const float* b, const float* c, float* out) {
  out[0] = a[0] * b[0] + c[0];
}
"""


@pytest.mark.parametrize("fma", ["0", "1"])
def test_contraction_follows_the_switch(monkeypatch, fma):
    if fma == "1" and not _compile._cpu_has_fma():
        with pytest.raises(sim.SimCompileError, match="FMA3"):
            monkeypatch.setenv("CUPAGED_SIM_FMA", fma)
            sim.RawModule(code=SRC)
        return
    monkeypatch.setenv("CUPAGED_SIM_FMA", fma)
    a = np.float32(1 + 2.0**-12)  # a*a = 1 + 2^-11 + 2^-24: rounded to float32 the 2^-24 is lost
    out = sim.zeros(1, np.float32)
    arr = lambda v: sim.asarray(np.array([v], np.float32))  # noqa: E731
    sim.RawModule(code=SRC).get_function("axpb")((1,), (1,), (arr(a), arr(a), arr(-(1 + 2.0**-11)), out))
    assert out[0] == (np.float32(2.0**-24) if fma == "1" else 0.0)


def test_bad_value_is_rejected(monkeypatch):
    monkeypatch.setenv("CUPAGED_SIM_FMA", "yes")
    with pytest.raises(sim.SimCompileError, match="CUPAGED_SIM_FMA must be 0 or 1"):
        sim.RawModule(code=SRC + "// another source")
