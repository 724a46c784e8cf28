"""Activation memory and communication buffers (bytes per device).

ActivationBytes holds one layer's bytes per token by recompute mode; the stage sums put
in-flight micro-batches, recompute and the layer being rerun together. For search.engine=
megatron the bytes are Megatron-Core's layer (terms/megatron_memory.py); our engine's come
from its memory model (workload/memory.py), not from here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ActivationBytes:
    """Stored activation bytes per token of one layer on one TP rank, by recompute mode."""

    none: float
    selective: float
    full: float


def _per_token(act: ActivationBytes, n, mode_code, k):
    """(stored, working) bytes per token of a stage of n layers (numpy arrays broadcast):
    what a micro-batch keeps (selective: every layer at `act.selective`; full: k layers keep
    their input, the other n - k everything), and one layer's worth while it is recomputed."""
    n = np.asarray(n, dtype=float)
    k = np.asarray(k, dtype=float)
    mode_code = np.asarray(mode_code)
    stored = np.where(mode_code == 1, n * act.selective,
                      np.where(mode_code == 2, k * act.full + (n - k) * act.none,
                               n * act.none))
    working = np.where(mode_code == 1, act.none - act.selective,
                       np.where(mode_code == 2, act.none - act.full, 0.0))
    return stored, working


def stage_activation_bytes(act: ActivationBytes, tokens: float, in_flight, n, mode_code, k):
    """Peak activation bytes of a stage of n layers (numpy arrays broadcast): `in_flight`
    micro-batches of `tokens` tokens each holding the stored activations, plus one layer's
    worth while it is recomputed (_per_token)."""
    stored, working = _per_token(act, n, mode_code, k)
    return tokens * (in_flight * stored + working)


def short_end_stage_activation_bytes(act: ActivationBytes, tokens: float, pairs: np.ndarray, n,
                                     v: int, mode_code, k):
    """Peak activation bytes of an end stage of n layers whose v chunks are ceil(n / v) layers
    each but one short one of s = n - (v - 1) ceil(n / v) (layout.stage_chunks; numpy arrays
    broadcast): the most, over `pairs` (schedule.chunk_in_flight_pairs: short chunks, other
    chunks in flight), of what those chunks keep, plus one layer's worth while it is
    recomputed. Full recompute of k layers is r layers of each chunk, all of a shorter one
    (layout.chunk_recompute: k = v r up to r = s, then s + (v - 1) r). Equal chunks (s =
    ceil(n / v)): stage_activation_bytes with the most chunks in flight / v."""
    n = np.asarray(n, dtype=float)
    k = np.asarray(k, dtype=float)
    c = np.ceil(n / v)
    s = n - (v - 1) * c
    r = np.where(k <= v * s, k / v, (k - s) / (v - 1))
    stored_s, working = _per_token(act, s, mode_code, np.minimum(r, s))
    stored_c, _ = _per_token(act, c, mode_code, np.minimum(r, c))
    shape = (-1,) + (1,) * np.ndim(stored_c)
    short, other = pairs[:, 0].reshape(shape), pairs[:, 1].reshape(shape)
    return tokens * (np.max(short * stored_s + other * stored_c, axis=0) + working)


def micro_batch_activation_bytes(act: ActivationBytes, tokens, n, mode_code, k):
    """(stored, working) bytes of one micro-batch of `tokens` tokens on a stage of n layers:
    what it keeps while in flight, and what it needs on top while a layer is recomputed
    (stage_activation_bytes = in_flight x stored + working)."""
    stored, working = _per_token(act, n, mode_code, k)
    return tokens * stored, tokens * working


def zero_buffer_bytes(zero: int, dp: int, layer_param_bytes: float) -> float:
    """ZeRO 3's communication buffers (bytes): two layers' gathered parameters (current +
    prefetch)."""
    return 2 * layer_param_bytes if zero >= 3 and dp > 1 else 0.0


def tp_buffer_bytes(tp: int, tp_message_bytes):
    """Tensor parallelism's communication buffer (bytes): one gathered activation."""
    return tp_message_bytes if tp > 1 else 0.0 * tp_message_bytes


def comm_buffer_bytes(zero: int, dp: int, tp: int, layer_param_bytes: float,
                      tp_message_bytes: float) -> float:
    """Communication buffers (bytes): ZeRO 3's (zero_buffer_bytes) and tensor parallelism's
    (tp_buffer_bytes)."""
    return zero_buffer_bytes(zero, dp, layer_param_bytes) + tp_buffer_bytes(tp, tp_message_bytes)
