"""How long `stage=trace` takes for the five seed configurations of llama2_7b (representative
ranks only), its peak memory, and what tracing every rank would cost instead.

    python bench/trace_speed.py           # the five seed configurations (104 ranks)
    python bench/trace_speed.py --quick   # the first two
    python bench/trace_speed.py --only-scale   # WS 8192 vs 131072 vs 1000000 alone
    python bench/trace_speed.py --moe --no-small --no-scale   # the seeds, mixtral_8x7b EP 8
    python bench/trace_speed.py --smoke   # the small world's representatives alone: seconds

What `stage=trace` runs, minus the ledger: plan_configs, then trace_configuration per
configuration (each traced rank priced from the h100 device sheet, its .jsonl and .log written
to a temporary folder, summary.json), chunk captures shared across the run as the stage shares
them.
GBS 1024, MBS 1, seq 4096, SP on, ZeRO 0, 1F1B. Targets: <= 60 s wall and <= 4 GiB peak RSS on
2 CPU cores. Then a small world (tiny model, WS 64 PP 4 TP 4) traced at every rank vs at the
representatives, and the every-rank estimate of the seed configurations (per-rank time x WS).
Then the world size alone: llama2_7b PP 8 TP 8 at WS 8192, 131072 and 1000000 with the same
per-rank work (8 micro-batches each), chunk captures made beforehand, each world timed in turn
(best of --repeats), wall and CPU seconds and their ratio to WS 8192 in the same run: a rank's
trace should cost about the same at any world size.
`--profile N` prints cProfile's top N functions of the seed run. `--moe` traces the same five
seed configurations of mixtral_8x7b (8 experts, top 2) with expert parallelism 8 (each rank 1
expert; [WS, PP, TP, 1, 8]) instead: the MoE trace's time against the dense one's.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import resource
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from orchestrator.models.config import ModelConfig  # noqa: E402
from orchestrator.trace.configs import TraceSettings, plan_configs  # noqa: E402
from orchestrator.profiling.model.analytic import load_device_sheet  # noqa: E402
from orchestrator.trace.output import write_rank  # noqa: E402
from orchestrator.trace.run import trace_configuration  # noqa: E402
from orchestrator.trace.timing import ComputePricer  # noqa: E402
from orchestrator.trace.tracer import trace_rank  # noqa: E402

SEED_CONFIGS = [[8192, 16, 8], [8192, 32, 8], [8192, 32, 4], [4096, 16, 4], [2048, 8, 4]]
SEED_SETTINGS = TraceSettings(global_batch_size=1024, micro_batch_size=1, seq_len=4096,
                              sequence_parallel=True, zero=0)
# KV heads 4: the small world's TP 4 splits them.
TINY = ModelConfig(name="tiny", hidden=128, ffn=384, layers=8, heads=4, kv_heads=4, vocab=512,
                   seq_len=256, dtype="bf16")
SMALL_WORLD = [64, 4, 4]
SMALL_SETTINGS = TraceSettings(global_batch_size=64, micro_batch_size=1, seq_len=256,
                               sequence_parallel=True, zero=1)
TARGET_S, TARGET_RSS_GiB = 60.0, 4.0
SCALE_WORLDS = [8192, 131072, 1000000]  # PP 8 TP 8; the first is the reference
SCALE_PP, SCALE_TP, SCALE_MICRO_BATCHES = 8, 8, 8


MOE_EP = 8  # --moe: mixtral_8x7b's 8 experts, one per EP rank


def llama2_7b() -> ModelConfig:
    return load_model("llama2_7b")


def load_model(name: str) -> ModelConfig:
    values = yaml.safe_load((REPO / f"orchestrator/conf/model/{name}.yaml").read_text())
    return ModelConfig(**values)


def peak_rss_GiB() -> float:
    """This process's peak resident set (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def folder_MiB(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.iterdir() if f.suffix == ".jsonl") / 2**20


def trace_configs(configs, settings, model, out_dir: Path, all_ranks: bool = False):
    """Per configuration: (spec, ranks traced, seconds, records, MiB of JSON lines, estimate of
    tracing every rank one process each, s)."""
    specs, skipped = plan_configs(configs, settings, model)
    if skipped:
        raise SystemExit(f"skipped configurations: {skipped}")
    pricer = ComputePricer(load_device_sheet("h100"))
    captures: dict = {}
    rows = []
    for spec in specs:
        start = time.perf_counter()
        folder = out_dir / spec.dir_name(model.name)
        summary = trace_configuration(spec, model, pricer, folder, all_ranks=all_ranks,
                                      captures=captures)
        records = sum(r["ops"] for r in summary["ranks"].values())
        rows.append((spec, summary["ranks_traced"], time.perf_counter() - start, records,
                     folder_MiB(folder), summary["seconds_all_ranks_estimate"]))
    return rows


