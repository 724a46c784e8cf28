"""A decoder-only transformer in plain PyTorch, readable top to bottom.

    tokens -> tok_emb -> blocks[0..L) -> norm -> lm_head -> logits (-> cross-entropy loss)
    Block:  x = x + attn(attn_norm(x));  x = x + mlp(mlp_norm(x))

The model knows nothing about how it is split: tensor/sequence parallelism and the pipeline split
are applied from outside (orchestrator/models/parallelize.py). For that, every module reads local
sizes (heads on this rank) from the tensors it sees, never from the global config.
"""

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from orchestrator.choices import Dtype
from orchestrator.models.config import ModelConfig, is_moe_block, validate_model, vocab_rows
from orchestrator.models.loss import IGNORE_INDEX, token_losses  # noqa: F401 (IGNORE_INDEX:
# padding of variable-length samples, which counts in no loss; imported from here)
from orchestrator.models.moe import MoE
from orchestrator.models.projections import each_linear



def torch_dtype(name) -> torch.dtype:
    """The torch dtype for a config dtype (a Dtype, or a name such as "bf16" or "bfloat16")."""
    return Dtype.parse(name).torch


class Rotary(nn.Module):
    """Cos/sin tables for rotary position embeddings, shape (seq_len, head_dim / 2), float32.

    One instance is shared by the model and its pipeline stages, so a stage moved off the meta
    device can rebuild the tables with `reset()`.
    """

    def __init__(self, head_dim: int, seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.seq_len, self.theta = head_dim, seq_len, theta
        self.register_buffer("cos", torch.empty(seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(seq_len, head_dim // 2), persistent=False)
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        if self.cos.is_meta:
            return
        inv_freq = 1.0 / self.theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        angles = torch.outer(torch.arange(self.seq_len).float(), inv_freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x (batch, seq, heads, head_dim) by position:
    cos/sin the tables (positions 0.., seq_len, head_dim / 2), or per token (batch, seq,
    head_dim / 2: packed rows, each sample's positions from 0, `packed_rows`)."""
    seq = x.shape[1]
    if cos.dim() == 3:
        cos, sin = cos[:, :seq, None, :], sin[:, :seq, None, :]
    else:
        cos, sin = cos[:seq, None, :], sin[:seq, None, :]  # broadcast over heads
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return rotated.type_as(x)


def _attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _masked_attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor) -> torch.Tensor:
    """Attention under a boolean mask (batch, 1, seq, seq), True where a query may attend:
    packed rows' block-diagonal causal mask (`packed_rows`)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def packed_rows(segments: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What attention needs for rows that hold several samples back to back (packed rows, as
    Megatron's --reset-attention-mask --reset-position-ids): `segments` (batch, seq) int gives
    each token's sample within its row, non-decreasing along the row (a row's padding is a
    segment of its own). Returns the rotary tables at each token's position within its own
    sample (cos, sin: batch, seq, head_dim / 2) and the block-diagonal causal mask (batch, 1,
    seq, seq) bool: a token attends to the tokens of its own sample up to itself, so each
    sample computes what it would alone. The mask is dense: attention still computes the whole
    row (seq^2 per row, as the planner prices a packed row)."""
    seq = segments.shape[1]
    index = torch.arange(seq, device=segments.device)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.cummax(torch.where(starts, index, 0), dim=1).values
    positions = index - first  # (batch, seq), from 0 in each sample
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segments.device).tril()
    return cos[positions], sin[positions], (same & causal).unsqueeze(1)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads (kv_heads <= heads) and rotary embeddings."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        kv_dim = cfg.kv_heads * self.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wk = nn.Linear(cfg.hidden, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        # Selective recompute (set from outside, train): the attention core's activations are
        # not kept; backward reruns it (Megatron's --recompute-granularity selective).
        self.recompute_core = False
        # Context parallelism (set from outside, train): this rank holds some of each
        # sequence's tokens (models/context_parallel.ContextParallel), attends to all of them.
        self.context = None
        # How the input projections run (set from outside: sequence parallelism's own).
        self.project = each_linear

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: None, causal over the whole sequence; else packed rows' boolean mask (batch,
        1, seq, seq) with cos/sin per token (`packed_rows`)."""
        batch, seq, _ = x.shape
        if mask is not None and self.context is not None:
            raise ValueError("packed rows (a block-diagonal attention mask) are not supported "
                             "under context parallelism")
        # -1: the number of heads on this rank (all of them, or heads / tp after column sharding).
        q, k, v = (t.view(batch, seq, -1, self.head_dim)
                   for t in self.project(x, (self.wq, self.wk, self.wv)))
        if self.context is not None:
            cos, sin = self.context.rotary(cos, sin, seq)  # at this rank's tokens' positions
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        core = _attention_core if self.context is None else self.context.attention
        args = (q, k, v)
        if mask is not None:
            core, args = _masked_attention_core, (q, k, v, mask)
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(core, *args, use_reentrant=False)
        else:
            out = core(*args)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up keeping only gate and up for the backward, which recomputes the silu
    (Megatron's fused SwiGLU); autograd's op by op would keep silu(gate) as well."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        # Two tensors of the FFN's width beside the saved ones and `grad`, in place (the two
        # gradients it returns: what the workload model's backward working set counts); op by
        # op it held five. d silu / d gate = sigmoid (1 + gate (1 - sigmoid)).
        sigmoid = torch.sigmoid(gate)
        grad_gate = torch.sub(1, sigmoid).mul_(gate).add_(1).mul_(sigmoid).mul_(up).mul_(grad)
        grad_up = sigmoid.mul_(gate).mul_(grad)  # grad x silu(gate)
        return grad_gate, grad_up


class MLP(nn.Module):
    """SwiGLU feed-forward: w_down(silu(w_gate(x)) * w_up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w_gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w_up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w_down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)
        self.project = each_linear  # as Attention.project

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project(x, (self.w_gate, self.w_up))
        return self.w_down(SwiGLU.apply(gate, up))


class Block(nn.Module):
    """One pre-norm transformer layer. forward(x, cos, sin) -> x of the same shape. Block
    `index` of a mixture-of-experts model has a MoE FFN (models/moe.py) in place of the MLP."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = MoE(cfg) if is_moe_block(cfg, index) else MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """`mask`: packed rows' attention mask, cos/sin then per token (`packed_rows`)."""
        if mask is None:
            x = x + self.attn(self.attn_norm(x), cos, sin)
        else:  # a keyword: tensor parallelism's PrepareModuleInput takes (x, cos, sin) only
            x = x + self.attn(self.attn_norm(x), cos, sin, mask=mask)
        return x + self.mlp(self.mlp_norm(x))


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor,
                       fused: bool = False) -> torch.Tensor:
    """Mean next-token loss (nats) of logits (batch, seq, vocab) against targets (batch, seq),
    over the targets that are not IGNORE_INDEX.

    Also the `loss_fn` for a pipeline schedule; vocab-sharded DTensor logits give the
    vocab-parallel loss (models/loss.py: in chunks, never the whole fp32 logits).
    """
    return token_loss_sum(logits, targets, fused) / (targets != IGNORE_INDEX).sum()


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor,
                   fused: bool = False) -> torch.Tensor:
    """Summed next-token loss (nats) over the targets that are not IGNORE_INDEX (padding):
    micro-batches of different sizes add up to the sum a whole batch's token mean divides.
    `fused`: the loss one compiled call each way (models/loss.py; where train compiles)."""
    return token_losses(logits, targets, fused=fused).sum()


class GPT(nn.Module):
    """The whole model. `GPT(cfg)` under `torch.device("meta")` allocates nothing (for counting).

    Parameters are created in `cfg.dtype` and initialised deterministically from `seed`. The
    embedding and LM head have `vocab_rows(cfg, tp)` rows: the vocabulary padded for `tp` TP
    ranks (Megatron's --make-vocab-size-divisible-by; cfg.vocab where nothing pads).
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0, tp: int = 1):
        super().__init__()
        validate_model(cfg)
        self.cfg = cfg
        rows = vocab_rows(cfg, tp)
        dtype = torch_dtype(cfg.dtype)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            self.tok_emb = nn.Embedding(rows, cfg.hidden)
            self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
            self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.hidden, rows, bias=False)
        finally:
            torch.set_default_dtype(default_dtype)
        self.rope = Rotary(cfg.hidden // cfg.heads, cfg.seq_len, cfg.rope_theta)
        self.fused_loss = False  # head_loss's loss compiled (models/loss.py)
        self.init_weights(seed)

    def init_weights(self, seed: int = 0) -> None:
        """(Re)initialise every parameter not on the meta device; see `init_parameters`."""
        init_parameters(self, self.cfg, seed)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> hidden states (batch, seq, hidden)."""
        return self.tok_emb(tokens)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states (batch, seq, hidden) -> logits (batch, seq, vocab)."""
        return self.lm_head(self.norm(h))

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Hidden states and targets (batch, seq) -> mean cross-entropy loss (scalar); the
        loss compiled when `fused_loss` is set (profile_model, where train compiles)."""
        return cross_entropy_loss(self.head(h), targets, self.fused_loss)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        """Loss (scalar) if targets are given, else logits (batch, seq, vocab). `segments`
        (batch, seq) int: rows of samples packed back to back, each token's sample in its row;
        each sample then attends only to itself, its positions from 0 (`packed_rows`)."""
        cos, sin = self.rope()
        extra = ()
        if segments is not None:
            cos, sin, mask = packed_rows(segments, cos, sin)
            extra = (mask,)
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, cos, sin, *extra)
        logits = self.head(h)
        return logits if targets is None else cross_entropy_loss(logits, targets)


