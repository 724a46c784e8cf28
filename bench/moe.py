"""Mixture-of-experts layouts: how long the search takes and what it picks for MoE models on
256, 1024 and 8192 H100s, with published layouts priced beside the picks.

    python bench/moe.py            # all cases
    python bench/moe.py --quick    # 256 and 1024 devices only
    python bench/moe.py --smoke    # mixtral_8x7b on 256, the test fixtures' synthetic profiles

Profiles are the project's analytic ones, written once by the CLI into a temporary folder:
`cluster=dgx_h100` hardware (published H100 / NDR figures) for the case's node count, and each
model's profile on the H100 sheet (a dense block and the MoE parts: routing, one expert per
tokens, the shared expert; profile_model); the planner prices a MoE block as the dense block
less its MLP plus routing, the busiest rank's experts and the shared expert
(planner/terms/moe.py), the dispatcher's all-to-alls from the all2all fits inside a node and
the NICs across nodes. Global batch 1024 sequences of 4096 tokens (4M
tokens; 4096 sequences, 16M tokens, on 8192 GPUs), 80 GiB per GPU with the default reserve (10% + 1 GiB), search.moe_imbalance's default
(by aux_loss_coef: Mixtral 1.1, Qwen3 1.2, DeepSeek-V3 1.3), engine Megatron-LM (what the
export runs; DualPipe and the dispatcher's overlap with compute are not modelled) and, for
comparison, stage=train's (no CP, no ZeRO-3 with experts).

Published layouts priced by our cost model:
- DeepSeek-V3 (technical report, arXiv 2412.19437, section 3.2): 2048 H800 GPUs, PP16, EP64
  spanning 8 nodes, ZeRO-1, no TP; priced here with those degrees on 1024 and 8192 H100s (dp
  the rest; 256 GPUs cannot hold EP64 beside PP16) at our batch with 1F1B and selective
  recompute (its DualPipe overlaps the all-to-alls with compute, which we do not model).
- Mixtral-8x7B: Megatron-LM's examples/mixtral training script (checkpoint name
  Mixtral-8x7B-mcore-TP2PP4EP8): TP2 PP4 EP8 with sequence parallelism.
- Qwen3-30B-A3B: no published training layout found; omitted.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import yaml  # noqa: E402

from orchestrator.choices import Engine, Recompute  # noqa: E402
from orchestrator.layout import ParallelLayout  # noqa: E402
from orchestrator.models.config import ModelConfig, count_active_params  # noqa: E402
from orchestrator.planner import (CostOptions, HardwareModel, ModelCost, SearchSpace,  # noqa: E402
                                  evaluate, search)
from orchestrator.planner.cost_model import memory_reserve_GiB, moe_imbalance  # noqa: E402

GiB = 2**30
SEQ = 4096
GBS = {256: 1024, 1024: 1024, 8192: 4096}  # sequences (4M, 4M and 16M tokens)
BUDGET_GiB = 80
PEAK_TFLOPs = 989.4  # H100 SXM bf16 dense
MODELS = ("mixtral_8x7b", "qwen3_30b_a3b", "deepseek_v3")
WORLDS = (256, 1024, 8192)


def options(engine: Engine) -> CostOptions:
    return CostOptions(engine=engine,
                       reserve_bytes=memory_reserve_GiB(BUDGET_GiB, 0.10, 1.0) * GiB)


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO, check=True,
                   capture_output=True)


def hardware(world: int, folder: str) -> HardwareModel:
    cli("stage=profile_hardware", "profile_hardware.source=analytic", "profile_hardware.plot=false",
        "cluster=dgx_h100", f"cluster.nodes={world // 8}", f"profiles_dir={folder}")
    path = Path(folder) / "dgx_h100" / "hardware.json"
    return HardwareModel.from_dict(json.loads(path.read_text()))


def model_cost(name: str, folder: str):
    """(ModelCost with the experts attached, ModelConfig) from the model's analytic profile: a
    dense block and the MoE parts (routing, one expert per tokens, shared expert)."""
    cli("stage=profile_model", "profile_model.source=analytic", "profile_model.plot=false",
        "cluster=dgx_h100", f"model={name}", f"profiles_dir={folder}")
    path = Path(folder) / "dgx_h100" / "model" / f"{name}.json"
    cfg = ModelConfig(**yaml.safe_load(
        (REPO / "orchestrator" / "conf" / "model" / f"{name}.yaml").read_text()))
    return ModelCost.from_dict(json.loads(path.read_text())).with_moe(cfg), cfg


def synthetic_model_cost(name: str):
    """(ModelCost with the experts attached, ModelConfig) of the test fixtures' dense profile
    of the model's shape (tests/planner_fixtures.py): no CLI, no torch, for --smoke."""
    sys.path.insert(0, str(REPO / "tests"))
    import planner_fixtures

    cfg = ModelConfig(**yaml.safe_load(
        (REPO / "orchestrator" / "conf" / "model" / f"{name}.yaml").read_text()))
    return ModelCost.from_dict(planner_fixtures.shaped_like(name)).with_moe(cfg), cfg


