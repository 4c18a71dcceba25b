#!/usr/bin/env bash
# Same-machine A/B of a kernel patch through the torch extension (the benchmark's inputs, errors
# and eager/graph timings), on the GPU machine. Needs the build's wheels installed first
# (nvidia-cutlass for the CUTLASS headers; docs/install.md).
#
#   scripts/ab_extension.sh PATCH
#
# Builds two extensions in parallel: this checkout's (main: `pip install -e .`, which stays the
# installed one) and a copy of it with PATCH applied (the tarball $BASE_TAR of this checkout's
# tracked files, e.g. `git archive HEAD -o FILE` made where the git metadata is current, or the
# tracked files copied when unset; then `patch -p1`), built in place under $WORK/patched. A failed
# build stops the script. Then, with each build's `.so` swapped into `cula/` between processes:
#   1. one call per row of each build, saved, and the patched outputs' relative L2 difference from
#      main's (o and final state) and finiteness;
#   2. ROUNDS rounds of `scripts/eager_timeline.py --no-trace` per build (REPS interleaved calls per
#      row and round: eager and CUDA-graph medians), the two builds' order alternating by round,
#      and per row the median over rounds and the ratio patched / main.
# On exit main's `.so` is back in place, or the patched one with SWAP_TO_PATCHED=1 (so that tests
# run on it next). The summary goes to stdout; the rounds' raw output to $WORK/abab.log (and to
# $OUT/abab.log when OUT is set).
#
# Env: ROWS (eager_timeline row names, ","-separated; default the cooperative rows and a fused
#      control), ROUNDS (default 3), REPS (default 20), WORK (default /tmp/ab_extension),
#      BASE_TAR (optional), MAX_JOBS (per build, default 8), RUN_TIMEOUT (seconds per timing
#      process, default 150), TIMELINE_ARGS (more eager_timeline.py arguments, e.g.
#      --softplus-gate for the general-gate kernels).
set -euo pipefail
(($# == 1)) || { sed -n '2,27p' "$0"; exit 2; }
PATCH=$(readlink -f "$1")
BASE_TAR=${BASE_TAR:+$(readlink -f "$BASE_TAR")}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROWS=${ROWS:-"B1 T8192 H64,B1 T32768 H8,varlen 30000+3 H8,B1 T65536 H4,B2 T8192 H64"}
ROUNDS=${ROUNDS:-3}
REPS=${REPS:-20}
WORK=${WORK:-/tmp/ab_extension}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
read -r -a EXTRA <<< "${TIMELINE_ARGS:-}"
export MAX_JOBS=${MAX_JOBS:-8}

rm -rf "$WORK" && mkdir -p "$WORK/patched"
if [[ -n "$BASE_TAR" ]]; then
  tar xf "$BASE_TAR" -C "$WORK/patched"
else
  git ls-files -z | tar --null -T - -cf - | tar xf - -C "$WORK/patched"
fi
if command -v patch > /dev/null; then
  (cd "$WORK/patched" && patch -p1 -s --forward --batch < "$PATCH")
else
  (cd "$WORK/patched" && git apply "$PATCH")
fi

rm -f cula/_C*.so
set +e
CULA_REQUIRE_KERNELS=1 python3 -m pip install -v --no-index --no-build-isolation --no-deps -e . > "$WORK/build_main.log" 2>&1 &
main_pid=$!
(cd "$WORK/patched" && CULA_REQUIRE_KERNELS=1 python3 setup.py build_ext --inplace) > "$WORK/build_patched.log" 2>&1 &
patched_pid=$!
wait $main_pid; main_rc=$?
wait $patched_pid; patched_rc=$?
set -e
echo "builds: main rc $main_rc, patched rc $patched_rc"
grep -hE "C75[0-9]+" "$WORK/build_main.log" "$WORK/build_patched.log" | head -5 || true
if ((main_rc != 0 || patched_rc != 0)); then
  tail -n 20 "$WORK/build_main.log" "$WORK/build_patched.log"
  exit 1
fi
SO=$(ls cula/_C*.so)
cp "$SO" "$WORK/main.so"
cp "$(ls "$WORK"/patched/cula/_C*.so)" "$WORK/patched.so"
restore() {
  if [[ "${SWAP_TO_PATCHED:-0}" == 1 ]]; then cp "$WORK/patched.so" "$SO"; else cp "$WORK/main.so" "$SO"; fi
  if [[ -n "${OUT:-}" && -f "$WORK/abab.log" ]]; then cp "$WORK/abab.log" "$OUT/abab.log"; fi
}
trap restore EXIT

for v in main patched; do
  cp "$WORK/$v.so" "$SO"
  timeout "$RUN_TIMEOUT" python3 scripts/eager_timeline.py --no-trace --reps 1 --rows "$ROWS" ${EXTRA[@]+"${EXTRA[@]}"} \
    --save-outputs "$WORK/out_$v" > "$WORK/outputs_$v.log" 2>&1 || { echo "$v: output run failed"; tail -n 5 "$WORK/outputs_$v.log"; exit 1; }
done
python3 - "$WORK" <<'PY'
import os, sys
import torch
work = sys.argv[1]
def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
for f in sorted(os.listdir(f"{work}/out_main")):
    m = torch.load(f"{work}/out_main/{f}")
    x = torch.load(f"{work}/out_patched/{f}")
    print(f"{f}: patched vs main o {rel(x[0], m[0]):.2e}, state {rel(x[1], m[1]):.2e}, "
          f"finite {bool(torch.isfinite(x[0].float()).all() and torch.isfinite(x[1].float()).all())}")
PY

for r in $(seq 1 "$ROUNDS"); do
  order="main patched"
  ((r % 2 == 0)) && order="patched main"
  for v in $order; do
    cp "$WORK/$v.so" "$SO"
    echo "### $v round $r"
    timeout "$RUN_TIMEOUT" python3 scripts/eager_timeline.py --no-trace --reps "$REPS" --rows "$ROWS" ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 \
      | grep -v "^NVIDIA" || echo "### $v round $r: the run failed or timed out"
  done
done > "$WORK/abab.log" 2>&1
grep "failed or timed out" "$WORK/abab.log" || true
python3 - "$WORK/abab.log" <<'PY'
import re, statistics as st, sys
from collections import defaultdict
eager, graph = defaultdict(list), defaultdict(list)
build = row = None
for line in open(sys.argv[1]):
    if m := re.match(r"### (\S+) round \d+$", line.strip()):
        build = m.group(1)
    elif m := re.match(r"== (.*)", line):
        row = m.group(1).strip()
    elif m := re.search(r"eager ([0-9.]+) ms  graph ([0-9.]+) ms", line):
        eager[(build, row)].append(float(m.group(1)))
        graph[(build, row)].append(float(m.group(2)))
for r in sorted({r for _, r in eager}):
    if not eager[("main", r)] or not eager[("patched", r)]:
        continue
    em, ep = st.median(eager[("main", r)]), st.median(eager[("patched", r)])
    gm, gp = st.median(graph[("main", r)]), st.median(graph[("patched", r)])
    print(f"{r:22s} eager main {em:.4f} patched {ep:.4f} x{ep / em:.4f} | graph main {gm:.4f} patched {gp:.4f} "
          f"x{gp / gm:.4f} (rounds: main {graph[('main', r)]}, patched {graph[('patched', r)]})")
PY
