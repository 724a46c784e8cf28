"""Dynamic micro-batching: planning time (normal and fast) and predicted iteration time of the
dynamic plan vs. the padded and packed baselines, on long-tailed lengths (lognormal, seeded).
Prints; asserts nothing.

- llama2_7b (model.seq_len raised to 8192) on 4 analytic dgx_h100 nodes (32 GPUs), layout fixed
  at pp4 tp8 sp dp1, micro-batch size 1: profiles built in this process the way
  `stage=profile_hardware profile_hardware.source=analytic` and the analytic `stage=profile_model`
  build them. Lengths: mean 512, max 8192.
- tiny on cluster=local, pp2 dp2 (4 ranks): profiles/local/{hardware.json,model/tiny.json} when
  both exist, else analytic ones built here. Lengths: mean seq_len / 4, max seq_len.

Memory budget: cluster.device_mem_GiB minus the search's reserve (memory_reserve_GiB with the
search.reserve_fraction / reserve_GiB defaults). Targets (issues 12, 24): <= 50 ms normal and
<= 20 ms fast for 64 sequences; dynamic never slower than the better baseline; fast loss <= 2%
on every batch (fast mode plans below 64 sequences per rank as normal mode does), at most half
normal's time from 64 up; with --exhaustive, within 0.5% of the best order and schedule.

    python bench/dynamic_microbatching.py [--iterations 20] [--quick] [--no-measure] [--exhaustive]
                                          [--analytic-model]
    python bench/dynamic_microbatching.py --smoke   # tiny alone (synthetic profiles), 8 sequences
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from orchestrator.choices import Schedule  # noqa: E402
from orchestrator.config import CONF_DIR, cluster_world_size, register_configs  # noqa: E402
from orchestrator.layout import ParallelLayout  # noqa: E402
from orchestrator.planner import HardwareModel, ModelCost  # noqa: E402
from orchestrator.planner.dynamic import (MicroBatchCosts, packed_plan, padded_plan,  # noqa: E402
                                          plan_iteration)

GiB = float(1 << 30)
console = Console(width=160)  # the whole table, also when piped


def compose_cfg(overrides):
    """The composed config object (as the CLI builds it) for these overrides."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))


def analytic_hardware_profile(cfg) -> dict:
    """hardware.json as `profile_hardware.source=analytic` writes it for cfg.cluster."""
    from orchestrator.profiling.hardware.analytic import analytic_hardware
    from orchestrator.stages.profile_hardware import link_sheet

    return analytic_hardware(cfg.cluster.name, cluster_world_size(cfg.cluster), link_sheet(cfg),
                             max_tp=cfg.profile_hardware.max_tp).to_dict()


def analytic_model_profile(cfg) -> dict:
    """model/<name>.json as the analytic `stage=profile_model` writes it (every planned point)."""
    from orchestrator.profiling.model.fit import fit_points
    from orchestrator.profiling.model.memory import memory_summary
    from orchestrator.profiling.model.plan import plan_profile
    from orchestrator.profiling.model.runner import point_runner
    from orchestrator.store import new_profile
    from orchestrator.store.schema.identity import model_summary

    plan = plan_profile(cfg)
    if plan.source != "analytic":
        raise SystemExit(f"profile_model would measure here ({plan.reason}); this bench wants "
                         "the analytic source")
    runner = point_runner(None, cfg, plan, plan.tps)
    batch = int(cfg.profile_model.micro_batch_size)
    points = []
    for tp in plan.tps:
        with runner.for_tp(tp, max(plan.seq_lens)):
            points += [runner.point(seq, tp) for seq in plan.seq_lens]
    return new_profile("model", "analytic", {}, model=model_summary(cfg.model),
                       micro_batch_size=batch, method=runner.timing.method(plan), points=points,
                       fits=fit_points(points), memory=memory_summary(points, cfg.model, batch))


def budget_bytes(cfg) -> float:
    """cluster.device_mem_GiB minus the search's reserve rule, in bytes."""
    from orchestrator.train.microbatching import budget_bytes as planner_budget_bytes

    s = cfg.search
    return planner_budget_bytes(float(cfg.cluster.device_mem_GiB), s.reserve_fraction,
                                s.reserve_GiB)


def lognormal_lengths(rng, n: int, mean_len: float, max_len: int) -> list:
    """n lengths (tokens), lognormal with sigma 1 and mean mean_len, clipped to [1, max_len]."""
    # E[lognormal(mu, 1)] = exp(mu + 1/2)
    return np.clip(rng.lognormal(np.log(mean_len) - 0.5, 1.0, n).astype(int), 1, max_len).tolist()


