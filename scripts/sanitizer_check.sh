#!/usr/bin/env bash
# compute-sanitizer over a small varlen GVA workload of the fused SM90 kernel
# (scripts/sanitizer_case.py): memcheck, racecheck and synccheck, one run each.
#
#   scripts/sanitizer_check.sh            # logs in ${OUT:-.}/sanitizer_<tool>.log
#
# Prints one summary line per tool and exits non-zero if any tool reports an error (racecheck:
# an error or a warning, unless SANITIZER_ALLOW_RACE_WARNINGS=1), if a log has no summary line
# (the sanitizer did not run to the end), or if the workload itself failed (no GPU, no extension,
# results off the reference).
#
# Environment:
#   OUT                 folder for the logs (default: the current directory)
#   PYTHON              interpreter with torch and cula (default: python3)
#   COMPUTE_SANITIZER   the compute-sanitizer binary (default: PATH, then $CUDA_HOME/bin,
#                       then /usr/local/cuda/bin)
#   SANITIZER_TOOLS     tools to run (default: "memcheck racecheck synccheck"; initcheck also works)
#   SANITIZER_KEEP_CACHING=1  keep PyTorch's caching allocator. By default it is switched off
#                       (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so that every tensor is its own
#                       allocation and memcheck sees an access past the end of o, q, ... instead of
#                       landing silently in a neighbouring cached block.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-.}"
PYTHON="${PYTHON:-python3}"
TOOLS="${SANITIZER_TOOLS:-memcheck racecheck synccheck}"
CASE="$ROOT/scripts/sanitizer_case.py"

find_sanitizer() {
  if [[ -n "${COMPUTE_SANITIZER:-}" ]]; then echo "$COMPUTE_SANITIZER"; return; fi
  if command -v compute-sanitizer >/dev/null 2>&1; then command -v compute-sanitizer; return; fi
  for dir in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
    if [[ -n "$dir" && -x "$dir/bin/compute-sanitizer" ]]; then echo "$dir/bin/compute-sanitizer"; return; fi
  done
  for cand in /usr/local/cuda-*/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer/compute-sanitizer; do
    if [[ -x "$cand" ]]; then echo "$cand"; return; fi
  done
}

SANITIZER="$(find_sanitizer)"
if [[ -z "$SANITIZER" ]]; then
  echo "sanitizer_check: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
if [[ "${SANITIZER_KEEP_CACHING:-0}" != "1" ]]; then
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
fi

echo "sanitizer_check: $("$SANITIZER" --version 2>&1 | grep -i version | head -n 1)"
# COMMIT (as for the benchmark) names the commit where the checkout's git metadata cannot.
echo "sanitizer_check: commit ${COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}," \
     "caching allocator $([[ -n "${PYTORCH_NO_CUDA_MEMORY_CACHING:-}" ]] && echo off || echo on)"

status=0
failed_tools=()
for tool in $TOOLS; do
  log="$OUT_DIR/sanitizer_${tool}.log"
  start=$(date +%s)
  "$SANITIZER" --tool "$tool" --error-exitcode 86 "$PYTHON" "$CASE" >"$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))

  # memcheck / synccheck / initcheck: "========= ERROR SUMMARY: N error(s)"
  # racecheck: "========= RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)"
  #            (some versions print an ERROR SUMMARY line as well)
  summary="$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | sed 's/^=* *//' | paste -sd ';' -)"
  errors="$(grep -oE "ERROR SUMMARY: [0-9]+ error" "$log" | tail -n 1 | grep -oE "[0-9]+")"
  race_line="$(grep -E "RACECHECK SUMMARY" "$log" | tail -n 1)"
  race_errors="$(echo "$race_line" | grep -oE "[0-9]+ errors?" | grep -oE "[0-9]+")"
  race_warnings="$(echo "$race_line" | grep -oE "[0-9]+ warnings?" | grep -oE "[0-9]+")"
  workload="$(grep -E "^sanitizer_case: [0-9]+/[0-9]+ calls" "$log" | tail -n 1)"

  verdict="ok"
  reasons=()
  if [[ -z "$summary" ]]; then
    reasons+=("no summary line in the log: the sanitizer did not finish")
  fi
  if [[ -n "$errors" && "$errors" != "0" ]]; then reasons+=("$errors error(s)"); fi
  if [[ -n "$race_errors" && "$race_errors" != "0" ]]; then reasons+=("$race_errors race error(s)"); fi
  if [[ -n "$race_warnings" && "$race_warnings" != "0" && "${SANITIZER_ALLOW_RACE_WARNINGS:-0}" != "1" ]]; then
    reasons+=("$race_warnings race warning(s)")
  fi
  if [[ "$tool" != "racecheck" && -z "$errors" && -n "$summary" ]]; then
    reasons+=("no ERROR SUMMARY count")
  fi
  if [[ "$rc" -ne 0 ]]; then
    if [[ "$rc" -eq 86 ]]; then reasons+=("sanitizer exit code 86 (errors reported)")
    else reasons+=("exit code $rc (workload: ${workload:-did not finish})"); fi
  fi
  if [[ ${#reasons[@]} -gt 0 ]]; then
    verdict="FAIL: $(IFS=';'; echo "${reasons[*]}")"
    status=1
    failed_tools+=("$tool")
  fi
  printf '%-10s %s | %s | %ss | %s -> %s\n' "$tool" "${summary:-<no summary>}" \
    "${workload:-<workload did not report>}" "$secs" "$log" "$verdict"
  if [[ "$verdict" != "ok" ]]; then
    echo "---- last lines of $log ----"
    tail -n 30 "$log"
    echo "----"
  fi
done

if [[ $status -eq 0 ]]; then
  echo "sanitizer_check: all clean ($TOOLS)"
else
  echo "sanitizer_check: FAILED (${failed_tools[*]})"
fi
exit $status
