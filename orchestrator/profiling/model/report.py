"""Human views of a model profile: tables (rich) and a PNG (time and activation memory vs seq)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from rich.console import Console
from rich.table import Table

from orchestrator.choices import Recompute
from orchestrator.device import describe_efficiency
from orchestrator.profiling.measure import format_bytes
from orchestrator.profiling.model.fit import predict_poly
from orchestrator.store import save_figure

FIT_WARN_REL_ERR = 0.2  # a block time fit missing a point by more is flagged (plot and report)


def _source_tag(source: str) -> str:
    return "[yellow]analytic[/]" if source == "analytic" else source


def _points_by_tp(profile: Mapping) -> Dict[int, List[Mapping]]:
    by_tp: Dict[int, List[Mapping]] = {}
    for p in sorted(profile.get("points", []), key=lambda p: p["seq_len"]):
        by_tp.setdefault(p["tp"], []).append(p)
    return by_tp


def _block_fit_rel_errors(points: List[Mapping], fit: Mapping) -> List[Tuple[int, float]]:
    """(seq_len, |fit - measured| / measured) per point of block fwd + bwd time."""
    out = []
    for p in points:
        measured = p["block_fwd_us"] + p["block_bwd_us"]
        pred = (predict_poly(fit["block_fwd_us"], p["seq_len"])
                + predict_poly(fit["block_bwd_us"], p["seq_len"]))
        out.append((p["seq_len"], abs(pred - measured) / measured))
    return out


def block_fit_errors(profile: Mapping) -> Dict[int, float]:
    """Per TP degree with a fit: the largest relative error (a fraction) of the block fwd + bwd
    time fit over its points, max |fit - measured| / measured: the series the PNG draws."""
    fits = profile.get("fits", {})
    return {tp: max(e for _, e in _block_fit_rel_errors(pts, fits[str(tp)]))
            for tp, pts in _points_by_tp(profile).items() if str(tp) in fits}


def fit_warnings(profile: Mapping) -> List[str]:
    """One line per TP degree whose block time fit misses a point by more than
    FIT_WARN_REL_ERR, naming the error and the worst sequence length; [] when all fit."""
    fits = profile.get("fits", {})
    lines = []
    for tp, pts in _points_by_tp(profile).items():
        if str(tp) not in fits:
            continue
        seq, err = max(_block_fit_rel_errors(pts, fits[str(tp)]), key=lambda se: se[1])
        if err > FIT_WARN_REL_ERR:
            lines.append(f"tp={tp}: block time fit misses by {err:.0%} at seq {seq} (over "
                         f"{FIT_WARN_REL_ERR:.0%}): times the search prices from it are off; "
                         f"noisy points, or a length range too short for the fit")
    return lines


def host_device_lines(profile: Mapping) -> List[str]:
    """One line per TP degree whose fits tell host time from device time (a GPU's): the host's
    time to issue each call and the device's fit, which the cost model prices as max of the
    two; [] for a profile without them (a CPU's, analytic)."""
    lines = []
    for tp, f in sorted(profile.get("fits", {}).items(), key=lambda kv: int(kv[0])):
        if "host_us" not in f:
            continue
        per_token = f.get("host_us_per_token") or {}
        parts = ", ".join(f"{part.replace('_', ' ')} host {f['host_us'][part]:.0f} us"
                          f"{f' + {per_token[part]:.3g}/token' if per_token.get(part) else ''}, "
                          f"device {' '.join(f'{c:.3g}' for c in f['device_us'][part])}"
                          for part in f["host_us"])
        lines.append(f"tp={tp} host / device (a call: max of the two; device c0 + b (c1 s + "
                     f"c2 s^2) us): {parts}")
    return lines


def point_line(record: Optional[dict], batch: int, markup: bool = True) -> str:
    """One line per profiled point: its times (us) and block activations (bytes per token);
    "" for no record (ranks other than 0)."""
    if not record:
        return ""
    tag = _source_tag(record["source"]) if markup else record["source"]
    act = record["block_act_bytes"][Recompute.none] / (record["seq_len"] * batch)
    split = "".join(f"; mbs {h['micro_batch_size']} block device/host fwd "
                    f"{h['block_fwd_device_us']:.0f}/{h['block_fwd_host_us']:.0f} bwd "
                    f"{h['block_bwd_device_us']:.0f}/{h['block_bwd_host_us']:.0f} us"
                    for h in record.get("host_device", ()))
    return (f"  seq {record['seq_len']:>6} tp {record['tp']}: block fwd "
            f"{record['block_fwd_us']:.0f} us bwd {record['block_bwd_us']:.0f} us, other fwd "
            f"{record['other_fwd_us']:.0f} us bwd {record['other_bwd_us']:.0f} us, block act "
            f"{act:.0f} B/token ({tag}){split}")


def points_table(profile: Mapping) -> Table:
    """A row per (tp, seq): compute times (us), TP collective time, block activation bytes per
    token per recompute mode and the ratio to Megatron's formula; every row names its source."""
    model = profile["model"]
    title = (f"{model['name']}: one block and the other parts per micro-batch of "
             f"{profile.get('micro_batch_size', 1)} ({profile.get('source')})")
    table = Table(title=title, title_justify="left")
    for col in ("tp", "seq", "block fwd us", "block bwd us", "other fwd us", "other bwd us",
                "TP comm us", "act B/tok none", "selective", "full", "vs Megatron (none/sel)",
                "source"):
        table.add_column(col, justify="left" if col == "source" else "right")
    for p in sorted(profile.get("points", []), key=lambda p: (p["tp"], p["seq_len"])):
        tokens = p["seq_len"] * profile.get("micro_batch_size", 1)
        act = p["block_act_bytes"]
        comm = sum(p.get(k, 0.0) for k in ("block_fwd_comm_us", "block_bwd_comm_us"))
        ratio = p.get("megatron_ratio", {})
        table.add_row(str(p["tp"]), str(p["seq_len"]), f"{p['block_fwd_us']:.1f}",
                      f"{p['block_bwd_us']:.1f}", f"{p['other_fwd_us']:.1f}",
                      f"{p['other_bwd_us']:.1f}", f"{comm:.0f}" if comm else "-",
                      *(f"{act[m] / tokens:.0f}" for m in Recompute),
                      f"{ratio.get('none', 0):.2f} / {ratio.get('selective', 0):.2f}",
                      _source_tag(p.get("source", "measured")))
    return table


def fits_table(profile: Mapping) -> Table:
    """Per TP degree: the block (quadratic) and other (linear) fits and their worst error."""
    table = Table(title="fits: block c0 + c1 s + c2 s^2, other c0 + c1 s (us)", title_justify="left")
    for col in ("tp", "block fwd", "block bwd", "other fwd", "other bwd", "max rel err", "source"):
        table.add_column(col, justify="left" if col == "source" else "right")

    def fmt(c):
        return " ".join(f"{x:.3g}" for x in c)

    for tp, f in sorted(profile.get("fits", {}).items(), key=lambda kv: int(kv[0])):
        err = f"{f['max_rel_err']:.1%}"
        table.add_row(tp, fmt(f["block_fwd_us"]), fmt(f["block_bwd_us"]), fmt(f["other_fwd_us"]),
                      fmt(f["other_bwd_us"]),
                      f"[red]{err}[/]" if f["max_rel_err"] > FIT_WARN_REL_ERR else err,
                      _source_tag(f.get("source", "measured")))
    return table


def memory_table(profile: Mapping) -> Table:
    """Per TP degree and part: states of one rank and activation bytes per token."""
    seq = profile["model"]["seq_len"]
    table = Table(title=f"memory per rank (activations at seq {seq})", title_justify="left")
    for col in ("tp", "part", "params", "param", "grad", "optim", "act B/tok none", "selective",
                "full", "vs Megatron", "source"):
        table.add_column(col, justify="left" if col in ("part", "source") else "right")
    for tp, m in sorted(profile.get("memory", {}).items(), key=lambda kv: int(kv[0])):
        for part in ("block", "other"):
            e = m[part]
            act = e["act_bytes_per_token"]
            ratio = e.get("megatron_ratio")
            table.add_row(tp, part, f"{e.get('params', 0) / 1e6:.2f}M", format_bytes(e["param_bytes"]),
                          format_bytes(e["grad_bytes"]), format_bytes(e["optim_bytes"]),
                          *(f"{act[mode]:.0f}" for mode in Recompute),
                          " / ".join(f"{ratio[mode]:.2f}" for mode in Recompute) if ratio else "-",
                          _source_tag(m.get("source", "measured")))
    return table


def moe_line(section: Optional[Mapping]) -> str:
    """One line for a MoE section: expert and routing cost per token (the fits' slopes) and
    their constant terms; "" without one."""
    if not section:
        return ""
    routing, experts = section["routing"], section["experts"]
    etp = min(experts, key=int)
    e = experts[etp]
    return (f"  moe ({section['source']}): routing {routing['fwd_us'][0]:.0f} + "
            f"{routing['fwd_us'][1]:.3g} us/token fwd, {routing['bwd_us'][0]:.0f} + "
            f"{routing['bwd_us'][1]:.3g} bwd; one expert (etp {etp}) {e['fwd_us'][0]:.0f} + "
            f"{e['fwd_us'][1]:.3g} us/token fwd, {e['bwd_us'][0]:.0f} + "
            f"{e['bwd_us'][1]:.3g} bwd ({section['kernel']} of expert GEMMs)")


def moe_table(profile: Mapping) -> Table:
    """Per MoE part and split: time fits c0 + c1 x (us, x its tokens), activation bytes per
    token and the fit's worst error."""
    moe = profile["moe"]
    table = Table(title=f"MoE FFN parts: time c0 + c1 x (us), x = tokens in (experts: per "
                        f"expert, a {moe['kernel']} of {moe['experts_timed']} timed)",
                  title_justify="left")
    for col in ("part", "split", "fwd c0", "fwd c1", "bwd c0", "bwd c1", "act B/token",
                "tokens", "max rel err", "source"):
        table.add_column(col, justify="left" if col in ("part", "source") else "right")
    rows = [("routing", "1", moe["routing"])]
    for part, label in (("experts", "etp"), ("shared", "tp"), ("mlp", "tp")):
        for split, fit in sorted((moe.get(part) or {}).items(), key=lambda kv: int(kv[0])):
            rows.append((part, f"{label} {split}", fit))
    for part, split, f in rows:
        err = f.get("max_rel_err") or 0.0
        table.add_row(part, split, f"{f['fwd_us'][0]:.3g}", f"{f['fwd_us'][1]:.3g}",
                      f"{f['bwd_us'][0]:.3g}", f"{f['bwd_us'][1]:.3g}",
                      f"{f['act_bytes'][-1]:.0f}", f"{min(f['tokens'])}..{max(f['tokens'])}",
                      f"[red]{err:.1%}[/]" if err > FIT_WARN_REL_ERR else f"{err:.1%}",
                      _source_tag(f.get("source", "measured")))
    return table


def print_report(profile: Mapping, console: Optional[Console] = None) -> None:
    """Print the points, the fits and the memory tables."""
    import sys

    # Wide enough for the tables when output goes to a file or a pipe (rich would use 80).
    console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    console.print(points_table(profile))
    if profile.get("fits"):
        console.print(fits_table(profile))
        for line in fit_warnings(profile):
            console.print(f"[red]warning[/]: {line}")
        for line in host_device_lines(profile):
            console.print(line)
    if profile.get("memory"):
        console.print(memory_table(profile))
    if profile.get("moe"):
        console.print(moe_table(profile))
    if profile.get("source") == "analytic":
        sheet = profile.get("method", {}).get("device_sheet", {})
        effs = describe_efficiency(sheet) if "efficiency" in sheet else "efficiency ?"
        console.print(f"[yellow]analytic[/]: times from FLOPs on device sheet "
                      f"{sheet.get('name', '?')} ({effs}), "
                      f"TP collectives not included; optimizer step from its bytes at "
                      f"{sheet.get('hbm_GBps') or 'no'} GB/s HBM; memory exact from shapes")


def _time_panel(ax, profile: Mapping, by_tp: Dict[int, List[Mapping]], colours) -> None:
    """Block fwd + bwd (ms) against seq per TP degree, with the fit; a series whose fit misses
    a point by more than FIT_WARN_REL_ERR is named in red in the legend and the title."""
    import numpy as np

    errors = block_fit_errors(profile)
    missed = []
    for i, (tp, pts) in enumerate(by_tp.items()):
        c = colours[i % len(colours)]
        s = np.array([p["seq_len"] for p in pts], dtype=float)
        t = np.array([p["block_fwd_us"] + p["block_bwd_us"] for p in pts]) / 1e3
        label = f"tp={tp} {'analytic' if pts[0].get('source') == 'analytic' else 'measured'}"
        if tp in errors:
            err = errors[tp]
            label += (f", fit misses by {err:.0%}" if err > FIT_WARN_REL_ERR
                      else f", fit err {err:.1%}")
            if err > FIT_WARN_REL_ERR:
                missed.append(f"tp={tp}")
        ax.plot(s, t, "o", color=c, label=label)
        fit = profile.get("fits", {}).get(str(tp))
        if fit:
            grid = np.geomspace(s.min(), s.max() * 1.05, 100)
            pred = [(predict_poly(fit["block_fwd_us"], x) + predict_poly(fit["block_bwd_us"], x))
                    / 1e3 for x in grid]
            ax.plot(grid, pred, "-", color=c, alpha=0.6)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("block fwd + bwd (ms)")
    title = f"{profile['model']['name']}: block time ({profile.get('source')}), fit lines"
    if missed:
        title += f"\n{', '.join(missed)}: fit misses its points by > {FIT_WARN_REL_ERR:.0%}"
    ax.set_title(title, color="red" if missed else "black")
    # Below the axes, so that no point is hidden behind it.
    legend = ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    for text in legend.get_texts():
        if "fit misses" in text.get_text():
            text.set_color("red")
    ax.grid(alpha=0.3)


def _memory_panel(ax, by_tp: Dict[int, List[Mapping]], colours) -> None:
    """Block activations (MiB) against seq per TP degree and recompute mode."""
    styles = {Recompute.none: "-", Recompute.selective: "--", Recompute.full: ":"}
    for i, (tp, pts) in enumerate(by_tp.items()):
        s = [p["seq_len"] for p in pts]
        for mode in Recompute:
            ax.plot(s, [p["block_act_bytes"][mode] / 2**20 for p in pts], styles[mode],
                    marker="o", markersize=3, color=colours[i % len(colours)],
                    label=f"tp={tp} {mode}")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("block activations per rank (MiB)")
    ax.set_title("activation memory: none (-), selective (--), full (:)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    ax.grid(alpha=0.3)


def build_profile_figure(profile: Mapping):
    """The matplotlib Figure of a model profile, None if it has no points: axes "time" (block
    fwd + bwd in ms against seq, the fit as a line, fits missing their points flagged) and
    "memory" (block activations per rank in MiB per TP degree and recompute mode)."""
    points = profile.get("points", [])
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 5.5), layout="constrained")
    ax_t.set_label("time")
    ax_m.set_label("memory")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    by_tp = _points_by_tp(profile)
    _time_panel(ax_t, profile, by_tp, colours)
    _memory_panel(ax_m, by_tp, colours)
    seqs = [p["seq_len"] for p in points]
    if max(seqs) > 20 * min(seqs):  # a sweep over orders of magnitude reads better on log axes
        for ax in (ax_t, ax_m):
            ax.set_xscale("log")
            ax.set_yscale("log")
    return fig


def plot_profile(profile: Mapping, png_path: str | os.PathLike) -> Optional[Path]:
    """Write a PNG of build_profile_figure(profile) at `png_path`. Returns the path, None if the
    profile has no points."""
    fig = build_profile_figure(profile)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    png_path = save_figure(fig, png_path)
    plt.close(fig)
    return png_path
