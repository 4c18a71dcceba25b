"""Reports: the progress line per row, JSON, Markdown, and the merge of several JSON results.

The kernels a report covers are the ``baselines`` entries of its meta (name, label, version),
cula first; every per-kernel column is ``<name>_<field>``. A kernel that does not cover a row
has ``<name>_na`` (the reason): its cells read "n/a" and the reason is listed under the table.
"""
from __future__ import annotations

import json
import math
import os
import re
import statistics
from typing import Any

from kda_bench.util import log

# Kernels of reports written before meta["baselines"] existed.
LEGACY_BASELINES = [{"name": "cula", "label": "cula"}, {"name": "fla", "label": "FLA"}]

# Meta fields that must agree between merged files (rows would not be comparable otherwise).
MERGE_KEYS = ("device", "commit", "torch", "triton", "fla", "flash_kda", "cula", "options")


def kernels(meta: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, label) of the kernels of a report, cula first."""
    return [(b["name"], b["label"]) for b in meta.get("baselines") or LEGACY_BASELINES]


def fmt_num(v: Any, fmt: str) -> str:
    """A number in ``fmt``; "—" for missing, "nan" for NaN/Inf."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—" if v is None else "nan"
    return format(v, fmt)


def cell(row: dict[str, Any], name: str, field: str, fmt: str) -> str:
    """A kernel's value in a row: "n/a" where the kernel does not cover the row."""
    if f"{name}_na" in row:
        return "n/a"
    return fmt_num(row.get(f"{name}_{field}"), fmt)


def speedup_cell(row: dict[str, Any], other: str, graph: bool) -> str:
    """cula vs ``other`` (other ms / cula ms), "n/a" where ``other`` does not cover the row."""
    if f"{other}_na" in row:
        return "n/a"
    return fmt_num(row.get(f"cula_vs_{other}" + ("_graph" if graph else "")), ".2f")


def progress_line(i: int, n: int, row: dict[str, Any], names: list[tuple[str, str]]) -> str:
    """One line per finished row (plus its notes), as the suite runs."""
    ran = [(nm, lb) for nm, lb in names if f"{nm}_na" not in row]
    parts = [f"[{i}/{n}] {row['config']:<34} {row.get('status', ''):<7}"]
    parts += [f"{lb} n/a" for nm, lb in names if f"{nm}_na" in row]
    for nm, lb in ran:
        parts.append(f"{lb} {cell(row, nm, 'ms', '.3f')} ms (graph {cell(row, nm, 'graph_ms', '.3f')})")
    if any(nm == "cula" for nm, _ in ran):
        for nm, lb in ran:
            if nm == "cula_safe":
                parts.append(f"softplus / safe {fmt_num(row.get('softplus_vs_safe'), '.2f')}x "
                             f"(graph {fmt_num(row.get('softplus_vs_safe_graph'), '.2f')}x)")
            elif nm != "cula":
                parts.append(f"cula vs {lb} {speedup_cell(row, nm, False)}x "
                             f"(graph {speedup_cell(row, nm, True)}x)")
    errs = " ".join(f"{lb} {cell(row, nm, 'o_err', '.1e')}/{cell(row, nm, 'state_err', '.1e')}"
                    for nm, lb in ran)
    parts.append(f"err o/S {errs}")
    parts.append(f"HBM floor {fmt_num(row.get('hbm_floor_ms'), '.3f')} ms, "
                 f"TC floor {fmt_num(row.get('tc_floor_ms'), '.3f')} ms")
    if row.get("cula_schedule"):
        parts.append(f"schedule {row['cula_schedule']}")
    s = " | ".join(parts)
    if "wall_s" in row:
        firsts = ", ".join(f"{lb} {fmt_num(row.get(f'{nm}_first_call_s'), '.1f')} s" for nm, lb in ran)
        s += (f" | {row['wall_s']:.0f} s (first call: {firsts}; "
              f"check {fmt_num(row.get('check_s'), '.1f')} s)")
    if row.get("notes"):
        s += "\n      " + "; ".join(row["notes"])
    return s


