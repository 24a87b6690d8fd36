#!/usr/bin/env bash
# Download the small wheels profiling/gpu_check.sh installs on a GPU machine that reaches no package
# registry (its image has Python 3, numpy and cupy-cuda13x, nothing else the project needs):
#
#     bash profiling/prepare_gpu_wheels.sh [DIR]     # DIR defaults to gpu-wheels/ (gitignored)
#
# The list (profiling/gpu_check_wheels.py, also what gpu_check.sh checks): ml_dtypes, nvtx, pytest,
# hypothesis and their dependencies, each without its own dependencies (--no-deps: numpy is the
# image's), for CPython 3.10-3.14 on manylinux x86_64 (ml_dtypes and nvtx are binary: one wheel per
# Python version; the rest are pure). About 30 MB. Needs pip and the network here, not there.
set -u
cd "$(dirname "$0")/.." || exit 1
DIR=${1:-gpu-wheels}
PY=${PYTHON:-python3}
PLATFORM=${GPU_WHEELS_PLATFORM:-x86_64}
mkdir -p "$DIR" || exit 1
read -r -a BINARY <<<"$("$PY" profiling/gpu_check_wheels.py --binary)"
read -r -a PURE <<<"$("$PY" profiling/gpu_check_wheels.py --pure)"
rc=0
for v in 3.10 3.11 3.12 3.13 3.14; do
    tag=cp${v/./}
    # a version without a wheel for the newest Python is not an error: that Python is not the image's
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DIR" \
        --platform "manylinux2014_$PLATFORM" --platform "manylinux_2_17_$PLATFORM" \
        --platform "manylinux_2_28_$PLATFORM" --python-version "$v" --implementation cp --abi "$tag" \
        "${BINARY[@]}" || { echo "prepare_gpu_wheels: no binary wheels for Python $v" >&2; [ "$v" = 3.14 ] || rc=1; }
done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DIR" --python-version 3.10 \
    --implementation py --abi none --platform any "${PURE[@]}" || rc=1
ls -1 "$DIR"
du -sh "$DIR"
exit $rc