def fallback_ranks(dyn, pad, pack) -> int:
    """Ranks whose dynamic micro-batches are exactly one baseline's (the planner kept it)."""
    return sum(mbs in (pad.micro_batches[r], pack.micro_batches[r])
               for r, mbs in enumerate(dyn.micro_batches))


EXHAUSTIVE_MAX_MBS = 7  # every order of a rank's micro-batches: 7! = 5040 simulations


def best_order_us(plan, costs, budget) -> float:
    """The plan's iteration time with each rank's micro-batches (recompute kept) in the best of
    all their orders, each under plain 1F1B and every eager warm-up (interleaved: as planned),
    that fits the budget: the reference for the planner's order and schedule search (nan when a
    rank has more than EXHAUSTIVE_MAX_MBS micro-batches)."""
    import itertools

    from orchestrator.planner.dynamic import price_plan

    layout = costs.layout
    extras = range(layout.pp) if layout.schedule == Schedule["1f1b"] else range(1)
    worst = 0.0
    for mbs, rows in zip(plan.micro_batches, plan.packed_rows):
        if len(mbs) > EXHAUSTIVE_MAX_MBS:
            return float("nan")
        best = float("inf")
        for perm in itertools.permutations(range(len(mbs))):
            for extra in extras:
                priced = price_plan([[mbs[i] for i in perm]], costs, budget,
                                    packed_rows=[[rows[i] for i in perm]], extra_warmup=[extra])
                if priced.feasible:
                    best = min(best, priced.iteration_time_us)
        worst = max(worst, best)
    return worst


def run_batch(layout, model, hw, costs, budget, lengths_per_rank, max_len,
              exhaustive: bool = False) -> dict:
    """Plans of one iteration: timings (ms) and predicted iteration times (us)."""
    kw = dict(max_seq_len=max_len, costs=costs)
    t0 = time.perf_counter()
    dyn = plan_iteration(lengths_per_rank, layout, model, hw, budget, fast_mode=False,
                         on_bad="skip", **kw)
    t1 = time.perf_counter()
    fast = plan_iteration(lengths_per_rank, layout, model, hw, budget, fast_mode=True,
                          on_bad="skip", **kw)
    t2 = time.perf_counter()
    pad = padded_plan(lengths_per_rank, layout, model, hw, budget, **kw)
    pack = packed_plan(lengths_per_rank, layout, model, hw, budget, **kw)
    best_us = best_order_us(dyn, costs, budget) if exhaustive else float("nan")
    return {"normal_ms": (t1 - t0) * 1e3, "fast_ms": (t2 - t1) * 1e3, "best_us": best_us,
            "dyn_us": dyn.iteration_time_us, "fast_us": fast.iteration_time_us,
            "pad_us": pad.iteration_time_us, "pack_us": pack.iteration_time_us,
            "pad_ok": pad.feasible, "pack_ok": pack.feasible, "dyn_ok": dyn.feasible,
            "packed_mbs": sum(bool(rows) for r in dyn.packed_rows for rows in r),
            "mbs": sum(len(r) for r in dyn.micro_batches),
            "fallback": fallback_ranks(dyn, pad, pack), "ranks": len(dyn.micro_batches),
            "eager": sum(x > 0 for x in dyn.extra_warmup),
            "skipped": len(dyn.skipped)}


def baseline_best_us(row: dict) -> float:
    """The better baseline's time (us) among those that fit the budget (inf when neither)."""
    fits = [row[k + "_us"] for k in ("pad", "pack") if row[k + "_ok"]]
    return min(fits, default=float("inf"))


