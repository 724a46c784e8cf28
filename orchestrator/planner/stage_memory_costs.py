"""Memory per device of a config's stages (bytes): StageMemoryCosts, the byte half of
cost_model.StageCosts (which inherits it and sets what it reads: the key, the profile's states
sharded by ZeRO, the in-flight micro-batches, the activations of _price_micro_batch).

By kind, for engine=megatron: params / grads / optim from the profile's per-TP-rank bytes sharded
over dp by ZeRO stage; activations = in-flight micro-batches times the stage's per-micro-batch
activations for its recompute (Megatron-Core's layer, terms/megatron_memory.py, in the compute
dtype; an end stage's short chunk at its own layers: the most its chunks keep at once under the
schedule), plus one layer's worth while it is recomputed, the token ids on the first stage and the
loss's logits on the last; comm_buffers; reserve (CostOptions.reserve_bytes). The orchestrator
engine's is workload/memory.py's closed form (every byte it holds, checked against real steps),
fed the model profile's activations.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from orchestrator.choices import Recompute
from orchestrator.models.config import ModelConfig, vocab_rows
from orchestrator.planner.model_cost import ModelCost
from orchestrator.planner.options import ConfigKey, CostOptions
from orchestrator.planner.schedule import chunk_in_flight_pairs
from orchestrator.planner.terms import as_value
from orchestrator.planner.terms.megatron_memory import (
    LayerShape, embedding_activation_bytes_per_token,
    layer_activation_bytes_per_token, loss_activation_bytes_per_token)
from orchestrator.planner.terms.memory import (ActivationBytes, micro_batch_activation_bytes,
                                               short_end_stage_activation_bytes,
                                               stage_activation_bytes)
from orchestrator.planner.terms.moe import activation_delta_bytes, moe_imbalance
from orchestrator.planner.terms.pipeline import on_end_stages
from orchestrator.workload.memory import BlockActivations
from orchestrator.workload.stage_memory import StageMemory


def _block_activations(key: ConfigKey, model: ModelCost, block, seq_len, micro_batch_size,
                       imbalance: float) -> BlockActivations:
    """A layer's activations per micro-batch of `micro_batch_size` sequences of `seq_len`
    tokens on one rank (the model profile's, per token at the rank's s / cp, counted in the
    profile's dtype; a MoE block's FFN in block 0's FFN's place), by recompute mode: what
    workload/memory.py's closed form starts from. Floats, or arrays over micro-batches."""
    local = seq_len // key.cp  # a rank's tokens of each sequence
    tokens = as_value(local * micro_batch_size)
    per_mode = [block.act_bytes_per_token_at(mode, local) * tokens
                for mode in Recompute]
    if model.moe is not None:  # the MoE FFN's activations in block 0's FFN's place
        delta = activation_delta_bytes(model, model.moe, seq_len, micro_batch_size, key.tp,
                                       key.cp, key.etp, imbalance)
        per_mode = [per_mode[0] + delta, per_mode[1] + delta, per_mode[2]]
    return BlockActivations(*per_mode, elem_bytes=model.dtype_bytes)


def _engine_memory(key: ConfigKey, model: ModelCost, block, seq_len: int,
                   options: CostOptions) -> StageMemory:
    """workload/memory.py's closed form for this config, fed the model profile's activations
    (_block_activations)."""
    act = _block_activations(key, model, block, seq_len, key.micro_batch_size,
                             moe_imbalance(model, options))
    return StageMemory(engine_config(model, seq_len), key, act, options.dtype or model.dtype,
                       options.device, seq_len)


