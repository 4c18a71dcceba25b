#!/usr/bin/env bash
# Fallback for the FlashKDA baseline: when the prebuilt wheel (wheels/tokenspeed_flashkda-*.whl)
# does not load with the device's torch (see "import flash_kda" in device_check's env.txt), build
# MoonshotAI/FlashKDA from source against that torch and the nvidia-cutlass wheel's CUTLASS
# headers, into a wheel under ./wheels (git-ignored). device_check.sh installs a wheels/flash_kda-*
# wheel in preference to the prebuilt one. FlashKDA's sources are never committed here.
#
#   bash scripts/build_flashkda.sh third_party_build/flashkda      (on the GPU machine, repo root)
#
# The argument is a git-ignored copy of https://github.com/MoonshotAI/FlashKDA made beforehand,
# e.g. `git clone --depth 1 https://github.com/MoonshotAI/FlashKDA third_party_build/flashkda` or
# `git -C <mirror> archive HEAD | tar -x -C third_party_build/flashkda`; its `cutlass` submodule
# may be left empty (the device has no network): FlashKDA's setup.py adds <src>/cutlass/include,
# <src>/cutlass/tools/util/include and <src>/cutlass/examples/common to the include path, so this
# script points those at the nvidia-cutlass wheel's copies. FlashKDA includes only cute/ and
# cutlass/ headers; its pinned CUTLASS commit may differ from the wheel's version (4.2.0).
#
# Env: PYTHON (default python3); CUDA_HOME (default: the toolkit of nvcc on PATH); MAX_JOBS (default 16); FLASH_KDA_CUDA_ARCHS (default 90a: the
# Hopper target only, and no GPU needed to build; FlashKDA's own default "auto" asks the GPU);
# FLASH_KDA_VERSION_SUFFIX (FlashKDA's setup.py: local version such as "+1ce47ea"; default
# "+<git short sha>" when the source folder is a git checkout, none otherwise); LOG (default build/flashkda_build.log).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD

SRC=${1:?usage: bash scripts/build_flashkda.sh <FlashKDA source folder>}
SRC=$(cd "$SRC" && pwd)
PY=${PYTHON:-python3}
LOG=${LOG:-$REPO/build/flashkda_build.log}
export MAX_JOBS=${MAX_JOBS:-16}
export FLASH_KDA_CUDA_ARCHS=${FLASH_KDA_CUDA_ARCHS:-90a}

# torch's extension builder guesses CUDA_HOME as dirname(dirname(which nvcc)), wrong where nvcc on
# PATH is a wrapper outside the toolkit (then cuda_runtime_api.h is not found): ask nvcc's driver
# where its toolkit is (TOP), as cula's setup.py does.
if [[ -z "${CUDA_HOME:-}" ]]; then
  nv=$(command -v nvcc || true)
  CUDA_HOME=/usr/local/cuda
  if [[ -n "$nv" ]]; then
    top=$("$nv" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
    [[ -f "$top/include/cuda_runtime_api.h" ]] && CUDA_HOME=$(cd "$top" && pwd)
  fi
  export CUDA_HOME
fi

[[ -f "$SRC/setup.py" && -f "$SRC/flash_kda/__init__.py" ]] ||
  { echo "build_flashkda: $SRC does not look like a FlashKDA checkout (setup.py, flash_kda/)" >&2; exit 1; }

CUT=$($PY -c "import cutlass_library,os;print(os.path.join(os.path.dirname(cutlass_library.__file__),'source'))")
for d in include/cute include/cutlass tools/util/include; do
  [[ -d "$CUT/$d" ]] || { echo "build_flashkda: $CUT/$d missing (pip install nvidia-cutlass)" >&2; exit 1; }
done

# <src>/cutlass: an empty submodule folder, or links from an earlier run, become links into the
# wheel's tree; a populated checkout is left alone and refused (it would be built instead).
mkdir -p "$SRC/cutlass"
if [[ -e "$SRC/cutlass/include" && ! -L "$SRC/cutlass/include" ]]; then
  echo "build_flashkda: $SRC/cutlass holds a CUTLASS checkout; remove it to build against the" \
       "nvidia-cutlass wheel's headers ($CUT)" >&2
  exit 1
fi
mkdir -p "$SRC/cutlass/tools/util" "$SRC/cutlass/examples"
ln -sfn "$CUT/include" "$SRC/cutlass/include"
ln -sfn "$CUT/tools/util/include" "$SRC/cutlass/tools/util/include"
if [[ -d "$CUT/examples/common" ]]; then
  ln -sfn "$CUT/examples/common" "$SRC/cutlass/examples/common"
fi

mkdir -p "$REPO/wheels" "$(dirname "$LOG")"
echo "build_flashkda: $SRC -> $REPO/wheels (torch $($PY -c 'import torch;print(torch.__version__)'), CUDA_HOME $CUDA_HOME, CUTLASS $CUT, archs $FLASH_KDA_CUDA_ARCHS, MAX_JOBS $MAX_JOBS; log $LOG)"
# --no-build-isolation: compile against the torch installed here (the one the wheel must load in).
# GIT_CEILING_DIRECTORIES: FlashKDA's setup.py runs git (submodule update, its version suffix from
# `git rev-parse`); a source folder inside this repository must not find this repository's git.
(cd "$SRC" && GIT_CEILING_DIRECTORIES=$(dirname "$SRC") $PY -m pip wheel -v --no-build-isolation --no-deps --no-index -w "$REPO/wheels" .) \
  >"$LOG" 2>&1 || { tail -40 "$LOG"; echo "build_flashkda: build FAILED (log $LOG)" >&2; exit 1; }
grep -E 'registers|spill' "$LOG" | tail -6 || true
whl=$(ls -t "$REPO"/wheels/flash_kda-*.whl 2>/dev/null | head -1 || true)
[[ -n "$whl" ]] || { echo "build_flashkda: no wheels/flash_kda-*.whl after the build (log $LOG)" >&2; exit 1; }

# Check that the wheel loads with this torch, without touching the environment.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$PY -m pip install -q --no-index --no-deps --target "$tmp" "$whl"
PYTHONPATH="$tmp" $PY -c "import torch, flash_kda; print('import flash_kda: ok with torch', torch.__version__)"
echo "build_flashkda: built $whl"
echo "Install it with: $PY -m pip install --no-index --no-deps --force-reinstall $whl"
echo "(it provides the same flash_kda module as wheels/tokenspeed_flashkda-*.whl: install one of them)"
