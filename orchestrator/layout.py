"""ParallelLayout: one validated object for how a model is split over devices.

Shared by search (what it returns), train (what it builds) and trace (what it checks). Like
torchtitan's ParallelDims it validates itself on construction and its messages print the numbers
(`dp(2) * tp(4) * pp(2) != world_size(8)`), so a bad layout fails where it is written, not deep
inside a launch.

Rank order is Megatron's (tp fastest, then cp, then dp, then pp): global rank = tp_rank +
tp * cp_rank + tp * cp * dp_rank + tp * cp * dp * pp_rank. Tensor-parallel groups are consecutive
ranks, context-parallel groups have stride tp, data-parallel groups stride tp * cp (gradients are
reduced, and ZeRO shards, over the dp x cp ranks of stride tp that hold the same weights),
pipeline neighbours are tp * cp * dp ranks apart. The groups are named by choices.Group;
`group_ranks` gives a rank's members of each, `rank_groups` all of one rank's (trace makes only
those), `build_mesh` the DeviceMeshes train runs on (orchestrator/mesh.py).

Experts (mixture-of-experts models, models/moe.py) have their own grid over the same ranks of a
pipeline stage, Megatron's "MoE parallel folding": etp x ep x edp = tp x cp x dp, in the order
etp fastest, then ep, then edp (expert data parallel), then pp. An expert-parallel group holds
different experts on each of its ep ranks (`experts / ep` each) and exchanges tokens by
all-to-all; an expert-tensor-parallel group splits each expert's FFN columns over etp ranks;
expert weights are replicated, and their gradients reduced, over the edp ranks of stride
etp * ep only (the dense weights over dp x cp). EP may span the attention's TP, CP and DP ranks.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from orchestrator.choices import CpComm, Group, Recompute, Schedule
from orchestrator.errors import ConfigError
from orchestrator.records import FieldError, convert, join, show

ZERO_STAGES = (0, 1, 2, 3)
# stage=train's engine runs every CpComm flavour (models/context_parallel.py); its default:
ENGINE_CP_COMM = CpComm.p2p

# (mode, k_layers): how many layers of the stage use `mode`; the others keep all activations.
# "none" has k == 0, "selective" covers every layer of the stage (Megatron cannot do part of a
# stage), "full" recomputes the first k layers of the stage (Megatron's --recompute-method block).
StageRecompute = Tuple[Recompute, int]


def stage_chunks(n: int, v: int, first: bool, last: bool) -> Optional[Tuple[int, ...]]:
    """The layers of each of the v model chunks of a stage of n layers (chunk order), or None
    when the rule below cannot split n. Equal chunks (n % v == 0); otherwise, on the first
    stage (`first`) or the last (`last`) only, ceil(n / v) layers per chunk with the remainder
    short: the first stage's first chunk (beside the embedding) or the last stage's last chunk
    (beside the LM head and loss), >= 0 layers. Llama 3 405B's 126 layers over 16 stages are
    7 + 14 x 8 + 7: with v = 8, one layer per chunk and none beside the embedding and the
    loss (Megatron's --account-for-embedding/loss-in-pipeline-split); with v = 4, [1, 2, 2, 2]
    on the first stage. Megatron runs every such split (--pipeline-model-parallel-layout)."""
    if v == 1 or n % v == 0:
        return (n // v,) * v
    c = -(-n // v)
    short = n - (v - 1) * c
    if short < 0 or not (first or last):
        return None
    return (short,) + (c,) * (v - 1) if first else (c,) * (v - 1) + (short,)


def chunk_recompute(k: int, chunks: Tuple[int, ...]) -> Optional[int]:
    """r such that full recompute of k layers of a stage is the first r layers of each of its
    `chunks` (all of a chunk shorter than r: Megatron's --recompute-method block), or None.
    Equal chunks: r = k / v."""
    for r in range(1, max(chunks) + 1):
        if sum(min(r, c) for c in chunks) == k:
            return r
    return None


class LayoutError(ConfigError, ValueError):
    """A ParallelLayout that cannot run; the message prints the offending numbers."""


def _choice(kind: type, value: Any, what: str):
    """`value` as a member of the Choice `kind`; LayoutError naming `what` and the allowed
    values when it is none."""
    try:
        return kind.parse(value)
    except ValueError:
        raise LayoutError(f"{what} must be one of {tuple(kind)}, got {value!r}") from None


@dataclass(frozen=True)
class ParallelLayout:
    """How one training job is split: degrees, batch, schedule, pipeline partition, recompute.

    - world_size = dp * tp * cp * pp; cp > 1 splits every sequence over cp ranks (context
      parallelism, models/context_parallel.py; `cp_comm` how attention reaches the other ranks'
      keys and values, a CpComm; `cp_a2a` the all-to-all degree of "a2a+p2p", 1 < cp_a2a < cp
      dividing it, 1 otherwise).
    - zero: 0 (plain data parallel), 1 (optimizer states sharded over dp), 2 (+ gradients),
      3 (+ parameters). `distributed_optimizer` is Megatron's name for sharded optimizer states:
      it is True exactly when zero >= 1 (left as None it is derived from zero).
    - global batch (sequences) = dp * micro_batch_size * num_micro_batches.
    - schedule "1f1b" (virtual_stages == 1) or "interleaved" (virtual_stages = v >= 2 model
      chunks per device, split by stage_chunks: equal chunks, except that the first stage's
      first chunk and the last stage's last chunk may be short, the place Megatron's embedding
      and loss take; num_micro_batches divisible by pp as Megatron requires).
    - layers_per_stage: transformer blocks per pipeline stage, uneven allowed (>= 1 each).
    - recompute: one (mode, k_layers) per pipeline stage, see StageRecompute.
    """

    world_size: int
    pp: int
    tp: int
    dp: int
    layers_per_stage: Tuple[int, ...]
    recompute: Tuple[StageRecompute, ...] = ()
    zero: int = 0
    distributed_optimizer: Optional[bool] = None
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    num_micro_batches: int = 1
    schedule: Schedule = Schedule["1f1b"]
    virtual_stages: int = 1
    cp: int = 1
    cp_comm: CpComm = CpComm.p2p
    cp_a2a: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        # Normalise containers first so that lists from JSON or callers compare and hash.
        object.__setattr__(self, "layers_per_stage", tuple(int(n) for n in self.layers_per_stage))
        recompute = self.recompute or tuple((Recompute.none, 0) for _ in self.layers_per_stage)
        object.__setattr__(self, "recompute", tuple(
            (_choice(Recompute, mode, f"recompute[{stage}] mode"), int(k))
            for stage, (mode, k) in enumerate(recompute)))
        object.__setattr__(self, "schedule", _choice(Schedule, self.schedule, "schedule"))
        object.__setattr__(self, "cp_comm", _choice(CpComm, self.cp_comm, "cp_comm"))
        if self.distributed_optimizer is None:
            object.__setattr__(self, "distributed_optimizer", self.zero >= 1)
        if self.cp == 1:  # no context parallelism, no flavour: one layout, one equality
            object.__setattr__(self, "cp_comm", CpComm.p2p)
            object.__setattr__(self, "cp_a2a", 1)
        self._validate()

    # ---------------------------------------------------------------- validation
    def _validate(self) -> None:
        for name in ("world_size", "pp", "tp", "dp", "cp", "cp_a2a", "ep", "etp",
                     "micro_batch_size", "num_micro_batches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LayoutError(f"{name} must be an integer >= 1, got {value!r}")
        if self.dp * self.tp * self.cp * self.pp != self.world_size:
            cp = f" * cp({self.cp})" if self.cp > 1 else ""
            raise LayoutError(f"dp({self.dp}) * tp({self.tp}){cp} * pp({self.pp}) != "
                              f"world_size({self.world_size})")
        if self.cp_comm == CpComm["a2a+p2p"] and not (1 < self.cp_a2a < self.cp
                                               and self.cp % self.cp_a2a == 0):
            raise LayoutError(f"cp_comm a2a+p2p needs cp_a2a (the all-to-all degree inside the "
                              f"CP group, Megatron's --hierarchical-context-parallel-sizes) with "
                              f"1 < cp_a2a({self.cp_a2a}) < cp({self.cp}), dividing it")
        if self.cp_comm != CpComm["a2a+p2p"] and self.cp_a2a != 1:
            raise LayoutError(f"cp_a2a({self.cp_a2a}) is the all-to-all degree of cp_comm "
                              f"a2a+p2p, not of cp_comm {self.cp_comm}")
        stage_ranks = self.stage_ranks
        if stage_ranks % (self.ep * self.etp):
            raise LayoutError(f"ep({self.ep}) * etp({self.etp}) must divide the tp({self.tp}) * "
                              f"cp({self.cp}) * dp({self.dp}) = {stage_ranks} ranks of a pipeline "
                              f"stage (the expert grid folds onto them)")
        if self.tp > 1 and self.ep * self.etp > 1 and not self.sequence_parallel:
            raise LayoutError(f"expert parallelism (ep({self.ep}), etp({self.etp})) with tp"
                              f"({self.tp}) needs sequence_parallel: each TP rank routes its own "
                              f"sequence shard's tokens (Megatron's rule)")
        if self.zero not in ZERO_STAGES:
            raise LayoutError(f"zero must be one of {ZERO_STAGES}, got {self.zero!r}")
        if bool(self.distributed_optimizer) != (self.zero >= 1):
            raise LayoutError(
                f"distributed_optimizer({self.distributed_optimizer}) means optimizer states "
                f"sharded over dp, i.e. zero >= 1, but zero({self.zero}); set zero=1 for "
                f"Megatron's distributed optimizer or leave distributed_optimizer unset")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("sequence_parallel needs tp > 1 (tp(1)); it shards activations "
                              "over the tensor-parallel group")
        v = self.virtual_stages
        if self.schedule == Schedule["1f1b"] and v != 1:
            raise LayoutError(f"schedule '1f1b' has virtual_stages 1, got virtual_stages({v}); "
                              f"use schedule 'interleaved' for v > 1")
        if self.schedule == Schedule.interleaved:
            if v < 2:
                raise LayoutError(f"schedule 'interleaved' needs virtual_stages >= 2, got {v}")
            if self.pp < 2:
                raise LayoutError(f"schedule 'interleaved' needs pp >= 2, got pp({self.pp})")
            if self.num_micro_batches % self.pp:
                raise LayoutError(f"interleaved schedule: num_micro_batches"
                                  f"({self.num_micro_batches}) % pp({self.pp}) != 0")
        if len(self.layers_per_stage) != self.pp:
            raise LayoutError(f"len(layers_per_stage)={len(self.layers_per_stage)} != "
                              f"pp({self.pp}): give one layer count per pipeline stage")
        for stage, n in enumerate(self.layers_per_stage):
            if n < 1:
                raise LayoutError(f"layers_per_stage[{stage}]={n}: every stage needs >= 1 layer")
            if stage_chunks(n, v, stage == 0, stage == self.pp - 1) is None:
                ends = ("" if 0 < stage < self.pp - 1 else
                        f" (a short {'first' if stage == 0 else 'last'} chunk: n >= "
                        f"(v - 1) * ceil(n / v))")
                raise LayoutError(f"layers_per_stage[{stage}]={n} % virtual_stages({v}) != 0: "
                                  f"each model chunk needs the same number of layers{ends}")
        if len(self.recompute) != self.pp:
            raise LayoutError(f"len(recompute)={len(self.recompute)} != pp({self.pp}): give one "
                              f"(mode, k_layers) per pipeline stage")
        for stage, ((mode, k), n) in enumerate(zip(self.recompute, self.layers_per_stage)):
            if mode == Recompute.none and k != 0:
                raise LayoutError(f"recompute[{stage}]=('none', {k}): k_layers must be 0")
            if mode == Recompute.selective and k != n:
                raise LayoutError(f"recompute[{stage}]=('selective', {k}): selective recompute "
                                  f"covers the whole stage, k_layers must be "
                                  f"layers_per_stage[{stage}]={n}")
            if mode == Recompute.full:
                if not 1 <= k <= n:
                    raise LayoutError(f"recompute[{stage}]=('full', {k}): k_layers must be in "
                                      f"1..layers_per_stage[{stage}]={n}")
                if chunk_recompute(k, self.layers_per_chunk[stage]) is None:
                    raise LayoutError(f"recompute[{stage}]=('full', {k}) % virtual_stages({v}) "
                                      f"!= 0: each model chunk recomputes the same layers (its "
                                      f"first r, all of a chunk shorter than r)")

    def check_sequence(self, seq_len: int) -> None:
        """Raise LayoutError unless context parallelism can cut `seq_len`: 2 * cp chunks of equal
        length (the causal load balance), each split evenly over tp."""
        if self.cp > 1 and seq_len % (2 * self.cp * self.tp):
            raise LayoutError(f"seq_len({seq_len}) % (2 * cp({self.cp}) * tp({self.tp})) != 0: "
                              f"context parallelism cuts a sequence into 2 * cp equal chunks, "
                              f"each split over tp")

    def check_heads(self, heads: int, kv_heads: int, model_name: str = "model") -> None:
        """Raise LayoutError unless tp splits the heads and KV heads (and, for the all-to-all
        flavour of CP, tp x cp does; tp x cp_a2a for the hierarchical one)."""
        split, what = self.tp, f"tp({self.tp})"
        if self.cp > 1 and self.cp_comm == CpComm.a2a:
            split, what = self.tp * self.cp, f"tp({self.tp}) * cp({self.cp}) (cp_comm a2a)"
        elif self.cp_comm == CpComm["a2a+p2p"]:
            split = self.tp * self.cp_a2a
            what = f"tp({self.tp}) * cp_a2a({self.cp_a2a}) (cp_comm a2a+p2p)"
        if heads % split or kv_heads % split:
            raise LayoutError(f"{what} must divide heads({heads}) and kv_heads({kv_heads}) of "
                              f"{model_name}")

    def check_experts(self, experts: int, expert_ffn: int, model_name: str = "model") -> None:
        """Raise LayoutError unless ep splits the `experts` (0: a dense model, which needs
        ep = etp = 1) and etp the expert FFN width, and tp > 1 comes with sequence parallelism."""
        if not experts:
            if self.ep * self.etp > 1:
                raise LayoutError(f"ep({self.ep}) / etp({self.etp}) need a mixture-of-experts "
                                  f"model; {model_name} is dense (model.experts 0)")
            return
        if self.tp > 1 and not self.sequence_parallel:
            raise LayoutError(f"a mixture-of-experts model with tp({self.tp}) needs "
                              f"sequence_parallel: each TP rank routes its own sequence shard's "
                              f"tokens (Megatron's rule)")
        if experts % self.ep:
            raise LayoutError(f"experts({experts}) of {model_name} is not divisible by "
                              f"ep({self.ep}): each EP rank holds experts / ep of them")
        if expert_ffn % self.etp:
            raise LayoutError(f"expert FFN width({expert_ffn}) of {model_name} is not divisible "
                              f"by etp({self.etp})")

    def check_equal_chunks(self) -> None:
        """Raise LayoutError when a model chunk is short (short_chunks): Megatron-LM runs those
        (planner/exports.py writes them), stage=train builds equal chunks only."""
        if self.short_chunks:
            raise LayoutError(
                f"layers_per_stage={list(self.layers_per_stage)} with virtual_stages"
                f"({self.virtual_stages}) has short model chunks {list(self.layers_per_chunk)}: "
                f"Megatron-LM runs them (search.engine=megatron), stage=train builds equal "
                f"chunks only; give every stage a multiple of {self.virtual_stages} layers")

    def check_model_layers(self, layers: int, model_name: str = "model") -> None:
        """Raise LayoutError unless the stages hold exactly the model's `layers` blocks."""
        if self.num_layers != layers:
            raise LayoutError(f"sum(layers_per_stage)={self.num_layers} != layers({layers}) of "
                              f"{model_name}")

    # ---------------------------------------------------------------- derived values
    @property
    def num_layers(self) -> int:
        """Transformer blocks over all stages."""
        return sum(self.layers_per_stage)

    @property
    def layers_per_chunk(self) -> Tuple[Tuple[int, ...], ...]:
        """Per stage, the layers of each of its virtual_stages model chunks (stage_chunks); the
        model runs chunk c of stage s as virtual stage c * pp + s."""
        p, v = self.pp, self.virtual_stages
        return tuple(stage_chunks(n, v, s == 0, s == p - 1)
                     for s, n in enumerate(self.layers_per_stage))

    @property
    def short_chunks(self) -> bool:
        """True when some model chunk holds fewer layers than its stage's others (the first
        stage's first or the last stage's last, interleaved only)."""
        return any(len(set(chunks)) > 1 for chunks in self.layers_per_chunk)

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline stage: tp x cp x dp (the expert grid folds onto them)."""
        return self.tp * self.cp * self.dp

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights, dp x cp: gradients are reduced, and ZeRO shards,
        over them (the CP ranks of a sequence each hold the whole model)."""
        return self.dp * self.cp

    @property
    def replica_group(self) -> Group:
        """The group of the `replicas`: dp, or dp_cp under context parallelism."""
        return Group.dp_cp if self.cp > 1 else Group.dp

    @property
    def edp(self) -> int:
        """Expert data parallel: ranks of a stage holding the same experts' shard."""
        return self.stage_ranks // (self.ep * self.etp)

    @property
    def global_batch_size(self) -> int:
        """Sequences per iteration: dp * micro_batch_size * num_micro_batches."""
        return self.dp * self.micro_batch_size * self.num_micro_batches

    # ---------------------------------------------------------------- rank order
    def _size_stride(self, dim: str):
        """(group size, stride between its ranks) of Group `dim` in the rank order tp, cp, dp,
        pp; (None, None) for "world" and unknown names. dp_cp is the dp x cp ranks that hold
        the same weights (gradient reduction, ZeRO); cp_a2a and cp_ring split a CP group for
        a2a+p2p: cp_a2a consecutive CP ranks, and the ring over those groups (Megatron's
        hierarchical CP groups); tp_cp the tp x cp ranks of one sequence; etp, ep and edp are
        the expert grid's (etp, ep, edp, pp order over the same ranks)."""
        tp, cp, dp, a = self.tp, self.cp, self.dp, self.cp_a2a
        return {Group.tp: (tp, 1), Group.cp: (cp, tp), Group.dp: (dp, tp * cp),
                Group.dp_cp: (dp * cp, tp), Group.pp: (self.pp, tp * cp * dp),
                Group.cp_a2a: (a, tp), Group.cp_ring: (cp // a, tp * a),
                Group.tp_cp: (tp * cp, 1), Group.etp: (self.etp, 1),
                Group.ep: (self.ep, self.etp),
                Group.edp: (self.edp, self.etp * self.ep)}.get(dim, (None, None))

    def coordinate(self, rank: int, dim: str) -> int:
        """`rank`'s index along Group `dim` (any but "world") in the rank order tp, cp, dp, pp
        (etp, ep, edp, pp)."""
        self._check_rank(rank)
        size, stride = self._size_stride(dim)
        if size is None:
            raise LayoutError(f"dim must be one of {tuple(g for g in Group if g != Group.world)}"
                              f", got {dim!r}")
        return rank // stride % size

    def group_ranks(self, dim: str, rank: int) -> range:
        """The global ranks of `rank`'s Group `dim`, in group-rank order (the group the layout's
        DeviceMesh, build_mesh, gives `rank`), as a range: the same cost at any world size."""
        if dim == Group.world:
            self._check_rank(rank)
            return range(self.world_size)
        size, stride = self._size_stride(dim)
        if size is None:
            raise LayoutError(f"dim must be one of {tuple(Group)}, got {dim!r}")
        first = rank - self.coordinate(rank, dim) * stride
        return range(first, first + size * stride, stride)

    def groups(self, experts: bool = False) -> Tuple[Group, ...]:
        """The groups of this layout, those build_mesh makes: world, pp, dp, tp; cp and dp_cp
        with context parallelism, cp_a2a and cp_ring for a2a+p2p; with `experts` (a
        mixture-of-experts model) the expert grid's etp, ep and edp, and tp_cp where a sequence
        spans both TP and CP ranks (otherwise its ranks are the tp or the cp group's)."""
        out = [Group.world, Group.pp, Group.dp]
        if self.cp > 1:
            out += [Group.cp, Group.dp_cp]
            if self.cp_comm == CpComm["a2a+p2p"]:
                out += [Group.cp_a2a, Group.cp_ring]
        out.append(Group.tp)
        if experts:
            out += [Group.etp, Group.ep, Group.edp]
            if self.tp > 1 and self.cp > 1:
                out.append(Group.tp_cp)
        return tuple(out)

    def rank_groups(self, rank: int, experts: bool = False) -> Dict[Group, range]:
        """`rank`'s members of each of the layout's `groups(experts)`: the only groups one rank
        joins, at the same cost at any world size (trace makes just these on its fake
        backend; build_mesh makes every rank's)."""
        return {name: self.group_ranks(name, rank) for name in self.groups(experts)}

    def build_mesh(self, device_type: str, experts: bool = False):
        """This rank's LayoutMesh (orchestrator/mesh.py): the DeviceMeshes of the dense grid
        (pp, dp, cp | cp_ring, cp_a2a, tp) and, with `experts`, of the expert grid (pp, edp, ep,
        etp), one named dimension per Group. Every rank of the world calls it (a real backend
        makes every group of the world)."""
        from orchestrator.mesh import build_mesh  # torch: only where a mesh is built

        return build_mesh(self, device_type, experts)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank({rank}) must be in 0..world_size({self.world_size})-1")

    def describe(self) -> str:
        """One line for logs, e.g. `tp4 pp2 dp8 zero1 sp mbs1 x16 1f1b [18,18] rc[full2,none]`."""
        rc = ",".join(mode if mode != Recompute.full else f"full{k}" for mode, k in self.recompute)
        sched = (self.schedule if self.virtual_stages == 1
                 else f"{self.schedule}(v{self.virtual_stages})")
        comm = f"a2a{self.cp_a2a}+p2p" if self.cp_comm == CpComm["a2a+p2p"] else self.cp_comm
        cp = "" if self.cp == 1 else f" cp{self.cp}" + ("" if comm == CpComm.p2p else f"({comm})")
        ep = (f" ep{self.ep}" if self.ep > 1 else "") + (f" etp{self.etp}" if self.etp > 1 else "")
        return (f"tp{self.tp}{cp} pp{self.pp} dp{self.dp}{ep} zero{self.zero}"
                f"{' sp' if self.sequence_parallel else ''} mbs{self.micro_batch_size}"
                f" x{self.num_micro_batches} {sched} "
                f"[{','.join(map(str, self.layers_per_stage))}] rc[{rc}]")

    # ---------------------------------------------------------------- construction / JSON
    @classmethod
    def uniform(cls, world_size: int, tp: int, pp: int, layers: int, *,
                recompute: StageRecompute | Recompute = Recompute.none,
                **kwargs: Any) -> "ParallelLayout":
        """A layout with dp = world_size / (tp * cp * pp), layers split as evenly as possible (the
        first stages take the remainder) and the same recompute on every stage ("none",
        "selective", "full" for the whole stage, or an explicit (mode, k_layers))."""
        cp = kwargs.get("cp", 1)
        if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * cp * pp):
            cp_text = f" * cp({cp})" if cp != 1 else ""
            raise LayoutError(f"tp({tp}){cp_text} * pp({pp}) does not divide "
                              f"world_size({world_size})")
        v = kwargs.get("virtual_stages", 1)
        chunks = layers // v
        base, extra = divmod(chunks, pp)
        stages = tuple((base + (1 if s < extra else 0)) * v for s in range(pp))
        if isinstance(recompute, str):
            per_stage = tuple((recompute, 0 if recompute == Recompute.none else n) for n in stages)
        else:
            per_stage = tuple(recompute for _ in stages)
        return cls(world_size=world_size, pp=pp, tp=tp, dp=world_size // (tp * cp * pp),
                   layers_per_stage=stages, recompute=per_stage, **kwargs)

    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON-ready dict (lists for tuples); from_dict(to_dict()) == self. cp and
        cp_comm appear only with context parallelism (files written before it read as cp 1),
        cp_a2a only with a2a+p2p, ep and etp only with expert parallelism."""
        cp = {} if self.cp == 1 else {"cp": self.cp, "cp_comm": self.cp_comm}
        if self.cp_comm == CpComm["a2a+p2p"]:
            cp["cp_a2a"] = self.cp_a2a
        if self.ep * self.etp > 1:
            cp.update(ep=self.ep, etp=self.etp)
        return {
            "world_size": self.world_size, "pp": self.pp, "tp": self.tp, "dp": self.dp, **cp,
            "zero": self.zero, "distributed_optimizer": bool(self.distributed_optimizer),
            "sequence_parallel": self.sequence_parallel,
            "micro_batch_size": self.micro_batch_size,
            "num_micro_batches": self.num_micro_batches,
            "global_batch_size": self.global_batch_size,
            "schedule": self.schedule, "virtual_stages": self.virtual_stages,
            "layers_per_stage": list(self.layers_per_stage),
            "recompute": [[mode, k] for mode, k in self.recompute],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "") -> "ParallelLayout":
        """Inverse of to_dict; `global_batch_size`, when present, must match the product.
        LayoutError naming the key (under `where`, e.g. "layout": "layout.pp") that is missing,
        unknown or not of its JSON type, or the numbers of a layout that cannot run."""
        prefix = f"{where}: " if where else ""
        if not isinstance(d, Mapping):
            raise LayoutError(f"{where or 'layout'}: expected an object, got {show(d)}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known - {"global_batch_size"}
        if unknown:
            raise LayoutError(f"{prefix}unknown layout keys {sorted(unknown)}; known: "
                              f"{sorted(known)}")
        hints, values = typing.get_type_hints(cls), {}
        try:
            for f in dataclasses.fields(cls):
                if f.name in d:
                    values[f.name] = convert(d[f.name], hints[f.name], join(where, f.name))
                elif f.default is dataclasses.MISSING:
                    raise FieldError(join(where, f.name), "missing")
            gbs = convert(d.get("global_batch_size"), Optional[int],
                          join(where, "global_batch_size"))
        except FieldError as e:
            raise LayoutError(str(e)) from None
        try:
            layout = cls(**values)
        except LayoutError as e:
            raise LayoutError(f"{prefix}{e}") from None
        if gbs is not None and gbs != layout.global_batch_size:
            raise LayoutError(f"{prefix}global_batch_size({gbs}) != dp({layout.dp}) * "
                              f"micro_batch_size({layout.micro_batch_size}) * num_micro_batches"
                              f"({layout.num_micro_batches}) = {layout.global_batch_size}")
        return layout
