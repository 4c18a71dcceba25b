"""Sum an ncu per-instruction SASS table over blocks of the kernel's code, to see which region (role,
phase) takes the warps' time and issues the instructions.

The table comes from a report with the SourceCounters section:

    ncu --section SourceCounters ... -o rep BINARY ...
    ncu --import rep.ncu-rep --page source --csv --print-source sass | gzip > table.csv.gz

    python scripts/ncu_sass_regions.py table.csv.gz [--block 300] [--span LO HI] [--chunks N]

Per block of `--block` consecutive SASS instructions it prints the share of stall samples (warp
time), the share of executed warp instructions, the signature instructions found there (they tell
the regions apart: HGMMA state/intra products, STSM/LDSM/HMMA the exact pass, UTMALDG the
producer, ...) and the three largest stall reasons. `--span LO HI` sums one range instead;
`--chunks` (chunk-tiles of the launch, e.g. 16384 for B=2 T=8192 H=64) adds executed warp
instructions per chunk-tile.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import re
from dataclasses import dataclass, field

SIGNATURES = ("STSM", "LDSM", "HMMA", "HGMMA", "UTMALDG", "UTMASTG", "MUFU", "SYNCS", "BAR", "ATOMS", "STG", "LDG")


@dataclass
class Instr:
    op: str
    samples: int
    executed: int
    stalls: dict[str, int] = field(default_factory=dict)


def load(path: str) -> list[Instr]:
    """The instructions of the first kernel in the table, in code order."""
    with gzip.open(path, "rt") as f:
        rows = list(csv.reader(f))
    hdr = rows[1]
    ix = {h: i for i, h in enumerate(hdr)}
    stall_cols = [h for h in hdr if h.startswith("stall_") and "(Not" not in h]
    out = []
    for x in rows[2:]:
        if len(x) < len(hdr):
            continue
        out.append(Instr(op=x[ix["Source"]].strip(), samples=int(x[ix["Warp Stall Sampling (All Samples)"]] or 0),
                         executed=int(x[ix["Instructions Executed"]] or 0),
                         stalls={h[len("stall_"):]: int(x[ix[h]] or 0) for h in stall_cols}))
    return out


def summary(block: list[Instr], tot_samples: int, tot_exec: int, chunks: int) -> str:
    s = sum(r.samples for r in block)
    e = sum(r.executed for r in block)
    tags = set()
    stalls: dict[str, int] = {}
    for r in block:
        m = re.match(r"(@!?U?P\w+\s+)?([A-Z0-9]+)", r.op)
        if m and m.group(2) in SIGNATURES:
            tags.add(m.group(2))
        for k, v in r.stalls.items():
            stalls[k] = stalls.get(k, 0) + v
    top = sorted(stalls.items(), key=lambda kv: -kv[1])[:3]
    per_chunk = f" ({e / chunks:.0f} per chunk-tile)" if chunks else ""
    return (f"samples {100 * s / max(tot_samples, 1):5.1f}% exec {100 * e / max(tot_exec, 1):5.1f}%{per_chunk} "
            f"{' '.join(sorted(tags))} | " + " ".join(f"{k}:{100 * v / max(s, 1):.0f}%" for k, v in top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("table")
    ap.add_argument("--block", type=int, default=300)
    ap.add_argument("--span", type=int, nargs=2, metavar=("LO", "HI"))
    ap.add_argument("--chunks", type=int, default=0)
    args = ap.parse_args()
    rows = load(args.table)
    tot_s = sum(r.samples for r in rows)
    tot_e = sum(r.executed for r in rows)
    print(f"instructions {len(rows)}, stall samples {tot_s}, executed warp instructions {tot_e}")
    if args.span:
        lo, hi = args.span
        print(f"[{lo}, {hi}) " + summary(rows[lo:hi], tot_s, tot_e, args.chunks))
        return
    for i in range(0, len(rows), args.block):
        print(f"{i:5d} " + summary(rows[i:i + args.block], tot_s, tot_e, args.chunks))


if __name__ == "__main__":
    main()
