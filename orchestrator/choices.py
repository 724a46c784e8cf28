"""Closed choices: one Enum per vocabulary, shared by configs, profiles, planner and models.

Each is a `str` Enum, so a member equals its string (`Schedule["1f1b"] == "1f1b"`), JSON writes
it as that string, and config hashes of earlier runs stay the same. OmegaConf validates a config
value by member *name* at compose time, so the names are what a user types.
"""
from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:  # messages listing choices read as before: ('1f1b', 'interleaved')
        return repr(self.value)

    @classmethod
    def parse(cls, value) -> "Choice":
        """The member for a member, a name or a value; ValueError naming the allowed ones."""
        if isinstance(value, cls):
            return value
        try:
            return cls[value]
        except KeyError:
            pass
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a {cls.__name__}; allowed: "
                             f"{', '.join(cls.__members__)}") from None


class Dtype(Choice):
    """One dtype vocabulary. The long torch names are accepted as aliases of the short ones."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    float32 = "fp32"
    bfloat16 = "bf16"
    float16 = "fp16"

    @property
    def bytes(self) -> int:
        return 4 if self is Dtype.fp32 else 2

    @property
    def torch(self):
        import torch

        return {Dtype.fp32: torch.float32, Dtype.bf16: torch.bfloat16,
                Dtype.fp16: torch.float16}[self]


class Backend(Choice):
    gloo = "gloo"  # CPU
    nccl = "nccl"  # GPU, one rank per GPU


class LauncherName(Choice):
    local = "local"
    slurm = "slurm"


class Ranks(Choice):
    """Where a stage runs: every rank of the cluster, or one process (in the CLI's, locally)."""

    cluster = "cluster"
    one = "one"


class HardwareSource(Choice):
    measured = "measured"
    analytic = "analytic"  # from cluster.links, no launch


class ModelSource(Choice):
    auto = "auto"
    measured = "measured"
    analytic = "analytic"  # FLOPs + device sheet, exact memory under FakeTensorMode


class Engine(Choice):
    """What runs a layout (orchestrator/workload prices each one's communication)."""

    orchestrator = "orchestrator"
    megatron = "megatron"


class Recompute(Choice):
    none = "none"
    selective = "selective"
    full = "full"


# "1f1b" is not a Python identifier, so this one is built with the functional API (its members:
# Schedule["1f1b"], Schedule.interleaved).
Schedule = Choice("Schedule", [("1f1b", "1f1b"), ("interleaved", "interleaved")], module=__name__)

# How context-parallel attention reaches the other ranks' tokens (Megatron's --cp-comm-type):
# "p2p", a ring of K/V sends overlapped with the attention of the chunk held; "a2a" (DeepSpeed's
# Ulysses), all-to-alls that trade the sequence split for a head split around the attention
# core (heads and KV heads must divide over tp x cp); "allgather", K and V of the whole sequence
# gathered before the attention core, their gradients reduce-scattered after (Llama 3's);
# "a2a+p2p" (hierarchical) Ulysses inside groups of `cp_a2a` CP ranks (a node's, typically) and
# the ring across those groups (Megatron's --hierarchical-context-parallel-sizes cp_a2a
# cp/cp_a2a). "a2a+p2p" is not a Python identifier: CpComm["a2a+p2p"].
CpComm = Choice("CpComm", [("p2p", "p2p"), ("a2a", "a2a"), ("allgather", "allgather"),
                           ("a2a+p2p", "a2a+p2p")], module=__name__)


class Group(Choice):
    """A parallel layout's process groups, by name: ParallelLayout.group_ranks gives a rank's
    members of each, ParallelLayout.build_mesh the DeviceMesh dimension of each, and workload/
    and trace name every message by its group. Rank order tp, cp, dp, pp (Megatron's); the
    expert grid etp, ep, edp, pp over the same ranks (layout.py)."""

    world = "world"  # every rank: the gradient norm, the loss
    pp = "pp"  # pipeline stages
    dp = "dp"  # data parallel
    cp = "cp"  # context parallel: the ranks holding one sequence's chunks
    tp = "tp"  # tensor parallel
    dp_cp = "dp_cp"  # dp x cp, the replicas: the ranks holding the same weights
    cp_a2a = "cp_a2a"  # a2a+p2p: the all-to-all level of the CP group (cp_a2a ranks)
    cp_ring = "cp_ring"  # a2a+p2p: the ring over those groups (cp / cp_a2a ranks)
    tp_cp = "tp_cp"  # tp x cp: the ranks holding one sequence's tokens (MoE balance statistics)
    etp = "etp"  # expert tensor parallel
    ep = "ep"  # expert parallel: different experts, tokens by all-to-all
    edp = "edp"  # expert data parallel: the ranks holding the same experts


class HardwareExport(Choice):
    galvatron = "galvatron"


class Source(Choice):
    """Where a profile's numbers come from."""

    measured = "measured"
    analytic = "analytic"  # computed from published figures (link sheets, device sheets)
    galvatron = "galvatron"  # imported from Galvatron's profile files (stage=import)


class Op(Choice):
    """A communication pattern."""

    allreduce = "allreduce"
    p2p = "p2p"
    reduce_scatter = "reduce_scatter"
    all_gather = "all_gather"
    all2all = "all2all"


class LinkLayout(Choice):
    """How a group's ranks are placed: collectives "consec" (groups [i*s, (i+1)*s), TP-like) or
    "strided" (range(i, W, W/s), DP-like); p2p "intra" / "inter" (same node or not)."""

    consec = "consec"
    strided = "strided"
    intra = "intra"
    inter = "inter"


class Microbatching(Choice):
    """How `stage=train` splits an iteration's samples into micro-batches."""

    fixed = "fixed"  # every sample train.seq_len tokens, the layout's equal micro-batches
    dynamic = "dynamic"  # variable-length samples, a planned split/order/recompute per iteration
    padded = "padded"  # variable-length samples, the layout's micro-batches padded to the longest
    packed = "packed"  # variable-length samples packed into rows of train.seq_len tokens



class MoePart(Choice):
    """The parts of a mixture-of-experts FFN that profile_model times (models/moe.py)."""

    routing = "routing"  # router GEMM, softmax, top-k, aux loss, permute and unpermute
    experts = "experts"  # one routed expert's SwiGLU GEMMs (a loop over experts, per expert)
    shared = "shared"  # the shared expert: a dense SwiGLU of shared_expert_ffn, TP-sharded
    mlp = "mlp"  # the profiled dense block's SwiGLU of model.ffn, TP-sharded

# profile_hardware's benchmarks, in run order (profiling/hardware/benchmarks.py runs them; the
# config lists them without importing what measures them).
BENCHMARK_NAMES = ("inventory", "allreduce", "p2p", "reduce_scatter", "all_gather", "all2all",
                   "overlap")