def case(label, layout, model, hw, budget, mean_len, max_len, sizes, iterations,
         exhaustive: bool = False) -> None:
    costs = MicroBatchCosts(layout, model, hw)
    table = Table(title=f"{label}: pp{layout.pp} tp{layout.tp} dp{layout.dp}"
                        f"{' sp' if layout.sequence_parallel else ''}, budget "
                        f"{budget / GiB:.2f} GiB, lengths mean {mean_len:g} max {max_len}, "
                        f"median of {iterations}")
    for col in ("seqs/rank", "plan ms normal", "plan ms fast", "dynamic ms", "fast ms",
                "padded ms", "packed ms", "gain vs better (min)", "fast loss (max)",
                "packed mbs", "eager 1F1B ranks", "fallback ranks", "skipped",
                "over best order (max)"):
        table.add_column(col, justify="right")
    for n in sizes:
        rng = np.random.default_rng(n)
        rows = [run_batch(layout, model, hw, costs, budget,
                          [lognormal_lengths(rng, n, mean_len, max_len) for _ in range(layout.dp)],
                          max_len, exhaustive) for _ in range(iterations)]
        over_best = [r["dyn_us"] / r["best_us"] - 1 for r in rows if r["best_us"] == r["best_us"]]

        def med(key):
            return statistics.median(r[key] for r in rows)

        gain = statistics.median(baseline_best_us(r) / r["dyn_us"] for r in rows)
        loss = statistics.median(r["fast_us"] / r["dyn_us"] - 1 for r in rows)
        worst_loss = max(r["fast_us"] / r["dyn_us"] - 1 for r in rows)
        worst_gain = min(baseline_best_us(r) / r["dyn_us"] for r in rows)
        table.add_row(
            str(n), f"{med('normal_ms'):.1f}", f"{med('fast_ms'):.1f}",
            f"{med('dyn_us') / 1e3:.1f}" + ("" if all(r["dyn_ok"] for r in rows) else " (over)"),
            f"{med('fast_us') / 1e3:.1f}",
            f"{med('pad_us') / 1e3:.1f}" + _over(rows, "pad_ok"),
            f"{med('pack_us') / 1e3:.1f}" + _over(rows, "pack_ok"),
            f"{gain:.2f}x ({worst_gain:.2f}x)", f"{loss * 100:.2f}% ({worst_loss * 100:.2f}%)",
            f"{sum(r['packed_mbs'] for r in rows)}/{sum(r['mbs'] for r in rows)}",
            f"{sum(r['eager'] for r in rows)}/{sum(r['ranks'] for r in rows)}",
            f"{sum(r['fallback'] for r in rows)}/{sum(r['ranks'] for r in rows)}",
            str(sum(r["skipped"] for r in rows)),
            f"{100 * statistics.median(over_best):.2f}% ({100 * max(over_best):.2f}%), "
            f"{len(over_best)} of {len(rows)}" if over_best else "-")
    console.print(table)


def _over(rows, key: str) -> str:
    """' (k over)' when k of the iterations' baseline plans exceed the budget."""
    over = sum(not r[key] for r in rows)
    return f" ({over} over)" if over else ""


def llama_case(sizes, iterations, exhaustive: bool = False) -> None:
    t0 = time.perf_counter()
    cfg = compose_cfg(["stage=profile_model", "cluster=dgx_h100", "cluster.nodes=4",
                       "model=llama2_7b", "model.seq_len=8192", "profile_model.source=analytic"])
    hw = HardwareModel.from_dict(analytic_hardware_profile(cfg))
    model = ModelCost.from_dict(analytic_model_profile(cfg))
    console.print(f"llama2_7b: analytic dgx_h100 profiles (4 nodes) built in "
                  f"{time.perf_counter() - t0:.1f} s")
    layout = ParallelLayout.uniform(32, 8, 4, model.layers, sequence_parallel=True,
                                    micro_batch_size=1)
    case("llama2_7b", layout, model, hw, budget_bytes(cfg), 512, 8192, sizes, iterations,
         exhaustive)
    # DynaPipe's side-by-side mix (issue 24): mean 1024, capped at 4096; and the ends of fast
    # mode's contract (means 512-2048, caps 4096-8192)
    for mean_len, max_len in ((1024, 4096), (2048, 8192), (512, 4096)):
        case("llama2_7b", layout, model, hw, budget_bytes(cfg), mean_len, max_len, sizes,
             iterations, exhaustive)


def tiny_profiles(cfg):
    """(hardware, model) dicts: profiles/local's when both exist, else analytic ones."""
    folder = REPO / "profiles" / "local"
    hw_path, model_path = folder / "hardware.json", folder / "model" / "tiny.json"
    if hw_path.exists() and model_path.exists():
        console.print(f"tiny: using {hw_path} and {model_path}")
        return json.loads(hw_path.read_text()), json.loads(model_path.read_text())
    console.print(f"tiny: no {hw_path} and {model_path}: analytic profiles for cluster=local "
                  "built in this process")
    return analytic_hardware_profile(cfg), analytic_model_profile(cfg)


def synthetic_tiny_profiles():
    """(hardware, model) dicts of the test fixtures (tests/planner_fixtures.py) for cluster=local
    and tiny's shape: no torch, for --smoke; round numbers, not this machine's."""
    sys.path.insert(0, str(REPO / "tests"))
    import planner_fixtures

    console.print("tiny: the test fixtures' synthetic profiles (--smoke)")
    return planner_fixtures.synthetic_hardware(1, 4), planner_fixtures.shaped_like("tiny")


def tiny_case(sizes, iterations, smoke: bool = False) -> None:
    cfg = compose_cfg(["stage=profile_model", "cluster=local", "model=tiny",
                       "profile_model.source=analytic"])
    hw_profile, model_profile = synthetic_tiny_profiles() if smoke else tiny_profiles(cfg)
    hw, model = HardwareModel.from_dict(hw_profile), ModelCost.from_dict(model_profile)
    layout = ParallelLayout.uniform(4, 1, 2, model.layers, micro_batch_size=1)
    case("tiny", layout, model, hw, budget_bytes(cfg), model.seq_len / 4, model.seq_len, sizes,
         iterations)


