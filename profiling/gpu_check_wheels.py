"""The wheels profiling/gpu_check.sh may install on a GPU image (which has numpy and cupy only), in one
list shared with profiling/prepare_gpu_wheels.sh. Each is installed without its dependencies, so the
list names them all.

    python profiling/gpu_check_wheels.py --binary | --pure   # requirement specs, for pip download
    python profiling/gpu_check_wheels.py --missing           # specs whose module this Python lacks
    python profiling/gpu_check_wheels.py --check             # versions; exit 1 if one is missing
"""

from __future__ import annotations

import importlib
import sys

# (requirement spec, import name, needed on this Python, binary wheel)
WHEELS = [
    ("ml_dtypes>=0.5", "ml_dtypes", True, True),
    ("nvtx>=0.2", "nvtx", True, True),
    ("tqdm>=4.66", "tqdm", True, False),
    ("pytest>=8", "pytest", True, False),
    ("iniconfig", "iniconfig", True, False),
    ("packaging", "packaging", True, False),
    ("pluggy", "pluggy", True, False),
    ("pygments", "pygments", True, False),
    ("hypothesis>=6.100", "hypothesis", True, False),
    ("sortedcontainers", "sortedcontainers", True, False),
    ("exceptiongroup", "exceptiongroup", sys.version_info < (3, 11), False),
    ("tomli", "tomli", sys.version_info < (3, 11), False),
    ("typing_extensions", "typing_extensions", sys.version_info < (3, 13), False),
    # cupaged.make_tensor_map on a GPU (the Hopper tests): the driver's cuTensorMapEncodeTiled
    ("cuda-bindings>=13.0,<14", "cuda.bindings", True, True),
    ("cuda-pathfinder>=1.1", "cuda.pathfinder", True, False),
]


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


def main(argv=None) -> int:
    mode = (argv if argv is not None else sys.argv[1:] or ["--check"])[0]
    if mode in ("--binary", "--pure"):
        print(" ".join(spec for spec, _, _, binary in WHEELS if binary == (mode == "--binary")))
        return 0
    needed = [(spec, mod) for spec, mod, need, _ in WHEELS if need]
    if mode == "--missing":
        print(" ".join(spec for spec, mod in needed if not _importable(mod)))
        return 0
    if mode == "--check":
        missing = 0
        for spec, mod in needed:
            if _importable(mod):
                m = sys.modules[mod]
                print(f"{mod} {getattr(m, '__version__', '?')} {getattr(m, '__file__', '')}")
            else:
                print(f"{mod} MISSING ({spec})")
                missing += 1
        return 1 if missing else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
