"""Model shape as plain values, its validation, and analytic parameter counts.

Kept free of torch so the CLI and the planner can import it cheaply.
"""

import math
from dataclasses import dataclass, fields
from typing import Optional

from orchestrator.choices import Dtype


@dataclass
class ModelConfig:
    """A decoder-only transformer (Llama-style: RMSNorm, GQA + RoPE, SwiGLU, untied head).

    Defaults are the tiny model that runs anywhere in seconds. Code reading a config accepts this
    dataclass or an OmegaConf DictConfig of it, so it uses fields only (no properties).

    Mixture of experts (models/moe.py) when `experts` > 0: every block after the first
    `dense_layers` replaces its FFN by `experts` SwiGLU experts of width `expert_ffn`, each token
    sent to its `top_k` highest-scoring ones (softmax router, the k weights renormalised), plus
    a shared expert of width `shared_expert_ffn` every token goes through (0: none). The dense
    blocks keep `ffn`. `capacity_factor` None is dropless; a number c caps each expert at
    ceil(tokens x top_k / experts x c) of a routing group's tokens (the rest dropped, as
    Megatron's). `aux_loss_coef` weighs the sequence-wise load-balancing loss (DeepSeek-V3's).

    `make_vocab_size_divisible_by` (Megatron-LM's flag of that name): the embedding and the LM
    head have `padded_vocab` rows, `vocab` rounded up to a multiple of it x the TP degree, so a
    vocabulary of any size splits over TP (GPT-2's 50257); the data and the loss's labels stay
    below `vocab`, the padded rows are ordinary parameters. Default 1: pad only what TP needs
    (nothing where tp divides `vocab`); Megatron's own default is 128.
    """

    name: str = "tiny"
    hidden: int = 128
    ffn: int = 384
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    seq_len: int = 256
    dtype: Dtype = Dtype.fp32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    experts: int = 0  # 0: a dense model
    top_k: int = 2
    expert_ffn: int = 0  # 0: ffn
    shared_expert_ffn: int = 0
    dense_layers: int = 0  # the first blocks keep a dense FFN (DeepSeek-V3: 3)
    capacity_factor: Optional[float] = None  # None: dropless
    aux_loss_coef: float = 0.01
    make_vocab_size_divisible_by: int = 1  # Megatron's 128 pads further (vocab_rows)

    def __post_init__(self) -> None:
        try:  # "bfloat16" and "bf16" name one dtype
            self.dtype = Dtype.parse(self.dtype)
        except ValueError:
            pass  # validate_model names it, with the other shape errors


def model_fields(cfg: ModelConfig) -> dict:
    """{field: value} of `cfg` as JSON values (the dtype by its name)."""
    return {f.name: getattr(getattr(cfg, f.name), "value", getattr(cfg, f.name))
            for f in fields(cfg)}


