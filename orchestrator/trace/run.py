"""One configuration, traced: its ranks, their compute times, the files, the summary."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Dict, Optional

from orchestrator.models.config import is_moe
from orchestrator.store import write_json
from orchestrator.trace.configs import TraceSpec
from orchestrator.trace.megatron_args import megatron_command_args
from orchestrator.trace.output import rank_totals, write_rank
from orchestrator.trace.timing import ComputePricer
from orchestrator.trace.tracer import trace_rank


def _merge(into: Dict[str, dict], totals: Dict[str, dict]) -> None:
    for key, values in totals.items():
        slot = into.setdefault(key, {k: 0 for k in values})
        for k, v in values.items():
            slot[k] += v


def trace_configuration(spec: TraceSpec, model, pricer: ComputePricer, folder: Path, *,
                        all_ranks: bool = False, replay: bool = True, bucket_MiB: float = 25.0,
                        export: Optional[str] = None,
                        on_rank: Callable[[int], None] = lambda rank: None,
                        captures: Optional[dict] = None, overlap=None) -> dict:
    """Trace the representative ranks (or all), write their files and summary.json into
    `folder`; returns the summary. `captures`: chunk captures shared across configurations
    (tracer.trace_rank); one for this configuration when not given. `overlap`: what the
    Megatron arguments say is overlapped (megatron_command_args)."""
    start = time.perf_counter()
    ranks = spec.all_ranks() if all_ranks else spec.representative_ranks()
    representatives = set(spec.representative_ranks())  # every traced list includes them
    per_stage: Dict[int, Dict[str, dict]] = {}
    per_rank = {}
    seconds_alone = []
    captures = {} if captures is None else captures
    for rank in ranks:
        traced = trace_rank(spec, model, rank, replay=replay, bucket_MiB=bucket_MiB,
                            captures=captures)
        pp_rank = spec.stage_of(rank)
        pricer.price(traced.records, spec, pp_rank)
        write_rank(folder, rank, traced.records)
        totals = rank_totals(traced.records)
        if rank in representatives:
            per_stage[pp_rank] = totals  # the stage's representative speaks for it
        per_rank[rank] = {"stage": pp_rank, "ops": len(traced.records),
                          "seconds": round(traced.seconds, 4),
                          "seconds_alone": round(traced.seconds_alone, 4)}
        seconds_alone.append(traced.seconds_alone)
        if export == "simai" and rank in representatives:
            from orchestrator.trace.simai import simai_file_name, write_simai

            write_simai(folder / simai_file_name(spec, model.name, stage=pp_rank,
                                                 moe=is_moe(model)),
                        traced.records, spec, model.name)
        on_rank(rank)
    elapsed = time.perf_counter() - start
    lay = spec.layout
    mean_s = sum(seconds_alone) / len(seconds_alone)
    megatron = megatron_command_args(model, lay, overlap)
    totals: Dict[str, dict] = {}
    for stage_totals in per_stage.values():
        _merge(totals, stage_totals)
    summary = {
        "config": spec.config(), "index": spec.index,
        "layout": lay.to_dict(), "layout_text": lay.describe(), "seq_len": spec.seq_len,
        "ranks_traced": len(ranks), "ranks_total": lay.world_size,
        "representatives_only": not all_ranks, "rank_rule": spec.rank_rule(),
        "seconds": round(elapsed, 3),
        # One rank per process as other tools do, each tracing its chunks itself, at this
        # process's pace: a floor (it leaves out their per-process start-up).
        "seconds_all_ranks_estimate": round(mean_s * lay.world_size, 1),
        "compute_times": pricer.note,
        "megatron_args": megatron[0], "megatron_args_notes": megatron[1],
        "per_stage": {str(s): per_stage[s] for s in sorted(per_stage)},
        "per_stage_summed": totals,
        "ranks": {str(r): v for r, v in per_rank.items()},
    }
    write_json(folder / "summary.json", summary)
    return summary
