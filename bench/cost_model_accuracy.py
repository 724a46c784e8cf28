"""How right the cost model is: predicted against measured `stage=train`, from profiles measured
in the same run.

  python bench/cost_model_accuracy.py                 # 4 local CPU ranks (+ dev Slurm if up)
  python bench/cost_model_accuracy.py --keep /tmp/acc --no-slurm
  python bench/cost_model_accuracy.py --rescore /tmp/acc   # re-predict kept runs with this code

In a scratch folder: `stage=all` (profile_hardware, profile_model, search, train of search's
layout), then `stage=train` of each layout below; each run's summary
(profiles/<cluster>/train/<model>/<tag>.json) holds the measured parts beside the planner's
prediction. Prints per layout predicted / measured / error of the iteration time, per-stage
compute and peak memory, their mean and max |error|, and where search's chosen layout ranks
among the measured ones. Targets (issue 10): iteration mean error <= 15%, peak memory within 10%,
chosen layout within 10% of the measured best. Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
STEPS = 12
# Short profiles: the lengths train runs at and two below; the default collectives.
PROFILE_ARGS = ["profile_model.seq_lens=[128,192,256]", "profile_model.iters=8",
                "search.plot=false"]
TRAIN_ARGS = [f"train.steps={STEPS}", "train.checkpoint_every=0", "train.plot=false"]
LOCAL_LAYOUTS = {
    "dp4": ["train.pp=1", "train.tp=1"],
    "dp4 zero1": ["train.pp=1", "train.tp=1", "train.zero=1"],
    "dp4 full recompute": ["train.pp=1", "train.tp=1", "train.recompute=full"],
    "tp2 dp2": ["train.pp=1", "train.tp=2"],
    "pp2 dp2": ["train.pp=2", "train.tp=1"],
    "pp2 tp2": ["train.pp=2", "train.tp=2"],
    "pp4": ["train.pp=4", "train.tp=1"],
    "pp2 v2 interleaved": ["train.pp=2", "train.tp=1", "train.schedule=interleaved"],
}
SLURM_LAYOUTS = {k: LOCAL_LAYOUTS[k] for k in ("dp4", "tp2 dp2", "pp2 dp2")}
SLURM_ARGS = ["launcher=slurm", "cluster=dev"]


def cli(args: List[str], cwd: Path, log: Path) -> int:
    """Run `python -m orchestrator args` in `cwd`, output appended to `log`; the exit code."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with log.open("a") as out:
        out.write(f"\n$ python -m orchestrator {' '.join(args)}\n")
        out.flush()
        return subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd, env=env,
                              stdout=out, stderr=subprocess.STDOUT).returncode


def newest_summary(folder: Path, since: float) -> Optional[Path]:
    """The train summary written after `since` (epoch s) under `folder`, or None."""
    found = [p for p in folder.glob("train/*/*.json") if p.stat().st_mtime >= since]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def measure(cluster_args: List[str], cluster: str, layouts: Dict[str, List[str]], work: Path,
            console: Console) -> Dict[str, Path]:
    """Profiles + search + train of the chosen layout, then each layout: {name: summary}."""
    log = work / f"{cluster}.log"
    folder = work / "profiles" / cluster
    t0 = time.time()
    rc = cli(["stage=all", *cluster_args, *PROFILE_ARGS, *TRAIN_ARGS], work, log)
    console.print(f"{cluster}: stage=all exit {rc} in {time.time() - t0:.0f} s (log {log})")
    summaries = {}
    chosen = newest_summary(folder, t0)
    if chosen is not None:
        summaries["search's choice"] = chosen
    for name, args in layouts.items():
        # A layout trained before (search's choice) would resume from its last checkpoint and
        # have no step left to time: start each one from scratch.
        for ckpt in folder.glob("train/*/*.ckpt"):
            shutil.rmtree(ckpt)
        t1 = time.time()
        rc = cli(["stage=train", *cluster_args, *args, *TRAIN_ARGS], work, log)
        found = newest_summary(folder, t1)
        console.print(f"{cluster}: {name}: exit {rc} in {time.time() - t1:.0f} s")
        if rc == 0 and found is not None:
            summaries[name] = found
    return summaries


def rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def rescored(summary: dict, folder: Path) -> Optional[dict]:
    """The summary's predicted parts again, from this code's planner and the run's profiles."""
    from orchestrator.layout import ParallelLayout
    from orchestrator.planner import CostOptions, HardwareModel, ModelCost, evaluate
    from orchestrator.train.report import predicted_parts

    from orchestrator.profiling.model.fit import fit_points

    layout = ParallelLayout.from_dict(summary["layout"])
    raw = json.loads((folder / "model" / f"{summary['model']}.json").read_text())
    raw["fits"] = fit_points(raw["points"])  # this code's fits of the kept points
    model = ModelCost.from_dict(raw)
    hw_raw = json.loads((folder / "hardware.json").read_text())
    hw = HardwareModel.from_dict(hw_raw)
    device = "cuda" if hw_raw["cluster"].get("backend") == "nccl" else "cpu"
    pred = evaluate(layout, model, hw, seq_len=summary["seq_len"],
                    options=CostOptions(reserve_bytes=0.0, dtype=summary.get("dtype") or "",
                                        device=device))
    return predicted_parts(pred, layout)


