"""Which configurations a trace covers, checked before anything is traced (pure, no torch).

A configuration is [WORLD_SIZE, PP, TP], [WORLD_SIZE, PP, TP, CP], or for a mixture-of-experts
model [WORLD_SIZE, PP, TP, CP, EP] or [WORLD_SIZE, PP, TP, CP, EP, ETP] (CP: context parallelism,
EP / ETP: expert and expert-tensor parallelism; trace.cp / trace.ep / trace.etp when not given);
DP = WORLD_SIZE / (PP * TP * CP), and the expert grid EDP = TP * CP * DP / (EP * ETP) folds onto
the same ranks of a stage (ParallelLayout). Everything else (batch, micro-batch, sequence length,
sequence parallelism, the CP flavour, schedule, ZeRO) is shared by the batch of configurations. An
invalid configuration is reported with its reason and skipped; the others run.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from orchestrator.choices import CpComm, Recompute, Schedule
from orchestrator.layout import LayoutError, ParallelLayout
from orchestrator.models.config import expert_width, is_moe, validate_model


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
        """TP rank 0, CP rank 0 and DP rank 0 of every pipeline stage: rank 0's pipeline group.
        (The ranks of a stage issue the same ops, to their own groups' ranks; CP ranks the same
        kernels and messages in a rank-dependent order, trace/cp.py.)"""
        return list(self.layout.group_ranks("pp", 0))

    def rank_rule(self) -> str:
        """Why the representative ranks stand for every rank (summary.json's `rank_rule`)."""
        rule = ("one rank per pipeline stage (TP, CP and DP rank 0): a stage's ranks issue the "
                "same ops to their own groups")
        if self.layout.ep * self.layout.etp > 1:
            rule += ("; experts: routing is uniform, so every EP rank of a stage sends, receives "
                     "and computes the same token counts and every ETP rank the same slice: the "
                     "same rank stands for every (stage, EP rank) (an imbalanced load would "
                     "need the busiest EP rank traced on its own)")
        return rule

    def all_ranks(self) -> List[int]:
        return list(range(self.layout.world_size))

    def stage_of(self, rank: int) -> int:
        return self.layout.coordinate(rank, "pp")

    def dir_name(self, model: str) -> str:
        """The seed tracer's folder name for this configuration (+ _EP<ep> / _ETP<etp> when
        > 1)."""
        lay = self.layout
        cp = f"_CP{lay.cp}" if lay.cp > 1 else ""
        experts = (f"_EP{lay.ep}" if lay.ep > 1 else "") + (f"_ETP{lay.etp}" if lay.etp > 1 else "")
        return (f"SIM_{model}_Config{self.index}_WS{lay.world_size}_PP{lay.pp}_TP{lay.tp}{cp}"
                f"_DP{lay.dp}{experts}_nMICROB{lay.num_micro_batches}_MICROB_SIZE"
                f"{lay.micro_batch_size}_GLOBAL_BATCH{lay.global_batch_size}")

    def subpart(self) -> str:
        """The ledger sub-part naming this configuration."""
        lay = self.layout
        cp = f"_cp{lay.cp}" if lay.cp > 1 else ""
        experts = (f"_ep{lay.ep}" if lay.ep > 1 else "") + (f"_etp{lay.etp}" if lay.etp > 1 else "")
        return f"config{self.index}_ws{lay.world_size}_pp{lay.pp}_tp{lay.tp}{cp}{experts}"

    def config(self) -> List[int]:
        """The configuration as the user gives it: [WS, PP, TP], + CP when > 1 (or when EP /
        ETP follow), + EP when > 1 (or when ETP follows), + ETP when > 1."""
        lay = self.layout
        tail = [lay.cp, lay.ep, lay.etp]
        while tail and tail[-1] == 1:
            tail.pop()
        return [lay.world_size, lay.pp, lay.tp] + tail


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
    schedule: Schedule = Schedule["1f1b"]
    virtual_stages: int = 2
    zero: int = 1
    recompute: Recompute = Recompute.none
    layers_per_stage: Optional[Tuple[int, ...]] = None
    cp: int = 1  # context parallelism of a configuration that gives none
    cp_comm: CpComm = CpComm.p2p  # Megatron's --cp-comm-type
    cp_a2a: int = 1  # a2a+p2p: the all-to-all degree inside the CP group
    ep: int = 1  # expert parallelism of a configuration that gives none (MoE models)
    etp: int = 1  # expert tensor parallelism of a configuration that gives none


CONFIG_FORMS = ("[WORLD_SIZE, PP, TP], [WORLD_SIZE, PP, TP, CP], [WORLD_SIZE, PP, TP, CP, EP] or "
                "[WORLD_SIZE, PP, TP, CP, EP, ETP]")


def parse_configs(configs) -> List[Tuple[int, ...]]:
    """[[ws, pp, tp(, cp(, ep(, etp)))], ...] from the config; ValueError on a malformed one."""
    out = []
    for i, c in enumerate(configs or []):
        items = list(c) if isinstance(c, (list, tuple)) else None
        if items is None or not 3 <= len(items) <= 6 or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in items):
            raise ValueError(f"trace.configs[{i}]={c!r}: each configuration is "
                             f"{CONFIG_FORMS} (integers)")
        out.append(tuple(items))
    return out


