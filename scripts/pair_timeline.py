#!/usr/bin/env python3
"""Summarise a pair-form launch's event timeline (a -DCULA_KDA_TIMELINE build, csrc/kda/sm90/timeline.cuh).

    CULA_KDA_COOPERATIVE=0 CULA_KDA_PAIR=1 CULA_KDA_TIMELINE_FILE=/tmp/tl.txt kda_standalone 1 1024 64 64 3
    python3 scripts/pair_timeline.py /tmp/tl.txt [--chunks 20]

Every mark reads %globaltimer, which perturbs the kernel (B1 T1024 H64: 0.150 ms against 0.124 in
one run); a build with -DCULA_KDA_TIMELINE_ENDS_ONLY as well keeps the CTAs' starts and ends only
(with the SM of each CTA), and this prints those alone.

Times in microseconds from the launch's first CTA start. Per chunk (the CTA's chunk count) and
cluster rank, the median over the CTAs of when each role was through with it: the prep's wait for
the load (`loaded`), the prep (`prepped`), the intra-chunk chain (`intra`), the state warpgroup's
wait for `ready` (`ready`), its release of the stage (`released`) and its output store (`stored`);
then the state warpgroup's period (released(c) - released(c - 1)) and where the launch's fixed
time goes: CTA starts, the first chunk's way to `ready`, the last chunk's store to the CTA's end.
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

KINDS = {11: "start", 12: "loaded", 13: "prepped", 14: "intra", 15: "ready", 16: "released", 17: "stored", 18: "end"}
PER_CHUNK = ["loaded", "prepped", "intra", "ready", "released", "stored"]


def load(path: str) -> tuple[dict[tuple[str, int, int], int], dict[int, int]]:
    """(kind, cta, chunk) -> ns for the written records, and cta -> SM."""
    out, sm = {}, {}
    with open(path) as f:
        for line in f:
            ns, ev, _extra, cta, smid, slot = (int(x) for x in line.split())
            if ns == 0 or ev not in KINDS:
                continue
            out[(KINDS[ev], cta, slot)] = ns
            sm[cta] = smid
    return out, sm


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.2f}" if xs else "       -"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--chunks", type=int, default=20, help="chunks to list (the first ones)")
    args = ap.parse_args()
    rec, sm = load(args.file)
    if not rec:
        raise SystemExit("no pair-form records (a timeline build, the pair form, CULA_KDA_TIMELINE_FILE set?)")
    t0 = min(ns for (k, _, _), ns in rec.items() if k == "start")
    us = lambda ns: (ns - t0) / 1000.0  # noqa: E731
    ctas = sorted({cta for (_, cta, _) in rec})
    starts = [us(rec[("start", c, 0)]) for c in ctas if ("start", c, 0) in rec]
    ends = [us(rec[("end", c, 0)]) for c in ctas if ("end", c, 0) in rec]
    print(f"{len(ctas)} CTAs")
    print(f"CTA start: min {min(starts):.2f} med {statistics.median(starts):.2f} max {max(starts):.2f} us")
    print(f"CTA end:   min {min(ends):.2f} med {statistics.median(ends):.2f} max {max(ends):.2f} us")
    # Where the slow clusters ran: the clusters by end time, with their CTAs' SMs.
    by_end = sorted((us(rec[("end", c, 0)]), c) for c in ctas if c % 2 == 0 and ("end", c, 0) in rec)
    fmt = lambda e, c: f"{c // 2}@SM{sm.get(c)}/{sm.get(c + 1)}:{e:.1f}"  # noqa: E731
    print("fastest clusters (cluster@SMs:end us): " + " ".join(fmt(e, c) for e, c in by_end[:8]))
    print("slowest clusters (cluster@SMs:end us): " + " ".join(fmt(e, c) for e, c in by_end[-8:]))
    released = [c for (k, _, c) in rec if k == "released"]
    if not released:  # a -DCULA_KDA_TIMELINE_ENDS_ONLY build: starts and ends only
        return
    n_chunks = 1 + max(released)
    print(f"{n_chunks} chunks each (marks kept for {min(n_chunks, 128)})")

    print("\nmedian over CTAs, us from the first start (rank 0 | rank 1)")
    print("chunk " + " ".join(f"{k:>17}" for k in PER_CHUNK) + "   period")
    prev: dict[int, list[float]] = {}
    for ch in range(min(n_chunks, args.chunks)):
        cols = []
        for k in PER_CHUNK:
            r0 = [us(rec[(k, c, ch)]) for c in ctas if c % 2 == 0 and (k, c, ch) in rec]
            r1 = [us(rec[(k, c, ch)]) for c in ctas if c % 2 == 1 and (k, c, ch) in rec]
            cols.append(f"{med(r0)}|{med(r1)}")
        per = []
        for c in ctas:
            if ("released", c, ch) in rec and ("released", c, ch - 1) in rec:
                per.append((rec[("released", c, ch)] - rec[("released", c, ch - 1)]) / 1000.0)
        print(f"{ch:5d} " + " ".join(cols) + f" {med(per)}")

    # Phases of each CTA, medians over CTAs.
    def span(a: str, ca: int, b: str, cb: int) -> list[float]:
        return [(rec[(b, c, cb)] - rec[(a, c, ca)]) / 1000.0 for c in ctas if (a, c, ca) in rec and (b, c, cb) in rec]

    last = min(n_chunks, 128) - 1
    print("\nphases (median over CTAs, us):")
    for name, a, ca, b, cb in [
        ("start -> chunk 0 loaded", "start", 0, "loaded", 0),
        ("chunk 0 loaded -> prepped", "loaded", 0, "prepped", 0),
        ("chunk 0 prepped -> intra done", "prepped", 0, "intra", 0),
        ("chunk 0 intra done -> ready seen", "intra", 0, "ready", 0),
        ("chunk 0 ready -> released", "ready", 0, "released", 0),
        ("chunk 1 ready -> released", "ready", 1, "released", 1),
        (f"chunk {last} ready -> released", "ready", last, "released", last),
        (f"chunk {last} released -> stored", "released", last, "stored", last),
        (f"chunk {last} stored -> CTA end", "stored", last, "end", 0),
        ("start -> CTA end", "start", 0, "end", 0),
    ]:
        xs = span(a, ca, b, cb)
        if xs:
            print(f"  {name:34s} {statistics.median(xs):8.2f}   (min {min(xs):.2f}, max {max(xs):.2f})")
    if n_chunks > 2:
        per = [(rec[("released", c, last)] - rec[("released", c, 0)]) / 1000.0 / last for c in ctas
               if ("released", c, last) in rec and ("released", c, 0) in rec]
        print(f"  state period, chunks 1..{last}: {statistics.median(per):.3f} us a chunk")


if __name__ == "__main__":
    main()