def trace_alone(configs, settings, model, out_dir: Path):
    """Every rank traced on its own (nothing shared between ranks, as one process per rank
    would), its files written: (ranks, seconds, records)."""
    specs, _ = plan_configs(configs, settings, model)
    pricer = ComputePricer(load_device_sheet("h100"))
    start = time.perf_counter()
    ranks = records = 0
    for spec in specs:
        folder = out_dir / spec.dir_name(model.name)
        folder.mkdir(parents=True, exist_ok=True)
        for rank in spec.all_ranks():
            traced = trace_rank(spec, model, rank)
            pricer.price(traced.records, spec, traced.stage)
            write_rank(folder, rank, traced.records)
            ranks, records = ranks + 1, records + len(traced.records)
    return ranks, time.perf_counter() - start, records


def seed_table(rows, wall_s: float, name: str = "llama2_7b", what: str = "seed configurations",
               settings: TraceSettings = SEED_SETTINGS) -> Table:
    table = Table(title=f"{name} {what} (GBS {settings.global_batch_size}, seq "
                        f"{settings.seq_len}{', SP' if settings.sequence_parallel else ''}): wall "
                        f"{wall_s:.1f} s (target <= {TARGET_S:.0f} s), peak RSS "
                        f"{peak_rss_GiB():.2f} GiB (target <= {TARGET_RSS_GiB:.0f} GiB)")
    for col in ("WS", "PP", "TP", "DP", "micro-batches", "ranks traced", "time s",
                "s / rank", "records", "MiB written", "every rank (est.) s"):
        table.add_column(col, justify="right")
    for spec, ranks, seconds, records, mib, every_rank_s in rows:
        lay = spec.layout
        per_rank_s = seconds / ranks
        table.add_row(str(lay.world_size), str(lay.pp), str(lay.tp), str(lay.dp),
                      str(lay.num_micro_batches), str(ranks), f"{seconds:.1f}",
                      f"{per_rank_s:.2f}", f"{records:,}", f"{mib:.1f}",
                      f"{every_rank_s:,.0f}")
    ranks = sum(r[1] for r in rows)
    every_s = sum(r[5] for r in rows)
    table.add_row("all", "", "", "", "", str(ranks), f"{sum(r[2] for r in rows):.1f}", "",
                  f"{sum(r[3] for r in rows):,}", f"{sum(r[4] for r in rows):.1f}",
                  f"{every_s:,.0f} ({every_s / wall_s:,.0f}x)")
    return table


def small_world_table(out_dir: Path) -> Table:
    rep = trace_configs([SMALL_WORLD], SMALL_SETTINGS, TINY, out_dir / "rep")[0][1:4]
    every = trace_alone([SMALL_WORLD], SMALL_SETTINGS, TINY, out_dir / "all")
    ws, pp, tp = SMALL_WORLD
    table = Table(title=f"tiny model WS {ws} PP {pp} TP {tp}: every rank, each on its own (as one "
                        f"process per rank would), vs the representatives as the stage traces")
    for col in ("ranks", "time s", "s / rank", "records"):
        table.add_column(col, justify="right")
    for label, row in (("representatives", rep), ("every rank", every)):
        table.add_row(f"{row[0]} ({label})", f"{row[1]:.1f}", f"{row[1] / row[0]:.2f}",
                      f"{row[2]:,}")
    table.add_row("ratio", f"{every[1] / rep[1]:.1f}x", "", f"{every[2] / rep[2]:.1f}x")
    return table