def check_config(index: int, config: Sequence[int], settings: TraceSettings, model) -> TraceSpec:
    """The TraceSpec of one [ws, pp, tp(, cp(, ep(, etp)))], or ValueError saying why it cannot
    be traced."""
    ws, pp, tp = config[:3]
    cp, ep, etp = (tuple(config[3:]) + (settings.cp, settings.ep, settings.etp)[len(config) - 3:])
    if min(ws, pp, tp, cp, ep, etp) < 1:
        raise ValueError(f"WORLD_SIZE, PP, TP, CP, EP and ETP must be >= 1, got {list(config)}"
                         f" (trace.cp={settings.cp}, trace.ep={settings.ep}, "
                         f"trace.etp={settings.etp} fill what it leaves out)")
    cp_text = f" * CP({cp})" if cp > 1 else ""
    if ws % (pp * tp * cp):
        raise ValueError(f"WORLD_SIZE({ws}) % (PP({pp}) * TP({tp}){cp_text}) != 0")
    dp = ws // (pp * tp * cp)
    # Heads, KV heads, FFN and sequence over TP (the vocabulary is padded for it: vocab_rows):
    # the checks the TP sharding itself makes (apply_tensor_parallel), here before tracing so
    # the configuration is skipped.
    validate_model(dataclasses.replace(model, seq_len=settings.seq_len), tp=tp,
                   seq_len_key="model.seq_len" if settings.seq_len == model.seq_len
                   else "trace.seq_len")
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
    schedule = settings.schedule if pp > 1 else Schedule["1f1b"]
    v = settings.virtual_stages if schedule == Schedule.interleaved else 1
    mode = settings.recompute
    recompute = tuple((mode, 0 if mode == Recompute.none else n) for n in layers)
    try:
        layout = ParallelLayout(
            world_size=ws, pp=pp, tp=tp, dp=dp, layers_per_stage=layers, recompute=recompute,
            zero=settings.zero, sequence_parallel=settings.sequence_parallel and tp > 1,
            micro_batch_size=mbs, num_micro_batches=gbs // (dp * mbs), schedule=schedule,
            virtual_stages=v, cp=cp, cp_comm=settings.cp_comm,
            cp_a2a=settings.cp_a2a if settings.cp_comm == CpComm["a2a+p2p"] and cp > 1 else 1,
            ep=ep, etp=etp)
        layout.check_sequence(settings.seq_len)
        layout.check_heads(model.heads, model.kv_heads, model.name)
        # experts % ep, expert width % etp, a dense model with ep / etp > 1
        layout.check_experts(model.experts if is_moe(model) else 0, expert_width(model),
                             model.name)
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
