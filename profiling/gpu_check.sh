#!/usr/bin/env bash
# One check of cupaged on a real GPU, run from the repo root of a checkout on a machine that reaches no
# package registry (an H200 image with a driver, Python 3 and cupy-cuda13x; see profiling/README.md,
# "GPU check"):
#
#     bash profiling/gpu_check.sh [--wheels DIR] [--only PHASE,...]
#
# Phases: probe (GPU, driver, CuPy, NVRTC, the CUDA headers CuPy and cupaged use), install (the wheels
# of profiling/gpu_check_wheels.py this Python lacks, from DIR, prepared elsewhere with
# profiling/prepare_gpu_wheels.sh: pip install --no-index --no-deps --target a temp dir; nothing when
# all import), selftest (python -m cupaged selftest --backend cuda), demo (python -m cupaged demo --verify
# --backend cuda, then in bfloat16 at 4x the requests), tests (pytest -m "not slow" -k cuda
# with CUPAGED_REQUIRE_GPU=1 and --backend cuda), bench_* (each profiling/bench_*.py but pool/sim, small
# sizes, --json), ncu (one decode launch), memcheck, racecheck and synccheck (compute-sanitizer on
# profiling/gpu_check_kernels.py). ncu / compute-sanitizer absent or unusable (no permission, device
# unsupported): skipped. Each phase's log is $OUT/<phase>.log, its status and one-line verdict a line of
# $OUT/summary.txt ($OUT: env, default ./gpu-check-out). Every phase has a timeout, all together a
# budget of GPU_CHECK_BUDGET seconds (default 510); a phase left without time fails.
#
# The GPU is probed first, before anything is installed: without nvidia-smi working and CuPy seeing a
# device every phase is "skipped (no GPU)" and the exit status is 3, within seconds. Exit 0 only when
# the probe and every selected phase passed; 1 otherwise; 2 on a usage error. PYTHON picks the
# interpreter (default python3); --only PHASE,... runs the probe and those phases ("bench": all benches).
set -u
cd "$(dirname "$0")/.." || exit 2

WHEELS="" ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS=${2:-}; shift 2 || { echo "gpu_check: --wheels needs a DIR" >&2; exit 2; } ;;
        --wheels=*) WHEELS=${1#--wheels=}; shift ;;
        --only) ONLY=${2:-}; shift 2 || { echo "gpu_check: --only needs a list" >&2; exit 2; } ;;
        --only=*) ONLY=${1#--only=}; shift ;;
        -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

OUT=${OUT:-./gpu-check-out}
mkdir -p "$OUT" || exit 2
SUMMARY=$OUT/summary.txt
BUDGET=${GPU_CHECK_BUDGET:-510}
PY=${PYTHON:-$(command -v python3 || command -v python || echo python3)}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1

BENCHES=()
for f in profiling/bench_*.py; do
    b=$(basename "$f" .py)
    case "$b" in bench_pool|bench_sim) ;; *) BENCHES+=("$b") ;; esac  # CPU-only benches
done
PHASES=(probe install selftest demo tests "${BENCHES[@]}" ncu memcheck racecheck synccheck)

FAILED=0 PASSED=0 SKIPPED=0
{
    echo "cupaged gpu_check $(date -u '+%Y-%m-%dT%H:%M:%SZ') on $(hostname 2>/dev/null || echo '?')"
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' (+ local changes)')  python $PY  OUT $OUT"
} >"$SUMMARY"

record() {  # phase status rc verdict: one line of the summary
    case "$2" in passed) PASSED=$((PASSED + 1)) ;; skipped*) SKIPPED=$((SKIPPED + 1)) ;; *) FAILED=$((FAILED + 1)) ;; esac
    printf '%-26s %-16s rc=%-4s %s\n' "$1" "$2" "$3" "$4" >>"$SUMMARY"
}

