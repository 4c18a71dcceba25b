#!/usr/bin/env python3
"""Summarise a cooperative launch's event timeline (a -DCULA_KDA_TIMELINE build, csrc/kda/sm90/timeline.cuh).

    CULA_KDA_TIMELINE_FILE=/tmp/tl.txt kda_standalone 1 1024 64 64 3   # any call; the file holds the last launch
    python3 scripts/coop_timeline.py /tmp/tl.txt [--bin-us 10]

Prints, in microseconds from the launch's first event: when the CTAs of each role started and
ended, the helpers' chunk latencies (claim -> head -> tail -> published) and throughput over time,
and per owner where its time went: waiting for the first chunk, running chunks, and waiting for
chunks that were not yet published (the helpers behind), with the owner that ended last in detail.
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

EVENTS = {
    0: "helper_start", 1: "owner_start", 2: "claim", 3: "head", 4: "tail", 5: "published",
    6: "stage_free", 7: "flag_seen", 8: "chunk_done", 9: "helper_end", 10: "owner_end",
}


def load(path: str) -> list[tuple[int, str, int, int, int, int]]:
    rows = []
    with open(path) as f:
        for line in f:
            ns, ev, extra, cta, vh, slot = (int(x) for x in line.split())
            rows.append((ns, EVENTS[ev], extra, cta, vh, slot))
    return rows


def q(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    return f"min {xs[0]:.1f} med {statistics.median(xs):.1f} max {xs[-1]:.1f} (n {len(xs)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--bin-us", type=float, default=10.0, help="width of the throughput histogram's bins")
    args = ap.parse_args()
    rows = load(args.file)
    t0 = min(r[0] for r in rows)
    us = lambda ns: (ns - t0) / 1000.0  # noqa: E731

    by_ev: dict[str, list] = defaultdict(list)
    for r in rows:
        by_ev[r[1]].append(r)
    print(f"{args.file}: {len(rows)} events")
    for name in ("helper_start", "owner_start", "helper_end", "owner_end"):
        print(f"  {name:13s} {q([us(r[0]) for r in by_ev[name]])}")

    # Chunks by (v_head, slot).
    chunk: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    chain_of: dict[tuple[int, int], tuple[int, int]] = {}
    owner_of: dict[tuple[int, int], int] = {}
    for ns, ev, extra, cta, vh, slot in rows:
        if ev in ("claim", "head", "tail", "published", "stage_free", "flag_seen", "chunk_done"):
            key = (vh, slot)
            # (two owners of a tile, value split: keep the later chunk_done)
            chunk[key][ev] = max(chunk[key].get(ev, 0.0), us(ns)) if ev == "chunk_done" else us(ns)
            if ev == "claim":
                chain_of[key] = (cta, extra)
            if ev == "flag_seen":
                owner_of[key] = cta
    lat = lambda a, b: [c[b] - c[a] for c in chunk.values() if a in c and b in c]  # noqa: E731
    print(f"chunks {len(chunk)}; helper chains {len(set(chain_of.values()))}")
    print(f"  claim -> head      {q(lat('claim', 'head'))}")
    print(f"  head -> tail       {q(lat('head', 'tail'))}")
    print(f"  tail -> published  {q(lat('tail', 'published'))}")
    print(f"  claim -> published {q(lat('claim', 'published'))}")
    print(f"  published -> seen  {q(lat('published', 'flag_seen'))}")
    first = sorted(c["published"] for c in chunk.values() if "published" in c)
    if first:
        print(f"  publishes: first {first[0]:.1f}, 100th {first[min(99, len(first) - 1)]:.1f}, last {first[-1]:.1f}")
        width = args.bin_us
        nbins = int(first[-1] // width) + 1
        hist = [0] * nbins
        for t in first:
            hist[int(t // width)] += 1
        print(f"  published per {width:g} us: " + " ".join(str(h) for h in hist))
    # Per chain: claim times -> rounds.
    per_chain: dict[tuple[int, int], list[float]] = defaultdict(list)
    for key, ch in chain_of.items():
        if "published" in chunk[key]:
            per_chain[ch].append(chunk[key]["published"])
    # A chain's first chunk (claim -> tail) against its later ones (tail to tail): the first runs
    # on cold code (instruction fetch from L2 / HBM), the cost every launch pays once.
    per_chain_chunks: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for key, ch in chain_of.items():
        if "tail" in chunk[key]:
            per_chain_chunks[ch].append(key)
    first_chunk, later_cycle = [], []
    for keys in per_chain_chunks.values():
        keys.sort(key=lambda k: chunk[k]["claim"])
        first_chunk.append(chunk[keys[0]]["tail"] - chunk[keys[0]]["claim"])
        later_cycle += [chunk[b]["tail"] - chunk[a]["tail"] for a, b in zip(keys, keys[1:])]
    print(f"  chain's first chunk, claim -> tail {q(first_chunk)}")
    print(f"  chain's later chunks, tail -> tail {q(later_cycle)}")
    counts = defaultdict(int)
    for v in per_chain.values():
        counts[len(v)] += 1
    print(f"  chunks per helper chain: {dict(sorted(counts.items()))}")
    last_pub = [max(v) for v in per_chain.values()]
    print(f"  helper chains' last publish {q(last_pub)}")

    # Owners.
    per_owner: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for key, cta in owner_of.items():
        per_owner[cta].append(key)
    stats = []
    for cta, keys in per_owner.items():
        keys.sort(key=lambda k: chunk[k].get("flag_seen", 0.0))
        wait_first = chunk[keys[0]]["flag_seen"]
        starve = 0.0
        starved = 0
        step = []
        prev_done = None
        for k in keys:
            c = chunk[k]
            if prev_done is not None and "published" in c and c["published"] > prev_done:
                starve += c["published"] - prev_done
                starved += 1
            if prev_done is not None and "chunk_done" in c:
                step.append(c["chunk_done"] - max(prev_done, c.get("flag_seen", 0.0)))
            prev_done = c.get("chunk_done", prev_done)
        stats.append((prev_done or 0.0, cta, wait_first, starve, starved, len(keys), step))
    stats.sort()
    if stats:
        print(f"owners {len(stats)}: end {q([s[0] for s in stats])}")
        print(f"  first chunk seen {q([s[2] for s in stats])}")
        print(f"  waiting on unpublished chunks (us per owner) {q([s[3] for s in stats])}")
        print(f"  chunk step after its flag {q([x for s in stats for x in s[6]])}")
        end, cta, wait_first, starve, starved, n, step = stats[-1]
        print(f"  last owner (CTA {cta}): end {end:.1f}, first chunk at {wait_first:.1f}, {n} chunks, "
              f"{starved} waited on for {starve:.1f} us, steps {q(step)}")
        keys = per_owner[cta]
        line = []
        for k in keys:
            c = chunk[k]
            line.append(f"{k[0]}:{k[1]} pub {c.get('published', -1):.1f} done {c.get('chunk_done', -1):.1f}")
        print("   " + "\n   ".join(line))


if __name__ == "__main__":
    main()
