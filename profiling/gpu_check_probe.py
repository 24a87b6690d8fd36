"""Probe phase of profiling/gpu_check.sh: the GPU, driver, CuPy and NVRTC versions, and which CUDA
headers CuPy and cupaged will compile against. Exit 1 if CuPy cannot use a device, or cannot compile
a kernel that includes cuda_fp16.h / cuda_bf16.h / cuda_fp8.h; every other finding is printed
(failures as "?: <error>"), never fatal."""

from __future__ import annotations

import inspect
import os
import platform
import sys


def show(label, fn):
    try:
        value = fn()
    except Exception as e:  # a finding we could not make is printed, not fatal
        value = f"?: {type(e).__name__}: {e}"
    print(f"{label}: {value}", flush=True)
    return value


def main() -> int:
    print(f"python: {sys.version.split()[0]} ({sys.executable}) on {platform.platform()}")
    import cupy

    rt = cupy.cuda.runtime
    show("cupy", lambda: f"{cupy.__version__} ({os.path.dirname(cupy.__file__)})")
    n = rt.getDeviceCount()
    print(f"devices: {n}")
    if n < 1:
        return 1
    props = rt.getDeviceProperties(0)
    print(f"device 0: {props['name'].decode()} sm_{props['major']}{props['minor']} "
          f"{props['multiProcessorCount']} SMs {props['totalGlobalMem'] / 2**30:.1f} GiB "
          f"smem/block opt-in {props.get('sharedMemPerBlockOptin', '?')} B")
    show("driver (CUDA API version)", rt.driverGetVersion)
    show("runtime version", rt.runtimeGetVersion)
    show("nvrtc version", lambda: cupy.cuda.nvrtc.getVersion())
    show("cupy cuda path", lambda: cupy.cuda.get_cuda_path())
    show("cupy nvcc path", lambda: cupy.cuda.get_nvcc_path())

    def pathfinder():
        from cuda import pathfinder as pf
        out = {}
        for lib in ("cudart", "nvrtc", "cccl"):
            try:
                out[lib] = pf.find_nvidia_header_directory(lib)
            except Exception as e:
                out[lib] = f"?: {type(e).__name__}: {e}"
        return out
    show("cuda.pathfinder header dirs", pathfinder)

    def cupy_includes():
        from cupy import _environment as env
        major, minor = divmod(rt.runtimeGetVersion() // 10, 100)
        fn = getattr(env, "_get_include_dir_from_conda_or_wheel", None)
        return fn(major, minor) if fn else "(no _get_include_dir_from_conda_or_wheel in this CuPy)"
    show("cupy wheel include dirs", cupy_includes)

    try:
        from cupaged import _cuda_paths
    except Exception as e:
        print(f"cupaged._cuda_paths: ?: {type(e).__name__}: {e}")
        _cuda_paths = None
    for name in getattr(_cuda_paths, "__all__", ()):
        fn = getattr(_cuda_paths, name)
        if inspect.isfunction(fn) and not any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                              p.POSITIONAL_OR_KEYWORD) for p in inspect.signature(fn).parameters.values()):
            show(f"cupaged._cuda_paths.{name}()", fn)

    def compile_headers():
        src = ('#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n'
               'extern "C" __global__ void k(float* x) { x[0] = __half2float(__float2half(x[0])) + '
               '__bfloat162float(__float2bfloat16(1.0f)) + float(__nv_fp8_e4m3(1.0f)); }')
        x = cupy.zeros(1, cupy.float32)
        cupy.RawKernel(src, "k")((1,), (1,), (x,))
        return f"ok (k -> {float(x.get()[0])}, expected 3.0)"
    ok = show("cupy.RawKernel with cuda_fp16/bf16/fp8 headers", compile_headers)
    try:
        cupy.show_config()
    except Exception as e:
        print(f"cupy.show_config: ?: {e}")
    return 0 if str(ok).startswith("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
