"""Our engine's states under bf16 at Megatron's level, on 2 real gloo ranks (dp 2): bf16
weights, fp32 gradients and an fp32 master copy in the (sharded) optimizer. The bytes every
tensor the optimizer holds at its step (weights, gradients, masters, AdamW's moments), counted
storage by storage, equal Megatron's bytes per parameter for each ZeRO stage (its
docs/user-guide/features/dist_optimizer.md: 18 and 6 + 12/d; Megatron-FSDP's optim_grads
2 + 16/d; FSDP2's ZeRO-3 16/d: its fp32 shard is the master, where Megatron-FSDP keeps a bf16
shard too, 18/d) and the workload model's rank_states; every message of a step, the
parameter all-gather after the step in bf16 included, is workload/comm.py's list."""
from __future__ import annotations

import functools

import pytest
import torch

from conftest import spawn_ranks

WORLD = 2  # dp 2: d in the formulas
MODEL = dict(hidden=32, ffn=64, layers=2, heads=4, kv_heads=2, vocab=64, seq_len=16)
ZERO_STAGES = (0, 1, 2, 3)
# Megatron's bytes per parameter under bf16 with d ranks sharing the weights, but ZeRO-3:
# FSDP2 keeps no bf16 shard (it casts its fp32 shard, the master, for the all-gather).
BYTES_PER_PARAM = {0: lambda d: 18, 1: lambda d: 6 + 12 / d, 2: lambda d: 2 + 16 / d,
                   3: lambda d: 16 / d}


def _layout(zero: int):
    from orchestrator.layout import ParallelLayout

    return ParallelLayout.uniform(WORLD, 1, 1, MODEL["layers"], micro_batch_size=1,
                                  num_micro_batches=2, zero=zero)


def _held_bytes(optim) -> tuple:
    """Bytes of every storage reachable from the optimizer (weights and their gradients,
    flat buckets, masters, AdamW's moments), each storage once: (all but AdamW's 0-dim step
    counters, which are no term of the per-parameter formula; the counters')."""
    from orchestrator.train.grads import local_tensor
    from orchestrator.train.live_memory import reachable_tensors

    seen, scalars = {}, {}
    for t in reachable_tensors([optim]):
        t = local_tensor(t)
        if t.is_meta:
            continue
        st = t.untyped_storage()
        (scalars if t.dim() == 0 else seen)[st._cdata] = st.nbytes()
    return sum(seen.values()), sum(scalars.values())


def _worker(rank: int, out: dict, folder: str) -> None:
    for zero in ZERO_STAGES:
        _run(rank, out, zero, f"{folder}/zero{zero}")


