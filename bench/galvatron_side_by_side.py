"""Galvatron's own llama-7b profiles through our import and search, next to Galvatron's picks.

    python bench/galvatron_side_by_side.py [--cache DIR] [--no-engine]
    python bench/galvatron_side_by_side.py --smoke   # the first scenario, no engine, no download

Downloads the hetu-galvatron 2.4.0 sdist (`pip download --no-deps`; skips with a message when it
cannot), imports its llama-7b hardware and model profiles with `stage=import` as a user would
(`cluster=dgx_a100`, `model=llama2_7b model.seq_len=2048`), and for each scenario prints: our
search time and pick, Galvatron's pick (its shipped strategy for that shape and memory, and the
one its own search engine writes when bench/galvatron_engine.py can build and run it here)
priced by our cost model, and the difference. Figures are printed, never asserted.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Tuple

from galvatron_engine import CACHE, fetch_sdist  # bench/, beside this file

MODEL = ["model=llama2_7b", "model.seq_len=2048"]
SCENARIOS = (
    # (label, nodes, memory GB per GPU, global batch, shipped strategy files of that shape)
    ("1 node x 8, 36 GB, batch 16", 1, 36, 16,
     ["galvatron_config_hidden4096_head32_1nodes_8gpus_per_node_36GB_bf16_[tpconsec_off].json"]),
    ("2 nodes x 8, 40 GB, batch 32", 2, 40, 32,
     ["galvatron_config_llama-7b_2nodes_8gpus_per_node_40GB_bf16_example.json",
      "galvatron_config_llama-7b_2nodes_8gpus_per_node_40GB_bf16_3D_example.json"]),
)


def orchestrator(args: List[str], cwd: Path) -> str:
    """Run `python -m orchestrator <args>` in `cwd`; its output (raises on failure)."""
    done = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"orchestrator {' '.join(args)} exited {done.returncode}:\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout


def price(work: Path, pick: Path, strategy: dict) -> Tuple[object, object, List[str]]:
    """(ours, theirs, notes): our best and Galvatron's pick `pick`, both priced by our cost model
    on the imported profiles, under the search's own budget and reserve."""
    from orchestrator.planner import CostOptions, HardwareModel, ModelCost, evaluate
    from orchestrator.interop.galvatron.compare import price_galvatron_strategy
    from orchestrator.layout import ParallelLayout
    from orchestrator.store.schema import HardwareProfile, ModelProfile

    folder = work / "profiles" / "dgx_a100"
    hw = HardwareModel.from_profile(HardwareProfile.from_dict(
        json.loads((folder / "hardware.json").read_text()), ""))
    model = ModelCost.from_profile(ModelProfile.from_dict(
        json.loads((folder / "model/llama2_7b.json").read_text()), ""))
    space = strategy["space"]
    budget = space["memory_GiB"] * 2**30
    options = CostOptions(reserve_bytes=(space.get("reserve_total_GiB") or 0.0) * 2**30)
    ours = evaluate(ParallelLayout.from_dict(strategy["layout"]), model, hw, space["seq_len"],
                    budget, options)
    theirs, notes = price_galvatron_strategy(pick, model, hw, world_size=space["world_size"],
                                             seq_len=space["seq_len"], budget_bytes=budget,
                                             options=options)
    return ours, theirs, notes


def _row(name: str, pred) -> str:
    b = pred.breakdown_us
    terms = " ".join(f"{k} {b[k] / 1e3:.0f}" for k in ("compute", "tp_comm", "pp_comm", "bubble",
                                                       "dp_sync_exposed", "recompute"))
    return (f"| {name} | {pred.layout.describe()} | {pred.iteration_time_us / 1e3:.0f} | "
            f"{pred.tokens_per_s:,.0f} | {pred.peak_memory_bytes / 2**30:.1f} | "
            f"{'yes' if pred.feasible else 'no'} | {terms} |")


def scenario(root: Path, work: Path, label: str, nodes: int, memory_GB: float, batch: int,
             shipped: List[str], engine: Optional[dict]) -> None:
    """Import, search, and price each Galvatron pick of one scenario; prints the figures."""
    galv = root / "galvatron"
    common = ["cluster=dgx_a100", f"cluster.nodes={nodes}", f"profiles_dir={work / 'profiles'}",
              *MODEL]
    t0 = time.perf_counter()
    orchestrator(["stage=import", f"import.path={galv / 'profile_hardware/hardware_configs'}",
                  *common], work)
    orchestrator(["stage=import", f"import.path={galv / 'models/llama_hf/configs'}", *common],
                 work)
    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    orchestrator(["stage=search", *common, f"search.memory_GiB={memory_GB}",
                  f"search.global_batch_size={batch}", "search.plot=false"], work)
    search_wall_s = time.perf_counter() - t0
    strategy = json.loads((work / "profiles/dgx_a100/strategy/llama2_7b.json").read_text())
    print(f"\n## {label}\nimport: {import_s:.1f} s for the two commands; our search: "
          f"{strategy['elapsed_s']:.2f} s in the planner, {search_wall_s:.1f} s for the command")
    if engine is not None:
        print("Galvatron's search engine: " + (
            f"{engine['search_s']:.1f} s in the engine, {engine['elapsed_s']:.1f} s for the "
            f"process ({engine['search_s'] / strategy['elapsed_s']:.0f}x ours)" if engine["ok"]
            else f"not run: {engine['reason']}"))
    picks = [(name, galv / "models/llama_hf/configs" / name) for name in shipped]
    if engine is not None and engine["ok"]:
        picks.append(("engine: " + Path(engine["config_path"]).name, Path(engine["config_path"])))
    print("\n| who | layout | iteration ms | tokens/s | peak GiB | fits | breakdown ms |")
    print("|---|---|---|---|---|---|---|")
    ours = None
    for name, pick in picks:
        ours, theirs, notes = price(work, pick, strategy)
        if name == picks[0][0]:
            print(_row("ours", ours))
        print(_row(f"Galvatron {name}", theirs))
        gain = ours.tokens_per_s / theirs.tokens_per_s - 1
        print(f"|  | ours vs it: {gain:+.1%} tokens/s; " + "; ".join(notes)[:400] + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--engine-dir", type=Path, default=None,
                        help="where Galvatron's engine venv is built (default: <cache>/engine)")
    parser.add_argument("--no-engine", action="store_true",
                        help="do not try to build and run Galvatron's own search engine")
    parser.add_argument("--smoke", action="store_true",
                        help="the first scenario, --no-engine, and no download (the cache's "
                             "sdist or a skip)")
    args = parser.parse_args()
    root, why = fetch_sdist(args.cache, download=not args.smoke)
    if root is None:
        print(f"skipped: {why}")
        return
    for label, nodes, memory_GB, batch, shipped in SCENARIOS[:1] if args.smoke else SCENARIOS:
        engine = None
        if not (args.no_engine or args.smoke):
            from galvatron_engine import run_galvatron_search

            engine = run_galvatron_search(root, args.engine_dir or args.cache / "engine",
                                          nodes=nodes,
                                          gpus_per_node=8, memory_GB=memory_GB,
                                          global_batch_size=batch)
        with tempfile.TemporaryDirectory() as tmp:
            scenario(root, Path(tmp), label, nodes, memory_GB, batch, shipped, engine)


if __name__ == "__main__":
    main()
