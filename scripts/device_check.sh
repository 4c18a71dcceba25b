#!/usr/bin/env bash
# The whole GPU round on the device machine (Hopper GPU, no network), from the repository root:
#   wheels   pip install --no-deps the wheels in ./wheels (nvidia-cutlass, fla-core, einops, and
#            FlashKDA: flash_kda-*.whl from scripts/build_flashkda.sh if present, else the prebuilt
#            tokenspeed_flashkda-*.whl; git-ignored, so the device call must carry them:
#            carry=["wheels"]); env.txt records their versions and whether `import flash_kda`
#            works with the device's torch
#   build    MAX_JOBS=16 pip install --no-build-isolation --no-deps -e .   (log: $OUT/build.log)
#   tests    python -m pytest tests -m gpu_sm90 -v --tb=short              (log: $OUT/gpu_tests.log,
#            errors of every comparison: $OUT/error_table.md)
#   sanitizer scripts/sanitizer_check.sh: memcheck, racecheck, synccheck (logs: $OUT/sanitizer_*.log)
#   bench    python benchmarks/bench_kda_prefill.py --quick --json $OUT/bench.json --md $OUT/bench.md
#            python benchmarks/bench_serving.py (the serving row: $OUT/bench_serving.{json,md})
# plus $OUT/env.txt (GPU, driver, versions, commit), $OUT/summary.txt, and all of it in
# $OUT/device_check_all.tgz (for remote runners that return only a few files).
#
#   OUT=/path bash scripts/device_check.sh       (OUT defaults to ./device_out)
# Env: SKIP_WHEELS=1 SKIP_BUILD=1 SKIP_TESTS=1 SKIP_SANITIZER=1 SKIP_BENCH=1 skip a stage; COMMIT=<sha> names the
# commit when .git did not travel; PYTHON (default python3); MAX_JOBS (default 16);
# BENCH_ARGS (default "--quick"); TRITON_CACHE_DIR (default ./.triton_cache, git-ignored: FLA 0.6.0
# stores its Triton autotuning results there, and the bench stage packs them, the *.autotune.json
# files only, into $OUT/triton_autotune.tgz; unpacked into ./.triton_cache and carried to the next
# device call, they spare FLA's autotuning, ~10-100 s per new shape); PYTEST_ARGS (default "-v --tb=short": every test named in the log; no -x, so one failure does not hide the rest).
# TEST_GROUPS: ';'-separated pytest targets run as parallel processes, e.g.
#   TEST_GROUPS="tests/test_sm90.py -k grid;tests/test_sm90.py -k 'not grid';tests/test_serving.py tests/test_cooperative.py tests/test_op.py;tests/test_fla_backend.py tests/test_build.py tests/test_bench.py"
# (logs gpu_tests_<i>.log, error_table_<i>.md; the quotes inside a group are not parsed: use -k expressions without spaces or split groups by file).
# Exit code: 0 when every stage that ran passed.
set -o pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

OUT=${OUT:-$PWD/device_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton_cache}
export MAX_JOBS=${MAX_JOBS:-16}
T0=$SECONDS
SUMMARY=()
FAILED=0

note() { echo "[device_check] $*"; }
record() {  # record NAME STATUS SECONDS [DETAIL]
  local line
  line=$(printf '%-7s %-8s %5ss  %s' "$1" "$2" "$3" "${4:-}")
  SUMMARY+=("$line")
  note "stage $1: $2 in $3s ${4:-}"
  case $2 in ok | skipped) ;; *) FAILED=1 ;; esac
}
stage_begin() { echo; note "=== $1 ($(date -u +%H:%M:%S) UTC, +$((SECONDS - T0))s)"; S0=$SECONDS; }

# --- environment -----------------------------------------------------------------------------------
stage_begin env
COMMIT_ID=${COMMIT:-$(git rev-parse --verify -q HEAD 2>/dev/null || true)}
COMMIT_ID=${COMMIT_ID:-${COMMIT:-unknown (no .git; pass COMMIT=<sha>)}}
{
  echo "date_utc: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $COMMIT_ID"
  echo "host: $(hostname) cpus: $(nproc)"
  echo "python: $($PY --version 2>&1) ($(command -v "$PY"))"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  echo "nvcc: $(nvcc --version 2>&1 | tail -1)"
  $PY - <<'EOF' 2>&1
import importlib, importlib.metadata as md
import torch
print(f"torch: {torch.__version__} (CUDA {torch.version.cuda})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu: {p.name}, capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
          f"{p.total_memory / 2**30:.1f} GiB")
else:
    print("gpu: torch.cuda.is_available() is False")
for dist in ("triton", "fla-core", "nvidia-cutlass", "einops", "numpy"):
    try:
        print(f"{dist}: {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist}: not installed")
EOF
  echo "--- nvidia-smi"
  nvidia-smi 2>&1
} >"$OUT/env.txt"
sed -n '1,12p' "$OUT/env.txt"
record env ok $((SECONDS - S0)) "$OUT/env.txt"

