"""train.load checked before launch (on Slurm before the queue wait): a checkpoint the ranks
would refuse for this model is a ConfigError naming what differs and what to do."""
from __future__ import annotations

from typing import Dict, Optional

from orchestrator.errors import ConfigError

# The parameters with a row per (padded) vocabulary entry.
VOCAB_PARAMS = ("tok_emb.weight", "lm_head.weight")


def check_load(cfg, tp: Optional[int] = None) -> None:
    """ConfigError (exit 2, before launch: on Slurm before the queue wait) when train.load names
    no complete checkpoint, or one the ranks would refuse for this model: a tensor missing or of
    another global shape (`shape_mismatch`, their rule; any layout is fine, DCP reshards). `tp`:
    the layout's TP degree, which the vocabulary's padded rows depend on (state_shapes; None:
    not known yet, their rows not compared). Reads complete.json and DCP's .metadata only."""
    from orchestrator.train.checkpoint import (CheckpointError, checkpoint_to_load, saved_shapes,
                                               shape_mismatch)
    from orchestrator.train.plan import model_config

    load = cfg.train.load
    try:
        found, _ = checkpoint_to_load(load)
        saved = saved_shapes(found.path)
    except CheckpointError as e:
        raise ConfigError(f"train.load={load}: {e}") from None
    model = model_config(cfg, cfg.model.seq_len)  # the shapes do not depend on the length
    mismatch = shape_mismatch(saved, state_shapes(model, tp))
    if mismatch and tp is not None and not shape_mismatch(saved, state_shapes(model, None)):
        raise ConfigError(padded_rows_text(load, found, model, tp, saved))
    if mismatch:
        raise ConfigError(another_model_text(load, found, model, mismatch))


def padded_rows_text(load: str, found, model, tp: int, saved) -> str:
    """The line refusing a checkpoint of this model whose only difference is the vocabulary's
    padded rows (models/config.vocab_rows: they depend on the TP degree): what it holds, what
    this layout pads to, and the TP degrees that pad alike."""
    from orchestrator.models.config import padded_vocab, vocab_rows

    rows = tuple(saved[f"model.{VOCAB_PARAMS[0]}"])[0]
    divisor = model.make_vocab_size_divisible_by
    fixes = [f"tp {t}" for t in (1, 2, 4, 8) if vocab_rows(model, t) == rows][:2]
    fixes += [f"model.make_vocab_size_divisible_by={d}" for d in range(1, rows // tp + 1)
              if padded_vocab(model.vocab, tp, d) == rows][:1]
    return (f"train.load={load}: checkpoint {found.path} holds model.vocab({model.vocab}) padded "
            f"to {rows} rows; tp {tp} pads it to {vocab_rows(model, tp)} "
            f"(model.make_vocab_size_divisible_by={divisor}: a multiple of {divisor} x tp)"
            + (f". Train it with {' or '.join(fixes)}" if fixes else ""))


# Fields that never change what a checkpoint holds of a model: left out of its differences.
_NOT_SAVED = ("seq_len",)


def another_model_text(load: str, found, model, mismatch: str) -> str:
    """The line refusing `found` (train.load=`load`) for `model`: which model saved it (from the
    model fields its complete.json records, where it does), what differs, what to do."""
    from orchestrator.models.config import model_fields

    saved = found.extra.get("model")
    saved = saved if isinstance(saved, dict) else {}  # older checkpoints record none
    here = model_fields(model)
    differ = [k for k in here if k not in _NOT_SAVED + ("name",) and k in saved
              and str(saved[k]) != str(here[k])]
    by, fix = "its tensors say", "model= and the model.* values it was trained with"
    if differ or saved.get("name", model.name) != model.name:
        by = (f"model {saved.get('name')}" + "".join(f", model.{k}={saved[k]}" for k in differ)
              + f"; here model {model.name}" + "".join(f", {k}={here[k]}" for k in differ))
        fix = (f"model={saved.get('name')}" if saved.get("name") != model.name else
               " ".join(f"model.{k}={saved[k]}" for k in differ))
    return (f"train.load={load}: checkpoint {found.path} is of another model ({by}): "
            f"{mismatch}. Give train.load a checkpoint of {model.name}, or train the model "
            f"it was saved by ({fix})")


def state_shapes(model, tp: Optional[int] = 1) -> Dict[str, Optional[tuple]]:
    """{DCP key: global shape} of what `Engine.state()` saves for `model` on all ranks together,
    in any layout of `tp` TP ranks (a sharded parameter keeps its global shape): each parameter
    under "model." and its two AdamW moments under "optim.". The embedding's and LM head's rows
    are the vocabulary padded for tp (models/config.vocab_rows); `tp` None (not known yet): their
    shape None, not compared (checkpoint.shape_mismatch). Built on the meta device: nothing is
    allocated (torch imported here, once a checkpoint is found: ~2 CPU-s)."""
    import dataclasses

    import torch

    from orchestrator.models.gpt import GPT
    from orchestrator.train.engine import OPTIM_MOMENTS
    from orchestrator.choices import Dtype

    with torch.device("meta"):
        whole = GPT(dataclasses.replace(model, dtype=Dtype.fp32), tp=tp or 1)
    params = {name: None if tp is None and name in VOCAB_PARAMS else tuple(p.shape)
              for name, p in whole.named_parameters()}
    return {**{f"model.{name}": shape for name, shape in params.items()},
            **{f"optim.{name}.{key}": shape for name, shape in params.items()
               for key in OPTIM_MOMENTS}}