def synthetic_hardware(world: int) -> HardwareModel:
    sys.path.insert(0, str(REPO / "tests"))
    import planner_fixtures

    return HardwareModel.from_dict(planner_fixtures.synthetic_hardware(world // 8, 8))


def mfu(cfg, pred) -> float:
    """Model FLOPs utilisation: 6 x active parameters per token (attention's s^2 left out)
    over the H100's peak."""
    tokens = pred.layout.global_batch_size * SEQ
    flops = 6.0 * count_active_params(cfg) * tokens
    return flops / (pred.iteration_time_us * 1e-6) / pred.layout.world_size / (PEAK_TFLOPs * 1e12)


def row(table: Table, label: str, cfg, pred, search_s=None, considered=None) -> None:
    b = pred.breakdown_us
    table.add_row(label, pred.layout.describe(),
                  f"{pred.iteration_time_us / 1e6:.2f}", f"{100 * mfu(cfg, pred):.1f}",
                  f"{b.get('ep_comm', 0.0) / 1e3:,.0f}", f"{b['dp_sync_exposed'] / 1e3:,.0f}",
                  f"{b['bubble'] / 1e3:,.0f}", f"{pred.peak_memory_bytes / GiB:.1f}"
                  + ("" if pred.feasible else " (over)"),
                  "" if search_s is None else f"{search_s:.2f} ({considered})")


def searched(model, hw, world: int, engine: Engine):
    space = SearchSpace(world_size=world, memory_budget_bytes=BUDGET_GiB * GiB,
                        global_batch_size=GBS[world], seq_len=SEQ, options=options(engine))
    t0 = time.perf_counter()
    result = search(model, hw, space)
    return result, time.perf_counter() - t0


def published(name: str, world: int, layers: int):
    """(label, layout) of the published layout for this model and world size, or None."""
    if name == "deepseek_v3" and (world // 16) % 64 == 0:  # EP64 folds onto dp = world / 16
        pp, ep = 16, 64
        dp = world // pp
        return ("DeepSeek-V3 report", ParallelLayout.uniform(
            world, 1, pp, layers, zero=1, ep=ep, micro_batch_size=1,
            num_micro_batches=GBS[world] // dp, recompute=Recompute.selective))
    if name == "mixtral_8x7b":
        tp, pp = 2, 4
        dp = world // (tp * pp)
        return ("Megatron-LM example", ParallelLayout.uniform(
            world, tp, pp, layers, zero=1, ep=8, sequence_parallel=True, micro_batch_size=1,
            num_micro_batches=GBS[world] // dp))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="256 and 1024 devices only")
    parser.add_argument("--smoke", action="store_true",
                        help="mixtral_8x7b on 256 devices, the test fixtures' synthetic profiles "
                             "(no CLI): a few seconds")
    args = parser.parse_args()
    worlds = WORLDS[:1] if args.smoke else WORLDS[:2] if args.quick else WORLDS
    console = Console(width=200)
    with tempfile.TemporaryDirectory() as folder:
        if args.smoke:
            models = {MODELS[0]: synthetic_model_cost(MODELS[0])}
        else:
            models = {name: model_cost(name, f"{folder}/{name}") for name in MODELS}
        for world in worlds:
            hw = (synthetic_hardware(world) if args.smoke
                  else hardware(world, f"{folder}/hw{world}"))
            source = "the test fixtures' synthetic profiles" if args.smoke else "analytic profiles"
            table = Table(title=f"{world} H100s, global batch {GBS[world]} x {SEQ} tokens, "
                                f"{BUDGET_GiB} GiB per GPU ({source})")
            for col in ("model / source", "layout", "s/iter", "MFU %", "ep_comm ms",
                        "dp exposed ms", "bubble ms", "peak GiB", "search s (configs)"):
                table.add_column(col, justify="left" if col in ("model / source", "layout")
                                 else "right")
            for name, (model, cfg) in models.items():
                imb = moe_imbalance(model, options(Engine.megatron))
                for engine in (Engine.megatron, Engine.orchestrator):
                    result, elapsed = searched(model, hw, world, engine)
                    row(table, f"{name} pick ({engine}, imb {imb:g})", cfg, result.prediction,
                        elapsed, result.considered)
                found = published(name, world, model.layers)
                if found is not None:
                    label, layout = found
                    pred = evaluate(layout, model, hw, SEQ, BUDGET_GiB * GiB,
                                    options(Engine.megatron))
                    row(table, f"{name} {label}", cfg, pred)
            console.print(table)


if __name__ == "__main__":
    main()
