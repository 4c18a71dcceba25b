#!/usr/bin/env bash
# Same-session A/B timing of kernel source trees with the standalone binary (no torch needed).
#
#   scripts/ab_standalone.sh NAME=DIR [NAME=DIR ...]
#
# Each DIR holds a copy of the repository's kernel sources (csrc/ and CMakeLists.txt), e.g. made
# on the development machine with
#   git archive <branch> csrc CMakeLists.txt | tar -x -C .scratch/<name>
# (and carried to the GPU machine). Builds every tree's `kda_standalone` in parallel
# (build/ab-NAME); a DIR that already holds an executable `kda_standalone` (with its
# libcula_kda_sm90.so beside it, e.g. built on the development machine with CMake and carried) is
# used as it is, which saves the GPU machine the compile. Then times each shape on every tree in turn, ROUNDS times, so that clock and
# thermal drift spread over all trees alike, and prints one median per (tree, shape).
#
# Env: SHAPES (";"-separated "B T H HV ITERS", default: the few-tile and fused target rows),
#      ROUNDS (default 2), JOBS (parallel compile jobs per tree, default 16 / number of trees),
#      ENVS (";"-separated environment settings to cross with the trees, e.g.
#            "CULA_KDA_COOPERATIVE=0;CULA_KDA_COOPERATIVE=1"; default: one empty setting),
#      BUILD_ONLY=1 (build the trees and stop: a later call times them on the same machine),
#      RUN_TIMEOUT (seconds per run, default 60: a run past it is reported as "hung" and that
#            tree is not run again; every run's result goes to stderr as it comes).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

(($# > 0)) || { sed -n '2,16p' "$0"; exit 2; }
SHAPES=${SHAPES:-"1 32768 8 8 5;1 65536 4 4 3;1 8192 64 64 10;1 1024 64 64 20;1 8192 32 32 10;2 8192 64 64 5"}
ROUNDS=${ROUNDS:-2}
JOBS=${JOBS:-$((16 / $#))}
((JOBS > 0)) || JOBS=1
ENVS=${ENVS:-""}
RUN_TIMEOUT=${RUN_TIMEOUT:-60}
GEN=""
command -v ninja >/dev/null && GEN="-G Ninja"

names=()
declare -A bin libdir
for spec in "$@"; do
  name=${spec%%=*}
  dir=${spec#*=}
  names+=("$name")
  if [[ -x "$dir/kda_standalone" ]]; then  # prebuilt
    bin[$name]="$dir/kda_standalone"
    libdir[$name]="$dir"
    continue
  fi
  [[ -f "$dir/CMakeLists.txt" ]] || { echo "ab_standalone: $dir has no CMakeLists.txt or kda_standalone" >&2; exit 2; }
  bin[$name]="build/ab-$name/kda_standalone"
  libdir[$name]="build/ab-$name"
  # shellcheck disable=SC2086
  (cmake -S "$dir" -B "build/ab-$name" $GEN -DPython3_EXECUTABLE="$(command -v python3)" >/dev/null &&
    cmake --build "build/ab-$name" -j"$JOBS" >"build/ab-$name.log" 2>&1 &&
    echo "ab_standalone: built $name") &
done
wait
for name in "${names[@]}"; do
  [[ -x "${bin[$name]}" ]] || { echo "ab_standalone: $name did not build (build/ab-$name.log)" >&2; exit 1; }
done

if [[ -n "${BUILD_ONLY:-}" ]]; then  # a build call ahead of the timing call (same machine)
  echo "ab_standalone: built ${names[*]}"
  exit 0
fi
IFS=';' read -r -a shape_list <<<"$SHAPES"
IFS=';' read -r -a env_list <<<"${ENVS:- }"
declare -A times hung
for ((round = 0; round < ROUNDS; ++round)); do
  for shape in "${shape_list[@]}"; do
    for setting in "${env_list[@]}"; do
      for name in "${names[@]}"; do
        # shellcheck disable=SC2086
        key="$name|$setting|$shape"
        if [[ -n "${hung[$name]:-}" ]]; then  # a tree that hung once is not run again
          times[$key]="${times[$key]:-} hung"
          continue
        fi
        # shellcheck disable=SC2086
        line=$(env LD_LIBRARY_PATH="${libdir[$name]}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" $setting \
          timeout "$RUN_TIMEOUT" "${bin[$name]}" $shape 2>&1 | tail -1; echo "rc=${PIPESTATUS[0]}")
        rc=${line##*rc=}
        line=${line%rc=*}
        line=${line%$'\n'}
        ms=$(sed -n 's/.*median \([0-9.]*\) ms.*/\1/p' <<<"$line")
        if ((rc == 124)); then
          hung[$name]=1
          ms=hung
        fi
        times[$key]="${times[$key]:-} ${ms:-nan}"
        echo "ab_standalone: round $round $name ${setting:--} [$shape]: ${ms:-nan}${line:+ ($line)}" >&2
      done
    done
  done
done

printf '%-12s %-32s %-22s %s\n' tree setting "B T H HV iters" "medians per round (ms)"
for shape in "${shape_list[@]}"; do
  for setting in "${env_list[@]}"; do
    for name in "${names[@]}"; do
      printf '%-12s %-32s %-22s %s\n' "$name" "${setting:--}" "$shape" "${times[$name|$setting|$shape]}"
    done
  done
done
