"""Human views of a hardware profile: nccl-tests-like tables (rich) and a PNG (busbw per op,
overlap)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from rich.console import Console
from rich.table import Table

from orchestrator.profiling.measure import format_bytes
from orchestrator.store import save_figure

OP_ORDER = ("allreduce", "reduce_scatter", "all_gather", "all2all", "p2p")


def _ops(hardware: Mapping) -> List[str]:
    benches = hardware.get("benchmarks", {})
    return [op for op in OP_ORDER if op in benches]


MAX_TABLE_ROWS = 48  # a larger table (a 1024-node analytic profile: ~1,000 rows) is cut


def op_table(hardware: Mapping, op: str) -> Table:
    """One op's points, nccl-tests style: a row per (group size, layout, size); times in us,
    bandwidths in GB/s. Over MAX_TABLE_ROWS points, only each (group size, layout)'s largest
    message (its bandwidth), the title says so; hardware.json keeps every point."""
    bench = hardware["benchmarks"][op]
    points = sorted(bench.get("points", []),
                    key=lambda p: (p["group_size"], p["layout"], p["size_bytes"]))
    title = f"{op} ({hardware.get('source', 'measured')})"
    if len(points) > MAX_TABLE_ROWS:
        largest = {(p["group_size"], p["layout"]): p for p in points}  # sorted: the last wins
        title += (f": the largest message of each group, {len(largest)} of {len(points)} "
                  f"points (every one in hardware.json)")
        points = list(largest.values())
    table = Table(title=title, title_justify="left")
    for col in ("group", "layout", "size", "dtype", "time us", "p10 us", "p90 us", "algbw GB/s",
                "busbw GB/s", "iters"):
        table.add_column(col, justify="left" if col in ("layout", "dtype") else "right")
    for p in points:
        table.add_row(str(p["group_size"]), p["layout"], format_bytes(p["size_bytes"]),
                      str(p["dtype"]), f"{p['time_us_median']:.1f}", f"{p['time_us_p10']:.1f}",
                      f"{p['time_us_p90']:.1f}", f"{p['algbw_GBps']:.3f}",
                      f"{p['busbw_GBps']:.3f}", str(p["iters"]))
    return table


def fits_table(hardware: Mapping) -> Table:
    """Every alpha-beta fit: latency (us), bandwidth (GB/s) and the worst relative error."""
    table = Table(title="alpha-beta fits: time_us = alpha_us + bytes / (algbw_GBps * 1e3)",
                  title_justify="left")
    for col in ("op", "group", "layout", "alpha us", "algbw GB/s", "max rel err"):
        table.add_column(col, justify="left" if col in ("op", "layout") else "right")
    for op in _ops(hardware):
        for f in hardware["benchmarks"][op].get("fits", []):
            err = f.get("max_rel_err")
            table.add_row(op, str(f["group_size"]), f["layout"], f"{f['alpha_us']:.1f}",
                          f"{f['algbw_GBps']:.3f}", "-" if err is None else f"{err:.1%}")
    return table


def print_report(hardware: Mapping, console: Optional[Console] = None) -> None:
    """Print every op's table, the fits and the overlap coefficient."""
    console = console or Console()
    for op in _ops(hardware):
        console.print(op_table(hardware, op))
    console.print(fits_table(hardware))
    overlap = hardware.get("benchmarks", {}).get("overlap")
    if overlap:
        def fmt(v: Any) -> str:
            return "-" if v is None else f"{v:.3f}"
        console.print(f"overlap: compute slowdown {fmt(overlap.get('compute_slowdown'))}, "
                      f"comm slowdown {fmt(overlap.get('comm_slowdown'))}, "
                      f"overlap_coe {fmt(overlap.get('overlap_coe'))}")


def _series(points: List[Mapping]) -> Dict[Tuple[int, str], Tuple[List[float], List[float]]]:
    series: Dict[Tuple[int, str], Tuple[List[float], List[float]]] = {}
    for p in sorted(points, key=lambda p: p["size_bytes"]):
        xs, ys = series.setdefault((p["group_size"], p["layout"]), ([], []))
        xs.append(p["size_bytes"])
        ys.append(p["busbw_GBps"])
    return series


SPAN_FOR_LOG = 20  # max/min above which an axis is logarithmic (small values stay readable)


def _busbw_panel(ax, op: str, points: List[Mapping]) -> None:
    ys_all: List[float] = []
    for (group_size, layout), (xs, ys) in sorted(_series(points).items()):
        ax.plot(xs, ys, marker="o", markersize=3, label=f"n={group_size} {layout}")
        ys_all += ys
    ax.set_xscale("log", base=2)
    positive = [y for y in ys_all if y > 0]
    if positive and max(positive) > SPAN_FOR_LOG * min(positive):
        ax.set_yscale("log")
    ax.set_title(op)
    ax.set_xlabel("message size per rank (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.grid(True, which="both", alpha=0.3)
    # Below the axes: a legend inside would hide the small-message points.
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))


def _overlap_panel(ax, overlap: Mapping) -> None:
    """Time of a matmul and of an allreduce, each alone (1) and run together (its slowdown)."""
    coe = overlap["overlap_coe"]
    for i, (name, key) in enumerate((("matmul", "compute_slowdown"),
                                     ("allreduce", "comm_slowdown"))):
        together = overlap.get(key)
        ax.bar([i - 0.2], [1.0], width=0.4, color="tab:blue", label="alone" if i == 0 else None)
        if together is not None:  # a Galvatron read-back keeps only overlap_coe
            ax.bar([i + 0.2], [together], width=0.4, color="tab:orange",
                   label="together" if i == 0 else None)
    ax.axhline(coe, color="red", linestyle="--", label=f"overlap_coe {coe:.2f}")
    ax.set_xticks([0, 1], ["matmul", "allreduce"])
    ax.set_ylabel("time relative to alone")
    ax.set_title(f"overlap: overlap_coe = {coe:.2f}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))


def build_busbw_figure(hardware: Mapping):
    """The matplotlib Figure of a hardware profile: busbw (GB/s) against message size (bytes,
    log) per op, one line per (group size, layout), busbw on a log axis where it spans
    decades; and, when measured, the overlap slowdowns. Axes are labelled with the op's name
    and "overlap"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benchmarks = hardware.get("benchmarks", {})
    ops = [op for op in _ops(hardware) if benchmarks[op].get("points")]
    overlap = benchmarks.get("overlap")
    panels = ops + (["overlap"] if overlap else [])
    ncols = min(3, max(1, len(panels)))
    nrows = max(1, -(-len(panels) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.5 * ncols, 4.6 * nrows), squeeze=False,
                             layout="constrained")
    for ax, panel in zip(axes.flat, panels):
        ax.set_label(panel)
        if panel == "overlap":
            _overlap_panel(ax, overlap)
        else:
            _busbw_panel(ax, panel, benchmarks[panel]["points"])
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    cluster = hardware.get("cluster", {})
    fig.suptitle(f"{cluster.get('name', '')}: {cluster.get('world_size', '?')} ranks, "
                 f"{hardware.get('source', 'measured')}")
    return fig


def plot_busbw(hardware: Mapping, path: os.PathLike) -> Path:
    """Write a PNG of build_busbw_figure(hardware) at `path`. Returns the path."""
    import matplotlib.pyplot as plt

    fig = build_busbw_figure(hardware)
    out = save_figure(fig, path)
    plt.close(fig)
    return out
