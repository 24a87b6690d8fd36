"""sm_90a end to end: Hopper-only kernel families in the runtime and the compile gate.

The gate (no GPU) compiles an sm_90a source with wgmma and setmaxnreg and reports the registers per
thread after each setmaxnreg; a Hopper family is compiled for sm_90a only, never for sm_80/86/89.
On cuda a Hopper family loads only on compute capability 9.0 and raises NotImplementedError naming
the family and the device's arch elsewhere, before compiling (a fake cupy here); the options it hands
CuPy's RawModule make NVRTC build sm_90a even with CuPy's own -arch=sm_90 after them (checked on this
machine's NVRTC); a real CuPy compile and launch runs where a Hopper GPU is.
"""

from __future__ import annotations

import io
import types

import numpy as np
import pytest

from cupaged import _nvrtc, _runtime, resources
from cupaged._runtime import HOPPER, KernelFamily, cuda_arch_options
from tests import fake_cupy
from tests.conftest import Backend, gpu_available, hopper_module

# Warpgroup 0 gives registers back (40), warpgroups 1 and 2 take them (232) and run one wgmma each on
# zeroed shared memory (A B^T = 0, so the accumulators keep their values).
ROLES = r"""
extern "C" __global__ void BOUNDS roles(float* out) {
  __shared__ __align__(128) unsigned char smem[4096];
  for (int i = threadIdx.x; i < 4096; i += blockDim.x) smem[i] = 0;
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    out[threadIdx.x] = 40.0f;
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  const unsigned base = (unsigned)__cvta_generic_to_shared(smem);
  const unsigned long long lbo_sbo = (8ull << 16) | (16ull << 32);  // LBO 128 B, SBO 256 B, no swizzle
  const unsigned long long da = ((base & 0x3FFFFu) >> 4) | lbo_sbo, db = (((base + 2048) & 0x3FFFFu) >> 4) | lbo_sbo;
  float d[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db), "r"(1));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  out[threadIdx.x] = 232.0f + d[0] + d[1] + d[2] + d[3];
}
"""
HOPPER_SRC = ROLES.replace("BOUNDS", "__launch_bounds__(384, 1)")
UNBOUNDED_SRC = ROLES.replace("BOUNDS", "")  # ptxas cannot tell the count at entry: setmaxnreg ignored
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not gpu_available(), reason="no GPU"))


def _family(stem, source, arch=None):
    return types.SimpleNamespace(stem=stem, source=source, name_expressions=(), options=("-std=c++17",), arch=arch)