def row_notes(rows: list[dict[str, Any]], names: list[tuple[str, str]]) -> list[str]:
    """Notes under the table, each text once with the rows it applies to: a row's own notes and
    "<label> n/a: <reason>" for kernels that do not cover it."""
    where: dict[str, list[str]] = {}
    for r in rows:
        texts = [f"{lb} n/a: {r[f'{nm}_na']}" for nm, lb in names if f"{nm}_na" in r]
        texts += list(r.get("notes", []))
        for t in texts:
            where.setdefault(t, []).append(r["config"])
    return [f"{', '.join(cfgs)}: {text}" for text, cfgs in where.items()]


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], statements: list[str]) -> str:
    """The report as Markdown: header (device, versions, method), one table row per config,
    notes."""
    names = kernels(meta)
    labels = [lb for _, lb in names]
    has_cula = any(nm == "cula" for nm, _ in names)
    # Speedup columns against the other kernels; cula's safe gate beside the softplus rows gets
    # the ratio the other way round ("softplus / safe": cula ms / its safe-gate ms).
    others = [(nm, lb) for nm, lb in names if nm not in ("cula", "cula_safe")] if has_cula else []
    with_safe = has_cula and any(nm == "cula_safe" for nm, _ in names)
    L = [f"# KDA prefill: {' vs '.join(labels)} — {meta.get('device', '?')}", ""]
    L.append(f"- date: {meta.get('date')}, commit: `{meta.get('commit')}`")
    L.append(f"- torch {meta.get('torch')}, triton {meta.get('triton')}, FLA {meta.get('fla')}, "
             f"FlashKDA {meta.get('flash_kda')}, cula {meta.get('cula')}, CUDA {meta.get('cuda')}, "
             f"Python {meta.get('python')}")
    if meta.get("copy_bandwidth_GBps"):
        L.append(f"- measured copy bandwidth (read + write): {meta['copy_bandwidth_GBps']:.0f} GB/s; "
                 f"bf16 GEMM 8192^3: {meta['gemm_TFLOPs']:.0f} TFLOP/s; {meta.get('sm_count')} SMs")
    if meta.get("options"):
        L.append(f"- options (every kernel that supports them): {meta['options']}")
    for b in meta.get("baselines") or []:
        extra = ", ".join(f"{k} {v}" for k, v in b.items()
                          if k not in ("name", "label", "version") and v is not None)
        if extra:
            L.append(f"- {b['label']}: {extra}")
    for key in ("method", "varlen_note"):
        if meta.get(key):
            L.append(f"- {meta[key]}")
    for s in statements:
        L.append(f"- {s}")
    L.append("")
    if rows:
        head = ["config", "B", "N", "H", "HV"]
        head += [f"{lb} ms" for lb in labels]
        head += [f"cula vs {lb}" for _, lb in others] + (["softplus / safe"] if with_safe else [])
        head += [f"{lb} graph ms" for lb in labels]
        head += [f"cula vs {lb} graph" for _, lb in others] + (["softplus / safe graph"] if with_safe else [])
        head += [f"err o / S {lb}" for lb in labels]
        head += [f"SM·µs/chunk·head {lb}" for lb in labels]
        head += ["HBM floor ms"] + [f"{lb}/HBM" for lb in labels]
        head += ["TC floor ms", "cula schedule", "check", "status"]
        L.append("| " + " | ".join(head) + " |")
        L.append("|" + "---|" * len(head))
        for r in rows:
            c = [r["config"]] + [str(r.get(k, "—")) for k in ("B", "N", "H", "HV")]
            c += [cell(r, nm, "ms", ".3f") for nm, _ in names]
            c += [speedup_cell(r, nm, False) for nm, _ in others]
            c += [fmt_num(r.get("softplus_vs_safe"), ".2f")] if with_safe else []
            c += [cell(r, nm, "graph_ms", ".3f") for nm, _ in names]
            c += [speedup_cell(r, nm, True) for nm, _ in others]
            c += [fmt_num(r.get("softplus_vs_safe_graph"), ".2f")] if with_safe else []
            c += [f"{cell(r, nm, 'o_err', '.1e')} / {cell(r, nm, 'state_err', '.1e')}"
                  for nm, _ in names]
            c += [cell(r, nm, "sm_us_per_chunk_head", ".1f") for nm, _ in names]
            c += [fmt_num(r.get("hbm_floor_ms"), ".3f")] + [cell(r, nm, "hbm_ratio", ".2f") for nm, _ in names]
            c += [fmt_num(r.get("tc_floor_ms"), ".3f"), str(r.get("cula_schedule") or "—"),
                  str(r.get("check", "—")), str(r.get("status", ""))]
            L.append("| " + " | ".join(c) + " |")
        notes = row_notes(rows, names)
        if notes:
            L += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    L.append("")
    return "\n".join(L)


def slug(s: str) -> str:
    """File-name form of a device name."""
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "device"


def resolve_paths(json_path: str | None, md_path: str | None, png_path: str | None, save: bool,
                  results_dir: str, meta: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    """The paths to write: those given, plus ``<results_dir>/<device>-<date>.*`` with ``save``."""
    if save:
        base = os.path.join(results_dir, f"{slug(meta.get('device', 'device'))}-{meta['date']}")
        json_path = json_path or base + ".json"
        md_path = md_path or base + ".md"
        png_path = png_path or base + ".png"
    return json_path, md_path, png_path


def write_reports(paths: tuple[str | None, str | None, str | None], meta: dict[str, Any],
                  rows: list[dict[str, Any]], statements: list[str]) -> None:
    """Write the JSON, Markdown and PNG reports whose paths are given."""
    from kda_bench.plot import plot

    json_path, md_path, png_path = paths
    for path in paths:
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if json_path:
        with open(json_path, "w") as fh:
            json.dump({"meta": meta, "statements": statements, "rows": rows}, fh, indent=1,
                      default=str)
        log(f"wrote {json_path}")
    if md_path:
        with open(md_path, "w") as fh:
            fh.write(markdown(meta, rows, statements))
        log(f"wrote {md_path}")
    if png_path:
        why = plot(png_path, meta, rows)
        log(f"wrote {png_path}" if why is None else f"plot not written: {why}")


def merge(paths: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """Rows of several JSON results of one device and commit (e.g. one per --mode) as one report.
    The meta of the first file is kept (rates: median over the files). Raises ValueError when a
    field of :data:`MERGE_KEYS` differs between files."""
    metas, rows, statements = [], [], []
    for path in paths:
        with open(path) as fh:
            d = json.load(fh)
        metas.append(d["meta"])
        rows += d.get("rows", [])
        statements += [s for s in d.get("statements", []) if s not in statements]
    for key in MERGE_KEYS:
        vals = sorted({str(m.get(key)) for m in metas})
        if len(vals) > 1:
            raise ValueError(f"{key} differs between the files: {vals}")
    meta = dict(metas[0])
    for key in ("copy_bandwidth_GBps", "gemm_TFLOPs"):
        vals = [m[key] for m in metas if m.get(key)]
        if vals:
            meta[key] = statistics.median(vals)
            meta[key + "_per_file"] = vals
    meta["merged_from"] = [os.path.basename(p) for p in paths]
    meta["suite"] = "+".join(str(m.get("suite")) for m in metas)
    return meta, rows, statements
