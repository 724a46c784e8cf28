"""ModelCost: a model profile (orchestrator.store.schema) as the cost model asks it, "how long does
a transformer block take at this sequence length and tensor-parallel degree, and how much memory
does it hold", from the profile's fits per TP degree (TpFit: one call's time, host and device
apart on a GPU) and memory per part (PartMemory). Built from the validated profile dataclass
(`from_profile`; `from_dict` validates a loaded JSON dict first); holds no file handles.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

import numpy as np

from orchestrator.choices import Dtype
from orchestrator.commands import rerun_command
from orchestrator.errors import ProfileError
from orchestrator.planner.calibration import Concurrency
from orchestrator.store import parse_profile
from orchestrator.store.schema import MemoryPart, ModelProfile
from orchestrator.workload.moe import MoeShape


@dataclass(frozen=True)
class PartMemory:
    """Memory of one part (a transformer block or "other") on one rank of a TP group.
    act_bytes_per_token holds the figures at act_seq_len; act_bytes_fit, when the profile has it,
    is bytes per micro-batch as [c0, c1, c2] in seq_len, used to move to other lengths."""

    param_bytes: float
    grad_bytes: float
    optim_bytes: float
    act_bytes_per_token: Mapping[str, float]  # keys none | selective | full
    act_seq_len: int = 0
    act_bytes_fit: Optional[Mapping[str, Tuple[float, ...]]] = None

    def act_bytes_per_token_at(self, mode: str, seq_len: float) -> float:
        """Activation bytes per token at `seq_len`: the profiled figure scaled by the fit's
        bytes-per-token ratio between `seq_len` and the profiled length (constant without a
        fit, as with flash attention)."""
        per_token = self.act_bytes_per_token[mode]
        fit = (self.act_bytes_fit or {}).get(mode)
        if not fit or not self.act_seq_len:
            return per_token
        at_profiled = _poly(fit, self.act_seq_len) / self.act_seq_len
        if at_profiled <= 0:
            return per_token
        scaled = per_token * (_poly(fit, seq_len) / seq_len) / at_profiled
        if np.ndim(scaled) == 0:
            return per_token if seq_len == self.act_seq_len else float(scaled)
        return np.where(np.asarray(seq_len) == self.act_seq_len, per_token, scaled)


@dataclass(frozen=True)
class TpFit:
    block_fwd: Tuple[float, float, float]  # c0 + c1 s + c2 s^2, us per sequence
    block_bwd: Tuple[float, float, float]
    other_fwd: Tuple[float, float]  # c0 + c1 s
    other_bwd: Tuple[float, float]
    block_optim_us: float = 0.0  # optimizer step (clip, AdamW, copy) of a block, one rank
    other_optim_us: float = 0.0  # of the other parts' (0: not profiled, e.g. analytic)
    # A GPU profile's device time alone per part (block_fwd, ...: coefficients as the fits') and
    # the host's time to issue a call (us); None where they are not told apart (CPU, analytic).
    device: Optional[Mapping[str, Tuple[float, ...]]] = None
    host: Optional[Mapping[str, float]] = None
    host_per_token: Optional[Mapping[str, float]] = None  # us per token of a call (None: 0)
    # What selective and full recompute add to a block's forward + backward, timed as train
    # runs them (a CPU's tp 1: fits.recompute_us); None: priced from the FLOPs instead.
    recompute: Optional[Mapping[str, Tuple[float, ...]]] = None
    # An analytic profile's (block, other) train gradient add per micro-batch (us), which a
    # measured profile's backward already holds (0: measured, or no hbm_GBps on the sheet)
    grad_add_us: Tuple[float, float] = (0.0, 0.0)

    def coeffs(self, part: str) -> Tuple[float, ...]:
        """The coefficients that price `part`'s work per sequence (block_fwd, ...): the
        device's where the profile tells it from the host, else the fit's."""
        return self.device[part] if self.device is not None else getattr(self, part)

    def call_us(self, part: str, s, batch=1.0):
        """Time (us) of one call of `part` (block_fwd, block_bwd, other_fwd, other_bwd) on
        `batch` sequences of `s` tokens (floats or numpy arrays). A GPU profile (host and
        device apart): max(host, device), since the host issues the next kernels while the
        device runs the last ones; the device's constant once per call, the rest per
        sequence. Otherwise (a CPU, where the host runs the kernels; analytic and older
        profiles) the fit's constant once per call and the rest per sequence (_poly)."""
        if self.host is None:
            return _poly(getattr(self, part), s, batch)
        value = np.maximum(self.host_us(part, s, batch), self.device_us(part, s, batch))
        return float(value) if np.ndim(value) == 0 else value

    def device_us(self, part: str, s, batch=1.0):
        """A GPU profile's device time of one call of `part` on `batch` sequences of `s`
        tokens: its constant once, the rest per sequence."""
        return _poly(self.device[part], s, batch)

    def host_us(self, part: str, s, batch=1.0):
        """A GPU profile's host time to issue one call of `part` on `batch` sequences of `s`
        tokens: its constant plus its per-token term (0 but where the profile found one)."""
        per_token = (self.host_per_token or {}).get(part, 0.0)
        return self.host[part] + per_token * batch * s if per_token else self.host[part]

    def full_rerun_us(self, s, batch=1.0):
        """What full recompute adds to a block's backward call on a GPU profile (host and
        device apart): the backward reruns the forward inside the one call, so the host issues
        both while the device runs both, max(host fwd + bwd, device fwd + bwd), less the
        backward's own call. A host-bound forward before a device-bound backward (micro-batch
        1: 1,956 us host against 1,240 on the device for a llama2_7b block at 2,048 on an
        H200) reruns under the backward's kernels for less than its own call. None without
        the split (the FLOPs price one more forward)."""
        if self.host is None:
            return None
        fwd, bwd = (self.device_us(part, s, batch) for part in ("block_fwd", "block_bwd"))
        host_fwd, host_bwd = (self.host_us(part, s, batch) for part in ("block_fwd", "block_bwd"))
        value = np.maximum(host_fwd + host_bwd, fwd + bwd) - np.maximum(host_bwd, bwd)
        return float(value) if np.ndim(value) == 0 else value