# --- wheels -------------------------------------------------------------------------------------------
if [[ "${SKIP_WHEELS:-0}" == 1 ]]; then
  record wheels skipped 0
else
  stage_begin wheels
  shopt -s nullglob
  whls=(wheels/nvidia_cutlass-*.whl wheels/fla_core-*.whl wheels/einops-*.whl)
  # A FlashKDA wheel built from source (scripts/build_flashkda.sh) exists because the prebuilt one
  # did not load with this torch, so it wins. Installed on its own: the prebuilt wheel is cp312
  # only, and a refusal must not keep FLA out.
  fk=(wheels/flash_kda-*.whl)
  ((${#fk[@]})) || fk=(wheels/tokenspeed_flashkda-*.whl)
  shopt -u nullglob
  fk_note=""
  if ((${#fk[@]})) && ! $PY -m pip install -q --no-index --no-deps --no-cache-dir "${fk[@]}"; then
    fk_note="; WARNING: pip refused ${fk[*]} (FlashKDA columns will say why)"
  fi
  if ((${#whls[@]} == 0)); then
    record wheels missing $((SECONDS - S0)) "no wheels in ./wheels (carry=[\"wheels\"] in the device call?)"
  elif $PY -m pip install -q --no-index --no-deps --no-cache-dir "${whls[@]}"; then
    if $PY -c 'import einops' 2>/dev/null; then
      record wheels ok $((SECONDS - S0)) "${whls[*]} ${fk[*]}$fk_note"
    else
      record wheels ok $((SECONDS - S0)) "${whls[*]} ${fk[*]}$fk_note; WARNING: einops missing (fla needs it)"
    fi
  else
    record wheels FAILED $((SECONDS - S0)) "pip install ${whls[*]}"
  fi
  # env.txt was written before the wheels went in: add the versions they brought, and whether
  # FlashKDA's extension loads with this torch (a wheel built against another torch fails here).
  {
    for dist in fla-core nvidia-cutlass einops tokenspeed-flashkda flash_kda; do
      v=$($PY -m pip show "$dist" 2>/dev/null | sed -n 's/^Version: //p')
      echo "$dist (after the wheels stage): ${v:-not installed}"
    done
    $PY - <<'EOF' 2>&1
import torch
try:
    import flash_kda
    print(f"import flash_kda with torch {torch.__version__}: ok ({flash_kda.__file__})")
except Exception as exc:
    first = (str(exc).splitlines() or [""])[0][:300]
    print(f"import flash_kda with torch {torch.__version__}: FAILED: {type(exc).__name__}: {first}")
EOF
  } >>"$OUT/env.txt"
  grep -E '^(import flash_kda|tokenspeed-flashkda|flash_kda) ' "$OUT/env.txt"
fi

# --- build ---------------------------------------------------------------------------------------------
if [[ "${SKIP_BUILD:-0}" == 1 ]]; then
  record build skipped 0
else
  stage_begin "build (MAX_JOBS=$MAX_JOBS)"
  if CULA_REQUIRE_KERNELS=1 $PY -m pip install -v --no-index --no-build-isolation --no-deps -e . \
      >"$OUT/build.log" 2>&1 &&
     $PY -c 'import cula, sys; print("cula._C loaded:", cula.kernels_available()); sys.exit(0 if cula.kernels_available() else cula.kernels_unavailable_reason())' \
      >>"$OUT/build.log" 2>&1; then
    sed -nE 's@^\s*(\[[0-9]+/[0-9]+\]).* -c ([^ -][^ ]*).*@\1 \2@p' "$OUT/build.log" | tail -30
    note "build.log: $(grep -ci 'warning' "$OUT/build.log") line(s) mention a warning"
    grep -E 'bytes spill (stores|loads)' "$OUT/build.log" | grep -vE ' 0 bytes spill stores, 0 bytes spill loads' | head -5
    record build ok $((SECONDS - S0)) "$OUT/build.log"
  else
    tail -60 "$OUT/build.log"
    record build FAILED $((SECONDS - S0)) "see $OUT/build.log"
  fi
fi

# --- GPU tests -------------------------------------------------------------------------------------------
if [[ "${SKIP_TESTS:-0}" == 1 ]]; then
  record tests skipped 0
else
  stage_begin "GPU tests"
  if [[ -n "${TEST_GROUPS:-}" ]]; then
    # Parallel pytest processes on the one GPU (the suite is mostly host-bound: ~6 min serial,
    # ~4.5 min in four groups), each with its own log and error table; rc: the worst of them.
    IFS=';' read -r -a groups <<<"$TEST_GROUPS"
    pids=()
    for i in "${!groups[@]}"; do
      # shellcheck disable=SC2086
      (CULA_SM90_ERROR_TABLE="$OUT/error_table_$i.md" $PY -m pytest ${groups[$i]} -m gpu_sm90 \
        ${PYTEST_ARGS:--v --tb=short} -rfEs >"$OUT/gpu_tests_$i.log" 2>&1) &
      pids+=($!)
    done
    rc=0
    : >"$OUT/gpu_tests.log"
    for i in "${!pids[@]}"; do  # not in a pipeline: wait needs this shell's children
      wait "${pids[$i]}"
      r=$?
      ((r > rc)) && rc=$r
      echo "group $i (${groups[$i]}): rc=$r: $(tail -1 "$OUT/gpu_tests_$i.log")" >>"$OUT/gpu_tests.log"
    done
    cat "$OUT/gpu_tests.log"
    for i in "${!groups[@]}"; do cat "$OUT/gpu_tests_$i.log"; done >>"$OUT/gpu_tests.log"
  else
    # shellcheck disable=SC2086
    CULA_SM90_ERROR_TABLE="$OUT/error_table.md" $PY -m pytest tests -m gpu_sm90 ${PYTEST_ARGS:--v --tb=short} -rfEs 2>&1 |
      tee "$OUT/gpu_tests.log"
    rc=${PIPESTATUS[0]}
  fi
  last=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUT/gpu_tests.log" | tail -1)
  case $rc in
    0) record tests ok $((SECONDS - S0)) "$last" ;;
    5) record tests NO_TESTS $((SECONDS - S0)) "no gpu_sm90 test was collected" ;;
    *) record tests FAILED $((SECONDS - S0)) "pytest rc=$rc: $last" ;;
  esac
fi

# --- compute-sanitizer ------------------------------------------------------------------------------------
if [[ "${SKIP_SANITIZER:-0}" == 1 ]]; then
  record sanitize skipped 0
else
  stage_begin "compute-sanitizer"
  OUT="$OUT" PYTHON="$PY" COMMIT="$COMMIT_ID" bash scripts/sanitizer_check.sh 2>&1 | tee "$OUT/sanitizer.log"
  rc=${PIPESTATUS[0]}
  if ((rc == 0)); then
    record sanitize ok $((SECONDS - S0)) "$(tail -1 "$OUT/sanitizer.log")"
  else
    record sanitize FAILED $((SECONDS - S0)) "rc=$rc, see $OUT/sanitizer.log"
  fi
fi

# --- benchmark --------------------------------------------------------------------------------------------
if [[ "${SKIP_BENCH:-0}" == 1 ]]; then
  record bench skipped 0
elif [[ ! -f benchmarks/bench_kda_prefill.py ]]; then
  record bench skipped 0 "benchmarks/bench_kda_prefill.py does not exist"
else
  stage_begin bench
  # shellcheck disable=SC2086
  COMMIT="$COMMIT_ID" $PY benchmarks/bench_kda_prefill.py ${BENCH_ARGS:---quick} --json "$OUT/bench.json" --md "$OUT/bench.md" --plot "$OUT/bench.png" 2>&1 |
    tee "$OUT/bench.log"
  rc=${PIPESTATUS[0]}
  # The serving row (pooled vs plain vs gather + scatter): a few seconds.
  COMMIT="$COMMIT_ID" $PY benchmarks/bench_serving.py --json "$OUT/bench_serving.json" --md "$OUT/bench_serving.md" 2>&1 |
    tee -a "$OUT/bench.log"
  rc_serving=${PIPESTATUS[0]}
  # FLA's autotuning results (a few KB): the next session carries them back (see Env above).
  (cd "$TRITON_CACHE_DIR" 2>/dev/null && find . -name '*.autotune.json' | tar czf "$OUT/triton_autotune.tgz" -T -) || true
  if ((rc == 0 && rc_serving == 0)); then
    record bench ok $((SECONDS - S0)) "$OUT/bench.json $OUT/bench.md $OUT/bench_serving.md"
  else
    record bench FAILED $((SECONDS - S0)) "rc=$rc, serving rc=$rc_serving, see $OUT/bench.log"
  fi
fi

# --- summary -----------------------------------------------------------------------------------------------
{
  echo "device_check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), total $((SECONDS - T0))s)"
  echo "commit: $COMMIT_ID"
  grep -m1 '^gpu:' "$OUT/env.txt" || true
  grep -m1 '^torch:' "$OUT/env.txt" || true
  printf '%s\n' "${SUMMARY[@]}"
  if ((FAILED)); then echo "RESULT: FAILED"; else echo "RESULT: OK"; fi
} | tee "$OUT/summary.txt"
# Everything in one archive too: a remote runner may bring back only a few files of $OUT.
(cd "$OUT" && tar czf device_check_all.tgz --exclude=device_check_all.tgz ./* 2>/dev/null) || true
exit $FAILED
