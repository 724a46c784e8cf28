"""What a model profile says a mixture-of-experts FFN costs: pure functions of its "moe" section
(profiling/model/moe.py makes it), for the planner. No torch.

Every figure is c0 + c1 x of the tokens x the part processes on one rank, per micro-batch:
- routing: x = the rank's tokens (micro_batch x seq / tp with sequence parallelism; / cp);
- expert: x = the tokens one expert gets on this rank (after the EP all-to-all and the ETP
  all-gather: micro_batch x seq / tp x top_k / experts x ep x etp at uniform load), per expert
  (a rank with experts / ep experts pays that many);
- shared, mlp: x = the gathered sequence's tokens (micro_batch x seq under TP with SP; / cp).
A split (etp, tp) that was not profiled is priced from the nearest profiled one below it (else
the smallest), its per-token time scaled by their ratio (the width is split that much more);
its activation bytes per token as a + b / split through the profiled splits (the input is
whole on each rank, the intermediates split).
A MoE block then costs the profile's (dense) block - mlp + routing + its experts + shared
(`moe_block_delta_us`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from orchestrator.store.schema.model import ModelProfile, MoeSection, TokenFit


def _line(coeffs: Sequence[float], x: float) -> float:
    """c0 + c1 x + ... at x (a float, or a numpy array: the dynamic planner's micro-batches)."""
    if np.ndim(x):
        return sum(c * np.asarray(x, dtype=float) ** i for i, c in enumerate(coeffs))
    return float(sum(c * float(x) ** i for i, c in enumerate(coeffs)))


def _scaled(coeffs: Sequence[float], per_token_scale: float) -> Tuple[float, ...]:
    return tuple(c * (per_token_scale if i else 1.0) for i, c in enumerate(coeffs))


def _per_split_line(values: Mapping[int, float], split: int) -> float:
    """a + b / split through values per split (least squares), at `split`."""
    xs = [1.0 / s for s in values]
    ys = list(values.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
         / sum((x - mx) ** 2 for x in xs))
    return (my - b * mx) + b / split


def _fit_for(fits: Dict[int, TokenFit], split: int, what: str) -> Tuple[TokenFit, float]:
    """The fit for `split` ways and the factor its per-token terms take (1 when profiled)."""
    if split < 1:
        raise ValueError(f"{what}: split({split}) must be >= 1")
    if split in fits:
        return fits[split], 1.0
    below = [s for s in fits if s < split]
    near = max(below) if below else min(fits)
    return fits[near], near / split


@dataclass(frozen=True)
class MoeCosts:
    """The "moe" section of a model profile as functions (us, bytes; see the module doc)."""

    section: MoeSection

    @property
    def source(self) -> str:
        return str(self.section.source)

    @property
    def etps(self) -> Tuple[int, ...]:
        """The expert-TP degrees profiled (others are scaled from them)."""
        return tuple(sorted(self.section.experts))

    # ---------------------------------------------------------------- time (us)
    def routing_fwd_us(self, tokens: float) -> float:
        """Router, softmax, top-k, aux loss, permute and unpermute of the rank's `tokens`."""
        return _line(self.section.routing.fwd_us, tokens)

    def routing_bwd_us(self, tokens: float) -> float:
        return _line(self.section.routing.bwd_us, tokens)

    def routing_us(self, tokens: float) -> float:
        """routing forward + backward."""
        return self.routing_fwd_us(tokens) + self.routing_bwd_us(tokens)

    def _split_us(self, fits: Optional[Dict[int, TokenFit]], key: str, tokens: float,
                  split: int, what: str) -> float:
        if not fits:
            return 0.0
        fit, scale = _fit_for(fits, int(split), what)
        return _line(_scaled(getattr(fit, key), scale), tokens)

    def expert_fwd_us(self, tokens_per_expert: float, etp: int = 1) -> float:
        """One expert's SwiGLU GEMMs (width expert_ffn / etp) on `tokens_per_expert` tokens,
        forward, in the loop of per-expert GEMMs (its constant: one expert's launches and
        weight reads)."""
        return self._split_us(self.section.experts, "fwd_us", tokens_per_expert, etp, "etp")

    def expert_bwd_us(self, tokens_per_expert: float, etp: int = 1) -> float:
        return self._split_us(self.section.experts, "bwd_us", tokens_per_expert, etp, "etp")

    def expert_us(self, tokens_per_expert: float, etp: int = 1) -> float:
        """One expert forward + backward."""
        return (self.expert_fwd_us(tokens_per_expert, etp)
                + self.expert_bwd_us(tokens_per_expert, etp))

    def shared_fwd_us(self, tokens: float, tp: int = 1) -> float:
        """The shared expert (width shared_expert_ffn / tp) on the gathered `tokens`; 0 for a
        model without one."""
        return self._split_us(self.section.shared, "fwd_us", tokens, tp, "tp")

    def shared_bwd_us(self, tokens: float, tp: int = 1) -> float:
        return self._split_us(self.section.shared, "bwd_us", tokens, tp, "tp")

    def mlp_fwd_us(self, tokens: float, tp: int = 1) -> float:
        """The profiled dense block's SwiGLU (width ffn / tp) on the gathered `tokens`: what a
        MoE block does not run."""
        return self._split_us(self.section.mlp, "fwd_us", tokens, tp, "tp")

    def mlp_bwd_us(self, tokens: float, tp: int = 1) -> float:
        return self._split_us(self.section.mlp, "bwd_us", tokens, tp, "tp")

    def moe_block_delta_us(self, rank_tokens: float, gathered_tokens: float,
                           tokens_per_expert: float, local_experts: int, tp: int = 1,
                           etp: int = 1) -> Tuple[float, float]:
        """(forward, backward) us a MoE block takes beyond the profile's dense block on one
        rank: routing + local_experts x expert + shared - mlp (compute only; the dispatcher's
        all-to-alls and ETP collectives are the hardware profile's). Negative when the MoE FFN
        is cheaper than the dense MLP."""
        out = []
        for phase in ("fwd", "bwd"):
            routing = getattr(self, f"routing_{phase}_us")(rank_tokens)
            experts = local_experts * getattr(self, f"expert_{phase}_us")(tokens_per_expert, etp)
            shared = getattr(self, f"shared_{phase}_us")(gathered_tokens, tp)
            mlp = getattr(self, f"mlp_{phase}_us")(gathered_tokens, tp)
            out.append(routing + experts + shared - mlp)
        return out[0], out[1]

    # ---------------------------------------------------------------- memory (bytes)
    def routing_act_bytes(self, tokens: float) -> float:
        """Bytes routing keeps for backward (no or selective recompute) for the rank's tokens:
        router probabilities, indices, and the expert outputs and weighted copies it combines."""
        return _line(self.section.routing.act_bytes, tokens)

    def expert_act_bytes(self, tokens_per_expert: float, etp: int = 1) -> float:
        """Bytes one expert keeps for backward (its input and SwiGLU intermediates)."""
        return self._split_bytes(self.section.experts, tokens_per_expert, etp, "etp")

    def shared_act_bytes(self, tokens: float, tp: int = 1) -> float:
        return self._split_bytes(self.section.shared, tokens, tp, "tp")

    def mlp_act_bytes(self, tokens: float, tp: int = 1) -> float:
        return self._split_bytes(self.section.mlp, tokens, tp, "tp")

    def _split_bytes(self, fits: Optional[Dict[int, TokenFit]], tokens: float, split: int,
                     what: str) -> float:
        if not fits:
            return 0.0
        split = int(split)
        if split in fits:
            return _line(fits[split].act_bytes, tokens)
        if len(fits) < 2:
            raise ValueError(f"{what}={split}: activation bytes profiled at {what} "
                             f"{sorted(fits)} only; rerun stage=profile_model with a larger "
                             f"profile_model.max_tp")
        # The input is whole on every rank, the SwiGLU intermediates are split: each
        # coefficient is a + b / split (exact for these parts), solved from the profiled ones.
        coeffs = [_per_split_line({s: f.act_bytes[i] if i < len(f.act_bytes) else 0.0
                                   for s, f in fits.items()}, split) for i in range(2)]
        return _line(coeffs, tokens)

def moe_costs(profile: Union[ModelProfile, Mapping]) -> Optional[MoeCosts]:
    """The MoE costs of a model profile (a ModelProfile, or the file's dict); None for a dense
    model's profile or one made before profile_model timed MoE parts."""
    if isinstance(profile, ModelProfile):
        section = profile.moe
    else:
        raw = profile.get("moe")
        section = MoeSection.from_dict(raw, "moe") if raw is not None else None
    return MoeCosts(section) if section is not None else None