def scale_table(out_dir: Path, repeats: int) -> Table:
    """Each world of SCALE_WORLDS traced (representative ranks, files written) `repeats` times in
    turn after one warm-up that makes the chunk captures; the best wall and CPU seconds."""
    model = llama2_7b()
    pricer = ComputePricer(load_device_sheet("h100"))
    specs = []
    for ws in SCALE_WORLDS:
        dp = ws // (SCALE_PP * SCALE_TP)
        settings = dataclasses.replace(SEED_SETTINGS,
                                       global_batch_size=dp * SCALE_MICRO_BATCHES)
        planned, skipped = plan_configs([[ws, SCALE_PP, SCALE_TP]], settings, model)
        if skipped:
            raise SystemExit(f"skipped configurations: {skipped}")
        specs.append(planned[0])
    captures: dict = {}
    trace_configuration(specs[0], model, pricer, out_dir / "warm-up", captures=captures)
    best = {spec.world_size: (float("inf"), float("inf"), 0) for spec in specs}
    for attempt in range(repeats):
        for spec in specs:
            folder = out_dir / f"{attempt}" / spec.dir_name(model.name)
            wall, cpu = time.perf_counter(), time.process_time()
            summary = trace_configuration(spec, model, pricer, folder, captures=captures)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            records = sum(r["ops"] for r in summary["ranks"].values())
            old = best[spec.world_size]
            best[spec.world_size] = (min(old[0], wall), min(old[1], cpu), records)
    ref_wall, ref_cpu, _ = best[SCALE_WORLDS[0]]
    table = Table(title=f"llama2_7b PP {SCALE_PP} TP {SCALE_TP}, {SCALE_MICRO_BATCHES} "
                        f"micro-batches per rank, seq {SEED_SETTINGS.seq_len}: the world size "
                        f"alone (best of {repeats}, captures made beforehand)")
    for col in ("WS", "DP", "ranks traced", "time s", "CPU s", "s / rank", "records",
                f"time / WS {SCALE_WORLDS[0]}", f"CPU / WS {SCALE_WORLDS[0]}"):
        table.add_column(col, justify="right")
    for spec in specs:
        wall, cpu, records = best[spec.world_size]
        lay = spec.layout
        table.add_row(f"{lay.world_size:,}", f"{lay.dp:,}", str(lay.pp), f"{wall:.2f}",
                      f"{cpu:.2f}", f"{wall / lay.pp:.2f}", f"{records:,}",
                      f"{wall / ref_wall:.2f}x", f"{cpu / ref_cpu:.2f}x")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first two seed configs only")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print cProfile's top N functions (cumulative) of the seed run")
    parser.add_argument("--no-small", action="store_true", help="skip the small-world ratio")
    parser.add_argument("--no-scale", action="store_true",
                        help="skip the world-size comparison (WS 8192 vs 1000000)")
    parser.add_argument("--only-scale", action="store_true",
                        help="the world-size comparison alone")
    parser.add_argument("--moe", action="store_true",
                        help=f"the seed configurations of mixtral_8x7b with EP {MOE_EP}")
    parser.add_argument("--repeats", type=int, default=2,
                        help="times each world of the world-size comparison is traced")
    parser.add_argument("--smoke", action="store_true",
                        help=f"the small world alone (tiny, WS {SMALL_WORLD[0]} PP "
                             f"{SMALL_WORLD[1]} TP {SMALL_WORLD[2]}), its representative ranks")
    args = parser.parse_args()
    console = Console(width=150)
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="trace_speed_") as tmp:
            start = time.perf_counter()
            rows = trace_configs([SMALL_WORLD], SMALL_SETTINGS, TINY, Path(tmp))
            console.print(seed_table(rows, time.perf_counter() - start, TINY.name,
                                     "small world", SMALL_SETTINGS))
        return
    configs = SEED_CONFIGS[:2] if args.quick else SEED_CONFIGS
    model = llama2_7b()
    if args.moe:
        model = load_model("mixtral_8x7b")
        configs = [c + [1, MOE_EP] for c in configs]
    with tempfile.TemporaryDirectory(prefix="trace_speed_") as tmp:
        if args.only_scale:
            console.print(scale_table(Path(tmp) / "scale", args.repeats))
            return
        profiler = cProfile.Profile() if args.profile else None
        start = time.perf_counter()
        if profiler:
            profiler.enable()
        rows = trace_configs(configs, SEED_SETTINGS, model, Path(tmp) / "seed")
        if profiler:
            profiler.disable()
        wall_s = time.perf_counter() - start
        console.print(seed_table(rows, wall_s, model.name + (f" EP {MOE_EP}" if args.moe
                                                               else "")))
        if profiler:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
        if not args.no_small:
            console.print(small_world_table(Path(tmp) / "small"))
        if not args.no_scale:
            console.print(scale_table(Path(tmp) / "scale", args.repeats))


if __name__ == "__main__":
    main()