@pytest.fixture
def compiled_archs(tmp_path, monkeypatch):
    """A private results cache; the archs compile_resources is called for, in order."""
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path))
    calls, real = [], resources.compile_resources
    monkeypatch.setattr(resources, "compile_resources", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    return calls


def test_gate_reports_setmaxnreg_of_an_sm90a_wgmma_kernel():
    (rec,) = resources.compile_resources(HOPPER_SRC, [], HOPPER, family="roles")
    assert rec.arch == "sm_90a" and rec.name_expression == "roles" and not rec.spills
    assert rec.setmaxnreg == ("dec 40", "inc 232") and not rec.setmaxnreg_ignored
    assert 0 < rec.registers <= 168  # ptxas's count at launch: 65536 / 384 threads, rounded down to 8


def test_setmaxnreg_that_ptxas_ignores_fails_the_gate(compiled_archs):
    (rec,) = resources.compile_resources(UNBOUNDED_SRC, [], HOPPER)
    assert rec.setmaxnreg == ("dec 40", "inc 232") and rec.setmaxnreg_ignored and not rec.spills
    out = io.StringIO()
    assert resources.run_gate([_family("unbounded", UNBOUNDED_SRC, HOPPER)], jobs=1, file=out) == 1
    assert "SETMAXNREG IGNORED" in out.getvalue() and "1 with setmaxnreg ignored by ptxas" in out.getvalue()


def test_setmaxnreg_in_a_called_function_is_found():
    ptx = ("\n.func _Z4giveg(\n)\n{\n\tsetmaxnreg.dec.sync.aligned.u32 24;\n\tret;\n}\n"
           ".visible .entry k(\n)\n.maxntid 256, 1, 1\n{\n\t{ // callseq 0, 0\n\tcall.uni \n\t_Z4giveg, \n\t(\n\t);\n"
           "\t} // callseq 0\n\tsetmaxnreg.inc.sync.aligned.u32 240;\n\tret;\n}\n"
           ".visible .entry plain(\n)\n{\n\tret;\n}\n")
    from cupaged._resource_cache import _setmaxnreg

    assert _setmaxnreg(ptx, "") == {"k": (("inc 240", "dec 24"), False)}
    assert _setmaxnreg(ptx, "ptxas info    : (C7508) ... 'setmaxnreg' ignored; ...") == {"k": (("inc 240", "dec 24"),
                                                                                            True)}


def test_hopper_family_is_gated_for_sm90a_only(compiled_archs):
    hopper, plain = _family("hopper", HOPPER_SRC, HOPPER), _family("plain", 'extern "C" __global__ void k() {}')
    out = io.StringIO()
    assert resources.run_gate([hopper, plain], jobs=1, file=out) == 0  # default archs: sm_80, sm_90
    assert sorted(compiled_archs) == ["sm_80", "sm_90", "sm_90a"]
    rows = [line for line in out.getvalue().splitlines() if line.startswith(("hopper", "plain"))]
    assert [r.split(" | ")[2].strip() for r in rows] == ["sm_90a", "sm_80", "sm_90"]
    assert rows[0].endswith("| dec 40 / inc 232") and "0 with spills, 0 compile errors" in out.getvalue()
    assert resources.family_archs(hopper, ("sm_80", "sm_86", "sm_89")) == ()
    assert resources.family_archs(hopper, ("sm_90a",)) == ("sm_90a",)
    assert resources.family_archs(plain, ("sm_80", "sm_89")) == ("sm_80", "sm_89")
    compiled_archs.clear()
    assert resources.compile_families([hopper], ("sm_80", "sm_86", "sm_89"), jobs=1) == {}
    assert compiled_archs == []


def test_command_line_gates_a_source_file(tmp_path, compiled_archs, capsys):
    (tmp_path / "roles.cuh").write_text(HOPPER_SRC)
    (tmp_path / "roles_main.cu").write_text('#include "roles.cuh"\n')
    assert resources.main(["--source", str(tmp_path / "roles_main.cu"), "--arch", "sm_90a", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "roles_main | roles           | sm_90a |" in out and out.splitlines()[2].endswith("| dec 40 / inc 232")
    assert compiled_archs == ["sm_90a"]
    for argv in (["--name", "k<1>"], ["--source", str(tmp_path / "missing.cu")]):
        with pytest.raises(SystemExit):
            resources.main(argv)


def test_sm90a_options_survive_cupys_own_arch():
    """CuPy appends -arch=sm_<cc> after RawModule's options (cupy/cuda/compiler.py,
    _compile_using_nvrtc_no_warning); NVRTC >= 12.9 keeps sm_90a, as this argument order shows here."""
    if _nvrtc.version() < _runtime.ARCH_NVRTC[HOPPER]:
        pytest.skip(f"NVRTC {_nvrtc.version()} rejects a second -arch")
    assert cuda_arch_options(HOPPER, "90", _nvrtc.version()) == ("-arch=sm_90a",)  # first in RawModule's options
    cupys_own = ("-std=c++17", "-ftz=true", "-arch=sm_90", "--device-as-default-execution-space", "-Xptxas=-v")
    program = _nvrtc.compile_cubin(HOPPER_SRC, arch=HOPPER, options=cupys_own)  # argv: -arch=sm_90a, then these
    assert "Compiling entry function 'roles' for 'sm_90a'" in program.log and ".target sm_90a" in program.ptx
    with pytest.raises(_nvrtc.NvrtcError, match="not supported on .target 'sm_90'"):
        _nvrtc.compile_cubin(HOPPER_SRC, arch="sm_90", options=("-std=c++17",))  # never a quiet sm_90 build


def test_cuda_arch_options():
    assert cuda_arch_options(None, "100", (12, 0)) == ()
    assert cuda_arch_options(HOPPER, "90", (12, 9)) == ("-arch=sm_90a",)
    assert cuda_arch_options(HOPPER, "90", (13, 0)) == ("-arch=sm_90a",)
    with pytest.raises(NotImplementedError, match=r"kernels_cu/h\.cu needs NVRTC >= 12\.9 .* NVRTC 12\.8 rejects"):
        cuda_arch_options(HOPPER, "90", (12, 8), "kernels_cu/h.cu")
    for cc in ("80", "86", "89", "100", "120"):
        with pytest.raises(NotImplementedError, match=rf"this source is built for sm_90a only .* device is sm_{cc},"):
            cuda_arch_options(HOPPER, cc, (13, 0))


def _fake_cupy(monkeypatch, cc, nvrtc=(13, 0)):
    cupy = fake_cupy.install(monkeypatch)
    monkeypatch.setattr(cupy.cuda.Device, "compute_capability", cc)
    cupy.cuda.nvrtc = types.SimpleNamespace(getVersion=lambda: nvrtc)
    return cupy


def _hopper_family(tmp_path, monkeypatch, tag):
    (tmp_path / "hop.cu").write_text(f"// {tag}\n{HOPPER_SRC}")
    monkeypatch.setattr(_runtime, "kernels_dir", lambda: str(tmp_path))
    monkeypatch.setenv("CUPAGED_QUIET", "1")
    fam = KernelFamily.__new__(KernelFamily)  # not registered: families() stays the shipped ones
    fam.stem, fam.name_expressions, fam.arch, fam._functions = "hop", ("roles",), HOPPER, {}
    return fam


@pytest.mark.parametrize("cc", ["80", "86", "89", "100"])
def test_hopper_family_refuses_other_devices_before_compiling(tmp_path, monkeypatch, cc):
    cupy = _fake_cupy(monkeypatch, cc)
    fam = _hopper_family(tmp_path, monkeypatch, f"refuse {cc}")
    with pytest.raises(NotImplementedError, match=rf"kernels_cu/hop\.cu is built for sm_90a only .* is sm_{cc},"):
        fam.function("roles", cupy)
    assert cupy.options_seen == []  # no RawModule: nothing compiled, nothing else launched


def test_hopper_family_compiles_for_sm90a_on_compute_capability_9_0(tmp_path, monkeypatch):
    cupy = _fake_cupy(monkeypatch, "90")
    fam = _hopper_family(tmp_path, monkeypatch, "accept")
    assert fam.function("roles", cupy) == ("kernel", "roles")
    (options,) = cupy.options_seen
    assert options[:2] == ("-arch=sm_90a", "-std=c++17") and cupy.compiled == [("roles",)]
    old = _fake_cupy(monkeypatch, "90", nvrtc=(12, 4))
    with pytest.raises(NotImplementedError, match="NVRTC 12.4 rejects a second -arch"):
        _hopper_family(tmp_path, monkeypatch, "old nvrtc").function("roles", old)


def test_other_families_keep_cupys_arch(tmp_path, monkeypatch):
    cupy = _fake_cupy(monkeypatch, "100")
    fam = _hopper_family(tmp_path, monkeypatch, "portable")
    fam.arch = None
    fam.function("roles", cupy)
    assert not any(o.startswith("-arch") for o in cupy.options_seen[0])


def test_family_arch_is_checked():
    with pytest.raises(ValueError, match="arch must be None or one of"):
        KernelFamily("never_registered", [], arch="sm_90")
    assert "never_registered" not in {f.stem for f in _runtime.families()} and KernelFamily.arch is None


@pytest.mark.parametrize("name", ["sim", CUDA])
def test_hopper_module_runs_its_roles(name):
    """The sim runs sm_90a code like any other; on cuda hopper_module builds it with CuPy for sm_90a."""
    be = Backend(name)
    kernel = hopper_module(be, HOPPER_SRC).get_function("roles")
    out = be.empty((384,), np.float32)
    kernel((1,), (384,), (out,))
    np.testing.assert_array_equal(be.to_numpy(out), np.repeat(np.float32([40, 242, 242]), 128))


@pytest.mark.skipif(not gpu_available(), reason="no GPU")
def test_hopper_source_is_refused_on_a_gpu_that_is_not_compute_capability_9_0():
    import cupy

    cc = str(cupy.cuda.Device(0).compute_capability)
    if cc == "90":
        pytest.skip("device 0 is sm_90: it loads sm_90a code")
    with pytest.raises(NotImplementedError, match=f"is sm_{cc},"):
        _runtime._cuda_module(0, HOPPER_SRC, ("-std=c++17",), (), "hopper test", HOPPER)
