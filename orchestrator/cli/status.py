"""`stage=status`: what the ledger holds per stage, train's measured-vs-predicted table and the
calibrations tune wrote."""
from __future__ import annotations

import time
from pathlib import Path
from typing import List

from rich.markup import escape
from rich.table import Table

from orchestrator.commands import commands_that_launch, rerun_command
from orchestrator.console import console
from orchestrator.launch import refresh_ledger
from orchestrator.pipeline import ledger_for
from orchestrator.store import cluster_dir, read_json


# ---------------------------------------------------------------- status
def _relative(path) -> str:
    if not path:
        return ""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def print_status(cfg) -> List[dict]:
    """The ledger as a table, after re-attaching to Slurm jobs still pending or running."""
    ledger = ledger_for(cfg)
    refresh_ledger(ledger, cfg)  # what it cannot refresh (read-only folder) is shown as recorded
    entries = ledger.entries()
    table = Table(title=f"{ledger.path}")
    for col in ("entry", "state", "job id", "config", "started", "took", "progress / log / error"):
        table.add_column(col)
    colours = {"done": "green", "failed": "red", "cancelled": "yellow", "running": "cyan",
               "pending": "white"}
    def order(key):  # a part its run never reached (no start) sits with its stage
        parent = entries.get(key.rsplit("/", 1)[0])
        return (entries[key].started or (parent.started if parent else None) or 0, key)

    for key in sorted(entries, key=order):
        e = entries[key]
        took = f"{e.took_s:.1f}s" if e.took_s is not None else ""
        started = time.strftime("%m-%d %H:%M:%S", time.localtime(e.started)) if e.started else ""
        table.add_row(escape(key), f"[{colours.get(e.state.value, 'white')}]{e.state_text()}[/]",
                      str(e.job_id or ""), str(e.config_hash or "")[:8],
                      started, took,
                      escape(str(e.error or (e.progress if e.state.value == "running" else "")
                                 or _relative(e.log_path) or "")))
    if entries:
        console.print(table)
        print_train_table(cfg)
        print_calibrations(cfg)
    else:
        console.print(escape(f"nothing has run for cluster {cfg.cluster.name!r} yet "
                             f"({ledger.path} does not exist); start with: "
                             f"{' or '.join(commands_that_launch('all', cfg))}"))
    print_other_clusters(cfg, Path(ledger.path))
    return [dict(entry=k, **e.to_dict()) for k, e in entries.items()]


def print_other_clusters(cfg, ledger_path: Path) -> None:
    """The other clusters with a ledger in the same profiles folder, newest first, and the
    command that shows one: status shows one cluster (cluster=, local by default), and a
    Slurm user's jobs are under theirs."""
    others = sorted((p for p in ledger_path.parent.parent.glob("*/ledger.json")
                     if p.parent != ledger_path.parent),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    if not others:
        return
    from orchestrator.conf_folders import config_dirs, group_options

    name = others[0].parent.name  # a cluster file's name, or a name given as cluster.name=
    select = (f"cluster={name}" if name in group_options("cluster", config_dirs())
              else f"cluster.name={name}")
    names = ", ".join(f"{p.parent.name} (last written "
                      f"{time.strftime('%m-%d %H:%M', time.localtime(p.stat().st_mtime))})"
                      for p in others)
    console.print(escape(f"other clusters in {_relative(ledger_path.parent.parent) or '.'}: "
                         f"{names}; see one with: "
                         f"{rerun_command('status', select)}"),
                  highlight=False)


def print_train_table(cfg) -> None:
    """Every train summary of the cluster: predicted against measured, one row per layout."""
    from orchestrator.sweep import train_row
    from orchestrator.train.plan import train_dir

    rows = []
    for path in sorted(train_dir(cfg).parent.glob("*/*.json")):
        try:
            summary = read_json(path)
            if summary.get("kind") == "train":
                rows.append({"model": str(summary["model"]), "run": run_label(path),
                             **train_row(summary)})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not rows:
        return
    table = Table(title="train: predicted vs measured iteration time")
    columns = ("model", "layout", "run", "iteration ms", "measured ms", "error %", "tokens/s",
               "model peak GiB", "measured peak GiB")
    for col in columns:
        table.add_column("predicted ms" if col == "iteration ms" else col,
                         justify="left" if col in ("model", "layout", "run") else "right")
    for row in rows:
        table.add_row(*(escape(row[c]) for c in columns))
    console.print(table)


def run_label(summary_path: Path) -> str:
    """Which command wrote a train summary, from its file name (train/plan.py's tag, then
    -dynamic, then @<label>: tune's candidates, a sweep point's overrides)."""
    tag, _, label = summary_path.stem.partition("@")
    parts = ["dynamic micro-batches"] if tag.endswith("-dynamic") else []
    if label:
        parts.append("stage=tune" if label == "tune" else f"sweep {label}")
    return ", ".join(parts) or "stage=train"


def print_calibrations(cfg) -> None:
    """One line per model stage=tune calibrated on this cluster: its factors, its runs, the
    pick, and whether the profiles still match it."""
    import dataclasses as dc

    from orchestrator.train.plan import current_calibration

    folder = cluster_dir(cfg.profiles_dir, cfg.cluster.name) / "calibration"
    for path in sorted(folder.glob("*.json")):
        try:
            rec = read_json(path)
            model_cfg = dc.replace(cfg, model=dc.replace(cfg.model, name=path.stem))
            calibration, used, note = current_calibration(model_cfg)
            factors = ", ".join(f"{k} x{v:.2f}" for k, v in rec["factors"].items())
            state = ("stale: " + note if note else
                     "unused" if used is None else
                     "current, not fitted: no factor applied" if rec.get("why_not") else
                     "current")
            if rec.get("at_bound"):  # older files have no such field
                state += (f"; {', '.join(rec['at_bound'])} at the fit's bound: measure the "
                          f"profiles again (stage=tune says which)")
            console.print(escape(f"calibration {path.stem}: {rec['runs']} runs of "
                                 f"{len(rec['candidates'])} ({factors}); "
                                 f"{rec.get('why_not') or 'fitted'}; pick "
                                 f"{rec.get('pick_describe') or 'none'}; {state}"),
                          highlight=False)
        except (OSError, ValueError, KeyError, TypeError) as e:
            console.print(escape(f"calibration {path}: unreadable ({e})"))
