"""The training engine on 4 real CPU processes over gloo: every layout of the issue trains the
same model on the same data, gives the same losses as plain data parallelism (fp32), and its
loss falls over 20 steps. One launch for all layouts (a launch costs seconds)."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from conftest import spawn_ranks

WORLD_SIZE = 4
STEPS = 20
SAME_STEPS = 10  # steps over which every layout must give dp4's losses
GBS = 4
# (pp, tp, extra ParallelLayout fields): dp4, tp2*dp2, pp2*dp2, pp2*tp2, pp4 1F1B, pp2 v2
# interleaved, ZeRO 1/2/3 (FSDP2, also under a pipeline and with TP), each recompute mode,
# an uneven split.
LAYOUTS = [
    (1, 1, {}),
    (1, 2, {}),
    (2, 1, {}),
    (2, 2, {}),
    (4, 1, {}),
    (2, 1, {"schedule": "interleaved", "virtual_stages": 2}),
    (1, 1, {"zero": 1}),
    (1, 1, {"zero": 2}),
    (1, 1, {"zero": 3}),
    (2, 1, {"zero": 3}),
    (1, 2, {"zero": 3}),
    (1, 1, {"recompute": "selective"}),
    (2, 1, {"recompute": "full"}),
    (2, 1, {"layers_per_stage": (3, 1)}),
]


def _layout(pp, tp, extra):
    from orchestrator.layout import ParallelLayout

    extra = dict(extra)
    recompute = extra.pop("recompute", "none")
    dp = WORLD_SIZE // (pp * tp)
    common = dict(micro_batch_size=1, num_micro_batches=GBS // dp, sequence_parallel=tp > 1)
    stages = extra.pop("layers_per_stage", None)
    if stages:
        return ParallelLayout(world_size=WORLD_SIZE, pp=pp, tp=tp, dp=dp, layers_per_stage=stages,
                              **common, **extra)
    return ParallelLayout.uniform(WORLD_SIZE, tp, pp, 4, recompute=recompute, **common, **extra)


def _worker(rank: int, out: dict) -> None:
    from orchestrator.models.config import ModelConfig
    from orchestrator.train.data import make_data
    from orchestrator.train.engine import Engine
    from orchestrator.train.lr import lr_at

    model = ModelConfig(hidden=64, ffn=128, layers=4, heads=4, kv_heads=2, vocab=128,
                        seq_len=32)
    data = make_data(None, model.vocab, model.seq_len, seed=0)
    for pp, tp, extra in LAYOUTS:
        layout = _layout(pp, tp, extra)
        engine = Engine(layout, model, torch.device("cpu"), seed=1)
        per_rank = GBS // layout.dp
        losses = []
        for step in range(STEPS):
            tokens, targets = data.rank_batch(step, engine.dp_rank, layout.dp, per_rank)
            stats = engine.train_step(tokens, targets, lr_at(step, 3e-3, 3, STEPS), 1.0)
            losses.append(stats.loss)
        if rank == 0:
            out[layout.describe()] = losses
        dist.barrier()


@pytest.fixture(scope="module")
def losses_by_layout():
    return spawn_ranks(_worker, WORLD_SIZE)


def test_every_layout_trains(losses_by_layout):
    assert len(losses_by_layout) == len(LAYOUTS)


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_loss_falls_over_20_steps(losses_by_layout, index):
    describe = _layout(*LAYOUTS[index]).describe()
    losses = losses_by_layout[describe]
    first, last = losses[0], sum(losses[-5:]) / 5
    assert last < first - 1.0, f"{describe}: loss {first:.3f} -> {last:.3f}"


@pytest.mark.parametrize("index", range(1, len(LAYOUTS)))
def test_same_losses_as_data_parallel(losses_by_layout, index):
    """fp32, same seed, same data: the split changes where the arithmetic runs, not its result."""
    reference = losses_by_layout[_layout(*LAYOUTS[0]).describe()]
    describe = _layout(*LAYOUTS[index]).describe()
    for step, (want, got) in enumerate(zip(reference[:SAME_STEPS],
                                           losses_by_layout[describe][:SAME_STEPS])):
        assert abs(got - want) <= 1e-4 * abs(want), f"{describe} step {step + 1}: {got} != {want}"
