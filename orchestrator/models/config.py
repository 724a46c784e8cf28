"""Model shape as plain values, its validation, and analytic parameter counts.

Kept free of torch so the CLI and the planner can import it cheaply.
"""

from dataclasses import dataclass

from orchestrator.choices import Dtype


@dataclass
class ModelConfig:
    """A decoder-only transformer (Llama-style: RMSNorm, GQA + RoPE, SwiGLU, untied head).

    Defaults are the tiny model that runs anywhere in seconds. Code reading a config accepts this
    dataclass or an OmegaConf DictConfig of it, so it uses fields only (no properties).
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

    def __post_init__(self) -> None:
        try:  # "bfloat16" and "bf16" name one dtype
            self.dtype = Dtype.parse(self.dtype)
        except ValueError:
            pass  # validate_model names it, with the other shape errors


def validate_model(cfg: ModelConfig, tp: int = 1) -> None:
    """Raise ValueError naming the offending numbers if `cfg` cannot be built or split over `tp` ranks.

    With tensor parallelism, query and KV heads, the FFN width and the vocabulary (vocab-parallel
    embedding and head) are split over tp, and so is the sequence (sequence parallelism).
    """
    for field in ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab", "seq_len"):
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
    # Each TP rank holds whole heads: its share of query heads, KV heads, FFN columns and vocab rows.
    splits = (
        ("heads", cfg.heads, "query heads"),
        ("kv_heads", cfg.kv_heads, "KV heads (wk/wv are split column-wise)"),
        ("ffn", cfg.ffn, "FFN columns"),
        ("vocab", cfg.vocab, "vocab-parallel embedding and LM head"),
        ("seq_len", cfg.seq_len, "sequence parallelism"),
    )
    for field, value, why in splits:
        if value % tp:
            raise ValueError(f"model.{field}({value}) is not divisible by tp({tp}); needed for {why}")


def count_block_params(cfg: ModelConfig) -> int:
    """Parameters in one transformer block (no biases)."""
    kv_dim = cfg.kv_heads * (cfg.hidden // cfg.heads)
    attention = cfg.hidden * cfg.hidden * 2 + cfg.hidden * kv_dim * 2  # wq, wo, wk, wv
    mlp = 3 * cfg.hidden * cfg.ffn  # w_gate, w_up, w_down
    norms = 2 * cfg.hidden
    return attention + mlp + norms


def count_params(cfg: ModelConfig) -> int:
    """Parameters in the whole model: embedding, blocks, final norm, untied LM head."""
    return cfg.vocab * cfg.hidden * 2 + cfg.layers * count_block_params(cfg) + cfg.hidden
