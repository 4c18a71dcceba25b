"""scripts/kernel_code_size.py's parsers on ptxas and cuobjdump text of the forms nvcc 13.0 prints
(no compiler needed)."""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("kernel_code_size", os.path.join(ROOT, "scripts", "kernel_code_size.py"))
kcs = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = kcs  # dataclasses look their module up there
_spec.loader.exec_module(kcs)

FUSED = "_ZN4cula3kda4sm9023kda_prefill_sm90_kernelILb1ELb1ELb0ELNS1_10KernelPassE0ELNS1_6DecaysE0EEEvNS1_15KdaKernelParamsE"
HELPERS = "_ZN4cula3kda4sm9023kda_prefill_sm90_kernelILb1ELb1ELb0ELNS1_10KernelPassE2ELNS1_6DecaysE0EEEvNS1_15KdaKernelParamsE"

PTXAS = f"""ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '{FUSED}' for 'sm_90a'
ptxas info    : Function properties for {FUSED}
    48 bytes stack frame, 66 bytes spill stores, 56 bytes spill loads
ptxas info    : Used 128 registers, used 16 barriers, 48 bytes cumulative stack size
ptxas info    : Compiling entry function '{HELPERS}' for 'sm_90a'
ptxas info    : Function properties for {HELPERS}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
"""

SASS = f"""
	code for sm_90a
		Function : {FUSED}
	.headerflags	@"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                             /* 0x00000a00ff017b82 */
                                                                                      /* 0x000fe20000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                                 /* 0x0000000000007919 */
                                                                                      /* 0x000e220000002100 */
        /*0020*/                   EXIT ;                                             /* 0x000000000000794d */
                                                                                      /* 0x000fea0003800000 */
		..........

		Function : {HELPERS}
        /*0000*/                   LDC R1, c[0x0][0x28] ;                             /* 0x00000a00ff017b82 */
                                                                                      /* 0x000fe20000000800 */
        /*0010*/                   EXIT ;                                             /* 0x000000000000794d */
                                                                                      /* 0x000fea0003800000 */
"""


def test_parse_ptxas_reads_registers_stack_and_spills_per_kernel():
    kernels = kcs.parse_ptxas(PTXAS)
    assert set(kernels) == {FUSED, HELPERS}
    fused = kernels[FUSED]
    assert (fused.registers, fused.stack, fused.spill_stores, fused.spill_loads) == (128, 48, 66, 56)
    helpers = kernels[HELPERS]
    assert (helpers.registers, helpers.stack, helpers.spill_stores, helpers.spill_loads) == (168, 0, 0, 0)


def test_count_sass_counts_instructions_not_their_encoding_lines():
    assert kcs.count_sass(SASS) == {FUSED: 3, HELPERS: 2}


def test_kernel_pass_and_size_from_the_mangled_name():
    fused = kcs.KernelSize(FUSED, instructions=11008)
    assert fused.pass_name == "fused"
    assert kcs.KernelSize(HELPERS).pass_name == "helpers"
    assert kcs.KernelSize(HELPERS.replace("KernelPassE2", "KernelPassE3")).pass_name == "pair"
    assert abs(fused.kib - 11008 * 16 / 1024) < 1e-9


def _sass_function(name: str, instructions: list[str]) -> str:
    lines = [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"']
    for i, ins in enumerate(instructions):
        lines.append(f"        /*{16 * i:04x}*/                   {ins} ;                /* 0x000000000000794d */")
        lines.append("                                                                      /* 0x000fea0003800000 */")
    return "\n".join(lines)


def test_sass_spans_counts_the_instructions_between_each_start_and_the_next_end():
    owners = _sass_function(FUSED, [
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R8+URZ+0x380a0], R17",  # start: 3 instructions to the HGMMA
        "IMAD R9, R0, -0x80, R9",
        "F2FP.BF16.F32.PACK_AB R152, R25, R24",
        "WARPGROUP.ARRIVE",
        "HGMMA.64x64x16.F32.BF16 R120, R152, gdesc[UR4], RZ, !UPT",
        "HGMMA.64x64x16.F32.BF16 R120, R156, gdesc[UR8], R120",  # a second end closes nothing
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R8+URZ+0x380a0], R17",  # start: 0 before the HGMMA
        "HGMMA.64x64x16.F32.BF16 R120, R152, gdesc[UR4], RZ, !UPT",
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R8+URZ+0x380d0], R17",  # another barrier: not a start
        "EXIT",
    ])
    # a start left open at a function's end does not carry into the next function
    helpers = _sass_function(HELPERS, [
        "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R8+URZ+0x380a0], R17",
        "EXIT",
    ])
    spans = kcs.sass_spans(owners + "\n" + helpers + "\n" + _sass_function("third", ["HGMMA.64x64x16.F32 R0"]),
                           r"SYNCS.PHASECHK.TRANS64.TRYWAIT.*0x380a0", "HGMMA")
    assert spans == {FUSED: [3, 0], HELPERS: [], "third": []}
    # limit: a span longer than it is left out
    assert kcs.sass_spans(owners, r"TRYWAIT.*0x380a0", "HGMMA", limit=2)[FUSED] == [0]
    # the counts of the same text agree with count_sass
    assert kcs.count_sass(owners) == {FUSED: 10}
