"""Context parallelism: one sequence split over the `cp` ranks of a group, attention over all of it.

The split balances the causal mask (Megatron-Core's): the sequence is cut into 2 * cp equal
chunks and CP rank r keeps chunks r and 2cp - 1 - r, so that every rank holds as many early
(cheap) as late (expensive) queries. Everything but attention is per token and runs on the
rank's own tokens unchanged; rotary embeddings take the tokens' global positions.

Attention, flavour "allgather" (Megatron's `--cp-comm-type allgather`, what Llama 3 trained
with): the keys and values of the whole sequence are all-gathered over the CP group before the
attention core (its backward reduce-scatters their gradients), and each rank's queries attend to
them under the causal mask of their global positions. Per layer and micro-batch a rank receives
(cp - 1) / cp of the sequence's K and V (2 x b x s x kv_heads/tp x head_dim elements in all)
forward and sends as much of their gradients backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def chunk_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions (int64, ascending) of the tokens CP rank `cp_rank` of `cp` keeps: chunks
    cp_rank and 2cp - 1 - cp_rank of 2cp equal chunks. ValueError unless 2cp divides seq_len."""
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank({cp_rank}) must be in 0..cp({cp})-1")
    if seq_len % (2 * cp):
        raise ValueError(f"seq_len({seq_len}) % (2 * cp({cp})) != 0: context parallelism cuts "
                         f"the sequence into 2 * cp equal chunks")
    size = seq_len // (2 * cp)
    first, second = cp_rank * size, (2 * cp - 1 - cp_rank) * size
    return torch.cat([torch.arange(first, first + size), torch.arange(second, second + size)])


@dataclass
class ContextParallel:
    """This rank's share of a context-parallel sequence: its CP group, and the global positions
    of its tokens and of the gathered sequence's (every rank's chunks, in CP-rank order)."""

    group: object  # the CP process group
    cp: int
    cp_rank: int
    positions: torch.Tensor  # (seq_len / cp,) this rank's tokens
    gathered_positions: torch.Tensor  # (seq_len,) the all-gathered K/V's tokens, in order

    @classmethod
    def of(cls, group, seq_len: int) -> "ContextParallel":
        import torch.distributed as dist

        cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
        gathered = torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)])
        return cls(group, cp, cp_rank, chunk_positions(seq_len, cp, cp_rank), gathered)

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (tokens, targets, a full activation)."""
        return x.index_select(dim, self.positions.to(x.device))

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor):
        """The rotary tables at this rank's tokens' positions."""
        index = self.positions.to(cos.device)
        return cos.index_select(0, index), sin.index_select(0, index)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys and values:
        q, k, v (batch, heads, local seq, head_dim), K/V heads may be fewer (GQA)."""
        from torch.distributed._functional_collectives import all_gather_tensor_autograd

        k_all, v_all = (all_gather_tensor_autograd(t.contiguous(), gather_dim=2, group=self.group)
                        for t in (k, v))
        mask = (self.positions[:, None] >= self.gathered_positions[None, :]).to(q.device)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
