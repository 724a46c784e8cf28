"""A resumed run continues the uninterrupted one exactly, also when some steps of the straight
run made no optimizer step: stage=train skips an iteration in which a dp rank has no sample
that fits (dynamic micro-batching), and the engine skips the update of a step whose gradient
norm is not finite. AdamW's bias correction counts the updates made, not the steps, so a
checkpoint carries that count (Engine.checkpoint_extra) and the resumed optimizer takes it,
not the step number; under fp16 it carries the dynamic loss scale too. On gloo ranks, in
seconds."""
from __future__ import annotations

import functools

import torch

from conftest import spawn_ranks

WORLD = 2
MODEL = dict(hidden=32, ffn=64, layers=2, heads=4, kv_heads=2, vocab=64, seq_len=16)
PER_RANK = 2  # samples per dp rank and step


def _step(engine, data, layout, step: int, nan: bool = False):
    """One training step of this rank's samples; `nan`: its gradient overflows (the engine
    skips the update)."""
    tokens, targets = data.rank_batch(step, engine.dp_rank, layout.dp, PER_RANK)
    hook = None
    if nan:
        first = next(iter(engine.named_parameters().values()))
        hook = first.register_hook(lambda g: g * float("nan"))
    try:
        return engine.train_step(tokens, targets, 1e-2, 1.0)
    finally:
        if hook is not None:
            hook.remove()


def _worker(rank: int, out: dict, folder: str) -> None:
    from orchestrator.layout import ParallelLayout
    from orchestrator.models.config import ModelConfig
    from orchestrator.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from orchestrator.train.data import make_data
    from orchestrator.train.engine import Engine

    model = ModelConfig(**MODEL)
    layout = ParallelLayout.uniform(WORLD, 1, 1, MODEL["layers"], micro_batch_size=1,
                                    num_micro_batches=PER_RANK, zero=1)
    data = make_data(None, model.vocab, model.seq_len, seed=0)

    def train(engine, step: int, nan: bool = False):
        return _step(engine, data, layout, step, nan)

    straight = Engine(layout, model, torch.device("cpu"), seed=1)
    train(straight, 0)
    # step 2 (index 1): skipped by the stage, as a planned iteration with an empty dp rank is
    out["nan skipped"] = train(straight, 2, nan=True).skipped  # step 3: no update either
    train(straight, 3)
    save_checkpoint(folder, 4, straight.state(), straight.checkpoint_extra())
    resumed = Engine(layout, model, torch.device("cpu"), seed=2)
    state = resumed.state()
    info = latest_checkpoint(folder)
    load_checkpoint(info, state)
    resumed.load_state(state, info.step, info.extra)
    for step in (4, 5):
        losses = [train(e, step).loss for e in (straight, resumed)]
        out[f"losses {step} {rank}"] = losses
    a, b = straight.named_parameters(), resumed.named_parameters()
    out[f"max param diff {rank}"] = max(float((a[n].detach() - b[n].detach()).abs().max())
                                        for n in a)


def test_resume_after_steps_without_an_update_continues_the_same_trajectory(tmp_path):
    out = spawn_ranks(functools.partial(_worker, folder=str(tmp_path)), WORLD)
    assert out["nan skipped"]
    for rank in range(WORLD):
        for step in (4, 5):
            want, got = out[f"losses {step} {rank}"]
            assert abs(got - want) <= 1e-6 * abs(want), (step, rank, want, got)
        assert out[f"max param diff {rank}"] <= 1e-7, out[f"max param diff {rank}"]


def _fp16_worker(rank: int, out: dict, folder: str) -> None:
    from orchestrator.layout import ParallelLayout
    from orchestrator.models.config import ModelConfig
    from orchestrator.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from orchestrator.train.data import make_data
    from orchestrator.train.engine import Engine

    model = ModelConfig(**MODEL)
    layout = ParallelLayout.uniform(1, 1, 1, MODEL["layers"], micro_batch_size=1,
                                    num_micro_batches=PER_RANK)
    data = make_data(None, model.vocab, model.seq_len, seed=0)

    def train(engine, step: int, nan: bool = False):  # nan: an overflow, the scale halved
        return _step(engine, data, layout, step, nan)

    straight = Engine(layout, model, torch.device("cpu"), dtype="fp16", seed=1)
    train(straight, 0)
    train(straight, 1, nan=True)
    train(straight, 2)
    save_checkpoint(folder, 3, straight.state(), straight.checkpoint_extra())
    resumed = Engine(layout, model, torch.device("cpu"), dtype="fp16", seed=2)
    state = resumed.state()
    info = latest_checkpoint(folder)
    load_checkpoint(info, state)
    resumed.load_state(state, info.step, info.extra)
    out["scales"] = [e.loss_scale for e in (straight, resumed)]
    out["losses"] = [train(e, 3).loss for e in (straight, resumed)]


def test_an_fp16_resume_keeps_the_loss_scale(tmp_path):
    """GradScaler's state is a checkpoint's: a resumed fp16 run that started its scale afresh
    at 2^16 would overflow (skip) steps the straight run trains."""
    out = spawn_ranks(functools.partial(_fp16_worker, folder=str(tmp_path)), 1)
    straight, resumed = out["scales"]
    assert straight == 2.0**15 and resumed == straight, out["scales"]
    want, got = out["losses"]
    assert abs(got - want) <= 1e-6 * abs(want), out["losses"]
