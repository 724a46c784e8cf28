"""model.make_vocab_size_divisible_by: the vocabulary padded as Megatron-LM pads it
(`--make-vocab-size-divisible-by`, its _vocab_size_with_padding), by one rule
(models/config.padded_vocab) that the model, the memory model, the planner, profile_model and the
exports all size the embedding and the LM head by. Before it, a vocabulary that tp did not divide
(GPT-2's 50257) could never use tensor parallelism."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import spawn_ranks
from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig, validate_model

# the engine matrix's model (tests/engine_matrix.py) with an odd vocabulary
ODD = dict(hidden=64, ffn=128, layers=4, heads=4, kv_heads=2, vocab=127, seq_len=32)


@pytest.mark.parametrize("vocab, tp, divisible_by, rows", [
    # GPT-2 with Megatron's default 128: a multiple of 128 x tp
    (50257, 1, 128, 50304), (50257, 2, 128, 50432), (50257, 8, 128, 51200),
    # only what TP needs (the default, 1)
    (50257, 1, 1, 50257), (50257, 2, 1, 50258), (50257, 8, 1, 50264),
    # a vocabulary already a multiple stays as it is
    (32000, 8, 1, 32000), (32000, 8, 128, 32768), (51200, 8, 128, 51200), (1, 4, 1, 4),
])
def test_padded_vocab_is_megatrons_rule(vocab, tp, divisible_by, rows):
    from orchestrator.models.config import padded_vocab

    assert padded_vocab(vocab, tp, divisible_by) == rows
    # Megatron's _vocab_size_with_padding, step by step: the least multiple of divisible_by x tp
    multiple = divisible_by * tp
    assert rows % multiple == 0 and vocab <= rows < vocab + multiple


def test_any_vocabulary_splits_over_tp_and_the_model_holds_the_padded_rows():
    """validate_model no longer refuses a vocabulary tp does not divide (it refused model.vocab
    (510) at tp 4); GPT(cfg, tp) has the padded rows; a divisor below 1 is refused."""
    from orchestrator.models.gpt import GPT

    cfg = ModelConfig(**ODD)
    validate_model(cfg, tp=2)
    with torch.device("meta"):
        assert GPT(cfg).tok_emb.weight.shape == (127, 64)  # nothing pads at tp 1
        assert GPT(cfg, tp=2).lm_head.weight.shape == (128, 64)
        assert GPT(dataclasses.replace(cfg, make_vocab_size_divisible_by=128),
                   tp=2).tok_emb.weight.shape == (256, 64)
    with pytest.raises(ValueError, match=r"model.make_vocab_size_divisible_by\(0\) must be a "
                                         r"positive integer"):
        validate_model(dataclasses.replace(cfg, make_vocab_size_divisible_by=0))


def test_memory_grows_by_exactly_the_padded_rows():
    """The memory model (workload/, what the planner prices for the orchestrator engine) holds
    the padded rows on every rank: 127 tokens at tp 2 are 128 rows, 64 a rank, the states of a
    128-token model; with divisor 128, 256 rows: 64 more a rank for each of the embedding and
    the LM head, at the bytes per element of every other parameter."""
    from orchestrator.workload.stage_memory import StageNumels
    from orchestrator.workload.states import rank_states

    layout = ParallelLayout.uniform(2, 2, 1, 4, micro_batch_size=1, num_micro_batches=1,
                                    sequence_parallel=True)
    odd, even = ModelConfig(**ODD), ModelConfig(**{**ODD, "vocab": 128})
    wide = dataclasses.replace(odd, make_vocab_size_divisible_by=128)
    for rank in range(2):  # before: rank 1 held 63 rows of each
        assert rank_states(odd, layout, rank) == rank_states(even, layout, rank)
    extra = 2 * (128 - 64) * odd.hidden  # elements: embedding and head, 64 more rows each
    assert (StageNumels.of(wide, layout).other - StageNumels.of(odd, layout).other).tolist() \
        == [extra]  # the planner's closed form (workload/stage_memory.py)
    before, after = rank_states(odd, layout, 1).as_dict(), rank_states(wide, layout, 1).as_dict()
    grown = {kind: after[kind] - before[kind] for kind in before if after[kind] != before[kind]}
    # fp32 at tp 2, ZeRO 0: the parameter, its fp32 master (the DTensor's bucket), the gradient
    # bucket and two AdamW moments, as every other parameter's
    assert grown == {"params": 4 * extra, "master": 4 * extra, "grads": 4 * extra,
                     "optim": 8 * extra, "total": 20 * extra}, grown


def test_the_planner_admits_tp_for_an_odd_vocabulary_and_prices_its_padded_rows():
    """A synthetic profile of a 1001-token vocabulary on 8 ranks: every TP degree the heads
    allow is searched (before: tp 2, 4 and 8 rejected as tp_splits_heads), and the
    orchestrator engine's embedding and head bytes are the padded rows' (1024 at tp 2 with
    divisor 128, 1002 with 1)."""
    from orchestrator.planner import CostOptions, HardwareModel, ModelCost
    from orchestrator.planner.cost_model import ConfigKey, StageCosts
    from orchestrator.planner.space import SearchSpace, enumerate_configs
    from planner_fixtures import synthetic_hardware, synthetic_model

    profile = synthetic_model(vocab=1001)
    model = ModelCost.from_dict(profile)
    hardware = HardwareModel.from_dict(synthetic_hardware(1, 8))
    space = SearchSpace(world_size=8, memory_budget_bytes=2**40, global_batch_size=16,
                        seq_len=512, micro_batch_sizes=(1,), options=CostOptions())
    rejected = {}
    tps = {key.tp for key in enumerate_configs(model, hardware, space, rejected)}
    assert tps == {1, 2, 4, 8} and "tp_splits_heads" not in rejected, (tps, rejected)

    wide_profile = {**profile, "model": {**profile["model"], "make_vocab_size_divisible_by": 128}}
    wide = ModelCost.from_dict(wide_profile)
    assert (model.make_vocab_size_divisible_by, wide.make_vocab_size_divisible_by) == (1, 128)
    key = ConfigKey(8, 2, 1, 4, 0, True, 1, 4, "1f1b", 1)
    narrow_bytes = StageCosts(key, model, hardware, 512, CostOptions()).other_param_bytes
    wide_bytes = StageCosts(key, wide, hardware, 512, CostOptions()).other_param_bytes
    # bf16 weights: 2 bytes an element; (1024 - 1002) / 2 rows a rank, embedding and head
    assert (wide_bytes - narrow_bytes).tolist() == [2 * 2 * 11 * 256]


def test_profiles_record_the_divisor_and_the_megatron_export_writes_it():
    """A model profile records the divisor when it is not 1 (profiles written before it read as
    1, so nothing already profiled turns stale) and is stale for another; the Megatron command
    line always carries --make-vocab-size-divisible-by (Megatron's own default is 128)."""
    from orchestrator.planner.exports import megatron_model_args
    from orchestrator.store.schema.identity import model_identity, model_summary

    plain = ModelConfig(**ODD)
    wide = dataclasses.replace(plain, make_vocab_size_divisible_by=128)
    assert "make_vocab_size_divisible_by" not in model_summary(plain)
    assert model_summary(wide)["make_vocab_size_divisible_by"] == 128
    assert model_identity(plain) != model_identity(wide)
    args = megatron_model_args(wide)
    assert args[args.index("--make-vocab-size-divisible-by") + 1] == "128"
    args = megatron_model_args(plain)
    assert args[args.index("--make-vocab-size-divisible-by") + 1] == "1"


def test_checkpoint_shapes_follow_the_tp_the_rows_are_padded_for():
    """train.load's check before launch: the embedding's rows at the layout's tp, not compared
    while the tp is not known yet (search writes the layout in the same command)."""
    from orchestrator.train.load_check import state_shapes

    model = ModelConfig(**ODD)
    assert state_shapes(model, 2)["model.tok_emb.weight"] == (128, 64)
    assert state_shapes(model)["optim.lm_head.weight.exp_avg"] == (127, 64)
    unknown = state_shapes(model, None)
    assert unknown["model.tok_emb.weight"] is None
    assert unknown["model.norm.weight"] == (64,)


STEPS = 3


def _train_worker(rank: int, out: dict) -> None:
    """Two runs of the odd vocabulary with 128 rows each: dp 2 with divisor 2 (tp 1 pads to a
    multiple of 2) and tp 2 with divisor 1: the same parameters, data and seed."""
    from orchestrator.train.data import make_data
    from orchestrator.train.engine import Engine

    base = ModelConfig(**ODD)
    data = make_data(None, base.vocab, base.seq_len, seed=0)
    for tp, divisor in ((1, 2), (2, 1)):
        model = dataclasses.replace(base, make_vocab_size_divisible_by=divisor)
        layout = ParallelLayout.uniform(2, tp, 1, model.layers, micro_batch_size=1,
                                        num_micro_batches=2 // (2 // tp),
                                        sequence_parallel=tp > 1)
        engine = Engine(layout, model, torch.device("cpu"), seed=1)
        emb = engine.named_parameters()["tok_emb.weight"]
        local = emb.to_local() if hasattr(emb, "to_local") else emb
        losses = []
        for step in range(STEPS):
            tokens, targets = data.rank_batch(step, engine.dp_rank, layout.dp, 2 // layout.dp)
            assert int(targets.max()) < base.vocab  # labels are real tokens only
            losses.append(engine.train_step(tokens, targets, 5e-3, 1.0).loss)
        out[f"tp{tp} rank {rank}"] = (losses, tuple(emb.shape), tuple(local.shape))


def test_an_odd_vocabulary_trains_at_tp_2_as_at_tp_1():
    """127 tokens at tp 2 over gloo (before: refused, model.vocab(127) is not divisible by
    tp(2)): each rank holds 64 of the 128 rows, and the losses are tp 1's with the same 128
    rows (divisor 2), step by step (fp32: the split moves the arithmetic, not its result)."""
    out = spawn_ranks(_train_worker, 2)
    for rank in range(2):
        losses1, shape1, local1 = out[f"tp1 rank {rank}"]
        losses2, shape2, local2 = out[f"tp2 rank {rank}"]
        assert (shape1, local1, shape2, local2) == ((128, 64), (128, 64), (128, 64), (64, 64))
        for step, (want, got) in enumerate(zip(losses1, losses2)):
            assert abs(got - want) <= 1e-4 * abs(want), (rank, step + 1, got, want)
    assert len(losses2) == STEPS and losses2[-1] < losses2[0]


def test_a_checkpoint_padded_for_another_tp_is_named_as_such():
    """train.load of this model's checkpoint saved at a TP degree that pads its vocabulary to
    other rows: the line says so and what pads alike (before this check: "of another model")."""
    from types import SimpleNamespace

    from orchestrator.train.load_check import padded_rows_text
    from orchestrator.train.load_check import state_shapes

    model = ModelConfig(**{**ODD, "vocab": 511})
    saved = state_shapes(model, 2)  # 512 rows
    text = padded_rows_text("ck", SimpleNamespace(path="ck/step_00000002"), model, 1, saved)
    assert "holds model.vocab(511) padded to 512 rows; tp 1 pads it to 511" in text, text
    assert text.endswith("Train it with tp 2 or tp 4 or model.make_vocab_size_divisible_by=2")