def rows_of(summaries: Dict[str, Path], rescore: bool) -> List[dict]:
    """Per layout: measured and predicted iteration, per-stage compute, peak memory."""
    names: Dict[Path, List[str]] = {}
    for name, path in summaries.items():  # search's choice may be one of the named layouts
        names.setdefault(path, []).append(name)
    rows = []
    for path, named in names.items():
        name = " = ".join(named)
        s = json.loads(path.read_text())
        pred = rescored(s, path.parents[2]) if rescore else s["predicted"]
        m = s["measured"]
        if pred is None:
            continue
        rows.append({
            "name": name, "describe": s["describe"],
            "iter": (pred["iteration_ms"], m["iteration_ms"]),
            "stages": [(p["compute_ms"], q["compute_ms"])
                       for p, q in zip(pred["stages"], m["stages"])],
            "optimizer_ms": max(q["optimizer_ms"] for q in m["stages"]),
            "sync_ms": max(q["dp_sync_exposed_ms"] for q in m["stages"]),
            "mem": (pred["peak_memory_MiB"], max(m["peak_memory_MiB"]))})
    return rows


def report(title: str, rows: List[dict], console: Console) -> None:
    table = Table(title=title)
    for col in ("layout", "iteration pred/meas ms", "err", "stage compute pred/meas ms", "err",
                "meas sync / optim ms", "peak MiB pred/meas", "err"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in rows:
        (pi, mi), (pm, mm) = r["iter"], r["mem"]
        stages = " ".join(f"{p:.0f}/{q:.0f}" for p, q in r["stages"])
        errs = " ".join(f"{rel(p, q):+.0%}" for p, q in r["stages"])
        table.add_row(f"{r['name']}\n{r['describe']}", f"{pi:.0f} / {mi:.0f}",
                      f"{rel(pi, mi):+.0%}", stages, errs,
                      f"{r['sync_ms']:.0f} / {r['optimizer_ms']:.0f}", f"{pm:.0f} / {mm:.0f}",
                      f"{rel(pm, mm):+.0%}")
    console.print(table)
    if not rows:
        return
    for what, errs in (("iteration", [abs(rel(*r["iter"])) for r in rows]),
                       ("per-stage compute", [abs(rel(*s)) for r in rows for s in r["stages"]]),
                       ("peak memory", [abs(rel(*r["mem"])) for r in rows])):
        console.print(f"  {what}: mean |error| {statistics.mean(errs):.1%}, "
                      f"max {max(errs):.1%} over {len(errs)}")
    chosen = next((r for r in rows if r["name"].startswith("search's choice")), None)
    if chosen is not None:
        measured = sorted(r["iter"][1] for r in rows)
        rank = measured.index(chosen["iter"][1]) + 1
        console.print(f"  search's choice ({chosen['describe']}): rank {rank} of {len(rows)} "
                      f"measured, {rel(chosen['iter'][1], measured[0]):+.1%} from the measured "
                      f"best (target <= 10%)")


def slurm_up(work: Path) -> bool:
    return shutil.which("sinfo") is not None and subprocess.run(
        ["sinfo"], cwd=work, capture_output=True).returncode == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, help="scratch folder to keep (default: a temporary one)")
    ap.add_argument("--no-slurm", action="store_true", help="skip the dev Slurm cluster")
    ap.add_argument("--rescore", type=Path, help="re-predict the summaries kept in this folder")
    args = ap.parse_args()
    console = Console(width=160)
    if args.rescore:
        for cluster_dir in sorted((args.rescore / "profiles").iterdir()):
            paths = {p.stem: p for p in sorted(cluster_dir.glob("train/*/*.json"))}
            report(f"{cluster_dir.name}: re-predicted by this code", rows_of(paths, True),
                   console)
        return
    work = args.keep or Path(tempfile.mkdtemp(prefix="cost_model_accuracy_"))
    work.mkdir(parents=True, exist_ok=True)
    runs = {"local": measure([], "local", LOCAL_LAYOUTS, work, console)}
    if not args.no_slurm and slurm_up(work):
        runs["dev"] = measure(SLURM_ARGS, "dev", SLURM_LAYOUTS, work, console)
    for cluster, summaries in runs.items():
        report(f"{cluster}: cost model against stage=train ({STEPS} steps, tiny)",
               rows_of(summaries, False), console)
    console.print(f"runs kept in {work}" if args.keep else f"scratch folder {work}")


if __name__ == "__main__":
    main()