selected() {  # is phase $1 to run (--only)?
    [ -z "$ONLY" ] && return 0
    local p
    for p in ${ONLY//,/ }; do
        [ "$p" = "$1" ] && return 0
        [ "$p" = bench ] && [ "${1#bench_}" != "$1" ] && return 0
    done
    return 1
}

RC=0 TIMED_OUT=0
run() {  # phase cap cmd...: run cmd under timeout into $OUT/phase.log (appended); sets RC, TIMED_OUT
    local phase=$1 cap=$2 left
    shift 2
    left=$((BUDGET - SECONDS - 5))
    [ "$cap" -gt "$left" ] && cap=$left
    TIMED_OUT=0
    if [ "$cap" -lt 5 ]; then
        echo "gpu_check: no time left in the ${BUDGET} s budget" >>"$OUT/$phase.log"
        RC=124 TIMED_OUT=1
        return
    fi
    echo "\$ $* (timeout ${cap} s)" >>"$OUT/$phase.log"
    timeout -k 10 "$cap" "$@" >>"$OUT/$phase.log" 2>&1
    RC=$?
    if [ $RC -eq 124 ] || [ $RC -eq 137 ]; then
        TIMED_OUT=1
        echo "gpu_check: timed out after ${cap} s" >>"$OUT/$phase.log"
    fi
}

last_line() { grep -v '^\s*$' "$1" 2>/dev/null | tail -n 1 | cut -c1-160; }

finish() {
    echo "RESULT: $1 ($PASSED passed, $FAILED failed, $SKIPPED skipped; ${SECONDS} s)" >>"$SUMMARY"
    cat "$SUMMARY"
    exit "$2"
}

# ---- probe: a GPU, before anything else --------------------------------------------------------
for p in "${PHASES[@]}"; do rm -f "$OUT/$p.log"; done
SMI="not found"
if command -v nvidia-smi >/dev/null 2>&1; then
    run probe 15 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    if [ $RC -eq 0 ]; then SMI="ok: $(tail -n 1 "$OUT/probe.log")"; else SMI="failed (rc $RC): $(last_line "$OUT/probe.log")"; fi
fi
run probe 30 "$PY" -c 'import cupy, sys; n = cupy.cuda.runtime.getDeviceCount(); print("cupy", cupy.__version__, "sees", n, "device(s)"); sys.exit(0 if n > 0 else 1)'
CUPY_RC=$RC CUPY="$(last_line "$OUT/probe.log")"
case "$SMI" in ok:*) SMI_OK=1 ;; *) SMI_OK=0 ;; esac
if [ $CUPY_RC -ne 0 ] && [ $SMI_OK -eq 0 ]; then
    why="nvidia-smi: $SMI; cupy: $CUPY"
    for p in "${PHASES[@]}"; do record "$p" "skipped (no GPU)" - "$( [ "$p" = probe ] && echo "$why" || echo "not run: no GPU" )"; done
    finish "FAIL: no GPU, nothing ran (never green without one)" 3
fi
if [ $CUPY_RC -ne 0 ]; then
    record probe FAILED "$CUPY_RC" "nvidia-smi sees a GPU ($SMI) but cupy cannot use it: $CUPY"
    for p in "${PHASES[@]:1}"; do record "$p" "skipped (probe failed)" - "not run: cupy cannot use the GPU"; done
    finish "FAIL: the GPU is not usable from cupy" 1
fi
run probe 60 "$PY" profiling/gpu_check_probe.py
if [ $RC -eq 0 ]; then
    record probe passed 0 "$(grep -m1 '^device 0:' "$OUT/probe.log" | cut -c11-); driver $(grep -m1 '^driver' "$OUT/probe.log" | sed 's/.*: //'); $CUPY; nvidia-smi $SMI"
else
    record probe FAILED "$RC" "$(last_line "$OUT/probe.log")"
fi

