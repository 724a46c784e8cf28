"""Per-micro-batch pricing for dynamic micro-batching: the cost model's terms (planner/terms/),
vectorised over many micro-batches of b sequences padded to s tokens under a recompute mode.

The arithmetic is StageCosts' (cost_model.py) with (micro_batch_size, seq_len) turned into
arrays: for m equal micro-batches the plan's time and memory equal evaluate(simulate=True)'s.
What does not depend on the micro-batch (static memory, gradient sync, optimizer step) is read
from one StageCosts of the layout itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from orchestrator.choices import Recompute
from orchestrator.layout import ParallelLayout
from orchestrator.planner.cost_model import (ConfigKey, CostOptions, StageCosts,
                                             check_layout_for_model)
from orchestrator.planner.profiles import HardwareModel, ModelCost
from orchestrator.planner.schedule import in_flight_micro_batches
from orchestrator.planner.terms import FwdBwd, overlap_extra_us
from orchestrator.planner.terms.memory import ActivationBytes, comm_buffer_bytes
from orchestrator.planner.terms.pipeline import boundary_intra_node
from orchestrator.planner.terms.tp_comm import TpComm
from orchestrator.planner.terms.zero import ZeroTraffic
from orchestrator.workload.comm import layer_activation_bytes, pp_message_bytes, tp_messages

@dataclass(frozen=True)
class PricedMicroBatches:
    """K micro-batches priced on p stages; arrays [p, K] (us or bytes).

    fwd_us / bwd_us: per-stage forward / backward (recompute included) without pipeline sends
    (what simulate() takes); boundary_us: one send across boundary j -> j+1 (row p - 1: the
    interleaved wrap-around); stage_time_us: forward + backward with the stage's sends (the
    cost model's t_j); stored_bytes: activations one in-flight micro-batch keeps on the stage;
    extra_bytes: what it needs on top while it runs (the layer being recomputed, the LM head's
    activations on the last stage, the TP gathered activation); sync_window_us: the backward
    (recompute excluded) that hides the gradient sync when it is the stage's last."""

    fwd_us: np.ndarray
    bwd_us: np.ndarray
    boundary_us: np.ndarray
    stage_time_us: np.ndarray
    stored_bytes: np.ndarray
    extra_bytes: np.ndarray
    sync_window_us: np.ndarray

    def take(self, index) -> "PricedMicroBatches":
        """The micro-batches at `index` (columns), in that order."""
        return PricedMicroBatches(*(getattr(self, f)[:, index] for f in self.__dataclass_fields__))


def _ends(first, last, pp: int, k: int) -> np.ndarray:
    """[pp, k]: `first` on stage 0, `last` on stage pp - 1 (both on a single stage)."""
    out = np.zeros((pp, k))
    out[0] += first
    out[pp - 1] += last
    return out


def _p2p_line(hardware: HardwareModel, intra: bool, pp: int) -> Tuple[float, float]:
    """(alpha_us, us_per_byte) of p2p_time_us, which is linear in the bytes: read from two sizes."""
    one = hardware.p2p_time_us(1.0, intra, pp)
    per_byte = hardware.p2p_time_us(2.0, intra, pp) - one
    return one - per_byte, per_byte


