"""Compile gate: every kernel family compiles with NVRTC for sm_80 and sm_90 without spills.

No GPU needed (NVRTC runs ptxas on the CPU). The gate itself is proven on throwaway sources
below, independent of which families exist yet: kernels that must spill and must not, a spill in
a called device function, and sources and options that must fail with the compiler's log.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import struct
import sys
import types

import pytest

from cupaged import _runtime, resources
from cupaged._nvrtc import NvrtcError, compile_cubin
from cupaged.resources import (ARCHS, compile_families, compile_resources, family_archs, kernel_resources,
                               run_gate)

FAMILIES = {f.stem: f for f in _runtime.families()}
GATE_TEST = "test_family_compiles_without_spills"


@pytest.fixture(scope="module")
def compiled(request):
    """Compile every selected (family, arch) once, in parallel worker processes (results are
    cached per user, keyed by everything that goes into the compile: a rerun is fast)."""
    params = [item.callspec.params for item in request.session.items
              if item.originalname == GATE_TEST and hasattr(item, "callspec")]
    stems = sorted({p["stem"] for p in params})
    archs = tuple(sorted({p["arch"].rstrip("a") for p in params}))  # a Hopper family's sm_90a comes of sm_90
    return compile_families(stems, archs)


@pytest.mark.parametrize("stem, arch", [(stem, arch) for stem in sorted(FAMILIES)
                                         for arch in family_archs(FAMILIES[stem], ARCHS)])
def test_family_compiles_without_spills(compiled, stem, arch):
    outcome = compiled[(stem, arch)]
    if isinstance(outcome, NvrtcError):
        pytest.fail(f"kernels_cu/{stem}.cu does not compile for {arch}:\n{outcome}", pytrace=False)
    spilling = [f"{r.name_expression}: {r.spill_stores} B stored, {r.spill_loads} B loaded"
                for r in outcome if r.spills]
    if spilling:
        pytest.fail(f"kernels_cu/{stem}.cu spills registers on {arch}:\n" + "\n".join(spilling), pytrace=False)
    assert {r.name_expression for r in outcome} >= set(FAMILIES[stem].name_expressions)


# All N values are live across the barrier; __launch_bounds__(1024, 2) caps a thread at 32
# registers (65536 / 2048), so hold_live_capped<64> must spill while hold_live<64> (~40) need not.
HOLD_LIVE = r"""
namespace gate {
template <int N>
__device__ __forceinline__ void hold(float* out, const float* in) {
  float v[N];
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = in[threadIdx.x + 32 * i];
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) out[threadIdx.x + 32 * i] = v[i] * v[N - 1 - i];
}
template <int N> __global__ void hold_live(float* out, const float* in) { hold<N>(out, in); }
template <int N> __global__ void __launch_bounds__(1024, 2) hold_live_capped(float* out, const float* in) {
  hold<N>(out, in);
}
template <int N> __device__ __noinline__ void hold_call(float* out, const float* in) {
  hold<N>(out, in);
}
template <int N> __global__ void __launch_bounds__(1024, 2) calls_spilling(float* out, const float* in) {
  hold_call<N>(out, in);
}
}  // namespace gate
"""

# A dynamically indexed local array lives on the stack without being a spill.
STACK_AND_SHARED = r"""
#include <cuda_fp16.h>
namespace gate {
template <typename T>
__global__ void local_array(T* out, const float* in, const int* index) {
  __shared__ float tile[256];
  float scratch[64];
  for (int i = 0; i < 64; ++i) scratch[i] = in[i * blockDim.x + threadIdx.x];
  float sum = 0.f;
#pragma unroll 1
  for (int i = 0; i < 64; ++i) sum += scratch[(i * 7 + index[threadIdx.x]) & 63];
  tile[threadIdx.x] = sum;
  __syncthreads();
  out[threadIdx.x] = T(tile[255 - threadIdx.x]);
}
}  // namespace gate
"""

BROKEN = r"""
__global__ void broken(float* out) { out[threadIdx.x] = undeclared_value; }
"""


def _by_name(records):
    return {r.name_expression: r for r in records}


@pytest.mark.parametrize("arch", ARCHS)
def test_launch_bounds_spill_is_detected(arch):
    got = _by_name(compile_resources(HOLD_LIVE, ["gate::hold_live<64>", "gate::hold_live_capped<64>"], arch))
    capped, free = got["gate::hold_live_capped<64>"], got["gate::hold_live<64>"]
    assert capped.spills and capped.spill_stores > 0 and capped.spill_loads > 0
    assert capped.registers <= 32 and capped.stack_bytes > 0
    assert not free.spills and free.registers > 32
    assert capped.mangled_name != free.mangled_name and capped.arch == arch


def test_maxrregcount_spill_is_detected():
    (rec,) = compile_resources(HOLD_LIVE, ["gate::hold_live<64>"], "sm_90",
                               options=("-std=c++17", "-maxrregcount=32"))
    assert rec.spills and rec.registers <= 32


def test_spill_in_called_device_function_is_charged_to_the_kernel():
    (rec,) = compile_resources(HOLD_LIVE, ["gate::calls_spilling<64>"], "sm_80")
    assert rec.spills


@pytest.mark.parametrize("arch", ARCHS)
def test_local_array_is_stack_not_spill(arch):
    names = ["gate::local_array<__half>", "gate::local_array<float>"]
    records = compile_resources(STACK_AND_SHARED, names, arch, family="stack")
    assert [r.name_expression for r in records] == names
    for rec in records:
        assert rec.family == "stack" and rec.registers > 0
        assert not rec.spills and rec.stack_bytes >= 64 * 4
        assert rec.shared_bytes == 256 * 4


def test_compile_error_raises_with_log():
    with pytest.raises(NvrtcError) as info:
        compile_resources(BROKEN, [], "sm_90", family="broken")
    err = info.value
    assert "undeclared_value" in err.log and "error" in err.log
    assert "broken.cu" in str(err) and "undeclared_value" in str(err)
    copy = pickle.loads(pickle.dumps(err))  # crosses process boundaries intact
    assert type(copy) is NvrtcError and copy.log == err.log and str(copy) == str(err)


def test_unknown_option_and_virtual_arch_are_rejected():
    with pytest.raises(NvrtcError, match="no-such-option"):
        compile_cubin(BROKEN, arch="sm_90", options=("--no-such-option",))
    with pytest.raises(ValueError, match="real architecture"):
        compile_cubin(BROKEN, arch="compute_90")


def test_cubin_is_complete_and_names_are_lowered():
    program = compile_cubin(STACK_AND_SHARED, arch="sm_80", options=("-std=c++17",),
                            name_expressions=["gate::local_array<float>"])
    cubin, mangled = program.cubin, program.lowered_names["gate::local_array<float>"]
    assert cubin[:4] == b"\x7fELF" and mangled.startswith("_ZN4gate11local_array")
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    assert shoff + shentsize * shnum <= len(cubin)  # CuPy's getCUBIN is one byte short here
    assert mangled.encode() in cubin


def _family(stem, source, names):
    return types.SimpleNamespace(stem=stem, source=source, name_expressions=names, options=("-std=c++17",))


def test_run_gate_exit_status():
    good = _family("good", HOLD_LIVE, ["gate::hold_live<32>"])
    spilling = _family("spilling", HOLD_LIVE, ["gate::hold_live_capped<64>"])
    broken = _family("broken", BROKEN, [])
    out = io.StringIO()
    assert run_gate([good], archs=("sm_90",), jobs=1, file=out) == 0
    assert "gate::hold_live<32> | sm_90" in out.getvalue() and "0 with spills" in out.getvalue()
    out = io.StringIO()
    assert run_gate([good, spilling, broken], archs=("sm_90",), jobs=2, file=out) == 1
    text = out.getvalue()
    assert "SPILLS" in text and "COMPILE ERROR in broken (sm_90)" in text and "undeclared_value" in text
    with pytest.raises(NvrtcError, match=r"broken \(sm_90\)"):
        kernel_resources([good, broken], archs=("sm_90",), jobs=1)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """A private results cache; the arches compile_resources is called for, in order."""
    monkeypatch.setenv("CUPAGED_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CUPAGED_QUIET", raising=False)
    calls, real = [], resources.compile_resources
    monkeypatch.setattr(resources, "compile_resources", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    return calls


def _gate(progress=None, **options):
    """run_gate on one small family in this process: (table, progress text)."""
    out, progress = io.StringIO(), progress or io.StringIO()
    assert run_gate([_family("small", HOLD_LIVE, ["gate::hold_live<32>"])], jobs=1, file=out,
                    progress=progress, **options) == 0
    return out.getvalue(), progress.getvalue()


def test_results_are_cached_and_no_cache_recompiles(counted, tmp_path):
    table, progress = _gate()
    assert counted == list(ARCHS)
    assert re.fullmatch(r"compiling 2 of 2 family x arch with NVRTC in 1 process\(es\)\n"
                        r"\[1/2\] small sm_80 done in \d+\.\d s\n\[2/2\] small sm_90 done in \d+\.\d s\n", progress)
    files = sorted(os.listdir(tmp_path / "resources"))
    assert [f.split("-")[:2] for f in files] == [["small", "sm_80"], ["small", "sm_90"]]
    assert all(os.stat(tmp_path / "resources" / f).st_mode & 0o777 == 0o600 for f in files)

    again, progress = _gate()
    assert counted == list(ARCHS)  # nothing compiled
    assert progress == "[1/2] small sm_80 cached\n[2/2] small sm_90 cached\n"
    assert again.splitlines()[:-1] == table.splitlines()[:-1]  # the same table
    assert "(2 of 2 family x arch results cached; --no-cache recompiles)" in again.splitlines()[-1]

    _, progress = _gate(cache=False)
    assert counted == list(ARCHS) * 2 and progress.count("done in") == 2


def test_a_cache_file_that_is_not_private_or_not_valid_is_recompiled(counted, tmp_path):
    _gate()
    sm80, sm90 = sorted(tmp_path.joinpath("resources").iterdir())
    sm80.chmod(0o664)  # writable by the group: never read (and deleted)
    sm90.write_text("[{\"registers\": 1}]")
    sm90.chmod(0o600)
    _, progress = _gate()
    assert counted == list(ARCHS) * 2 and progress.count("done in") == 2
    _, progress = _gate()
    assert counted == list(ARCHS) * 2 and progress.count("cached") == 2


def test_progress_is_a_bar_on_a_terminal_and_quiet_silences_it(counted, monkeypatch):
    _, progress = _gate(progress=_Terminal())
    lines = progress.split("\n")
    assert lines[0].startswith("compiling 2 of 2") and lines[2] == ""
    frames = lines[1].split("\r")[1:]
    assert frames[0].startswith("[" + "#" * 15 + "." * 15 + "] 1/2 small sm_80 done in ")
    assert frames[1].startswith("[" + "#" * 30 + "] 2/2 small sm_90 done in ") and frames[1].endswith("\x1b[K")
    monkeypatch.setenv("CUPAGED_QUIET", "1")
    assert _gate(progress=_Terminal())[1] == ""


def test_command_line_cache_flag(monkeypatch, capsys):
    from cupaged.__main__ import main as cupaged_main

    seen = []
    monkeypatch.setattr(resources, "run_gate", lambda *a, **k: seen.append((a, k)) or 0)
    assert resources.main([]) == 0 and cupaged_main(["resources", "cache_ops", "--no-cache", "--arch", "sm_90"]) == 0
    assert seen == [((None, ARCHS, None), {"cache": True, "progress": sys.stderr}),
                    ((["cache_ops"], ("sm_90",), None), {"cache": False, "progress": sys.stderr})]
    with pytest.raises(SystemExit):
        cupaged_main(["resources", "--help"])
    assert "--no-cache" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_kernels_hold_their_register_budgets(arch):
    """paged_decode_kernel stays within PD_REGISTERS (128 a thread: 4 CTAs of 128 threads an SM) and
    paged_decode_mma_kernel within PM_REGISTERS (168: 3 CTAs, which its stages allow at most): the occupancy the plan
    sizes its splits from (cupaged/_attention_kernels.py resident_ctas). Eight query rows on CUDA cores took 222-255.
    (mla_decode_kernel and paged_prefill_kernel are held to 255, their shared memory to 2 CTAs an SM or fewer.)"""
    from cupaged._attention_kernels import kernel_constants

    c = kernel_constants()
    outcome = compile_families(["paged_attention"], (arch,))[("paged_attention", arch)]
    decode = [r for r in outcome if "paged_decode" in r.name_expression]
    assert len(decode) >= 50
    budget = {r.name_expression: c["PM_REGISTERS" if "decode_mma" in r.name_expression else "PD_REGISTERS"]
              for r in decode}
    over = [f"{r.name_expression}: {r.registers} > {budget[r.name_expression]}" for r in decode
            if r.registers > budget[r.name_expression]]
    assert not over, "\n".join(over)
