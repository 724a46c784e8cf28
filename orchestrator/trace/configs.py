"""Which configurations a trace covers, checked before anything is traced (pure, no torch).

A configuration is [WORLD_SIZE, PP, TP]; DP = WORLD_SIZE / (PP * TP). Everything else (batch,
micro-batch, sequence length, sequence parallelism, schedule, ZeRO) is shared by the batch of
configurations. An invalid configuration is reported with its reason and skipped; the others run.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from orchestrator.layout import LayoutError, ParallelLayout
from orchestrator.models.config import validate_model


@dataclass(frozen=True)
class TraceSpec:
    """One configuration to trace: a full ParallelLayout at the fake world size, its index in
    the user's list, and the sequence length."""

    index: int
    layout: ParallelLayout
    seq_len: int

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def representative_ranks(self) -> List[int]:
        """TP rank 0 and DP rank 0 of every pipeline stage: rank 0's pipeline group."""
        return list(self.layout.group_ranks("pp", 0))

    def all_ranks(self) -> List[int]:
        return list(range(self.layout.world_size))

    def stage_of(self, rank: int) -> int:
        return self.layout.coordinate(rank, "pp")

    def dir_name(self, model: str) -> str:
        """The seed tracer's folder name for this configuration."""
        lay = self.layout
        return (f"SIM_{model}_Config{self.index}_WS{lay.world_size}_PP{lay.pp}_TP{lay.tp}"
                f"_DP{lay.dp}_nMICROB{lay.num_micro_batches}_MICROB_SIZE"
                f"{lay.micro_batch_size}_GLOBAL_BATCH{lay.global_batch_size}")

    def subpart(self) -> str:
        """The ledger sub-part naming this configuration."""
        lay = self.layout
        return f"config{self.index}_ws{lay.world_size}_pp{lay.pp}_tp{lay.tp}"


@dataclass(frozen=True)
class Skipped:
    index: int
    config: Tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class TraceSettings:
    """What every configuration of one trace shares."""

    global_batch_size: int
    micro_batch_size: int
    seq_len: int
    sequence_parallel: bool
    schedule: str = "1f1b"
    virtual_stages: int = 2
    zero: int = 1
    recompute: str = "none"
    layers_per_stage: Optional[Tuple[int, ...]] = None


def parse_configs(configs) -> List[Tuple[int, ...]]:
    """[[ws, pp, tp], ...] from the config (a list of triples); ValueError on a malformed one."""
    out = []
    for i, c in enumerate(configs or []):
        items = list(c) if isinstance(c, (list, tuple)) else None
        if items is None or len(items) != 3 or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in items):
            raise ValueError(f"trace.configs[{i}]={c!r}: each configuration is "
                             f"[WORLD_SIZE, PP, TP] (three integers)")
        out.append(tuple(items))
    return out


def check_config(index: int, config: Sequence[int], settings: TraceSettings, model) -> TraceSpec:
    """The TraceSpec of one [ws, pp, tp], or ValueError saying why it cannot be traced."""
    ws, pp, tp = config
    if min(ws, pp, tp) < 1:
        raise ValueError(f"WORLD_SIZE, PP and TP must be >= 1, got {list(config)}")
    if ws % (pp * tp):
        raise ValueError(f"WORLD_SIZE({ws}) % (PP({pp}) * TP({tp})) != 0")
    dp = ws // (pp * tp)
    # Heads, KV heads, FFN, vocabulary and sequence over TP: the checks the TP sharding itself
    # makes (apply_tensor_parallel), here before tracing so the configuration is skipped.
    validate_model(dataclasses.replace(model, seq_len=settings.seq_len), tp=tp)
    if settings.layers_per_stage is not None:
        layers = tuple(settings.layers_per_stage)
        if len(layers) != pp or sum(layers) != model.layers:
            raise ValueError(f"trace.layers_per_stage {list(layers)} needs {pp} entries "
                             f"summing to model.layers({model.layers})")
    elif model.layers % pp:
        raise ValueError(f"model.layers({model.layers}) % PP({pp}) != 0 (give "
                         f"trace.layers_per_stage for an uneven split)")
    else:
        layers = (model.layers // pp,) * pp
    gbs, mbs = settings.global_batch_size, settings.micro_batch_size
    if gbs % (dp * mbs):
        raise ValueError(f"GBS({gbs}) % (DP({dp}) * MBS({mbs})) != 0")
    schedule = settings.schedule if pp > 1 else "1f1b"
    v = settings.virtual_stages if schedule == "interleaved" else 1
    mode = settings.recompute
    recompute = tuple((mode, 0 if mode == "none" else n) for n in layers)
    try:
        layout = ParallelLayout(
            world_size=ws, pp=pp, tp=tp, dp=dp, layers_per_stage=layers, recompute=recompute,
            zero=settings.zero, sequence_parallel=settings.sequence_parallel and tp > 1,
            micro_batch_size=mbs, num_micro_batches=gbs // (dp * mbs), schedule=schedule,
            virtual_stages=v)
    except LayoutError as e:
        raise ValueError(str(e)) from None
    return TraceSpec(index=index, layout=layout, seq_len=settings.seq_len)


def plan_configs(configs: Sequence[Sequence[int]], settings: TraceSettings,
                 model) -> Tuple[List[TraceSpec], List[Skipped]]:
    """(valid configurations, skipped ones with their reasons), in the user's order."""
    specs, skipped = [], []
    for index, config in enumerate(configs):
        try:
            specs.append(check_config(index, config, settings, model))
        except ValueError as e:
            skipped.append(Skipped(index, tuple(config), str(e)))
    return specs, skipped