class MicroBatchCosts:
    """Prices micro-batches of one (layout, model, hardware): built once, then price(b, s, mode)
    on arrays of any length. The layout's micro_batch_size, num_micro_batches and recompute are
    not used (each micro-batch brings its own)."""

    def __init__(self, layout: ParallelLayout, model: ModelCost, hardware: HardwareModel,
                 options: CostOptions = CostOptions()):
        check_layout_for_model(layout, model)
        self.layout, self.model, self.hardware, self.options = layout, model, hardware, options
        self.pp, self.tp, self.v = layout.pp, layout.tp, layout.virtual_stages
        self.n = np.array(layout.layers_per_stage, dtype=float)[:, None]
        whole = StageCosts(ConfigKey.of(layout), model, hardware, model.seq_len, options)
        self.compute_dtype, self.residual_dtype = whole.compute_dtype, whole.residual_dtype
        j = np.arange(self.pp)
        params, grads, optim = whole.static_bytes(j, self.n[:, 0])
        block, _ = model.memory(layout.tp)
        # The orchestrator engine's memory is workload/memory.py's (whole.engine_memory);
        # Megatron's keeps the Korthikanti-style terms below.
        self.engine_memory = whole.engine_memory
        if self.engine_memory is not None:
            zero_buffers = whole.comm_buffers  # the pipeline's receive buffers, inputs
        else:
            zero_buffers = comm_buffer_bytes(layout.zero, layout.dp, layout.tp,
                                             block.param_bytes, 0.0)
        # Everything but activations and the TP buffer: params, grads, optim, ZeRO 3's gathered
        # layers, the reserve (bytes per stage).
        self.static_bytes = params + grads + optim + zero_buffers + whole.reserve
        self.tail_bytes = (self.engine_memory.tail_above_states(j, self.n[:, 0])
                           if self.engine_memory is not None else np.zeros(self.pp))
        self.dp_sync_us, self.dp_after_step_us = whole.dp_sync_parts_us(j, self.n[:, 0])
        self.optimizer_us = whole.optimizer_us(j, self.n[:, 0])
        self.overlap_coe = hardware.overlap_coe
        self.in_flight = in_flight_micro_batches(layout.schedule, layout.pp, 1 << 30, self.v)
        self.block_traffic = ZeroTraffic.from_hardware(hardware, layout.zero, layout.dp,
                                                       layout.tp, whole.block_param_bytes,
                                                       whole.block_grad_bytes, options.engine,
                                                       layout.pp, layout.num_micro_batches)
        other = ZeroTraffic.from_hardware(hardware, layout.zero, layout.dp, layout.tp,
                                          whole.other_param_bytes, whole.other_grad_bytes,
                                          options.engine, layout.pp, layout.num_micro_batches)
        per_stage = np.zeros((self.pp, 1))  # the traffic per stage, as a column
        self.other_traffic = (ZeroTraffic(
            per_stage + np.reshape(other.gather_us, (-1, 1)),
            per_stage + np.reshape(other.reduce_scatter_us, (-1, 1)),
            gather_bwd_us=(None if other.gather_bwd_us is None
                           else per_stage + np.reshape(other.gather_bwd_us, (-1, 1))))
            if other.active else other)
        intra = boundary_intra_node(layout.pp, layout.tp * layout.dp, hardware.tasks_per_node)
        # One stage sends nothing: a one-rank profile has no p2p fit to read.
        self.p2p_lines = (np.array([_p2p_line(hardware, x, layout.pp) for x in intra])
                          if layout.pp > 1 else np.zeros((len(intra), 2)))
        # Row s - 1: one sequence of s tokens (see _per_sequence); grown on demand.
        self._per_seq = np.zeros((0, 8))

    def _per_sequence(self, s: np.ndarray) -> np.ndarray:
        """[len(s), 8] for sequences of s tokens: the attention core (us); stored bytes per
        token of a layer for none, selective, full; the LM head's per token; the profile's own
        per-token bytes of a layer for none, selective, full (what the engine's memory model
        starts from). Computed for every length up to max(s) at once, then looked up. (Block
        and "other" times are priced per micro-batch in price: a call's constant once.)"""
        longest = int(np.max(s, initial=0))
        have = len(self._per_seq)
        if longest > have:
            m, tp = self.model, self.tp
            block, other = m.memory(tp)
            new = np.arange(have + 1, max(longest, 2 * have) + 1)
            act = ActivationBytes.from_block(block, new, tp, self.layout.sequence_parallel,
                                             m.hidden, m.dtype_bytes)
            columns = (m.attention_core_fwd_us(new, tp), act.none, act.selective, act.full,
                       other.act_bytes_per_token_at(Recompute.none, new),
                       *(block.act_bytes_per_token_at(mode, new)
                         for mode in Recompute))
            rows = np.stack([np.broadcast_to(np.asarray(c, dtype=float), new.shape)
                             for c in columns], axis=1)
            self._per_seq = np.concatenate([self._per_seq, rows])
        return self._per_seq[np.asarray(s) - 1]

    def _tp_comm(self, tokens: np.ndarray) -> TpComm:
        """TpComm.from_hardware for micro-batches of `tokens` tokens (an array)."""
        cal = self.options.calibration
        messages = tp_messages(self.options.engine, self.layout.sequence_parallel, tokens,
                               self.model.hidden, self.compute_dtype)
        return TpComm.from_hardware(self.hardware, self.tp, messages, cal.tp_latency,
                                    cal.tp_bandwidth)

    def price(self, b, s, mode_code) -> PricedMicroBatches:
        """Price K micro-batches: b[k] sequences padded to s[k] tokens, recompute
        mode_code[k] (terms.MODE_CODES: 0 none, 1 selective, 2 full) on every layer of every
        stage."""
        b = np.asarray(b, dtype=float)
        s = np.asarray(s, dtype=np.int64)
        code = np.asarray(mode_code)[None, :]
        (attn, a_none, a_sel, a_full, a_head,
         *profile_per_token) = self._per_sequence(s).T
        m, pp, v, n = self.model, self.pp, self.v, self.n
        tokens = b * s
        tp_bytes = layer_activation_bytes(tokens, m.hidden, self.residual_dtype)
        tpc = self._tp_comm(tokens)
        # A micro-batch is one call: the fits' constant once, the rest per sequence (ModelCost).
        tp = self.tp
        bf, bb = m.block_fwd_us(s, tp, b), m.block_bwd_us(s, tp, b)
        of, ob = m.other_fwd_us(s, tp, b), m.other_bwd_us(s, tp, b)
        window = FwdBwd(bf, bb) + tpc.layer
        layer = window + self.block_traffic.exposed(window, self.overlap_coe)
        share = self.options.other_time_first_share
        k = len(b)
        other_window = (FwdBwd(_ends(share * of, (1 - share) * of, pp, k),
                               _ends(share * ob, (1 - share) * ob, pp, k))
                        + FwdBwd(_ends(tpc.embedding.fwd_us, tpc.head.fwd_us, pp, k),
                                 _ends(tpc.embedding.bwd_us, tpc.head.bwd_us, pp, k)))
        other_t = other_window + self.other_traffic.exposed(other_window, self.overlap_coe)
        full_us = n * (bf + tpc.recompute_us)  # the forward and the TP it repeats
        recompute = np.where(code == 1, n * (b * attn), np.where(code == 2, full_us, 0.0))
        fwd = n * layer.fwd_us + other_t.fwd_us
        bwd = n * layer.bwd_us + recompute + other_t.bwd_us
        p2p_bytes = pp_message_bytes(tokens, m.hidden, self.tp, self.layout.sequence_parallel,
                                     self.residual_dtype)
        if pp == 1:
            boundary = np.zeros((1, k))
        else:
            boundary = self.p2p_lines[:, :1] + p2p_bytes[None, :] * self.p2p_lines[:, 1:]
        inner, wrap = v * boundary[:-1], (v - 1) * boundary[-1:]
        sends = np.concatenate([inner, wrap]) + np.concatenate([wrap, inner])
        if self.engine_memory is not None:
            stored, extra, fixed = self.engine_memory.micro_batch_bytes(
                self.n[:, 0], tokens, profile_per_token, code[0])
            extra = extra + fixed[:, None]
        else:
            stored_per_token = np.where(code == 1, n * a_sel, np.where(code == 2, n * a_full,
                                                                        n * a_none))
            stored = tokens * stored_per_token
            working = np.where(code == 1, a_none - a_sel,
                               np.where(code == 2, a_none - a_full, 0.0))
            extra = tokens * working + _ends(0.0, tokens * a_head, pp, k)
            if self.tp > 1:
                extra = extra + tp_bytes
        return PricedMicroBatches(fwd_us=fwd, bwd_us=bwd, boundary_us=boundary,
                                  stage_time_us=fwd + bwd + sends,
                                  stored_bytes=np.broadcast_to(stored, (pp, k)).astype(float),
                                  extra_bytes=np.broadcast_to(extra, (pp, k)).astype(float),
                                  sync_window_us=n * layer.bwd_us + other_t.bwd_us)

    def alone_bytes(self, priced: PricedMicroBatches) -> np.ndarray:
        """[p, K]: a stage's memory (bytes) if every in-flight micro-batch were this one (or its
        tail after the backward, when larger)."""
        return self.static_bytes[:, None] + np.maximum(
            self.in_flight[:, None] * priced.stored_bytes + priced.extra_bytes,
            self.tail_bytes[:, None])

    def tail_us(self, sync_window_us: np.ndarray) -> np.ndarray:
        """Per stage: exposed gradient sync after the last backward (whose window is given, 0
        with no micro-batch) + optimizer step + the sync after it (ZeRO 1/2's parameter
        all-gather in the orchestrator engine) (us)."""
        return (overlap_extra_us(sync_window_us, self.dp_sync_us, self.overlap_coe)
                + self.dp_after_step_us + self.optimizer_us)


