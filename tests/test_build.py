"""Build checks that need no GPU.

* setup.py's toolkit discovery (CUDA_HOME behind a wrapper nvcc) and its "no kernels" policy.
* The compiled extension ``cula._C``: it imports, it holds only sm_90a device code
  (``cuobjdump --list-elf``), and its SASS uses the Hopper pipeline that the fused kernel is built
  on (``cuobjdump -sass``: HGMMA, UTMALDG, SYNCS, USETMAXREG).
* Every kernel instantiation compiles without ptxas serializing its WGMMAs (C75xx messages).

Where the extension was not built these checks are skipped with the reason, except under
``CULA_REQUIRE_KERNELS=1`` (CI), where a missing extension or a missing cuobjdump/nvdisasm fails.
cuobjdump and nvdisasm come from the ``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm`` wheels
(``site-packages/nvidia/cu13/bin``), a CUDA toolkit, or PATH.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re
import shutil
import site
import stat
import subprocess
import sys
import sysconfig
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRE_KERNELS = os.environ.get("CULA_REQUIRE_KERNELS", "").strip().lower() in ("1", "true", "yes", "on")

# What the fused SM90 kernel must contain at the SASS level: warpgroup MMA, TMA loads, mbarrier
# (SYNCS.*) pipelines and the producer/consumer register split.
HOPPER_SASS = ("HGMMA", "UTMALDG", "SYNCS", "USETMAXREG")


def _missing(reason: str):
    """Fail under CULA_REQUIRE_KERNELS=1, else skip, with the reason."""
    if REQUIRE_KERNELS:
        pytest.fail(f"CULA_REQUIRE_KERNELS=1: {reason}")
    pytest.skip(reason)


# ---------------------------------------------------------------------------------------------
# setup.py
# ---------------------------------------------------------------------------------------------


def _load_setup_py():
    spec = importlib.util.spec_from_file_location("cula_setup_py", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines helpers only: setup() runs under __main__
    return module


@pytest.fixture
def setup_module():
    return _load_setup_py()


def _write_exe(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def test_cuda_home_found_behind_wrapper_nvcc(setup_module, tmp_path, monkeypatch):
    """nvcc on PATH is a wrapper script outside the toolkit (as /usr/local/bin/nvcc here):
    CUDA_HOME is the toolkit nvcc reports (its TOP), not dirname(dirname(which nvcc))."""
    toolkit = tmp_path / "cuda-x"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda.h").write_text("")
    _write_exe(str(toolkit / "bin" / "nvcc"), f"#!/bin/sh\necho '#$ TOP={toolkit}/bin/..' >&2\n")
    _write_exe(str(tmp_path / "wrap" / "bin" / "nvcc"), f'#!/bin/sh\nexec {toolkit}/bin/nvcc "$@"\n')
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}/wrap/bin:/usr/bin:/bin")
    assert setup_module.find_cuda_home() == os.path.realpath(str(toolkit))

    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "explicit"))
    assert setup_module.find_cuda_home() == str(tmp_path / "explicit")


def test_no_kernel_sources_installs_pure_python_or_fails_when_required(setup_module, monkeypatch, capsys):
    monkeypatch.setattr(setup_module, "KERNEL_SOURCE_GLOBS", ("csrc/does_not_exist/*.cu",))
    monkeypatch.delenv("CULA_REQUIRE_KERNELS", raising=False)
    assert setup_module.plan_extension() == ([], {})
    err = capsys.readouterr().err
    assert "fused KDA kernels unavailable" in err and "no kernel sources" in err

    monkeypatch.setenv("CULA_REQUIRE_KERNELS", "1")
    with pytest.raises(SystemExit, match="CULA_REQUIRE_KERNELS=1 but the fused KDA kernels cannot be built: no kernel sources"):
        setup_module.plan_extension()


def test_cutlass_dir_override(setup_module, tmp_path, monkeypatch):
    inc = tmp_path / "cutlass" / "include" / "cute"
    inc.mkdir(parents=True)
    (inc / "tensor.hpp").write_text("")
    monkeypatch.setenv("CUTLASS_DIR", str(tmp_path / "cutlass"))
    assert setup_module.find_cutlass_include() == str(tmp_path / "cutlass" / "include")
    monkeypatch.setenv("CUTLASS_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(SystemExit, match="CUTLASS_DIR"):
        setup_module.find_cutlass_include()


# ---------------------------------------------------------------------------------------------
# the compiled extension
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def extension_path() -> str | None:
    """Path of the built cula._C shared library (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec("cula._C")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin and os.path.isfile(spec.origin):
        return spec.origin
    pkg = importlib.util.find_spec("cula")
    for loc in (pkg.submodule_search_locations or []) if pkg else []:
        hits = sorted(glob.glob(os.path.join(loc, "_C*.so")))
        if hits:
            return hits[0]
    return None


def _site_dirs() -> list[str]:
    dirs = []
    for d in [*sys.path, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
              *(site.getsitepackages() if hasattr(site, "getsitepackages") else [])]:
        if d and os.path.isdir(d) and d not in dirs:
            dirs.append(d)
    return dirs


def find_tool(name: str) -> str | None:
    """PATH, then the CUDA toolkit, then the nvidia-* wheels (nvidia/cu13/bin, ...), then triton."""
    hit = shutil.which(name)
    if hit:
        return hit
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin"))
    candidates.append("/usr/local/cuda/bin")
    for sp in _site_dirs():
        candidates += sorted(glob.glob(os.path.join(sp, "nvidia", "cu*", "bin")))
        candidates.append(os.path.join(sp, "nvidia", "cuda_cuobjdump", "bin"))
        candidates.append(os.path.join(sp, "nvidia", "cuda_nvdisasm", "bin"))
        candidates.append(os.path.join(sp, "triton", "backends", "nvidia", "bin"))
    for d in candidates:
        path = os.path.join(d, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


@pytest.fixture(scope="module")
def ext_so() -> str:
    path = extension_path()
    if path is None:
        from cula._ext import kernels_unavailable_reason

        _missing(f"the extension cula._C was not built ({kernels_unavailable_reason()})")
    return path


@pytest.fixture(scope="module")
def cuobjdump() -> str:
    tool = find_tool("cuobjdump")
    if tool is None:
        _missing("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    return tool


def test_extension_imports(ext_so):
    import cula

    assert cula.kernels_available(), cula.kernels_unavailable_reason()


def test_extension_device_code_is_sm90a_only(ext_so, cuobjdump):
    out = subprocess.run([cuobjdump, "--list-elf", ext_so], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    archs = re.findall(r"\.(sm_\w+)\.cubin", out.stdout)
    assert archs, f"cuobjdump --list-elf lists no device code in {ext_so}:\n{out.stdout}{out.stderr}"
    assert "sm_90a" in archs, out.stdout
    assert set(archs) == {"sm_90a"}, f"device code for other targets than sm_90a: {sorted(set(archs))}"


def test_kernel_sass_has_hopper_pipeline_hgmma_tma_mbarrier_setmaxnreg(ext_so, cuobjdump):
    """Fails while the extension holds no real warp-specialised wgmma/TMA kernel."""
    nvdisasm = find_tool("nvdisasm")
    if nvdisasm is None:
        _missing("nvdisasm (needed by cuobjdump -sass) not found (pip install nvidia-cuda-nvdisasm)")
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + env.get("PATH", "")
    out = subprocess.run([cuobjdump, "-sass", ext_so], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    missing = [op for op in HOPPER_SASS if op not in out.stdout]
    assert not missing, textwrap.dedent(
        f"""\
        SASS of {ext_so} lacks {missing} (of {list(HOPPER_SASS)}): the fused SM90 kernel is not
        (fully) there: HGMMA = wgmma, UTMALDG = TMA loads, SYNCS = mbarrier pipeline,
        USETMAXREG = producer/consumer register split."""
    )


# ---------------------------------------------------------------------------------------------
# WGMMA serialization (ptxas C75xx) in the kernel instantiations
# ---------------------------------------------------------------------------------------------

INSTANTIATIONS = sorted(glob.glob(os.path.join(ROOT, "csrc", "kda", "sm90", "instantiations", "*.cu")))


@functools.lru_cache(maxsize=None)
def _ptxas_messages() -> dict[str, str]:
    """ptxas' messages per instantiation, each compiled to a cubin with setup.py's flags and
    includes (the "Potential Performance Loss" lines come without -v), all at once on every core."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    setup_py = _load_setup_py()
    cuda_home = setup_py.find_cuda_home()
    cutlass = setup_py.find_cutlass_include()
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    if nvcc is None or not os.path.isfile(nvcc) or cutlass is None:
        return {}
    includes = [os.path.join(ROOT, "csrc"), cutlass]
    util = setup_py._cutlass_util_include(cutlass)
    if util:
        includes.append(util)

    def compile_one(source: str) -> str:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [nvcc, *setup_py.KERNEL_NVCC_FLAGS, "-cubin", "-o", os.path.join(tmp, "k.cubin"),
                   *[f"-I{d}" for d in includes], source]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            return f"COMPILE FAILED: {' '.join(cmd)}\n{out.stdout}{out.stderr}"
        return out.stdout + out.stderr

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(zip(INSTANTIATIONS, pool.map(compile_one, INSTANTIATIONS)))


@pytest.mark.parametrize("source", INSTANTIATIONS, ids=[os.path.basename(s)[len("kda_prefill_sm90_"):-3]
                                                         for s in INSTANTIATIONS])
def test_no_wgmma_serialization(source):
    """ptxas makes every WGMMA of a kernel synchronous when it cannot prove the asynchronous
    pipeline safe (C7510-C7520: "Potential Performance Loss: wgmma.mma_async instructions are
    serialized ..."). The results stay right and the kernel gets 25-30 % slower (measured on an
    H100 when one intra-chunk call site was entered by two warpgroups), so it is a build failure
    here, with ptxas' reason."""
    all_messages = _ptxas_messages()
    if not all_messages:
        _missing("nvcc or the CUTLASS headers not found (setup.py's find_cuda_home / find_cutlass_include)")
    messages = all_messages[source]
    assert not messages.startswith("COMPILE FAILED"), messages
    serialized = [line for line in messages.splitlines() if re.search(r"\(C75\d\d\)", line)]
    assert not serialized, "\n".join(serialized)
