"""PNG bar chart: cula's speedup over each other kernel per configuration, eager and CUDA graph,
with parity (1.0) marked."""
from __future__ import annotations

import os
from typing import Any

from kda_bench.report import kernels
from kda_bench.util import first_line

# (competitor index, graph) -> bar colour: one hue per competitor, light for eager, dark for graph.
COLORS = [("#8FB3E0", "#2F5D9A"), ("#F2B482", "#C0622B"), ("#A8D5A2", "#3F8A3A")]


def plot(path: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> str | None:
    """Writes the chart to ``path``; returns None on success, else why it was not written."""
    others = [(nm, lb) for nm, lb in kernels(meta) if nm not in ("cula", "cula_safe")]
    series = [(nm, lb, graph) for nm, lb in others for graph in (False, True)]
    key = {(nm, graph): f"cula_vs_{nm}" + ("_graph" if graph else "") for nm, _, graph in series}
    pts = [r for r in rows if any(r.get(k) for k in key.values())]
    if not pts:
        return "no row has a speedup (cula and another kernel did not both run)"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"matplotlib unavailable ({first_line(exc)})"
    n, k = len(pts), len(series)
    w = 0.8 / k
    fig, ax = plt.subplots(figsize=(max(9.0, 0.25 * n * k + 3), 5.5))
    top = max([r.get(v) or 0.0 for r in pts for v in key.values()] + [1.0])
    for j, (nm, lb, graph) in enumerate(series):
        vals = [r.get(key[(nm, graph)]) for r in pts]
        off = (j - (k - 1) / 2) * w
        color = COLORS[(j // 2) % len(COLORS)][int(graph)]
        bars = ax.bar([x + off for x in range(n)], [v or 0.0 for v in vals], w,
                      label=f"vs {lb} ({'CUDA graph' if graph else 'eager'})", color=color)
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, (v or 0.0) + 0.01 * top,
                    f"{v:.2f}" if v else "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="1.0 (parity)")
    ax.set_ylim(0, top * 1.3)
    ax.set_xticks(list(range(n)))
    ax.set_xticklabels([r["config"] for r in pts], rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("cula speedup (other ms / cula ms)")
    versions = ", ".join(f"{b['label']} {b.get('version')}" for b in meta.get("baselines") or [])
    ax.set_title(f"KDA prefill: cula kda_prefill vs {', '.join(lb for _, lb in others)}\n"
                 f"{meta.get('device')}, {meta.get('date')}, commit {str(meta.get('commit', ''))[:12]}"
                 + (f"; {versions}" if versions else ""), fontsize=9)
    ax.legend(fontsize=7, loc="upper center", ncol=min(5, k + 1))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