# ====================================================================== candidate runs
def padded_length(length, multiple: int, max_seq_len: int):
    """Length rounded up to `multiple`, never above max_seq_len (ints or numpy arrays)."""
    return np.minimum(-(-np.asarray(length) // multiple) * multiple, max_seq_len)


def pack_rows(lengths: Sequence[int], row_len: int) -> List[Tuple[int, ...]]:
    """Samples in the order given concatenated into rows of at most row_len tokens; a sample
    longer than what is left of a row starts a new row (no splitting). Returns each row's
    sample positions."""
    rows, row, used = [], [], 0
    for index, length in enumerate(lengths):
        if row and used + length > row_len:
            rows.append(tuple(row))
            row, used = [], 0
        row.append(index)
        used += length
    if row:
        rows.append(tuple(row))
    return rows


def row_counts(lengths: np.ndarray, row_len_by_end: np.ndarray,
               bounds: np.ndarray) -> np.ndarray:
    """[g, g] for the g ascending split positions `bounds` (in [0, n]): counts[a, c] =
    len(pack_rows(lengths[bounds[a]:bounds[c]], row_len_by_end[c])) for a < c (0 elsewhere;
    row_len_by_end[0] is unused). Exact, for every run at once: a row starting at sample k
    ends where the prefix sums pass its length, and the rows of [i, j) are the jumps from i
    that stay below j, counted by pointer doubling (O(g^2 log n))."""
    n = len(lengths)
    prefix = np.concatenate([[0], np.cumsum(lengths)])
    # jump[c, k]: end of the row starting at k under row_len_by_end[c] (one sample at least).
    jump = np.searchsorted(prefix, prefix[None, :] + np.asarray(row_len_by_end)[:, None],
                           side="right") - 1
    jump = np.minimum(np.maximum(jump, np.arange(n + 1) + 1), n)
    levels = [jump]
    for _ in range(max(1, n.bit_length()) - 1):
        levels.append(np.take_along_axis(levels[-1], levels[-1], axis=1))
    g = len(bounds)
    cur = np.broadcast_to(bounds[None, :], (g, g)).copy()
    count = np.ones((g, g), dtype=np.int64)
    for level in range(len(levels) - 1, -1, -1):
        nxt = np.take_along_axis(levels[level], cur, axis=1)
        move = nxt < bounds[:, None]
        cur = np.where(move, nxt, cur)
        count += move.astype(np.int64) << level
    return np.where(bounds[:, None] < bounds[None, :], count.T, 0)


@dataclass(frozen=True)
class Candidates:
    """Every run [bounds[a], bounds[c]) of a sorted batch of n between split positions `bounds`
    (default all of 0..n), as the fastest micro-batch that fits: t_us[a, c] the bottleneck
    stage's forward + backward (inf: none fits or c <= a), mode[a, c] its recompute code,
    row_len[a, c] its rows' length (tokens) and rows[a, c] their count (as many as samples:
    one sample per row, padded; fewer: samples packed into rows)."""

    t_us: np.ndarray
    mode: np.ndarray
    row_len: np.ndarray
    rows: np.ndarray
    bounds: np.ndarray


def fastest_fitting(costs: MicroBatchCosts, b: np.ndarray, s: np.ndarray,
                    budget: float) -> Tuple[np.ndarray, np.ndarray]:
    """(t_us[K], mode[K]): each micro-batch's (b[k] rows of s[k] tokens) bottleneck time under
    the fastest recompute whose alone_bytes fit `budget` on every stage (inf, 0: none fits).
    Recompute only adds time, so modes are tried in order, each priced only where the
    previous did not fit."""
    t_us, mode = np.full(len(b), np.inf), np.zeros(len(b), dtype=np.int64)
    todo = np.arange(len(b))
    for code in range(3):
        if not len(todo):
            break
        priced = costs.price(b[todo], s[todo], np.full(len(todo), code))
        fits = (costs.alone_bytes(priced) <= budget).all(axis=0)
        t_us[todo[fits]] = priced.stage_time_us.max(axis=0)[fits]
        mode[todo[fits]] = code
        todo = todo[~fits]
    return t_us, mode


def price_candidates(costs: MicroBatchCosts, sorted_lengths: np.ndarray,
                     sorted_padded: np.ndarray, budget: float, max_seq_len: int,
                     bounds: Optional[np.ndarray] = None) -> Candidates:
    """Every run between split positions `bounds` (default 0..n) of the ascending lengths
    (sorted_padded: each rounded up), priced as its samples packed by pack_rows into rows of
    the run's padded length (at worst one sample per row: padded) or into rows of
    max_seq_len, whichever is faster; each row is priced as one sequence of its length
    (attention over the whole row)."""
    n = len(sorted_padded)
    bounds = np.arange(n + 1) if bounds is None else np.asarray(bounds)
    g = len(bounds)
    a, c = np.triu_indices(g, k=1)
    own_len = sorted_padded[bounds[c] - 1]
    own_caps = np.concatenate([[0], sorted_padded[bounds[1:] - 1]])
    own_rows = row_counts(sorted_lengths, own_caps, bounds)[a, c]
    long_rows = row_counts(sorted_lengths, np.full(g, max_seq_len), bounds)[a, c]
    # Many runs share (rows, length): price each pair once.
    pairs, inverse = np.unique(own_rows * (max_seq_len + 1) + own_len, return_inverse=True)
    t_own, mode_own = fastest_fitting(costs, pairs // (max_seq_len + 1),
                                      pairs % (max_seq_len + 1), budget)
    t_long, mode_long = fastest_fitting(costs, np.arange(1, n + 1), np.full(n, max_seq_len),
                                        budget)
    t_own, mode_own = t_own[inverse], mode_own[inverse]
    t_long, mode_long = t_long[long_rows - 1], mode_long[long_rows - 1]
    use_long = t_long < t_own
    out = [np.zeros((g, g), dtype=dtype) for dtype in (float, np.int64, np.int64, np.int64)]
    out[0][:] = np.inf
    for array, values in zip(out, (np.where(use_long, t_long, t_own),
                                   np.where(use_long, mode_long, mode_own),
                                   np.where(use_long, max_seq_len, own_len),
                                   np.where(use_long, long_rows, own_rows))):
        array[a, c] = values
    return Candidates(*out, bounds=bounds)
