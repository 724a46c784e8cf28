"""Long context: what context parallelism buys the search at 128K tokens, and published layouts
priced by our cost model.

    python bench/long_context.py
    python bench/long_context.py --smoke   # NeMo's case alone, the test fixtures' profiles

Profiles are the project's analytic ones (written once by the CLI into a temporary folder):
`cluster=dgx_h100` hardware for the case's node count, the model on the h100 sheet. The search
prices Megatron-LM's engine (`search.engine=megatron`, what the export runs) and, for qwen_100b,
stage=train's too (its ring attention and every byte it holds, workload/memory.py), at the
default reserve (10% + 1 GiB of 80 GiB), with `max_cp` 1 (no CP), 16 (Llama 3's degree) and,
for qwen_100b, search.max_cp's default (seq_len // 4096 = 32); the flavours of search.cp_comms'
default (p2p, a2a), and for Megatron-LM every flavour (allgather and the hierarchical a2a+p2p
too).
Published layouts to hold it against:
- Llama 3 405B at 128K on 16384 H100s: TP8 CP16 PP16 DP8, 16M-token batches (128 sequences),
  380 TFLOP/s per GPU ("The Llama 3 Herd of Models", Table 4); one layer fewer on the first and
  the last stage.
- NeMo: Llama2-7B at 128K on 128 H100s, TP4 CP4 PP1 DP8: 1.31x the throughput of the same run
  without CP (TP4 PP1 DP32 and full recompute, NeMo's long-sequence table).
MFU = the model FLOPs (orchestrator.device.model_flops: 6 N per token + causal attention) per
second per GPU over the H100's 989.4 TFLOP/s bf16 dense peak.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.choices import CpComm, Engine, Recompute  # noqa: E402
from orchestrator.device import model_flops  # noqa: E402
from orchestrator.layout import ParallelLayout  # noqa: E402
from orchestrator.models.config import ModelConfig, count_params  # noqa: E402
from orchestrator.planner import (CostOptions, HardwareModel, InfeasibleError,  # noqa: E402
                                  ModelCost, SearchSpace, evaluate, search)
from orchestrator.planner.cost_model import memory_reserve_GiB  # noqa: E402
from orchestrator.planner.search import auto_max_cp  # noqa: E402

GiB = 2**30
PEAK_TFLOPs = 989.4
SEQ = 131072
BUDGET_GiB = 80


def profiles(model: str, nodes: int, folder: str, overrides=()):
    """(HardwareModel, ModelCost) of the analytic dgx_h100 profiles, via the CLI."""
    base = ["cluster=dgx_h100", f"cluster.nodes={nodes}", f"model={model}",
            f"profiles_dir={folder}", *overrides]
    for stage in ("profile_hardware", "profile_model"):
        subprocess.run([sys.executable, "-m", "orchestrator", f"stage={stage}",
                        f"{stage}.source=analytic", f"{stage}.plot=false", *base],
                       cwd=REPO, check=True, capture_output=True)
    root = Path(folder) / "dgx_h100"
    return (HardwareModel.from_dict(json.loads((root / "hardware.json").read_text())),
            ModelCost.from_dict(json.loads((root / "model" / f"{model}.json").read_text())))


def model_config(model: ModelCost) -> ModelConfig:
    return ModelConfig(name=model.name, hidden=model.hidden, ffn=model.ffn, layers=model.layers,
                       heads=model.heads, kv_heads=model.kv_heads, vocab=model.vocab,
                       seq_len=SEQ, dtype=model.dtype)


def options(engine: Engine = Engine.megatron) -> CostOptions:
    return CostOptions(engine=engine,
                       reserve_bytes=memory_reserve_GiB(BUDGET_GiB, 0.10, 1.0) * GiB)


def line(label: str, layout: ParallelLayout, pred, model: ModelCost, extra: str = "") -> dict:
    """Print one priced layout: iteration, tokens/s, TFLOP/s per GPU and MFU, recompute."""
    tokens = layout.global_batch_size * SEQ
    cfg = model_config(model)
    seconds = pred.iteration_time_us / 1e6
    tflops = model_flops(count_params(cfg), cfg.layers, cfg.hidden, SEQ, tokens) / seconds \
        / layout.world_size / 1e12
    recomputed = sum(k for mode, k in layout.recompute if mode == Recompute.full)
    b = {k: v / 1e3 for k, v in pred.breakdown_us.items()}
    fits = "" if pred.feasible else "  DOES NOT FIT"
    print(f"  {label:<22} {layout.describe()}")
    print(f"  {'':<22} {seconds:8.2f} s/iter  {tokens / seconds:>12,.0f} tok/s  "
          f"{tflops:5.0f} TFLOP/s/GPU  MFU {100 * tflops / PEAK_TFLOPs:4.1f}%  "
          f"full recompute {recomputed} layers  peak {pred.peak_memory_bytes / GiB:.1f} GiB"
          f"{fits}{extra}")
    print(f"  {'':<22} ms: " + ", ".join(f"{k} {v:,.0f}" for k, v in b.items()))
    return {"tokens_per_s": tokens / seconds, "tflops": tflops}


def searched(model, hw, world: int, gbs: int, max_cp: int, label: str,
             engine: Engine = Engine.megatron, cp_comms=(CpComm.p2p, CpComm.a2a)) -> Optional[dict]:
    """Print the search's pick (None, and the search's reason, when no layout exists)."""
    space = SearchSpace(world_size=world, memory_budget_bytes=BUDGET_GiB * GiB,
                        global_batch_size=gbs, seq_len=SEQ, max_cp=max_cp,
                        options=options(engine), cp_comms=tuple(cp_comms))
    t0 = time.perf_counter()
    try:
        result = search(model, hw, space)
    except InfeasibleError as e:
        print(f"  {label:<22} no layout: {e}")
        return None
    elapsed = time.perf_counter() - t0
    return line(label, result.best, result.prediction, model,
                f"  (search {elapsed:.2f} s, {result.considered} configs)")


def priced(model, hw, layout: ParallelLayout, label: str) -> dict:
    pred = evaluate(layout, model, hw, SEQ, memory_budget_bytes=BUDGET_GiB * GiB,
                    options=options())
    return line(label, layout, pred, model)


def gain(with_cp: Optional[dict], without: Optional[dict]) -> str:
    """Tokens/s with CP over without, or which side has no layout."""
    if with_cp is None or without is None:
        return "-- (no layout " + ("with CP" if with_cp is None else "without CP") + ")"
    return f"{with_cp['tokens_per_s'] / without['tokens_per_s']:.2f}x"


def qwen_100b(folder: str) -> None:
    print("qwen_100b, 128K, 8192 H100s, global batch 512")
    hw, model = profiles("qwen_100b", 1024, folder + "/q")
    today = searched(model, hw, 8192, 512, 1, "pick without CP")
    with_cp = searched(model, hw, 8192, 512, 16, "pick, max_cp 16")
    print(f"  tokens/s with CP / without: {gain(with_cp, today)}")
    auto = auto_max_cp(SEQ)  # search.max_cp's default
    searched(model, hw, 8192, 512, auto, f"pick, max_cp {auto}")
    searched(model, hw, 8192, 512, auto, "every flavour", cp_comms=tuple(CpComm))
    # stage=train's engine: its ring (or all-gather) and every byte it holds. Without CP it has
    # no layout here: 8192 / tp (<= 8) ranks leave pp >= 2 stages a replica 1 micro-batch of
    # the 512 at most, and torch's pipeline schedules want one per stage.
    ours_today = searched(model, hw, 8192, 512, 1, "stage=train's, no CP", Engine.orchestrator)
    searched(model, hw, 8192, 512, 16, "stage=train's, cp 16", Engine.orchestrator)
    ours = searched(model, hw, 8192, 512, auto, f"stage=train's, cp {auto}",
                    Engine.orchestrator)
    print(f"  stage=train's engine, tokens/s with CP (max_cp {auto}) / without: "
          f"{gain(ours, ours_today)}")


def llama3_405b(folder: str) -> None:
    print("\nllama3_405b, 128K, 16384 H100s, global batch 128 (16M tokens)")
    hw, model = profiles("llama3_405b", 2048, folder + "/l")
    published = ParallelLayout(world_size=16384, tp=8, cp=16, pp=16, dp=8, zero=1,
                               sequence_parallel=True, micro_batch_size=1,
                               num_micro_batches=16,
                               layers_per_stage=(7,) + (8,) * 14 + (7,))
    got = priced(model, hw, published, "published (Llama 3)")
    print(f"  {'':<22} published 380 TFLOP/s per GPU; ours {got['tflops']:.0f} "
          f"({100 * (got['tflops'] / 380 - 1):+.0f}%)")
    searched(model, hw, 16384, 128, 1, "pick without CP")
    searched(model, hw, 16384, 128, 16, "pick, max_cp 16")
    searched(model, hw, 16384, 128, 16, "every flavour", cp_comms=tuple(CpComm))


def synthetic_profiles(model: str, nodes: int):
    """(HardwareModel, ModelCost) of the test fixtures (tests/planner_fixtures.py): no CLI, no
    torch, for --smoke; their figures are round numbers, not an H100's."""
    sys.path.insert(0, str(REPO / "tests"))
    import planner_fixtures

    return (HardwareModel.from_dict(planner_fixtures.synthetic_hardware(nodes, 8)),
            ModelCost.from_dict(getattr(planner_fixtures, model)()))