def _run(rank: int, out: dict, zero: int, folder: str) -> None:
    """Two bf16 steps of ZeRO-`zero`: the bytes held at the second step's optimizer step and
    its collectives, under keys "<what> <zero> <rank>"; then a checkpoint saved into `folder`,
    reloaded by an engine of another seed, and one more step on each (its losses)."""
    from orchestrator.models.config import ModelConfig
    from orchestrator.trace.recorder import OpRecorder
    from orchestrator.train.checkpoint import (latest_checkpoint, load_checkpoint,
                                               save_checkpoint)
    from orchestrator.train.engine import Engine

    model = ModelConfig(**MODEL)
    layout = _layout(zero)
    engine = Engine(layout, model, torch.device("cpu"), dtype="bf16", seed=1)
    optim = engine.optim
    original = optim.step

    def counted(*args, **kwargs):  # at the step: gradients reduced, moments made
        out[f"held {zero} {rank}"] = _held_bytes(optim)
        return original(*args, **kwargs)
    gen = torch.Generator().manual_seed(rank)
    for step in range(2):
        tokens = torch.randint(0, model.vocab, (2, model.seq_len), generator=gen)
        targets = torch.randint(0, model.vocab, (2, model.seq_len), generator=gen)
        if step == 1:
            optim.step = counted
            recorder = OpRecorder()
            with recorder:
                stats = engine.train_step(tokens, targets, 1e-3, 1.0)
            out[f"comms {zero} {rank}"] = [(r["op"], r["bytes"], r["dtype"])
                                           for r in recorder.records if r["kind"] == "coll"]
        else:
            stats = engine.train_step(tokens, targets, 1e-3, 1.0)
        out[f"loss {zero} {rank} {step}"] = stats.loss
    out[f"weights {zero} {rank}"] = sorted({str(p.dtype)
                                            for p in engine.named_parameters().values()})
    optim.step = original
    save_checkpoint(folder, 2, engine.state(), {})
    resumed = Engine(layout, model, torch.device("cpu"), dtype="bf16", seed=2)
    state = resumed.state()
    load_checkpoint(latest_checkpoint(folder), state)
    resumed.load_state(state, 2)
    out[f"saved dtypes {zero} {rank}"] = sorted({str(t.dtype) for t in state["model"].values()})
    tokens = torch.randint(0, model.vocab, (2, model.seq_len), generator=gen)
    targets = torch.randint(0, model.vocab, (2, model.seq_len), generator=gen)
    out[f"resumed {zero} {rank}"] = [e.train_step(tokens, targets, 1e-3, 1.0).loss
                                     for e in (engine, resumed)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bf16_checkpoints")
    return spawn_ranks(functools.partial(_worker, folder=str(folder)), WORLD)


@pytest.mark.parametrize("zero", ZERO_STAGES)
def test_bytes_per_parameter_are_megatron_s(runs, zero):
    """Weights, gradients, masters and moments held at the step, counted on the engine's real
    tensors, are the formula's bytes per parameter times the model's parameters, and
    rank_states' (between steps) with the fp32 gradient shards ZeRO 2/3 hold at the step."""
    from orchestrator.models.config import ModelConfig
    from orchestrator.workload.params import rank_chunks
    from orchestrator.workload.states import rank_states

    model = ModelConfig(**MODEL)
    layout = _layout(zero)
    total = sum(p.local_numel for chunk in rank_chunks(model, layout, 0) for p in chunk)
    for rank in range(WORLD):
        held, counters = runs[f"held {zero} {rank}"]
        states = rank_states(model, layout, rank, dtype="bf16")
        shards = 4 * total // WORLD if zero >= 2 else 0
        assert held + counters == (states.params + states.master + states.grads + states.optim
                                   + shards)
        assert held == BYTES_PER_PARAM[zero](WORLD) * total, (
            f"ZeRO-{zero} rank {rank}: {held / total:.3f} B per parameter, want "
            f"{BYTES_PER_PARAM[zero](WORLD)}")
        # ZeRO-3's weights are FSDP2's fp32 shards (cast to bf16 for the all-gather)
        assert runs[f"weights {zero} {rank}"] == (["torch.float32"] if zero == 3
                                                 else ["torch.bfloat16"])


@pytest.mark.parametrize("zero", ZERO_STAGES)
def test_messages_are_the_workload_models_under_bf16(runs, zero):
    """Every collective of a bf16 step is rank_comms' (op, bytes, dtype), the parameter
    all-gather after the step (ZeRO 1/2) and FSDP2's (ZeRO 3) in bf16, the gradients fp32."""
    from collections import Counter

    from orchestrator.models.config import ModelConfig
    from orchestrator.workload.comm import rank_comms

    model = ModelConfig(**MODEL)
    layout = _layout(zero)
    for rank in range(WORLD):
        recorded = Counter(runs[f"comms {zero} {rank}"])
        predicted = Counter()
        for c in rank_comms(model, layout, rank, dtype="bf16"):
            predicted[(c.op, c.bytes, c.dtype)] += c.count
        assert recorded == predicted, f"ZeRO-{zero} rank {rank}"
        gathers = {d for (op, _, d) in recorded if op == "all_gather"}
        assert gathers == (set() if zero == 0 else {"bf16"})
        # the gradient buckets' (the step's loss and norm reduce float64 scalars)
        grads = {d for (op, _, d) in recorded if op in ("all_reduce", "reduce_scatter")}
        assert grads - {"fp64"} == {"fp32"}


@pytest.mark.parametrize("zero", ZERO_STAGES)
def test_bf16_training_loss_is_finite_and_the_same_on_every_rank(runs, zero):
    for step in range(2):
        losses = {runs[f"loss {zero} {rank} {step}"] for rank in range(WORLD)}
        assert len(losses) == 1 and all(0 < loss < 10 for loss in losses)


@pytest.mark.parametrize("zero", ZERO_STAGES)
def test_a_bf16_checkpoint_saves_the_fp32_masters_and_resumes_the_same_step(runs, zero):
    """What a checkpoint keeps of bf16 weights is their fp32 masters; an engine that loads it
    (built from another seed) takes the same next step, to the bit."""
    for rank in range(WORLD):
        assert runs[f"saved dtypes {zero} {rank}"] == ["torch.float32"]
        trained, resumed = runs[f"resumed {zero} {rank}"]
        assert resumed == trained, f"ZeRO-{zero} rank {rank}"


def test_zero3_keeps_only_gradient_shards_through_gradient_accumulation():
    """Without a pipeline ZeRO-3 reduce-scatters every micro-batch's gradients (FSDP2's
    default, Megatron-FSDP's): through 8 micro-batches a rank holds its fp32 gradient shards
    (4 / dp bytes per parameter) beside one unit's fresh gradients, never the whole model's
    unsharded (4 bytes per parameter; Galvatron's llama-7b pick on 8 x 36 GB held 25 GiB of
    them). The walk (rank_memory), which tests/test_train_engine.py checks against the
    engine's live tensors, with no activations to isolate the gradients."""
    from orchestrator.layout import ParallelLayout
    from orchestrator.models.config import ModelConfig
    from orchestrator.workload.memory import BlockActivations, rank_memory
    from orchestrator.workload.params import rank_chunks
    from orchestrator.workload.states import fsdp_shards, rank_parameters

    model = ModelConfig(**{**MODEL, "layers": 8})
    layout = ParallelLayout.uniform(8, 1, 1, 8, micro_batch_size=1, num_micro_batches=8,
                                    zero=3)
    total = sum(p.local_numel for chunk in rank_chunks(model, layout, 0) for p in chunk)
    walked = rank_memory(model, layout, 0, BlockActivations(0.0, 0.0, 0.0, elem_bytes=2),
                         dtype="bf16")
    shard = sum(fsdp_shards(rank_parameters(model, layout, 0), layout, 0))
    assert "gradient accumulators" not in walked.at_peak, dict(walked.at_peak)
    assert walked.peak - walked.states.total < 4 * total / 2, dict(walked.at_peak)
    assert walked.at_peak.get("sharded gradients", 4 * shard) <= 4 * shard
