#!/usr/bin/env python3
"""Code size, registers and spills of the SM90 kernels, per instantiation, on the CPU.

Why: past roughly 170 KB of SASS a kernel's hot code stops fitting the instruction cache, and the
kernel slows by 15 % or more (measured three times: the general-gate kernels, a second intra-chunk
warpgroup per helper, fp16 A_qk v_new in the longest-first kernel; docs/perf-notes.md). A change's
size is known before any GPU run, so this script reports it, for one source tree or as the
difference between two.

Each instantiation (``csrc/kda/sm90/instantiations/*.cu``) is compiled to a cubin with setup.py's
kernel flags plus ``-Xptxas=-v``; ptxas' report gives each kernel's registers, stack frame and
spills, ``cuobjdump -sass`` its instructions (16 bytes each on sm_90a).

Usage::

    python scripts/kernel_code_size.py                          # this tree, every instantiation
    python scripts/kernel_code_size.py --only l2norm_index      # names containing a substring
    python scripts/kernel_code_size.py --base /path/to/other    # other tree's csrc vs this one's
    git archive main csrc | tar x -C /tmp/main_tree && \\
        python scripts/kernel_code_size.py --base /tmp/main_tree --only longest_first
    # instructions from each stage wait of the owners' loop to the next WGMMA (a path's length):
    python scripts/kernel_code_size.py --only gate_in_kernel_l2norm_cooperative \\
        --span 'SYNCS.PHASECHK.TRANS64.TRYWAIT.*0x380a0' HGMMA

Needs nvcc and the CUTLASS headers (as setup.py finds them) and cuobjdump (+ nvdisasm) from the
``nvidia-cuda-cuobjdump`` / ``nvidia-cuda-nvdisasm`` wheels, a CUDA toolkit, or PATH. One
instantiation takes 15-60 s on one core; ``--jobs`` compiles several at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BYTES_PER_INSTRUCTION = 16  # sm_90a


@dataclasses.dataclass
class KernelSize:
    """One kernel (a __global__ function) of one instantiation."""

    name: str              # mangled name
    instructions: int = 0  # SASS instructions
    registers: int = 0
    stack: int = 0         # bytes of stack frame
    spill_stores: int = 0  # bytes
    spill_loads: int = 0   # bytes
    spans: list[int] = dataclasses.field(default_factory=list)  # --span: instructions between the marks

    @property
    def kib(self) -> float:
        return self.instructions * BYTES_PER_INSTRUCTION / 1024.0

    @property
    def pass_name(self) -> str:
        """The kernel's KernelPass from its mangled template arguments (the fused kernels take
        kFused = 0, the owners' kCooperative = 1, the helpers' kCoopHelpers = 2, the pair form
        kFusedPair = 3)."""
        m = re.search(r"KernelPass(?:E)?(\d)", self.name)
        return {"0": "fused", "1": "cooperative", "2": "helpers", "3": "pair"}.get(m.group(1), "?") if m else "?"


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S")


def parse_ptxas(text: str) -> dict[str, KernelSize]:
    """Registers, stack and spills per entry function from ptxas -v's report."""
    kernels: dict[str, KernelSize] = {}
    current: KernelSize | None = None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = kernels.setdefault(m.group(1), KernelSize(m.group(1)))
            continue
        if current is None:
            continue
        m = _SPILL.search(line)
        if m:
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
        m = _USED.search(line)
        if m:
            current.registers = int(m.group(1))
    return kernels


def count_sass(text: str) -> dict[str, int]:
    """SASS instructions per function from ``cuobjdump -sass``."""
    counts: dict[str, int] = {}
    name = None
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            name = m.group(1)
            counts[name] = 0
        elif name is not None and _INSTRUCTION.match(line):
            counts[name] += 1
    return counts


def sass_spans(text: str, start: str, end: str, limit: int = 4000) -> dict[str, list[int]]:
    """Per function of ``cuobjdump -sass`` text: for each instruction matching the regex ``start``,
    the number of instructions strictly between it and the next one matching ``end`` (within
    ``limit`` instructions and the same function; none found: no entry). A static count: every
    instruction in between counts, whether or not its branch is taken."""
    start_re, end_re = re.compile(start), re.compile(end)
    spans: dict[str, list[int]] = {}
    name: str | None = None
    open_at: list[int] = []  # instruction indices of the starts still waiting for an end
    index = 0
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            name, open_at, index = m.group(1), [], 0
            spans.setdefault(name, [])
            continue
        if name is None or not _INSTRUCTION.match(line):
            continue
        if end_re.search(line):
            spans[name].extend(index - i - 1 for i in open_at if index - i - 1 <= limit)
            open_at = []
        if start_re.search(line):
            open_at.append(index)
        index += 1
    return spans


