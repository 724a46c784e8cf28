"""train/build.py is the one builder of a rank's model and optimizer: train's Engine and trace
build the same optimizer (same classes, same arguments). On torch's fake backend, one rank
each: no training, no processes."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.distributed as dist
import yaml
from conftest import REPO

from orchestrator.models.config import ModelConfig
from orchestrator.trace.configs import TraceSettings, plan_configs
from orchestrator.trace.tracer import fake_world, trace_rank
from orchestrator.train import grads, optimizers

TINY = ModelConfig(name="tiny", hidden=128, ffn=384, layers=4, heads=4, kv_heads=2, vocab=512,
                   seq_len=256, dtype="bf16")
TINY_MOE = ModelConfig(**{**yaml.safe_load((REPO / "orchestrator/conf/model/tiny_moe.yaml")
                                            .read_text()), "dtype": "bf16"})


def _spec(config, model, zero: int):
    settings = TraceSettings(global_batch_size=8, micro_batch_size=1, seq_len=256,
                             sequence_parallel=config[2] > 1, zero=zero)
    specs, skipped = plan_configs([config], settings, model)
    assert not skipped, skipped
    return specs[0]


def _plain(value):
    """An optimizer argument as something two processes' runs can compare: a process group as
    its ranks, parameters as their local shapes, a part optimizer as its class."""
    if isinstance(value, dist.ProcessGroup):
        return ("group", tuple(dist.get_process_group_ranks(value)))
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return [tuple(grads.local_tensor(p).shape) for p in value]
    if isinstance(value, grads.ShardedAdamW):
        return type(value).__name__
    return value


def _optimizers_built(monkeypatch) -> list:
    """Every ShardedAdamW and ExpertAdamW made from now on: (class, its arguments, defaults
    included)."""
    made = []
    for cls in (grads.ShardedAdamW, optimizers.ExpertAdamW):
        original = cls.__init__
        signature = inspect.signature(original)

        def init(self, *args, _original=original, _signature=signature, _cls=cls, **kwargs):
            bound = _signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            made.append((_cls.__name__, {k: _plain(v) for k, v in bound.arguments.items()
                                         if k != "self"}))
            _original(self, *args, **kwargs)
        monkeypatch.setattr(cls, "__init__", init)
    return made


def _structure(chunks) -> list:
    """A rank's model chunks as what the builder decided, not the values: each module's name
    and class, each parameter's name, local shape and DTensor placements (TP, EP), the blocks
    fully recomputed, the attention cores recomputed, a MoE layer's sequence split."""
    from orchestrator.models.moe import MoE

    return [dict(modules=[(n, type(m).__name__) for n, m in chunk.named_modules()],
                 params=[(n, tuple(grads.local_tensor(p).shape),
                          tuple(str(x) for x in getattr(p, "placements", ())))
                         for n, p in chunk.named_parameters()],
                 recompute=sorted(chunk.recompute_blocks),
                 core=[b.attn.recompute_core for b in chunk.blocks.values()],
                 moe=[(getattr(m, "sequence_group", None) is not None, m.sequence_parts)
                      for m in chunk.modules() if isinstance(m, MoE)])
            for chunk in chunks]


@pytest.mark.parametrize("config,model,zero,rank", [
    ([4, 1, 1], TINY, 0, 0),  # no pipeline, no TP: ZeRO-0's norm is local (replicas_only)
    ([8, 2, 2], TINY, 2, 5),  # TP + SP over a pipeline's last stage, ZeRO-2
    # CP under TP, EP folded over them: the experts' own optimizer over EDP, the balance
    # statistics over tp x cp
    ([8, 1, 2, 2, 2], TINY_MOE, 1, 3),
])
def test_the_tracer_builds_the_engine_s_model_and_optimizer(monkeypatch, config, model, zero,
                                                             rank):
    """The same rank of the same layout, built by train's Engine and by trace: the same
    modules, parameter shards, recompute and MoE sequence split (train/build.build_chunks),
    and the same optimizers made with the same arguments (train/build.build_optimizer)."""
    from orchestrator.trace import tracer
    from orchestrator.train.engine import Engine

    spec = _spec(config, model, zero)
    made = _optimizers_built(monkeypatch)
    with fake_world(rank, spec.world_size):
        engine = Engine(spec.layout, dataclasses.replace(model, seq_len=spec.seq_len),
                        torch.device("cpu"))
    trained, train_chunks = list(made), _structure(engine.modules)
    made.clear()
    traced = []

    def recorded(*args, _build=tracer.trace_chunks, **kwargs):
        chunks = _build(*args, **kwargs)
        traced.append(_structure(chunks))
        return chunks
    monkeypatch.setattr(tracer, "trace_chunks", recorded)
    trace_rank(spec, model, rank)
    assert trained and made == trained
    assert traced == [train_chunks]


def test_train_builds_equal_chunks_only():
    """A layout with a short end chunk (Megatron-LM's) is refused where train builds its chunks
    (build.virtual_stage_layers), naming the engine that runs it; equal chunks build."""
    from orchestrator.layout import LayoutError, ParallelLayout
    from orchestrator.train.build import virtual_stage_layers

    def interleaved(layers):
        return ParallelLayout(world_size=len(layers), pp=len(layers), tp=1, dp=1,
                              num_micro_batches=len(layers), schedule="interleaved",
                              virtual_stages=2, layers_per_stage=layers)

    with pytest.raises(LayoutError, match=r"short model chunks .*search.engine=megatron"):
        virtual_stage_layers(interleaved((3, 4)))
    assert virtual_stage_layers(interleaved((4, 8))) == [2, 4, 2, 4]