@torch.no_grad()
def init_parameters(module: nn.Module, cfg: ModelConfig, seed: int = 0) -> None:
    """Initialise the GPT parameters of `module` (a GPT or a pipeline stage of one) in place.

    Each parameter's values depend only on (seed, its name, its shape, the device kind that
    draws them: `draw_device`), so a pipeline stage or a tensor-parallel shard initialised on
    its own gets exactly the values of the whole model. Norm weights are ones; output
    projections (wo, w_down) use std 0.02 / sqrt(2 * layers) (GPT-2); everything else std 0.02.
    Parameters still on the meta device are skipped.
    """
    for name, param in module.named_parameters():
        if param.is_meta:
            continue
        device = draw_device(param)
        if "norm" in name:
            full = torch.ones(param.shape, device=device)
        else:
            output_proj = name.endswith(("wo.weight", "w_down.weight", "experts.w_down"))
            std = 0.02 / math.sqrt(2 * cfg.layers) if output_proj else 0.02
            key = seed * 1_000_003 + zlib.crc32(name.encode())
            generator = torch.Generator(device=device).manual_seed(key)
            full = torch.randn(param.shape, generator=generator, device=device).mul_(std)
        _copy_full_into(param, full)
    for sub in module.modules():
        if isinstance(sub, Rotary):
            sub.reset()


def draw_device(param: torch.Tensor) -> torch.device:
    """Where a parameter's initial values are drawn: on its GPU (drawn on the CPU, a 7B model's
    values took ~8 CPU-s a rank, each rank of a TP group drawing every tensor whole, then a
    copy over PCIe), else on the CPU. A GPU draws other values than a CPU for the same seed
    (Philox against Mersenne Twister); every GPU of one kind draws the same, so the ranks of
    a job agree whatever the layout."""
    return param.device if param.device.type == "cuda" else torch.device("cpu")


def _copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy a whole (unsharded) tensor into a parameter, or into this rank's shard of a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # Every rank computed the same full tensor: take the local shard without communication.
        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full)