def measured_case(steps: int, measured_model: bool) -> None:
    """tiny trained for real on 4 local CPU ranks (pp2 dp2, mpiexec + gloo), the same samples
    under dynamic, padded and packed micro-batching: medians of measured and predicted
    iteration time over the timed steps. Profiles in a temporary folder: the hardware measured
    on these ranks (a gloo send between two processes costs ~0.5 ms here, which the analytic
    sheet does not know, and a dynamic plan sends per micro-batch), and the model profile
    analytic (FLOPs on the CPU sheet: no per-sequence fixed cost) or, with measured_model,
    measured on these ranks (its fit's intercept is that cost)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        common = [f"profiles_dir={tmp}", "model=tiny"]

        def cli(*args):
            return subprocess.run([sys.executable, "-m", "orchestrator", *args, *common],
                                  capture_output=True, text=True, cwd=REPO)
        t0 = time.perf_counter()
        cli("stage=profile_hardware")
        console.print(f"local hardware profile: measured ({time.perf_counter() - t0:.0f} s)")
        source = "measured" if measured_model else "analytic"
        t0 = time.perf_counter()
        cli("stage=profile_model", f"profile_model.source={source}", "profile_model.plot=false",
            "profile_model.max_tp=1", "profile_model.seq_lens=[16,64,128,256]")
        console.print(f"tiny model profile: {source} ({time.perf_counter() - t0:.0f} s)")
        table = Table(title=f"tiny trained on 4 CPU ranks (pp2 dp2), {source} model profile, "
                            f"16 samples per dp rank, lengths mean 64 max 256, {steps} steps, "
                            f"medians after 2")
        for col in ("micro-batching", "measured ms", "predicted ms", "real / computed tokens",
                    "micro-batches per rank", "vs padded"):
            table.add_column(col, justify="right")
        padded_ms = None
        for kind in ("padded", "packed", "dynamic"):
            proc = cli("stage=train", "train.pp=2", f"train.microbatching={kind}",
                       f"train.steps={steps}", "train.global_batch_size=32",
                       "train.seq_len=256", "train.plot=false", "train.timing_warmup_steps=2")
            found = list(Path(tmp).glob(f"local/train/tiny/*-{kind}.json"))
            if proc.returncode or not found:
                console.print(f"{kind}: failed ({proc.returncode}): {proc.stderr[-400:]}")
                continue
            mb = json.loads(found[0].read_text())["microbatching"]
            per_rank = statistics.median(len(s["micro_batches"][0]) for s in mb["steps"])
            padded_ms = mb["measured_ms"] if kind == "padded" else padded_ms
            table.add_row(kind, f"{mb['measured_ms']:.1f}", f"{mb['predicted_ms']:.1f}",
                          f"{mb['real_tokens'] / mb['padded_tokens'] * 100:.0f}%",
                          f"{per_rank:g}",
                          f"{padded_ms / mb['measured_ms']:.2f}x" if padded_ms else "-")
        console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-measure", action="store_true",
                        help="skip training tiny on 4 CPU ranks (about 3 minutes)")
    parser.add_argument("--measure-steps", type=int, default=10)
    parser.add_argument("--analytic-model", action="store_true",
                        help="price the trained runs with the analytic tiny model profile "
                             "(default: measured on the 4 ranks first, ~30 s)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="iterations per batch size (default 20, 5 with --quick)")
    parser.add_argument("--quick", action="store_true", help="8 and 64 sequences")
    parser.add_argument("--smoke", action="store_true",
                        help="the tiny case alone on the test fixtures' synthetic profiles: 8 "
                             "sequences, 1 iteration, no training")
    parser.add_argument("--exhaustive", action="store_true",
                        help=f"also every order of each rank's micro-batches where it has at "
                             f"most {EXHAUSTIVE_MAX_MBS} (the gap of the planner's order to "
                             f"the best; seconds per batch)")
    args = parser.parse_args()
    sizes = (8, 64) if args.quick else (8, 16, 64, 256)
    iterations = args.iterations or (5 if args.quick else 20)
    t0 = time.perf_counter()
    if args.smoke:
        tiny_case((8,), 1, smoke=True)
        console.print(f"total {time.perf_counter() - t0:.1f} s")
        return
    llama_case(sizes, iterations, args.exhaustive)
    tiny_case(sizes, iterations)
    if not args.no_measure:
        measured_case(args.measure_steps, not args.analytic_model)
    console.print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