def engine_config(model: ModelCost, seq_len: int) -> ModelConfig:
    """The profiled model's shape as the workload model reads it (with its experts)."""
    moe = {}
    if model.moe is not None:
        shape = model.moe
        moe = dict(experts=shape.experts, top_k=shape.top_k, expert_ffn=shape.width,
                   shared_expert_ffn=shape.shared_width, dense_layers=shape.dense_layers,
                   capacity_factor=shape.capacity_factor, aux_loss_coef=shape.aux_loss_coef)
    return ModelConfig(name=model.name, hidden=model.hidden, ffn=model.ffn, layers=model.layers,
                       heads=model.heads, kv_heads=model.kv_heads, vocab=model.vocab,
                       make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
                       seq_len=seq_len, dtype=model.dtype, **moe)


class StageMemoryCosts:
    """The memory methods of StageCosts (its docstring: elementwise over stage index j, layer
    count n, recompute code and k)."""

    def _megatron_activations(self, model: ModelCost, seq_len, micro_batch_size) -> None:
        """Megatron-Core's activations (terms/megatron_memory.py): a layer's bytes per token by
        recompute mode (a MoE block's FFN in the dense FFN's place), the token ids each
        in-flight micro-batch keeps on the first stage, the loss's logits on the last."""
        key = self.key
        shape = LayerShape(model.hidden, model.heads, model.kv_heads, model.ffn)
        elem = self.compute_dtype.bytes
        self.act = ActivationBytes(*(layer_activation_bytes_per_token(
            shape, key.tp, key.sequence_parallel, mode, elem) for mode in Recompute))
        if self.moe is not None:
            delta = activation_delta_bytes(model, self.moe, seq_len, micro_batch_size, key.tp,
                                           key.cp, key.etp, self.imbalance) / self.tokens
            self.act = ActivationBytes(self.act.none + delta, self.act.selective + delta,
                                       self.act.full)
        self.first_stage_act = on_end_stages(
            self.tokens * embedding_activation_bytes_per_token(), 0.0 * self.tokens, key.pp)
        self.other_act = on_end_stages(
            0.0 * self.tokens,
            self.tokens * loss_activation_bytes_per_token(model.hidden,
                                                          vocab_rows(model, key.tp), key.tp,
                                                          key.sequence_parallel, elem),
            key.pp)

    @property
    def block_activations(self) -> BlockActivations:
        """A layer's activations per micro-batch by recompute mode, as the engine's memory
        model takes them (_block_activations)."""
        return _block_activations(self.key, self.model, self._block, self.seq_len,
                                  self.micro_batch_size, self.imbalance)

    @property
    def engine_memory(self) -> Optional[StageMemory]:
        """workload/memory.py's closed form of this config (orchestrator engine), else None."""
        if self._engine_memory is None and self._engine_memory_args is not None:
            self._engine_memory = _engine_memory(*self._engine_memory_args)
        return self._engine_memory

    @property
    def comm_buffers(self) -> np.ndarray:
        """Per stage: communication and receive buffers (orchestrator engine: the workload
        model's, pipeline receive buffers and inputs)."""
        memory = self.engine_memory
        return memory.buffers if memory is not None else self._comm_buffers

    def activation_bytes(self, j: int, n, mode_code, k):
        """Peak activation bytes of stage j. Orchestrator engine: everything its ranks hold at
        their peak beyond the states (activations in flight, gradients being accumulated, the
        loss's logits, recompute, the optimizer's temporaries: workload/memory.py). Megatron:
        in-flight micro-batches x stored activations (and token ids on the first stage), one
        layer's worth while it is recomputed, and the loss's on the last stage; an end stage
        with a short chunk holds the most of its chunks' own bytes Megatron's schedule keeps at
        once (terms/memory.short_end_stage_activation_bytes)."""
        if self.engine_memory is not None:
            return self.engine_memory.peak_above_states(j, n, mode_code, k)
        layers = stage_activation_bytes(self.act, self.tokens, self.in_flight[j], n, mode_code,
                                        k)
        if self.short_ends:
            # The end stages may run a short chunk (layout.stage_chunks: the first stage's
            # first, the last stage's last): what Megatron's schedule holds of each chunk
            # (schedule.chunk_in_flight_pairs); middle stages run equal chunks.
            key = self.key
            p, v = key.pp, key.virtual_stages
            ends = [short_end_stage_activation_bytes(
                self.act, self.tokens, chunk_in_flight_pairs(p, stage, key.num_micro_batches,
                                                             v, chunk), n, v, mode_code, k)
                    for stage, chunk in ((0, 0), (p - 1, v - 1))]
            j_arr = np.asarray(j)
            layers = np.where(j_arr == 0, ends[0], np.where(j_arr == p - 1, ends[1], layers))
        return layers + self.in_flight[j] * self.first_stage_act[j] + self.other_act[j]

    def micro_batch_bytes(self, n, mode_code):
        """Per micro-batch of at()'s, on every stage (n: each stage's layers as a column
        [pp, 1]; mode_code [K]: its recompute on every layer): (stored, extra) [pp, K] bytes,
        what one keeps while in flight and what it needs on top while it runs, so a stage holds
        fixed_bytes + in-flight stored + the largest extra (the dynamic planner's memory, where
        activation_bytes places each by the schedule). Orchestrator engine: workload/memory.py's
        (StageMemory.micro_batch_bytes, gradients accumulating from the first micro-batch on
        in extra); Megatron: the stored activations, and the layer being recomputed, the LM
        head's activations on the last stage and the TP buffer."""
        if self.engine_memory is not None:
            stored, extra, fixed = self.engine_memory.micro_batch_bytes(
                n[:, 0], self.block_activations, self.tokens, self.micro_batch_size, mode_code)
            return stored, extra + fixed[:, None]
        stored, working = micro_batch_activation_bytes(self.act, self.tokens, n, mode_code, n)
        return stored + self.first_stage_act, working + self.other_act + self.tp_buffer

    def fixed_bytes(self, j, n):
        """What stage j of n layers holds whatever its micro-batches (bytes): params, grads,
        optim, the buffers no micro-batch sizes (ZeRO 3's gathered layers; the engine's
        receive buffers and inputs) and the reserve; micro_batch_bytes adds theirs."""
        params, grads, optim = self.static_bytes(j, n)
        buffers = (self.engine_memory.buffers[j] if self.engine_memory is not None
                   else self._zero_buffers)
        return params + grads + optim + buffers + self.reserve

    def tail_bytes(self, j, n):
        """Stage j's bytes beyond its states after the last backward (the orchestrator
        engine's gradient norm, optimizer step and ZeRO buckets: workload/memory.py; 0 for
        Megatron)."""
        if self.engine_memory is not None:
            return self.engine_memory.tail_above_states(j, n)
        return np.zeros(np.shape(np.asarray(n)))

    def static_bytes(self, j: int, n):
        """(params, grads, optim) bytes of stage j holding n layers, after ZeRO sharding
        (orchestrator engine: its parameters (bf16 under bf16) with the fp32 masters AdamW
        updates, its gradient buckets and moments, workload/stage_memory.py)."""
        n = np.asarray(n, dtype=float)
        if self.engine_memory is not None:
            states = self.engine_memory.states(j, n)
            return states["params"], states["grads"], states["optim"]
        (layer_p, layer_g, layer_o), (other_p, other_g, other_o) = (self.layer_static,
                                                                    self.other_static)
        return n * layer_p + other_p[j], n * layer_g + other_g[j], n * layer_o + other_o[j]

    def total_bytes(self, j, params, grads, optim, activations):
        """Sum of the memory kinds of stage(s) j (bytes), in the one order every caller uses."""
        return params + grads + optim + activations + self.comm_buffers[j] + self.reserve

    def memory_bytes(self, j: int, n, mode_code, k):
        """Total bytes per device of stage j: params + grads + optim + activations + buffers +
        reserve."""
        params, grads, optim = self.static_bytes(j, n)
        return self.total_bytes(j, params, grads, optim,
                                self.activation_bytes(j, n, mode_code, k))
