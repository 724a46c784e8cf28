"""What SimAI makes of our trace export, next to our own priced iteration.

  python bench/simai_iteration.py --simai /path/to/SimAI      # its repo root, built (below)
  python bench/simai_iteration.py --simai ... --keep /tmp/sim --pp 2 --tp 4 --gbs 32
  python bench/simai_iteration.py --simai ... --cp 2 --seq 16384   # context parallelism (ring)
  python bench/simai_iteration.py            # without SimAI: the export, the trace and the planner
  python bench/simai_iteration.py --smoke    # tiny, WS 8 PP 2 TP 2: the export alone (seconds)

In a scratch folder (analytic profiles, nothing measured): the dgx_h100 hardware profile and
llama2_7b's model profile, then `stage=trace trace.export=simai` of WS 64 PP 2 TP 4 SP, GBS 32,
seq 4096 (issue 22's configuration), then SimAI's analytical simulator on each stage's file.
Prints per stage what SimAI reports (total compute, exposed TP / DP / PP communication, bubble,
total) next to the trace's own compute sum for that rank, and the planner's iteration for the
same layout (`search.engine=megatron`, the flavour trace records). Without --simai (or
$SIMAI_ROOT) SimAI's columns say "-" and the rest is printed. --smoke traces tiny on a small
layout without SimAI and prices it on the test fixtures' synthetic profiles (no profile stages).
Asserts nothing.

SimAI: aliyun/SimAI at f5efb5a9 (its 1.6 release), analytical build:
  git clone https://github.com/aliyun/SimAI && cd SimAI && git checkout f5efb5a9
  cd astra-sim-alibabacloud/build/simai_analytical && mkdir -p build && cd build
  cmake -DUSE_ANALYTICAL=TRUE .. && make -j2     # bin: ./simai_analytical/SimAI_analytical
(scripts/build.sh -c analytical does the same and links bin/SimAI_analytical.)
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
# --smoke: the tiny model on the smallest layout with every parallelism the export writes
SMOKE = dict(model="tiny", world_size=8, pp=2, tp=2, gbs=8, seq=256)


def cli(args, cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"python -m orchestrator {' '.join(args)} exited {proc.returncode}:\n"
                 f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")


def find_binary(simai: Path) -> Path:
    for candidate in ("bin/SimAI_analytical",
                      "astra-sim-alibabacloud/build/simai_analytical/build/simai_analytical/"
                      "SimAI_analytical"):
        if (simai / candidate).is_file():
            return simai / candidate
    sys.exit(f"no SimAI_analytical under {simai}: build it first (see this script's doc)")


def run_simai(binary: Path, simai: Path, workload: Path, gpus: int, links) -> dict:
    """SimAI's EndToEnd summary row for one workload file, as {column: value in us}."""
    results = simai / "results"
    results.mkdir(exist_ok=True)  # SimAI writes ./results/<prefix>EndToEnd.csv, cwd-relative
    prefix = f"orchestrator-{workload.stem}-"
    cmd = [str(binary), "-w", str(workload), "-g", str(gpus), "-g_p_s", "8",
           "-nv", str(links["intra_busbw_GBps"]), "-nic", str(links["nic_Gbps"] / 8),
           "-n_p_s", str(links["nics_per_node"]), "-g_type", "H100", "-r", prefix]
    proc = subprocess.run(cmd, cwd=simai, capture_output=True, text=True, timeout=600)
    out = results / f"{prefix}EndToEnd.csv"
    if proc.returncode != 0 or not out.exists():
        sys.exit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}"
                 f"{proc.stderr[-2000:]}")
    header, values = list(csv.reader(out.open()))[:2]
    # Each value is "<number> (<share>%)" but the file name; SimAI reports us (ticks / 1000).
    return {h.strip(): float(v.split("(")[0]) for h, v in zip(header[1:], values[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--simai", type=Path, default=os.environ.get("SIMAI_ROOT"),
                        help="the built SimAI repo root (default: $SIMAI_ROOT; none: SimAI's "
                             "columns say -)")
    parser.add_argument("--model", default="llama2_7b")
    parser.add_argument("--keep", type=Path, help="scratch folder to keep (default: a temp one)")
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--gbs", type=int, default=32)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--cp-comm", default="p2p")
    parser.add_argument("--smoke", action="store_true",
                        help=" ".join(f"--{k.replace('_', '-')} {v}" for k, v in SMOKE.items())
                        + ": the trace and its export, no SimAI, the planner on the test "
                          "fixtures' synthetic profiles")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(SMOKE, simai=None)
    binary = find_binary(Path(args.simai)) if args.simai else None
    scratch = args.keep or Path(tempfile.mkdtemp(prefix="simai_iteration_"))
    scratch.mkdir(parents=True, exist_ok=True)
    profiles = scratch / "profiles"
    common = ["cluster=dgx_h100", f"model={args.model}", f"profiles_dir={profiles}"]
    if not args.smoke:
        cli(["stage=profile_hardware", "profile_hardware.source=analytic",
             "profile_hardware.plot=false", *common], scratch)
        cli(["stage=profile_model", "profile_model.source=analytic", "profile_model.plot=false",
             *common], scratch)
    # compute priced as the planner column below prices it (search.engine=megatron)
    cli(["stage=trace", f"trace.world_size={args.world_size}", f"trace.pp={args.pp}",
         f"trace.tp={args.tp}", f"trace.global_batch_size={args.gbs}",
         f"trace.seq_len={args.seq}", f"trace.cp={args.cp}", f"trace.cp_comm={args.cp_comm}",
         "trace.export=simai", "search.engine=megatron", *common], scratch)
    (folder,) = (profiles / "dgx_h100" / "trace").glob(
        f"SIM_{args.model}_*_WS{args.world_size}_PP{args.pp}_TP{args.tp}_*")
    summary = json.loads((folder / "summary.json").read_text())

    sys.path.insert(0, str(REPO))
    from orchestrator.choices import Engine
    from orchestrator.layout import ParallelLayout
    from orchestrator.planner import CostOptions, HardwareModel, ModelCost, evaluate
    from orchestrator.store import read_profile
    from orchestrator.store.schema import HardwareProfile, ModelProfile

    layout = ParallelLayout.from_dict(summary["layout"])
    if args.smoke:
        sys.path.insert(0, str(REPO / "tests"))
        import planner_fixtures

        hw = HardwareModel.from_dict(planner_fixtures.synthetic_hardware(1, 8))
        model = ModelCost.from_dict(planner_fixtures.shaped_like(args.model))
    else:
        hw = HardwareModel.from_profile(
            read_profile(profiles / "dgx_h100" / "hardware.json", HardwareProfile, ""))
        model = ModelCost.from_profile(read_profile(
            profiles / "dgx_h100" / "model" / f"{args.model}.json", ModelProfile, ""))
        raw = json.loads((profiles / "dgx_h100" / "hardware.json").read_text())
        links = raw["provenance"]["config"]["cluster"]["links"]
    ours = evaluate(layout, model, hw, seq_len=args.seq,
                    options=CostOptions(engine=Engine.megatron, dtype="bf16", device="cuda"))

    table = Table(title=f"{args.model} {layout.describe()} seq {args.seq}: SimAI (analytical) "
                        f"vs the trace and the planner, ms")
    for column in ("stage", "SimAI total comp", "trace compute", "SimAI exposed TP",
                   "SimAI exposed DP", "SimAI exposed EP (CP)", "SimAI exposed PP",
                   "SimAI bubble", "SimAI total",
                   "planner stage", "planner iteration"):
        table.add_column(column, justify="right")
    for stage in range(layout.pp):
        workload = next(folder.glob(f"*-stage{stage}.txt"))
        rank = stage * layout.stage_ranks
        records = [json.loads(line) for line in (folder / f"fake_rank_{rank}.jsonl").open()]
        compute_us = sum(r.get("time_us", 0.0) for r in records if r["kind"] == "compute")
        if binary is None:
            simai = ["-"] * 7
        else:
            sim = run_simai(binary, Path(args.simai), workload, layout.world_size, links)
            simai = [f"{sim[k] / 1e3:.1f}" for k in (
                "total comp", "Expose TP comm", "Expose DP comm", "Expose_EP_comm",
                "Expose_PP_comm", "bubble time", "Total time")]
        table.add_row(str(stage), simai[0], f"{compute_us / 1e3:.1f}", *simai[1:],
                      f"{ours.stage_time_us[stage] * layout.num_micro_batches / 1e3:.1f}",
                      f"{ours.iteration_time_us / 1e3:.1f}")
    Console(width=200).print(table)
    if args.smoke:
        print("SimAI: not run (--smoke); the planner on the test fixtures' synthetic profiles")
    elif binary is None:
        print("SimAI: not given (--simai or $SIMAI_ROOT; this file's docstring builds it)")
    print("planner breakdown (ms): " + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in ours.breakdown_us.items()))
    print(f"files: {folder}")
    if args.keep is None:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
