#!/usr/bin/env bash
# Builds the torch-free shared library + standalone binary into ${OUT_DIR:-build/dev} with nvcc
# (what CMakeLists.txt does, without CMake), for quick iterations on the GPU machine.
# Extra nvcc flags via NVCC_EXTRA (e.g. -DCULA_KDA_PROFILE).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-build/dev}
CUT=${CUTLASS_INCLUDE:-$(python3 -c "import cutlass_library,os;print(os.path.join(os.path.dirname(cutlass_library.__file__),'source','include'))")}
mkdir -p "$OUT_DIR"
FLAGS="-gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -lineinfo -DNDEBUG -Xcompiler -fPIC -Icsrc -Icsrc/kda/sm90 -I$CUT ${NVCC_EXTRA:-}"
ls csrc/kda/sm90/instantiations/*.cu csrc/kda/sm90/*.cu csrc/standalone/kda_capi.cu |
  xargs -P "${MAX_JOBS:-$(nproc)}" -I{} sh -c "nvcc $FLAGS -c {} -o $OUT_DIR/\$(basename {} .cu).o"
nvcc -shared -o "$OUT_DIR/libcula_kda_sm90.so" "$OUT_DIR"/*.o -lcudart
nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Icsrc/standalone csrc/standalone/kda_standalone_main.cu \
  -o "$OUT_DIR/kda_standalone" -L"$OUT_DIR" -lcula_kda_sm90 -Xlinker -rpath='$ORIGIN'
echo "built $OUT_DIR/libcula_kda_sm90.so"
