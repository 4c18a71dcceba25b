#!/usr/bin/env bash
# Build kernel source trees' standalone binaries on THIS machine (no GPU needed: nvcc + the
# nvidia-cutlass wheel) and pack each as an xz tarball, so that a GPU call only times them
# (scripts/ab_standalone.sh takes a folder holding kda_standalone + libcula_kda_sm90.so as
# prebuilt). A tree builds in ~2.5 min on 2 cores; packed it is ~5 MB (the device call's carry
# limit is 64 MiB in all).
#
#   scripts/build_ab_trees.sh NAME=REF[+PATCH] ...      e.g. main=HEAD pipe=HEAD+experiments/aprod-pipe.patch
#
# REF is any git revision of this repository; +PATCH applies a patch file (git apply) on top.
# Env: OUT_DIR (default .abtar: git-ignored through .git/info/exclude, which this script
#      extends), CMAKE_CUDA_FLAGS (e.g. -DCULA_KDA_PROFILE for the per-phase counters),
#      JOBS (default: the number of CPUs), PYTHON (a Python whose site-packages has nvidia-cutlass).
# On the GPU machine:  mkdir -p /tmp/t && for f in .abtar/*.tar.xz; do tar xJf $f -C /tmp/t; done
#                      bash scripts/ab_standalone.sh main=/tmp/t/main pipe=/tmp/t/pipe
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
(($# > 0)) || { sed -n '2,16p' "$0"; exit 2; }
OUT_DIR=${OUT_DIR:-.abtar}
JOBS=${JOBS:-$(nproc)}
PY=${PYTHON:-$(command -v python3)}
mkdir -p .git/info "$OUT_DIR"
grep -qxF "/$OUT_DIR/" .git/info/exclude 2>/dev/null || echo "/$OUT_DIR/" >>.git/info/exclude
GEN=""
command -v ninja >/dev/null && GEN="-G Ninja"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/cula-ab.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
for spec in "$@"; do
  name=${spec%%=*}
  rest=${spec#*=}
  ref=${rest%%+*}
  patch=""
  [[ "$rest" == *+* ]] && patch=${rest#*+}
  src="$WORK/src-$name"
  mkdir -p "$src"
  git archive "$ref" csrc CMakeLists.txt | tar -x -C "$src"
  if [[ -n "$patch" ]]; then
    (cd "$src" && git apply --include='csrc/*' "$OLDPWD/$patch")
  fi
  # shellcheck disable=SC2086
  cmake -S "$src" -B "$WORK/build-$name" $GEN -DPython3_EXECUTABLE="$PY" \
    ${CMAKE_CUDA_FLAGS:+-DCMAKE_CUDA_FLAGS="$CMAKE_CUDA_FLAGS"} >"$WORK/cfg-$name.log"
  cmake --build "$WORK/build-$name" -j"$JOBS" >"$WORK/build-$name.log" 2>&1 ||
    { tail -20 "$WORK/build-$name.log"; exit 1; }
  if grep -q "C75[0-9][0-9]" "$WORK/build-$name.log"; then
    echo "build_ab_trees: $name: ptxas serialized WGMMAs (C75xx):" >&2
    # every kernel once, by its template arguments (from the mangled name): (gate in kernel, l2norm, longest
    # first, pass, decays), e.g. "1 1 0 pass0 decays1: C7512"
    grep -o "(C75[0-9][0-9]).*_ZN[A-Za-z0-9_]*" "$WORK/build-$name.log" |
      sed -E 's/^\((C75[0-9]+)\).*ILb([01])ELb([01])ELb([01])ELNS1_10KernelPassE([0-9])ELNS1_6DecaysE([0-9]).*/  \2 \3 \4 pass\5 decays\6: \1/' |
      sort -u >&2
  fi
  mkdir -p "$WORK/pack/$name"
  cp "$WORK/build-$name/kda_standalone" "$WORK/build-$name/libcula_kda_sm90.so" "$WORK/pack/$name/"
  tar -C "$WORK/pack" -cJf "$OUT_DIR/$name.tar.xz" "$name"
  echo "build_ab_trees: $name ($ref${patch:+ + $patch}) -> $OUT_DIR/$name.tar.xz ($(du -h "$OUT_DIR/$name.tar.xz" | cut -f1))"
done