# ---- install: only what this Python lacks, only from --wheels DIR -------------------------------
if selected install; then
    read -r -a MISSING <<<"$("$PY" profiling/gpu_check_wheels.py --missing 2>>"$OUT/install.log")"
    if [ ${#MISSING[@]} -eq 0 ]; then
        echo "every module of profiling/gpu_check_wheels.py imports: pip not run" >>"$OUT/install.log"
        record install passed 0 "nothing to install: all modules import (pip not run)"
    elif [ -z "$WHEELS" ] || [ ! -d "$WHEELS" ]; then
        record install FAILED - "missing ${MISSING[*]} and no --wheels DIR (make one with profiling/prepare_gpu_wheels.sh)"
    else
        SITE=$(mktemp -d "${TMPDIR:-/tmp}/cupaged-gpu-check-site.XXXXXX")
        run install 60 "$PY" -m pip install --no-index --find-links "$WHEELS" --no-deps --no-compile \
            --disable-pip-version-check --target "$SITE" "${MISSING[@]}"
        export PYTHONPATH="$PYTHONPATH:$SITE"
        if [ $RC -eq 0 ] && "$PY" profiling/gpu_check_wheels.py --check >>"$OUT/install.log" 2>&1; then
            record install passed 0 "installed ${MISSING[*]} from $WHEELS into $SITE"
        else
            record install FAILED "$RC" "installing ${MISSING[*]} from $WHEELS: $(last_line "$OUT/install.log")"
        fi
    fi
else
    record install "skipped (--only)" - ""
fi

# ---- selftest: every kernel family on the GPU; a fall-back to the sim fails -----------------------
if selected selftest; then
    run selftest 150 "$PY" -m cupaged selftest --backend cuda
    v=$(grep -E 'kernels ok on' "$OUT/selftest.log" | tail -n 1)
    if [ $TIMED_OUT -eq 1 ]; then record selftest FAILED "$RC" "timed out: $(last_line "$OUT/selftest.log")"
    elif grep -q 'on sim' "$OUT/selftest.log"; then record selftest FAILED "$RC" "ran on the sim, not the GPU: $v"
    elif [ $RC -ne 0 ] || ! grep -q 'on cuda' "$OUT/selftest.log"; then record selftest FAILED "$RC" "${v:-$(last_line "$OUT/selftest.log")}"
    else record selftest passed 0 "$v"; fi
else
    record selftest "skipped (--only)" - ""
fi

# ---- demo: the serving loop on the GPU, teacher-forced against float64 (float32, then bf16 bigger) ----
if selected demo; then
    run demo 120 "$PY" -m cupaged demo --verify --backend cuda
    [ $RC -eq 0 ] && run demo 120 "$PY" -m cupaged demo --verify --backend cuda --dtype bfloat16 --requests 64 \
        --max-num-seqs 32 --num-blocks 160 --token-budget 256
    v=$(grep -E '^(tokens/s|verify:)' "$OUT/demo.log" | sed 's/ (tolerance.*: / /; s/ over .* s on the / on the /' | tr '\n' ' ' | tr -s ' ')
    if [ $TIMED_OUT -eq 1 ]; then record demo FAILED "$RC" "timed out: $(last_line "$OUT/demo.log")"
    elif [ $RC -ne 0 ] || [ "$(grep -c 'PASS$' "$OUT/demo.log")" -ne 2 ]; then record demo FAILED "$RC" "${v:-$(last_line "$OUT/demo.log")}"
    else record demo passed 0 "$v"; fi
else
    record demo "skipped (--only)" - ""
fi

# ---- tests: the cuda tests; a "no GPU" skip fails -------------------------------------------------
if selected tests; then
    TEST_ARGS=(-q -m "not slow" -k cuda -rs -p no:cacheprovider)
    note=""
    if grep -q -- '"--backend"' tests/conftest.py 2>/dev/null; then TEST_ARGS+=(--backend cuda)
    else note=" (tests/conftest.py has no --backend option: CUPAGED_REQUIRE_GPU=1 only)"; fi
    CUPAGED_REQUIRE_GPU=1 run tests 200 "$PY" -m pytest "${TEST_ARGS[@]}"
    v=$(grep -E '(passed|failed|error|no tests ran)' "$OUT/tests.log" | tail -n 1 | tr -d '=' | sed 's/^ *//')
    if [ $TIMED_OUT -eq 1 ]; then record tests FAILED "$RC" "timed out$note: $(last_line "$OUT/tests.log")"
    elif grep -qi 'SKIPPED.*no GPU' "$OUT/tests.log"; then record tests FAILED "$RC" "cuda tests skipped for want of a GPU$note: $v"
    elif [ $RC -ne 0 ] || ! grep -q ' passed' <<<"$v"; then record tests FAILED "$RC" "${v:-$(last_line "$OUT/tests.log")}$note"
    else record tests passed 0 "$v$note"; fi
else
    record tests "skipped (--only)" - ""
fi

# ---- benches: small sizes, JSON rows; a sim smoke run fails -------------------------------------
for b in "${BENCHES[@]}"; do
    if ! selected "$b"; then record "$b" "skipped (--only)" - ""; continue; fi
    args=(--json "$OUT/$b.json")
    cap=40
    [ "$b" = bench_paged_attention ] && args+=(--quick) && cap=60
    rm -f "$OUT/$b.json"
    run "$b" $cap "$PY" "profiling/$b.py" "${args[@]}"
    rows=$("$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(len(d.get("rows", [])), "rows, device", d.get("device", "?"))' "$OUT/$b.json" 2>/dev/null)
    if [ $TIMED_OUT -eq 1 ]; then record "$b" FAILED "$RC" "timed out: $(last_line "$OUT/$b.log")"
    elif [ $RC -ne 0 ]; then record "$b" FAILED "$RC" "$(last_line "$OUT/$b.log")"
    elif grep -q 'SIM SMOKE RUN' "$OUT/$b.log" || grep -q 'device sim' <<<"$rows"; then record "$b" FAILED 0 "ran on the sim, not the GPU"
    elif [ -z "$rows" ]; then record "$b" FAILED 0 "no JSON written to $OUT/$b.json"
    else record "$b" passed 0 "$rows -> $OUT/$b.json"; fi
done

find_tool() {  # on PATH, else in the usual CUDA / Nsight install places
    command -v "$1" 2>/dev/null && return
    local c
    for c in /usr/local/cuda/bin/"$1" /usr/local/cuda-*/bin/"$1" /opt/nvidia/nsight-compute/*/"$1"; do
        [ -x "$c" ] && { echo "$c"; return; }
    done
}

# ---- ncu: one decode launch ---------------------------------------------------------------------
if ! selected ncu; then record ncu "skipped (--only)" - ""
elif NCU=$(find_tool ncu) && [ -n "$NCU" ]; then
    # SpeedOfLight for the duration; smsp__inst_executed.sum: warp instructions executed, beside the
    # sim's warp_instructions for the same launch (profiling/README.md, "Issued instructions")
    run ncu 90 "$NCU" --nvtx --launch-count 1 -k regex:paged_decode --section SpeedOfLight \
        --metrics smsp__inst_executed.sum "$PY" profiling/gpu_check_kernels.py decode
    err=$(grep -m1 -E 'ERR_NVGPUCTRPERM|==ERROR==' "$OUT/ncu.log" | cut -c1-120)
    if [ $TIMED_OUT -eq 1 ]; then record ncu FAILED "$RC" "timed out: $(last_line "$OUT/ncu.log")"
    elif grep -q 'ERR_NVGPUCTRPERM' "$OUT/ncu.log"; then record ncu "skipped (ncu unusable)" "$RC" "$err"
    elif grep -qE '^decode: (FAIL|ERROR)' "$OUT/ncu.log"; then record ncu FAILED "$RC" "$(grep -m1 '^decode:' "$OUT/ncu.log")"
    elif [ $RC -ne 0 ] && [ -n "$err" ]; then record ncu "skipped (ncu unusable)" "$RC" "$err"
    elif [ $RC -ne 0 ]; then record ncu FAILED "$RC" "$(last_line "$OUT/ncu.log")"
    elif grep -q 'No kernels were profiled' "$OUT/ncu.log"; then record ncu FAILED 0 "no paged_decode launch profiled"
    else record ncu passed 0 "paged_decode: $(grep -m1 -E '^\s+Duration' "$OUT/ncu.log" | tr -s ' ' | sed 's/^ //'); $(grep -m1 -E 'smsp__inst_executed.sum' "$OUT/ncu.log" | tr -s ' ' | sed 's/^ //')"; fi
else
    record ncu "skipped (ncu not found)" - ""
fi

# ---- compute-sanitizer: memcheck and racecheck on a few kernels, synccheck on the prefill routes --------------
# (on sm_90 "prefill" runs paged_prefill_sm90_kernel: mbarriers, named barriers, warpgroups; "prefill80" the
# mma.sync one through an sm_80 plan)
SAN=$(find_tool compute-sanitizer)
for tool in memcheck racecheck synccheck; do
    if ! selected $tool; then record $tool "skipped (--only)" - ""; continue; fi
    if [ -z "$SAN" ]; then record $tool "skipped (compute-sanitizer not found)" - ""; continue; fi
    cases=(decode prefill prefill80 flash merge)
    cap=90; [ $tool = racecheck ] && cap=150
    [ $tool = synccheck ] && cap=60 && cases=(prefill prefill80)
    run $tool $cap "$SAN" --tool $tool --error-exitcode 86 --print-limit 20 --report-api-errors no \
        "$PY" profiling/gpu_check_kernels.py "${cases[@]}"
    log=$OUT/$tool.log
    summ=$(grep -m1 -E 'ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY' "$log" | sed 's/^=* *//')
    err=$(grep -m1 -E '^========= (Error|Internal error)|not supported|permission' "$log" | sed 's/^=* *//' | cut -c1-120)
    kernels="$(grep -cE '^(decode|prefill|prefill80|flash|merge): ok' "$log") of ${#cases[@]} kernels ok"
    if [ $TIMED_OUT -eq 1 ]; then record $tool FAILED "$RC" "timed out: $(last_line "$log")"
    elif [ -z "$summ" ] && [ -n "$err" ]; then record $tool "skipped (compute-sanitizer unusable)" "$RC" "$err"
    elif [ $RC -ne 0 ]; then record $tool FAILED "$RC" "${summ:-$(last_line "$log")}; $kernels"
    else record $tool passed 0 "${summ:-no summary}; $kernels"; fi
done

if [ $FAILED -eq 0 ]; then finish PASS 0; else finish FAIL 1; fi
