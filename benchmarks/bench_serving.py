#!/usr/bin/env python3
"""The serving row: one prefill batch of a server against a state pool, three ways, one process.

    python benchmarks/bench_serving.py [--json PATH] [--md PATH]

Batch: 64 one-token sequences (decode-like rows) plus 4 sequences of 2048 tokens, H = HV = 32,
D = 128, bf16, gate in kernel (lower_bound -5), l2norm in kernel, beta logits, states fp32 in a
pool of 256 rows (the 68 sequences on scattered rows). Timed (CUDA-event medians of single calls
from an idle GPU, as ``bench_kda_prefill.py`` does; ``kda_bench.timing``):

* ``plain``: ``kda_prefill`` on the same batch with a dense initial state ``[68, ...]`` and a fresh
  final state (the states already gathered: the lower bound of any pooled scheme);
* ``pooled``: ``kda_prefill(initial_state=pool, state_indices=idx, output_final_state=True)``: the
  kernel reads and writes the pool rows in place;
* ``gather_scatter``: ``pool[idx]`` -> ``kda_prefill`` -> ``pool[idx] = final``: what a server does
  without the pool support (two extra copies of 64 KB per (sequence, head), two extra launches).

Targets (the serving contract's): pooled within 3 % of plain, and faster than gather_scatter by at
least the two copies. Needs an SM90 GPU and the built extension.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from kda_bench.timing import TimingParams, time_calls  # noqa: E402

H = HV = 32
D = 128
LENS = [1] * 64 + [2048] * 4
SLOTS = 256


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--md", help="write a Markdown table here")
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("bench_serving: needs an SM90 (Hopper) GPU", file=sys.stderr)
        return 2
    from cula.kda import kda_prefill

    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    T, N = sum(LENS), len(LENS)
    cu = torch.tensor([0] + [sum(LENS[:i + 1]) for i in range(N)], dtype=torch.int32, device=dev)
    x = dict(q=torch.randn(1, T, H, D, device=dev, dtype=bf16), k=torch.randn(1, T, H, D, device=dev, dtype=bf16),
             v=torch.randn(1, T, HV, D, device=dev, dtype=bf16), g=torch.randn(1, T, HV, D, device=dev, dtype=bf16),
             beta=torch.randn(1, T, HV, device=dev, dtype=bf16))
    opts = dict(cu_seqlens=cu, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                A_log=0.1 * torch.randn(HV, device=dev), dt_bias=0.1 * torch.randn(HV * D, device=dev),
                safe_gate=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True, backend="sm90")
    pool = 0.1 * torch.randn(SLOTS, HV, D, D, device=dev)
    idx = torch.randperm(SLOTS, device=dev)[:N].to(torch.int32)
    idx_long = idx.long()
    dense = pool[idx_long].clone()

    def plain() -> None:
        kda_prefill(**x, **opts, initial_state=dense, output_final_state=True)

    def pooled() -> None:
        kda_prefill(**x, **opts, initial_state=pool, state_indices=idx, output_final_state=True)

    def gather_scatter() -> None:
        _, final = kda_prefill(**x, **opts, initial_state=pool[idx_long], output_final_state=True)
        pool[idx_long] = final

    p = TimingParams()
    ms = {name: time_calls([fn], p)[0] for name, fn in
          (("plain", plain), ("pooled", pooled), ("gather_scatter", gather_scatter))}
    result = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "batch": f"64 x 1 + 4 x 2048 tokens, H = HV = {H}, pool of {SLOTS} fp32 rows",
        **{f"{k}_ms": v for k, v in ms.items()},
        "pooled_vs_plain": ms["pooled"] / ms["plain"],
        "gather_scatter_minus_pooled_ms": ms["gather_scatter"] - ms["pooled"],
    }
    lines = ["| call | ms |", "| --- | --- |"] + [f"| {k} | {v:.3f} |" for k, v in ms.items()]
    lines.append(f"\npooled / plain = {result['pooled_vs_plain']:.3f}; gather + scatter cost "
                 f"{result['gather_scatter_minus_pooled_ms']:.3f} ms more than pooled")
    print(f"bench_serving: {result['batch']} on {result['device']}")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"# Serving row: {result['batch']}, {result['device']}, torch {result['torch']}\n\n")
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
