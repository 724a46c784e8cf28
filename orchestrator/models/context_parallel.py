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


class ContextParallel:
    """This rank's share of context-parallel sequences: its CP group, and for a sequence of
    `seq_len` tokens the global positions of its tokens and of the all-gathered sequence's (every
    rank's chunks, in CP-rank order)."""

    def __init__(self, group):
        import torch.distributed as dist

        self.group = group
        self.cp, self.cp_rank = dist.get_world_size(group), dist.get_rank(group)
        self._positions = {}

    def positions(self, seq_len: int) -> torch.Tensor:
        """(seq_len / cp,) the global positions of this rank's tokens."""
        return self._both(seq_len)[0]

    def gathered_positions(self, seq_len: int) -> torch.Tensor:
        """(seq_len,) the global positions of the all-gathered tokens, in gathered order."""
        return self._both(seq_len)[1]

    def _both(self, seq_len: int):
        if seq_len not in self._positions:
            gathered = torch.cat([chunk_positions(seq_len, self.cp, r) for r in range(self.cp)])
            self._positions[seq_len] = (chunk_positions(seq_len, self.cp, self.cp_rank), gathered)
        return self._positions[seq_len]

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (tokens, targets, a full activation)."""
        return x.index_select(dim, self.positions(x.shape[dim]).to(x.device))

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor, local_len: int):
        """The rotary tables at the positions of this rank's `local_len` tokens."""
        index = self.positions(local_len * self.cp).to(cos.device)
        return cos.index_select(0, index), sin.index_select(0, index)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys and values:
        q, k, v (batch, heads, local seq, head_dim), K/V heads may be fewer (GQA)."""
        from torch.distributed import _functional_collectives as funcol

        # torch 2.13's name; the GPU image's 2.11 has only the older one
        gather = getattr(funcol, "all_gather_single_autograd", None) or \
            funcol.all_gather_tensor_autograd
        seq_len = q.shape[2] * self.cp
        k_all, v_all = (gather(t.contiguous(), gather_dim=2, group=self.group) for t in (k, v))
        mask = (self.positions(seq_len)[:, None]
                >= self.gathered_positions(seq_len)[None, :]).to(q.device)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