def _poly(coeffs: Tuple[float, ...], s, batch=1.0):
    """The polynomial at s (a float or a numpy array), never below 0; for a call on `batch`
    sequences at once, its constant once (a call's own cost: kernel launches, the host's
    Python) and the rest `batch` times."""
    value = np.maximum(0.0, coeffs[0] + batch * sum(c * s ** i for i, c in enumerate(coeffs)
                                                    if i > 0))
    return float(value) if np.ndim(value) == 0 else value


def _part_memory(part: MemoryPart, model_seq_len: int) -> PartMemory:
    """The planner's view of a profile's MemoryPart (keys as plain mode names)."""
    fit = part.act_bytes_fit
    return PartMemory(part.param_bytes, part.grad_bytes, part.optim_bytes,
                      {m.value: b for m, b in part.act_bytes_per_token.items()},
                      part.act_seq_len if part.act_seq_len is not None else model_seq_len,
                      None if fit is None else {m.value: c for m, c in fit.items()})


class ModelCost:
    """Compute time and memory of a transformer from a model profile, per tensor-parallel degree.

    Times are per micro-batch of ONE sequence in us (callers multiply by the micro-batch size) and
    do not include tensor-parallel communication (the cost model adds it from the hardware
    profile). Fits are quadratic in seq_len for a block (attention's s^2 term), linear for
    "other" (embedding + final norm + LM head + loss); a fit that dips below zero is clamped at 0.

    Activation memory (`act_bytes_per_token`) is read as the sequence-parallel figure at that tp
    (profile_model measures with sequence parallelism on: every activation sharded over the tp
    group), moved to other sequence lengths with the profile's `act_bytes_fit` when present; a
    layout without sequence parallelism adds the part that sequence parallelism would shard (see
    planner.terms.memory).
    """

    def __init__(self, name: str, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int,
                 vocab: int, seq_len: int, dtype: str, fits: Mapping[int, TpFit],
                 memory: Mapping[int, Tuple[PartMemory, PartMemory]],
                 concurrency: Optional[Concurrency] = None, moe: Optional[MoeShape] = None,
                 make_vocab_size_divisible_by: int = 1):
        self.name = name
        # The experts of a mixture-of-experts model (None: dense; with_moe): planner/terms/moe.py
        # prices a layout's MoE blocks from the profiled (dense) block and them.
        self.moe = moe
        # profile_model's MoE parts (routing, one expert per tokens, shared expert, the dense
        # MLP its block has), None for a dense profile or one written before them:
        # profiling/model/moe_costs.MoeCosts
        self.moe_costs = None
        # How many ranks computed at once when the times were taken (the contention term).
        self.concurrency = concurrency
        self.hidden = int(hidden)
        self.ffn = int(ffn)
        self.layers = int(layers)
        self.heads = int(heads)
        self.kv_heads = int(kv_heads)
        self.vocab = int(vocab)
        # The embedding and LM head hold vocab padded for each tp (models/config.vocab_rows).
        self.make_vocab_size_divisible_by = int(make_vocab_size_divisible_by or 1)
        self.seq_len = int(seq_len)
        try:
            self.dtype = Dtype.parse(dtype)
        except ValueError as e:
            raise ProfileError(f"model profile {name}: {e}") from None
        self.dtype_bytes = self.dtype.bytes
        self._fits = dict(fits)
        self._memory = dict(memory)
        self.tps = tuple(sorted(set(self._fits) & set(self._memory)))

    @classmethod
    def from_profile(cls, profile: ModelProfile) -> "ModelCost":
        """Build from a validated model profile."""
        from orchestrator.profiling.model.fit import GRAD_ADD_KEYS

        m = profile.model
        fits = {tp: TpFit(f.block_fwd_us, f.block_bwd_us, f.other_fwd_us, f.other_bwd_us,
                          float(f.extras.get("block_optim_us", 0.0)),
                          float(f.extras.get("other_optim_us", 0.0)), f.device_us, f.host_us,
                          f.host_us_per_token, f.extras.get("recompute_us"),
                          tuple(float(f.extras.get(k, 0.0)) for k in GRAD_ADD_KEYS))
                for tp, f in profile.fits.items()}
        memory = {tp: (_part_memory(mem.block, m.seq_len), _part_memory(mem.other, m.seq_len))
                  for tp, mem in profile.memory.items()}
        from orchestrator.profiling.model.moe_costs import moe_costs

        cost = cls(name=m.name, hidden=m.hidden, ffn=m.ffn, layers=m.layers, heads=m.heads,
                   kv_heads=m.kv_heads, vocab=m.vocab, seq_len=m.seq_len, dtype=m.dtype,
                   fits=fits, memory=memory,
                   concurrency=Concurrency.from_method(profile.method),
                   make_vocab_size_divisible_by=m.make_vocab_size_divisible_by or 1)
        cost.moe_costs = moe_costs(profile)
        return cost

    @classmethod
    def from_dict(cls, model_profile: Mapping[str, Any]) -> "ModelCost":
        """Build from a loaded model profile dict (validated as a ModelProfile)."""
        return cls.from_profile(parse_profile(model_profile, ModelProfile, "model profile"))

    def with_moe(self, cfg) -> "ModelCost":
        """This profile for the model `cfg` (a ModelConfig or its DictConfig): a copy carrying
        its experts (MoeShape), or itself for a dense model. ValueError when cfg's MoE fields
        are inconsistent (models/config.validate_moe)."""
        from orchestrator.models.config import validate_moe

        validate_moe(cfg)
        shape = MoeShape.of(cfg)
        if shape is None:
            return self
        if shape.hidden != self.hidden or shape.layers != self.layers:
            raise ValueError(f"model {getattr(cfg, 'name', '?')} (hidden {shape.hidden}, "
                             f"layers {shape.layers}) is not the profiled {self.name} (hidden "
                             f"{self.hidden}, layers {self.layers})")
        twin = copy.copy(self)
        twin.moe = shape
        return twin

    def block_linear_us(self, seq_len: float, tp: int, batch=1.0) -> Tuple[float, float]:
        """(forward, backward): the part (us) of one block's time linear in its tokens for
        `batch` sequences, the fits' c1 x s term: its matmuls (what a MoE block's experts
        scale)."""
        fit = self._fit(tp)
        fwd, bwd = fit.coeffs("block_fwd"), fit.coeffs("block_bwd")
        fwd = fwd[1] if len(fwd) > 1 else 0.0
        bwd = bwd[1] if len(bwd) > 1 else 0.0
        return batch * max(0.0, fwd) * seq_len, batch * max(0.0, bwd) * seq_len

    def _at_tp(self, table: dict, what: str, tp: int):
        """table[tp], else a ProfileError naming the degrees profiled and the command that
        profiles `tp`."""
        if tp not in table:
            raise ProfileError(f"model profile {self.name} has no {what} for tp={tp} (profiled: "
                               f"{sorted(table)}); rerun "
                               f"`{rerun_command('profile_model', f'profile_model.max_tp={tp}')}`")
        return table[tp]

    def _fit(self, tp: int) -> TpFit:
        return self._at_tp(self._fits, "fit", tp)

    def block_fwd_us(self, seq_len: float, tp: int, batch=1.0) -> float:
        """Forward time (us) of one transformer block for a micro-batch of `batch` sequences of
        `seq_len` tokens (one call: TpFit.call_us)."""
        return self._fit(tp).call_us("block_fwd", seq_len, batch)

    def block_bwd_us(self, seq_len: float, tp: int, batch=1.0) -> float:
        """Backward time (us) of one block for `batch` sequences (no recompute)."""
        return self._fit(tp).call_us("block_bwd", seq_len, batch)

    def attention_core_fwd_us(self, seq_len: float, tp: int) -> float:
        """The quadratic (s^2) term of the block forward fit in us (the device's on a GPU
        profile): the attention score/softmax/value product that selective recompute reruns."""
        coeffs = self._fit(tp).coeffs("block_fwd")
        return max(0.0, coeffs[2] if len(coeffs) > 2 else 0.0) * seq_len ** 2

    def recompute_us(self, mode: str, seq_len: float, tp: int, batch=1.0) -> Optional[float]:
        """What recompute `mode` (selective, full) adds to one block's forward + backward for a
        micro-batch of `batch` sequences: as profile_model timed it (a CPU's tp 1; a call's
        constant once); full on a GPU profile, the forward rerun inside the backward's call
        (TpFit.full_rerun_us); None where the FLOPs price it (selective on a GPU, analytic,
        a CPU's tp > 1)."""
        fit = self._fit(tp)
        coeffs = (fit.recompute or {}).get(mode)
        if coeffs is not None:
            return _poly(coeffs, seq_len, batch)
        return fit.full_rerun_us(seq_len, batch) if mode == "full" else None

    def other_fwd_us(self, seq_len: float, tp: int, batch=1.0) -> float:
        """Forward time (us) of embedding + final norm + LM head + loss for `batch`
        sequences."""
        return self._fit(tp).call_us("other_fwd", seq_len, batch)

    def other_bwd_us(self, seq_len: float, tp: int, batch=1.0) -> float:
        """Backward time (us) of "other" for `batch` sequences."""
        return self._fit(tp).call_us("other_bwd", seq_len, batch)

    def grad_add_us(self, tp: int) -> Tuple[float, float]:
        """(block, other): train's add of one micro-batch's gradients into its fp32 buckets
        (us, one rank of a TP group of `tp`), where the profile has it apart (an analytic one);
        (0, 0) where its backward holds it (measured) or it is unknown."""
        return self._fit(tp).grad_add_us

    def optimizer_us(self, tp: int) -> Tuple[float, float]:
        """(block, other): one optimizer step (us: norm, clipping, AdamW, parameter copy) of the
        part's parameters on one rank of a TP group of size `tp`, unsharded by ZeRO; (0, 0) when
        the profile has no such figure."""
        fit = self._fit(tp)
        return fit.block_optim_us, fit.other_optim_us

    def memory(self, tp: int) -> Tuple[PartMemory, PartMemory]:
        """(block, other) memory per rank of a TP group of size `tp`."""
        return self._at_tp(self._memory, "memory", tp)