def llama2_7b_nemo(folder: str, smoke: bool = False) -> None:
    source = "; the test fixtures' synthetic profiles" if smoke else ""
    print(f"\nllama2_7b, 128K, 128 H100s, global batch 32 (NeMo's layouts){source}")
    hw, model = (synthetic_profiles("llama2_7b", 16) if smoke else
                 profiles("llama2_7b", 16, folder + "/n", ["model.seq_len=131072"]))
    cp = priced(model, hw, ParallelLayout.uniform(128, 4, 1, 32, cp=4, sequence_parallel=True,
                                                   num_micro_batches=4), "NeMo TP4 CP4 DP8")
    nocp = priced(model, hw, ParallelLayout.uniform(128, 4, 1, 32, sequence_parallel=True,
                                                     recompute=Recompute.full),
                  "TP4 DP32, full recompute")
    print(f"  {'':<22} CP / no CP: {cp['tokens_per_s'] / nocp['tokens_per_s']:.2f}x "
          f"(NeMo measured 1.31x)")
    searched(model, hw, 128, 32, 16, "pick, max_cp 16")
    if not smoke:
        searched(model, hw, 128, 32, 16, "every flavour", cp_comms=tuple(CpComm))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="NeMo's case alone (the smallest: 128 H100s) on the test fixtures' "
                             "profiles, without the every-flavour search: a few seconds")
    args = parser.parse_args()
    if args.smoke:
        llama2_7b_nemo("", smoke=True)
        return
    with tempfile.TemporaryDirectory() as folder:
        for case in (qwen_100b, llama3_405b, llama2_7b_nemo):
            case(folder)


if __name__ == "__main__":
    main()