def _build_helpers():
    """setup.py's toolkit search and the build tests' tool search (tests/test_build.py), reused."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:
        import test_build
    finally:
        sys.path.pop(0)
    return test_build._load_setup_py(), test_build.find_tool


def measure(tree: str, source: str, nvcc: str, includes: list[str], flags: list[str],
            cuobjdump: str, env: dict[str, str], span: tuple[str, str] | None = None) -> list[KernelSize]:
    """Compile one instantiation of ``tree`` and return its kernels' sizes."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        cmd = [nvcc, *flags, "-Xptxas=-v", "-cubin", "-o", cubin,
               f"-I{os.path.join(tree, 'csrc')}", *[f"-I{d}" for d in includes], source]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if out.returncode != 0:
            raise RuntimeError(f"compile failed: {' '.join(cmd)}\n{out.stdout}{out.stderr}")
        kernels = parse_ptxas(out.stdout + out.stderr)
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, timeout=600, env=env)
        if sass.returncode != 0:
            raise RuntimeError(f"cuobjdump failed on {source}: {sass.stderr}")
    for name, n in count_sass(sass.stdout).items():
        kernels.setdefault(name, KernelSize(name)).instructions = n
    if span is not None:
        for name, found in sass_spans(sass.stdout, *span).items():
            kernels.setdefault(name, KernelSize(name)).spans = found
    return sorted(kernels.values(), key=lambda k: k.pass_name)


def _instantiations(tree: str, only: list[str]) -> list[str]:
    paths = sorted(glob.glob(os.path.join(tree, "csrc", "kda", "sm90", "instantiations", "*.cu")))
    short = [os.path.basename(p)[len("kda_prefill_sm90_"):-3] for p in paths]
    return [p for p, s in zip(paths, short) if not only or any(o in s for o in only)]


def _row(label: str, k: KernelSize, base: KernelSize | None) -> str:
    text = (f"{label:<48} {k.pass_name:<11} {k.instructions:>6} {k.kib:>6.1f} {k.registers:>4} "
            f"{k.stack:>5} {k.spill_stores:>5}/{k.spill_loads:<5}")
    if base is not None:
        text += (f"  vs base {k.instructions - base.instructions:+6} instr, "
                 f"spills {base.spill_stores}/{base.spill_loads}")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=ROOT, help="source tree to measure (its csrc/); default: this checkout")
    ap.add_argument("--base", help="another tree (with csrc/) to compare against, instantiation by instantiation")
    ap.add_argument("--only", nargs="*", default=[], help="keep instantiations whose name contains any of these")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--span", nargs=2, metavar=("FROM", "TO"), default=None,
                    help="also list, per kernel, the SASS instructions between each instruction matching the "
                         "regex FROM and the next matching TO (a static path length)")
    args = ap.parse_args(argv)

    setup_py, find_tool = _build_helpers()
    cuda_home = setup_py.find_cuda_home()
    cutlass = setup_py.find_cutlass_include()
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None
    if nvcc is None or not os.path.isfile(nvcc) or cutlass is None:
        print("kernel_code_size: nvcc or the CUTLASS headers not found (setup.py's find_cuda_home / "
              "find_cutlass_include)", file=sys.stderr)
        return 2
    includes = [cutlass]
    util = setup_py._cutlass_util_include(cutlass)
    if util:
        includes.append(util)
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        print("kernel_code_size: cuobjdump / nvdisasm not found (pip install nvidia-cuda-cuobjdump "
              "nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + env.get("PATH", "")
    flags = list(setup_py.KERNEL_NVCC_FLAGS)

    sources = _instantiations(args.tree, args.only)
    if not sources:
        print(f"kernel_code_size: no instantiation matches {args.only} in {args.tree}", file=sys.stderr)
        return 2
    jobs = [(args.tree, s) for s in sources]
    if args.base:
        base_dir = os.path.join(args.base, "csrc", "kda", "sm90", "instantiations")
        jobs += [(args.base, os.path.join(base_dir, os.path.basename(s))) for s in sources
                 if os.path.isfile(os.path.join(base_dir, os.path.basename(s)))]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        span = tuple(args.span) if args.span else None
        results = list(pool.map(lambda j: measure(j[0], j[1], nvcc, includes, flags, cuobjdump, env, span), jobs))
    by_job = dict(zip(jobs, results))

    print(f"tree {args.tree}" + (f", base {args.base}" if args.base else ""))
    print(f"{'instantiation':<48} {'kernel':<11} {'instr':>6} {'KiB':>6} {'regs':>4} {'stack':>5} "
          f"spills st/ld (bytes)")
    for s in sources:
        label = os.path.basename(s)[len("kda_prefill_sm90_"):-3]
        base_kernels = {}
        if args.base:
            base_src = os.path.join(args.base, "csrc", "kda", "sm90", "instantiations", os.path.basename(s))
            base_kernels = {k.pass_name: k for k in by_job.get((args.base, base_src), [])}
        for k in by_job[(args.tree, s)]:
            print(_row(label, k, base_kernels.get(k.pass_name)))
            if args.span:
                base = base_kernels.get(k.pass_name)
                print(f"{'':<48} {'':<11} span {args.span[0]!r} -> {args.span[1]!r}: {k.spans}"
                      + (f" (base {base.spans})" if base is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
