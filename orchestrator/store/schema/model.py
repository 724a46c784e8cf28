"""model/<name>.json: layer time points and fits per TP degree, memory per TP degree."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from orchestrator.choices import Dtype, MoePart, Recompute, Source
from orchestrator.store.schema.header import PartMade, Profile
from orchestrator.store.schema.identity import MOE_IDENTITY
from orchestrator.records import FieldError, Record, doc, join


@dataclass(kw_only=True)
class ModelSummary(Record):
    """The model profiled: what the profile claims to be (schema/identity.py says which fields
    every reader compares with its own model config, and why the others are not)."""

    name: str = doc("model.name", default="model")
    hidden: int = doc("hidden size")
    ffn: int = doc("MLP inner size")
    layers: int = doc("transformer blocks")
    heads: int = doc("attention heads")
    kv_heads: Optional[int] = doc("key/value heads (GQA); heads when absent", default=None)
    vocab: int = doc("vocabulary size")
    make_vocab_size_divisible_by: Optional[int] = doc(
        "the embedding and LM head hold vocab rounded up to a multiple of this x tp (Megatron's "
        "--make-vocab-size-divisible-by); absent: 1, written only when not 1", default=None)
    seq_len: int = doc("the model's sequence length", default=0)
    dtype: Dtype = doc("parameter and activation dtype", default=Dtype.bf16)
    experts: Optional[int] = doc("routed experts per MoE block (MoE models only)", default=None)
    top_k: Optional[int] = doc("experts each token is routed to (MoE)", default=None)
    expert_ffn: Optional[int] = doc("one routed expert's width (MoE)", default=None)
    shared_expert_ffn: Optional[int] = doc("the shared expert's width, 0: none (MoE)",
                                           default=None)
    dense_layers: Optional[int] = doc("leading blocks with a dense FFN (MoE)", default=None)
    capacity_factor: Optional[float] = doc("tokens each expert keeps, x its even share; null: "
                                           "dropless (MoE: written, null too)", default=None)
    aux_loss_coef: Optional[float] = doc("the balance loss's weight (MoE)", default=None)

    def __post_init__(self) -> None:
        if self.kv_heads is None:
            self.kv_heads = self.heads

    @classmethod
    def from_dict(cls, raw: Any, path: str = "") -> "ModelSummary":
        """The summary; a MoE model's must hold every MoE field (identity.MOE_IDENTITY; a null
        capacity_factor is dropless): one without them was written before profiles recorded
        them and cannot say what its MoE parts timed."""
        summary = super().from_dict(raw, path)
        if summary.experts:
            for name in MOE_IDENTITY:
                if name not in raw:
                    raise FieldError(join(path, name), "missing (a MoE profile written before "
                                                       "profiles recorded it: stale)")
        return summary

    def to_dict(self) -> Dict[str, Any]:
        out = super().to_dict()
        if self.experts:  # every MoE field, a null capacity_factor (dropless) too
            out.update({name: getattr(self, name) for name in MOE_IDENTITY if name not in out})
        return out


@dataclass(kw_only=True)
class ModelPoint(Record):
    """One (seq_len, tp) point, per micro-batch of 1 sequence, us."""

    seq_len: int = doc("tokens per sequence")
    tp: int = doc("tensor-parallel degree")
    block_fwd_us: float = doc("one transformer block, forward (TP compute only)")
    block_bwd_us: float = doc("one block, backward")
    other_fwd_us: float = doc("embedding + final norm + LM head + loss, forward")
    other_bwd_us: float = doc('"other", backward')
    source: Source = doc("measured, or FLOPs over a device sheet (analytic)")
    compiled: Optional[bool] = doc("measured: whether the block was timed torch.compile'd, as "
                                   "train runs it (train.compile; auto: on CUDA only); absent: "
                                   "eager (earlier profiles, analytic points)", default=None)
    extras: Dict[str, Any] = doc("*_fastest_us, *_optim_us, *_total_us, *_comm_us, "
                                 "*_grad_add_us (analytic: train's gradient add per "
                                 "micro-batch, apart), iters, "
                                 "groups, flops, per-mode activation bytes per micro-batch, "
                                 "states, megatron_act_bytes, megatron_ratio; on a CPU at tp 1 "
                                 "block_selective_us and block_full_us (the block's forward + "
                                 "backward under that recompute, as train runs it)",
                                 default_factory=dict)


@dataclass(kw_only=True)
class TpFits(Record):
    """Fits in seq_len s of one TP degree: block c0 + c1 s + c2 s^2, other c0 + c1 s (us)."""

    block_fwd_us: Tuple[float, ...] = doc("[c0, c1, c2]")
    block_bwd_us: Tuple[float, ...] = doc("[c0, c1, c2]")
    other_fwd_us: Tuple[float, ...] = doc("[c0, c1]")
    other_bwd_us: Tuple[float, ...] = doc("[c0, c1]")
    max_rel_err: Optional[float] = doc("largest relative residual of the fits", default=None)
    device_us: Optional[Dict[str, Tuple[float, ...]]] = doc(
        "GPU (measured): the device's time alone per part (block_fwd, block_bwd, other_fwd, "
        "other_bwd), queued behind a sleep so the host never starves it: c0 + b (c1 s + c2 s^2) "
        "for a call on b sequences of s tokens (other: c0 + b c1 s), fitted over the profiled "
        "lengths and micro-batch sizes; absent where host and device are not told apart (a CPU: "
        "the host runs the kernels; analytic and older profiles)", default=None)
    host_us: Optional[Dict[str, float]] = doc(
        "GPU (measured, with device_us): the host's time to issue one call per part (Python, "
        "dispatch, kernel launches), its constant: c0 + host_us_per_token x the call's tokens. "
        "A call costs max(host, device): they overlap", default=None)
    host_us_per_token: Optional[Dict[str, float]] = doc(
        "GPU (measured, with host_us): what issuing a call adds per token, per part: a line "
        "through the samples where it explains half their variance (the eager loss issues its "
        "ops once per chunk of tokens), else 0 and host_us their median; absent (earlier "
        "profiles): 0", default=None)
    extras: Dict[str, Any] = doc("seq_lens, rel_residuals, block_models, source, "
                                 "device_rel_residuals, device_models; recompute_us (a CPU's "
                                 "tp 1: what selective and full recompute add to the block's "
                                 "forward + backward, [c0, c1, c2] as the forward's fit)",
                                 default_factory=dict)

    def check(self, path: str) -> None:
        for name, most in (("block_fwd_us", 3), ("block_bwd_us", 3), ("other_fwd_us", 2),
                           ("other_bwd_us", 2)):
            n = len(getattr(self, name))
            if not 1 <= n <= most:
                raise FieldError(f"{path}.{name}", f"expected 1 to {most} coefficients, got {n}")
        if self.host_us_per_token is not None and self.host_us is None:
            raise FieldError(f"{path}.host_us", "missing (host_us_per_token needs it)")
        if (self.device_us is None) != (self.host_us is None):
            raise FieldError(f"{path}.{'host_us' if self.host_us is None else 'device_us'}",
                             "missing (device_us and host_us come together)")
        for part in HOST_DEVICE_PARTS if self.device_us is not None else ():
            for name in ("device_us", "host_us"):
                if part not in getattr(self, name):
                    raise FieldError(f"{path}.{name}.{part}", "missing")
            most = 3 if part.startswith("block") else 2
            if not 1 <= len(self.device_us[part]) <= most:
                raise FieldError(f"{path}.device_us.{part}",
                                 f"expected 1 to {most} coefficients, got "
                                 f"{len(self.device_us[part])}")


HOST_DEVICE_PARTS = ("block_fwd", "block_bwd", "other_fwd", "other_bwd")


@dataclass(kw_only=True)
class MemoryPart(Record):
    """Memory of a block or of "other" on one rank of a TP group (bytes; sharded parts already
    divided by tp)."""

    param_bytes: float = doc("parameters")
    grad_bytes: float = doc("gradients")
    optim_bytes: float = doc("optimizer state")
    act_bytes_per_token: Dict[Recompute, float] = doc(
        "activations kept per token for each recompute mode, with sequence parallelism under TP "
        "and a vocab-parallel loss, at act_seq_len")
    act_seq_len: Optional[int] = doc("sequence length act_bytes_per_token was taken at; the "
                                     "model's seq_len when absent", default=None)
    act_bytes_fit: Optional[Dict[Recompute, Tuple[float, ...]]] = doc(
        "bytes per micro-batch c0 + c1 s + c2 s^2 per mode, so activations follow the searched "
        "sequence length", default=None)
    extras: Dict[str, Any] = doc("params, act_from, megatron_ratio", default_factory=dict)

    def check(self, path: str) -> None:
        missing = [m.value for m in Recompute if m not in self.act_bytes_per_token]
        if missing:
            raise FieldError(f"{path}.act_bytes_per_token.{missing[0]}", "missing")


@dataclass(kw_only=True)
class TpMemory(Record):
    block: MemoryPart = doc("one transformer block")
    other: MemoryPart = doc("embedding + final norm + LM head + loss (not split: the planner "
                            "puts half on the first stage, half on the last)")
    source: Optional[Source] = doc("measured or analytic", default=None)


@dataclass(kw_only=True)
class TokenFit(Record):
    """One MoE part against the tokens x it processes on one rank: time c0 + c1 x (us) and the
    bytes autograd keeps for its backward, c0 + c1 x (no and selective recompute; full
    recompute keeps only the block's input)."""

    fwd_us: Tuple[float, ...] = doc("[c0, c1]: forward")
    bwd_us: Tuple[float, ...] = doc("[c0, c1]: backward")
    act_bytes: Tuple[float, ...] = doc("[c0, c1]: activations kept for backward")
    tokens: List[int] = doc("the token counts profiled")
    max_rel_err: Optional[float] = doc("largest relative residual of the two time fits",
                                       default=None)
    source: Optional[Source] = doc("measured or analytic", default=None)
    extras: Dict[str, Any] = doc("rel_residuals", default_factory=dict)

    def check(self, path: str) -> None:
        for name in ("fwd_us", "bwd_us", "act_bytes"):
            n = len(getattr(self, name))
            if not 1 <= n <= 2:
                raise FieldError(f"{path}.{name}", f"expected 1 to 2 coefficients, got {n}")


@dataclass(kw_only=True)
class MoePoint(Record):
    """One timed MoE part at one token count (per micro-batch, one rank, us)."""

    part: MoePart = doc("routing, experts (per expert), shared, mlp")
    tokens: int = doc("tokens in: the rank's tokens (routing), one expert's tokens (experts), "
                      "the gathered sequence's tokens (shared, mlp)")
    split: int = doc("the width's split: etp (experts), tp (shared, mlp), 1 (routing)")
    fwd_us: float = doc("forward")
    bwd_us: float = doc("backward")
    act_bytes: float = doc("bytes kept for backward")
    source: Source = doc("measured, or FLOPs (and bytes) over a device sheet (analytic)")
    extras: Dict[str, Any] = doc("*_fastest_us, flops, iters, groups", default_factory=dict)


@dataclass(kw_only=True)
class MoeSection(Record):
    """A mixture-of-experts model's FFN parts (profiling/model/moe.py). The points' block is a
    dense block (attention + a SwiGLU of model.ffn); a MoE block costs that block - mlp +
    routing + its local experts x experts + shared (profiling/model/moe_costs.py)."""

    kernel: str = doc('how the experts compute: "loop" (one SwiGLU per expert, its GEMMs on '
                      'its own tokens; no grouped GEMM)')
    block: str = doc('what the points\' block is: "dense" (attention + SwiGLU of model.ffn)')
    experts_timed: int = doc("experts in each timed loop; expert times are per expert")
    routing: TokenFit = doc("router GEMM, softmax, top-k, aux loss, permute, unpermute, in the "
                            "rank's tokens (its sequence shard under TP)")
    experts: Dict[int, TokenFit] = doc("per etp: one expert's SwiGLU at width expert_ffn / "
                                       "etp, in the tokens that expert gets")
    shared: Optional[Dict[int, TokenFit]] = doc("per tp: the shared expert (width "
                                                "shared_expert_ffn / tp) in the gathered "
                                                "sequence's tokens; absent without one",
                                                default=None)
    mlp: Dict[int, TokenFit] = doc("per tp: the profiled block's SwiGLU (width ffn / tp) in "
                                   "the gathered sequence's tokens (the block less it is "
                                   "attention and norms)")
    points: List[MoePoint] = doc("what was timed", default_factory=list)
    source: Optional[Source] = doc("measured or analytic", default=None)
    extras: Dict[str, Any] = doc("anything else a producer adds", default_factory=dict)


@dataclass(kw_only=True)
class ModelProfile(Profile):
    """profiles/<cluster.name>/model/<model.name>.json (written by profile_model)."""

    KIND = "model"
    kind: str = doc("this file's kind", default="model")
    PRODUCER = "profile_model"

    model: ModelSummary = doc("the model profiled")
    points: List[ModelPoint] = doc("what was timed", default_factory=list)
    fits: Dict[int, TpFits] = doc('fits per tp (keys are strings in JSON: "1", "2", ...)')
    memory: Dict[int, TpMemory] = doc("memory per tp")
    parts: Optional[Dict[str, PartMade]] = doc(
        "per point (seq<S>_tp<T>) and MoE parts (moe): the settings it was made under",
                                     default=None)
    micro_batch_size: Optional[int] = doc("sequences per timed micro-batch", default=None)
    method: Optional[Dict[str, Any]] = doc("source and why, device sheet, timing and memory "
                                           "method (prose)", default=None)
    moe: Optional[MoeSection] = doc("mixture-of-experts models: the MoE FFN's parts",
                                    default=None)
    extras: Dict[str, Any] = doc("anything else a producer adds", default_factory=dict)
