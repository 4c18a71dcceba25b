"""Build script for cula.

``pip install --no-build-isolation .`` (or ``-e .``) compiles the torch CUDA extension ``cula._C``
for ``sm_90a`` wherever nvcc and a CUDA build of torch exist (no GPU is needed). Where either is
missing, or the kernel sources are not there, the pure-Python package (reference backend) is
installed and one message says that the fused kernels are unavailable. ``CULA_REQUIRE_KERNELS=1``
turns that case into a build error.

Environment knobs:
  CUDA_HOME / CUDA_PATH   the CUDA toolkit (default: found from nvcc, else /usr/local/cuda)
  CUTLASS_DIR             a CUTLASS checkout (uses $CUTLASS_DIR/include); default: the headers of
                          the nvidia-cutlass wheel (cutlass_library/source/include), or
                          third_party/cutlass/include when present
  CULA_REQUIRE_KERNELS=1  fail instead of installing without the fused kernels
  CULA_PTXAS_VERBOSE=1    pass -Xptxas=-v (register / spill report per kernel)
  MAX_JOBS                parallel compile jobs (default: number of CPUs)
"""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))

KERNEL_SOURCE_GLOBS = (
    "csrc/kda/sm90/*.cu",
    "csrc/kda/sm90/instantiations/*.cu",
)
BINDING_SOURCE_GLOBS = ("csrc/api/*.cpp",)


# nvcc flags of the kernel sources (tests/test_build.py compiles each instantiation with them too).
KERNEL_NVCC_FLAGS = (
    "-gencode=arch=compute_90a,code=sm_90a",
    "-O3",
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    "-DNDEBUG",
    # torch adds -D__CUDA_NO_{HALF,BFLOAT16}_* for its own kernels; the CuTe code uses the
    # bf16/half operators, and the CMake build compiles the same sources without them.
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _log(msg: str) -> None:
    print(f"[cula setup] {msg}", file=sys.stderr, flush=True)


def read_version() -> str:
    try:
        with open(os.path.join(ROOT, "cula", "__init__.py"), encoding="utf-8") as f:
            m = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', f.read(), re.M)
        if m:
            return m.group(1)
    except OSError:
        pass
    return "0.1.0"


def _has_cuda_h(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "include", "cuda.h"))