def padded_vocab(vocab: int, tp: int, divisible_by: int = 1) -> int:
    """The embedding's and LM head's rows for a vocabulary of `vocab` tokens on `tp` TP ranks:
    `vocab` rounded up to a multiple of divisible_by x tp (Megatron-LM's
    _vocab_size_with_padding, --make-vocab-size-divisible-by). The one rule every part that
    sizes the vocabulary uses (through `vocab_rows`)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def vocab_rows(cfg, tp: int = 1) -> int:
    """`padded_vocab` of a model (a ModelConfig, its DictConfig, a profile's ModelSummary or the
    planner's ModelCost: anything with `vocab` and, optionally, `make_vocab_size_divisible_by`,
    absent or None: 1) on `tp` TP ranks."""
    return padded_vocab(cfg.vocab, tp, getattr(cfg, "make_vocab_size_divisible_by", None) or 1)


def validate_model(cfg: ModelConfig, tp: int = 1, seq_len_key: str = "model.seq_len") -> None:
    """Raise ValueError naming the offending numbers if `cfg` cannot be built or split over `tp` ranks.

    With tensor parallelism, query and KV heads and the FFN width are split over tp, and so is the
    sequence (sequence parallelism); the vocabulary (vocab-parallel embedding and head) is padded
    to a multiple of tp (vocab_rows), so it never refuses a degree.
    `seq_len_key`: the key the user set the length with (e.g. trace.seq_len), as messages name it.
    """
    for field in ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab", "seq_len",
                  "make_vocab_size_divisible_by"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"model.{field}({value}) must be a positive integer")
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp({tp}) must be a positive integer")
    if not isinstance(cfg.dtype, Dtype):
        raise ValueError(f"model.dtype({cfg.dtype!r}) must be one of {list(Dtype.__members__)}")
    if cfg.rope_theta <= 0 or cfg.norm_eps <= 0:
        raise ValueError(
            f"model.rope_theta({cfg.rope_theta}) and model.norm_eps({cfg.norm_eps}) must be > 0"
        )
    if cfg.hidden % cfg.heads:
        raise ValueError(f"model.hidden({cfg.hidden}) is not divisible by model.heads({cfg.heads})")
    head_dim = cfg.hidden // cfg.heads
    if head_dim % 2:
        raise ValueError(
            f"head dim model.hidden({cfg.hidden}) / model.heads({cfg.heads}) = {head_dim} "
            "must be even for rotary embeddings"
        )
    if cfg.heads % cfg.kv_heads:
        raise ValueError(
            f"model.heads({cfg.heads}) is not divisible by model.kv_heads({cfg.kv_heads})"
        )
    validate_moe(cfg)
    # Each TP rank holds whole heads: its share of query heads, KV heads and FFN columns (and
    # of the vocabulary's rows, padded to a multiple of tp: vocab_rows).
    splits = (
        ("heads", cfg.heads, "query heads"),
        ("kv_heads", cfg.kv_heads, "KV heads (wk/wv are split column-wise)"),
        ("ffn", cfg.ffn, "FFN columns"),
        ("seq_len", cfg.seq_len, "sequence parallelism"),
    )
    if cfg.shared_expert_ffn:
        splits += (("shared_expert_ffn", cfg.shared_expert_ffn, "the shared expert's columns"),)
    for field, value, why in splits:
        if value % tp:
            key = seq_len_key if field == "seq_len" else f"model.{field}"
            raise ValueError(f"{key}({value}) is not divisible by tp({tp}); needed for {why}")


def validate_moe(cfg: ModelConfig) -> None:
    """Raise ValueError naming the numbers if the mixture-of-experts fields are inconsistent."""
    if not isinstance(cfg.experts, int) or cfg.experts < 0:
        raise ValueError(f"model.experts({cfg.experts}) must be an integer >= 0 (0: dense)")
    if not cfg.experts:
        return
    if not isinstance(cfg.top_k, int) or not 1 <= cfg.top_k <= cfg.experts:
        raise ValueError(f"model.top_k({cfg.top_k}) must be in 1..model.experts({cfg.experts})")
    for field in ("expert_ffn", "shared_expert_ffn", "dense_layers"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"model.{field}({value}) must be an integer >= 0")
    if cfg.dense_layers >= cfg.layers:
        raise ValueError(f"model.dense_layers({cfg.dense_layers}) must be < model.layers"
                         f"({cfg.layers}): a MoE model needs at least one MoE block")
    if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
        raise ValueError(f"model.capacity_factor({cfg.capacity_factor}) must be > 0 "
                         f"(null: dropless)")
    if not cfg.aux_loss_coef >= 0:
        raise ValueError(f"model.aux_loss_coef({cfg.aux_loss_coef}) must be >= 0")


def capacity(tokens: int, top_k: int, experts: int, capacity_factor: float) -> int:
    """Token copies each expert takes from a routing group of `tokens` under a capacity factor
    (Megatron's rule): ceil(tokens x top_k / experts x capacity_factor)."""
    return math.ceil(tokens * top_k / experts * capacity_factor)


def is_moe(cfg: ModelConfig) -> bool:
    """Whether the model has experts."""
    return bool(getattr(cfg, "experts", 0))


def is_moe_block(cfg: ModelConfig, index: int) -> bool:
    """Whether block `index` holds experts (every block after the first `dense_layers`)."""
    return is_moe(cfg) and index >= cfg.dense_layers


def dense_twin(cfg: ModelConfig) -> ModelConfig:
    """A MoE model's dense block shape (its experts off, the MLP of model.ffn: what its first
    dense_layers blocks are, and what profile_model's points time); a dense model itself."""
    import dataclasses

    return dataclasses.replace(cfg, experts=0) if is_moe(cfg) else cfg


def expert_width(cfg: ModelConfig) -> int:
    """One routed expert's FFN width."""
    return cfg.expert_ffn or cfg.ffn


def count_attention_params(cfg: ModelConfig) -> int:
    """A block's attention and its two norms (no biases)."""
    kv_dim = cfg.kv_heads * (cfg.hidden // cfg.heads)
    return cfg.hidden * cfg.hidden * 2 + cfg.hidden * kv_dim * 2 + 2 * cfg.hidden


def count_expert_params(cfg: ModelConfig) -> int:
    """One routed expert (w_gate, w_up, w_down)."""
    return 3 * cfg.hidden * expert_width(cfg)


def count_moe_dense_params(cfg: ModelConfig) -> int:
    """A MoE block's parameters outside the routed experts: router and shared expert."""
    return cfg.hidden * cfg.experts + 3 * cfg.hidden * cfg.shared_expert_ffn


def count_block_params(cfg: ModelConfig, index: int = 0) -> int:
    """Parameters in transformer block `index` (no biases); all its experts for a MoE block."""
    if is_moe_block(cfg, index):
        return (count_attention_params(cfg) + count_moe_dense_params(cfg)
                + cfg.experts * count_expert_params(cfg))
    return count_attention_params(cfg) + 3 * cfg.hidden * cfg.ffn  # w_gate, w_up, w_down


def count_active_block_params(cfg: ModelConfig, index: int = 0) -> int:
    """Parameters one token goes through in block `index` (top_k experts of a MoE block): what
    its FLOPs scale with."""
    if is_moe_block(cfg, index):
        return (count_attention_params(cfg) + count_moe_dense_params(cfg)
                + cfg.top_k * count_expert_params(cfg))
    return count_block_params(cfg, index)


def count_params(cfg: ModelConfig) -> int:
    """Parameters in the whole model: embedding, blocks, final norm, untied LM head."""
    return (cfg.vocab * cfg.hidden * 2 + cfg.hidden
            + sum(count_block_params(cfg, i) for i in range(cfg.layers)))


def count_active_params(cfg: ModelConfig) -> int:
    """Parameters a token goes through (the "A3B" of Qwen3-30B-A3B), embedding included."""
    return (cfg.vocab * cfg.hidden * 2 + cfg.hidden
            + sum(count_active_block_params(cfg, i) for i in range(cfg.layers)))
