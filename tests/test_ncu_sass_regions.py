"""scripts/ncu_sass_regions.py on a small table of the form `ncu --page source --csv --print-source
sass` writes (no GPU or ncu needed)."""
from __future__ import annotations

import gzip
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("ncu_sass_regions", os.path.join(ROOT, "scripts", "ncu_sass_regions.py"))
nsr = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = nsr  # dataclasses look their module up there
_spec.loader.exec_module(nsr)

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"')
ROWS = [
    '"0x0","      LDC R1, c[0x0][0x28]","2","2","100","0","2","0"',
    '"0x10","      STSM.16.MT88.4 [R12], R16","6","5","300","1","5","1"',
    '"0x20","@!P0  BRA 0x7fc15d7ce7c0","12","12","500","12","0","12"',
    '"0x30","      HMMA.16816.F32.BF16 R4, R8, R12, R4","0","0","100","0","0","0"',
]


def _table(tmp_path) -> str:
    path = str(tmp_path / "t.csv.gz")
    with gzip.open(path, "wt") as f:
        f.write('"Kernel Name","void kernel()",\n' + HEADER + "\n" + "\n".join(ROWS) + "\n")
    return path


def test_load_reads_samples_executed_and_stalls(tmp_path):
    rows = nsr.load(_table(tmp_path))
    assert [r.samples for r in rows] == [2, 6, 12, 0]
    assert [r.executed for r in rows] == [100, 300, 500, 100]
    assert rows[2].stalls == {"long_sb": 12, "wait": 0}  # the "(Not Issued)" column is not a reason of its own
    assert rows[1].op.startswith("STSM")


def test_summary_shares_signatures_and_top_stalls(tmp_path):
    rows = nsr.load(_table(tmp_path))
    line = nsr.summary(rows[1:4], tot_samples=20, tot_exec=1000, chunks=10)
    # samples 18 of 20, executed 900 of 1000 (90 per chunk), STSM / HMMA found, predicated BRA ignored
    assert line.startswith("samples  90.0% exec  90.0% (90 per chunk-tile) HMMA STSM |")
    assert line.endswith("long_sb:72% wait:28%")