def find_cuda_home() -> str | None:
    """CUDA_HOME/CUDA_PATH, else the toolkit nvcc belongs to, else /usr/local/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            return os.path.abspath(value)
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidate = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if _has_cuda_h(candidate):
            return candidate
        # nvcc on PATH may be a wrapper script (e.g. /usr/local/bin/nvcc -> exec .../bin/nvcc):
        # ask nvcc itself where its toolkit is (the TOP variable of its driver).
        try:
            out = subprocess.run(
                [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                capture_output=True, text=True, timeout=60,
            )
            m = re.search(r"^#\$ TOP=(.+)$", out.stdout + out.stderr, re.M)
            if m:
                candidate = os.path.realpath(m.group(1).strip())
                if _has_cuda_h(candidate):
                    return candidate
        except (OSError, subprocess.SubprocessError):
            pass
    if _has_cuda_h("/usr/local/cuda"):
        return "/usr/local/cuda"
    return None


def find_cutlass_include() -> str | None:
    """$CUTLASS_DIR/include, else third_party/cutlass/include, else the nvidia-cutlass wheel."""
    cutlass_dir = os.environ.get("CUTLASS_DIR")
    if cutlass_dir:  # an explicit choice: use it or fail, never fall back silently
        for c in (os.path.join(cutlass_dir, "include"), cutlass_dir):
            if os.path.isfile(os.path.join(c, "cute", "tensor.hpp")):
                return os.path.abspath(c)
        raise SystemExit(f"[cula setup] error: CUTLASS_DIR={cutlass_dir} has no include/cute/tensor.hpp")
    candidates = []
    candidates.append(os.path.join(ROOT, "third_party", "cutlass", "include"))
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates.append(os.path.join(loc, "source", "include"))
    for c in candidates:
        if os.path.isfile(os.path.join(c, "cute", "tensor.hpp")):
            return os.path.abspath(c)
    return None


def _cutlass_util_include(cutlass_include: str) -> str | None:
    # cutlass/util/*.h: <root>/tools/util/include in a checkout and in the wheel's source tree.
    util = os.path.join(os.path.dirname(cutlass_include), "tools", "util", "include")
    return util if os.path.isdir(util) else None


def torch_wheel_cuda_includes() -> list[str]:
    """Include dirs of the nvidia-* wheels that CUDA builds of torch depend on (cu13 layout:
    site-packages/nvidia/cu13/include; older: site-packages/nvidia/<lib>/include)."""
    found = []
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations) if spec and spec.submodule_search_locations else []
    per_lib = ("cublas", "cusparse", "cusolver", "curand", "cufft", "cuda_runtime", "cuda_nvrtc")
    for root in roots:
        names = sorted(d for d in os.listdir(root) if re.fullmatch(r"cu\d+", d)) + list(per_lib)
        for name in names:
            inc = os.path.join(root, name, "include")
            if os.path.isdir(inc) and inc not in found:
                found.append(inc)
    return found


def extra_cuda_header_dir(cuda_home: str, build_dir: str) -> str | None:
    """A directory of symlinks to the headers that torch's nvidia-* wheels carry but the toolkit
    lacks (cublas_v2.h, cusparse.h, ... which ATen's CUDA headers include). Only missing headers
    are linked, so the toolkit's own headers (cuda_runtime.h, ...) are never shadowed by the
    wheels' possibly different versions."""
    toolkit_include = os.path.join(cuda_home, "include")
    links = {}
    for inc in torch_wheel_cuda_includes():
        for entry in os.listdir(inc):
            if entry in links or os.path.exists(os.path.join(toolkit_include, entry)):
                continue
            links[entry] = os.path.join(inc, entry)
    if not links:
        return None
    out = os.path.join(build_dir, "cula_extra_cuda_include")
    os.makedirs(out, exist_ok=True)
    for entry, target in links.items():
        link = os.path.join(out, entry)
        if os.path.islink(link) and os.readlink(link) == target:
            continue
        if os.path.lexists(link):
            if os.path.isdir(link) and not os.path.islink(link):
                shutil.rmtree(link)
            else:
                os.remove(link)
        os.symlink(target, link)
    return out


def _nvcc_version(cuda_home: str) -> str | None:
    nvcc = os.environ.get("PYTORCH_NVCC") or os.path.join(cuda_home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def _glob_sources(patterns) -> list[str]:
    files = []
    for pattern in patterns:
        files += sorted(glob.glob(os.path.join(ROOT, pattern)))
    return [os.path.relpath(f, ROOT) for f in files]


def plan_extension():
    """(ext_modules, cmdclass) for the fused kernels, or ([], {}) with the reason reported."""
    kernel_sources = _glob_sources(KERNEL_SOURCE_GLOBS)
    binding_sources = _glob_sources(BINDING_SOURCE_GLOBS)

    reason = None
    cuda_home = find_cuda_home()
    torch = None
    if not kernel_sources or not binding_sources:
        missing = []
        if not kernel_sources:
            missing.append(" or ".join(KERNEL_SOURCE_GLOBS))
        if not binding_sources:
            missing.append(" or ".join(BINDING_SOURCE_GLOBS))
        reason = "no kernel sources in this tree (nothing matches " + "; ".join(missing) + ")"
    elif cuda_home is None:
        reason = "no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH)"
    elif not os.path.isfile(os.path.join(cuda_home, "bin", "nvcc")) and not os.environ.get("PYTORCH_NVCC"):
        reason = f"nvcc not found (CUDA_HOME={cuda_home} has no bin/nvcc)"
    else:
        try:
            import torch  # noqa: F811
        except ImportError as exc:
            reason = (f"torch is not importable ({exc}); install torch first and build with "
                      "`pip install --no-build-isolation`")
        else:
            if getattr(torch.version, "cuda", None) is None:
                reason = f"torch {torch.__version__} is not a CUDA build"
            else:
                nvcc_version = _nvcc_version(cuda_home)
                if nvcc_version and nvcc_version.split(".")[0] != torch.version.cuda.split(".")[0]:
                    reason = (f"nvcc in {cuda_home} is CUDA {nvcc_version} but torch {torch.__version__} "
                              f"was built with CUDA {torch.version.cuda} (the major versions must match)")
    cutlass_include = None
    if reason is None:
        cutlass_include = find_cutlass_include()
        if cutlass_include is None:
            reason = ("CUTLASS/CuTe headers not found (pip install nvidia-cutlass==4.2.0.0, or set "
                      "CUTLASS_DIR to a CUTLASS checkout)")

    if reason is not None:
        if _truthy("CULA_REQUIRE_KERNELS"):
            raise SystemExit(f"[cula setup] error: CULA_REQUIRE_KERNELS=1 but the fused KDA kernels "
                             f"cannot be built: {reason}.")
        _log("=" * 78)
        _log(f"fused KDA kernels unavailable: {reason}. Installing the pure-Python package only "
             "(backend='reference' works; backend='sm90' needs a build with nvcc and a CUDA torch). "
             "Set CULA_REQUIRE_KERNELS=1 to make this an error.")
        _log("=" * 78)
        return [], {}

    # torch.utils.cpp_extension reads CUDA_HOME when it is imported; its own guess
    # (dirname(dirname(which nvcc))) is wrong where nvcc is a wrapper outside the toolkit.
    os.environ["CUDA_HOME"] = cuda_home
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    build_dir = os.path.join(ROOT, "build")
    include_dirs = [os.path.join(ROOT, "csrc"), cutlass_include]
    util_include = _cutlass_util_include(cutlass_include)
    if util_include:
        include_dirs.append(util_include)
    extra_include = extra_cuda_header_dir(cuda_home, build_dir)
    if extra_include:
        include_dirs.append(extra_include)

    nvcc_flags = list(KERNEL_NVCC_FLAGS)
    if _truthy("CULA_PTXAS_VERBOSE"):
        nvcc_flags.append("-Xptxas=-v")
    # No -std for the C++ compiler: the binding includes torch headers, and torch picks the
    # standard it requires (C++20 for torch >= 2.10, C++17 before). The kernels (.cu) are
    # torch-free C++17, as in the CMake build.
    cxx_flags = ["-O3"]

    _log(f"building cula._C for sm_90a: CUDA_HOME={cuda_home}, torch {torch.__version__} "
         f"(CUDA {torch.version.cuda}), CUTLASS {cutlass_include}, MAX_JOBS={os.environ['MAX_JOBS']}, "
         f"{len(kernel_sources)} .cu + {len(binding_sources)} .cpp")
    ext = CUDAExtension(
        name="cula._C",
        sources=binding_sources + kernel_sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


def main() -> None:
    ext_modules, cmdclass = plan_extension()
    setup(
        version=read_version(),
        packages=find_packages(include=["cula", "cula.*"]),
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        zip_safe=False,
    )


# setuptools' build backend and `python setup.py` both run this file as __main__; tests import it
# (tests/test_build.py) to check the toolkit discovery without building anything.
if __name__ == "__main__":
    main()
