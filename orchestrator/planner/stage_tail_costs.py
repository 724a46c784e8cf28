"""What a stage adds after its last backward (us): its data-parallel gradient sync, the part of it
not hidden under that backward, and its optimizer step. StageTailCosts, the tail half of
cost_model.StageCosts (which inherits it and sets what it reads: the key, the layers' and
"other"'s bytes and backward times, the optimizer step per layer, the calibration).

The sync's formulas are terms/zero.py's, by engine: ours reduces (or reduce-scatters) the fp32
gradients beside the last micro-batch's backward and gathers the parameters after the step;
Megatron-LM's in buckets model chunk by model chunk (_megatron_exposed_us), by CostOptions'
overlap knobs.
"""
from __future__ import annotations

from functools import partial

import numpy as np

from orchestrator.choices import Engine
from orchestrator.planner.terms import overlap_extra_us
from orchestrator.planner.terms.zero import (dp_sync_parts_us, megatron_bucket_count,
                                             megatron_sync_parts_us, overlapped_sync_us)


class StageTailCosts:
    """The gradient sync and optimizer methods of StageCosts (elementwise over stage index j
    and layer count n, as its other methods)."""

    def sync_window_us(self, j: int, n):
        """The backward of stage j's last micro-batch (recompute excluded), which its gradient
        sync runs beside (us)."""
        return np.asarray(n, dtype=float) * self.layer.bwd_us + self.other.bwd_us[j]

    def dp_sync_parts_us(self, j: int, n, layers=None):
        """Stage j's data-parallel sync (us) with n layers, alone: (during its last backward,
        after the optimizer step) (terms/zero.py: dp_sync_parts_us, by engine); Megatron's as
        (its gradient collective, its parameter all-gather: megatron_sync_parts_us), of
        `layers` of the n (default all; "other" always in)."""
        n = np.asarray(n, dtype=float)
        layers = n if layers is None else np.asarray(layers, dtype=float)
        key = self.key
        parts = (megatron_sync_parts_us if self.engine == Engine.megatron
                 else partial(dp_sync_parts_us, engine=self.engine))
        during, after = parts(self.hardware, key.zero, key.replicas, key.tp,
                              layers * self.block_grad_bytes + self.other_grad_bytes[j],
                              layers * self.block_param_bytes + self.other_param_bytes[j])
        if self.moe is not None:  # then the experts' over edp (stride ep x etp)
            e_during, e_after = parts(self.hardware, key.zero, key.edp, key.ep * key.etp,
                                      layers * self.expert_grad_bytes,
                                      layers * self.expert_param_bytes)
            during, after = during + e_during, after + e_after
        return during * self.calibration.dp_sync, after * self.calibration.dp_sync

    def dp_sync_us(self, j: int, n):
        """Data-parallel sync time (us) of stage j with n layers at the end of the iteration,
        alone (both parts)."""
        during, after = self.dp_sync_parts_us(j, n)
        return during + after

    def optimizer_us(self, j: int, n):
        """Optimizer step time (us) of stage j holding n layers, on one rank after ZeRO."""
        return np.asarray(n, dtype=float) * self.block_optim_us + self.other_optim_us[j]

    def tail_us(self, j: int, n):
        """What stage j adds after its last backward: its exposed gradient sync, then its
        optimizer step (us); e_0 + o_0 of the iteration time for j = 0."""
        return self.dp_exposed_us(j, n) + self.optimizer_us(j, n)

    def dp_exposed_us(self, j: int, n, window_us=None, parts_us=None):
        """Part of stage j's gradient sync (us) not hidden under the backward of its last
        micro-batch (recompute excluded from the window): `window_us` that backward (default
        sync_window_us: this config's micro-batch), `parts_us` dp_sync_parts_us(j, n) when the
        caller has them. Megatron: _megatron_exposed_us."""
        n = np.asarray(n, dtype=float)
        window = self.sync_window_us(j, n) if window_us is None else window_us
        if self.engine == Engine.megatron:
            return self._megatron_exposed_us(j, n, window)
        during, after = self.dp_sync_parts_us(j, n) if parts_us is None else parts_us
        return overlap_extra_us(window, during, self.overlap_coe) + after

    def _megatron_exposed_us(self, j: int, n, window_us):
        """Stage j's data-parallel sync (us) left exposed by Megatron-LM (terms/zero.py's module
        docstring): with overlap_grad_reduce, its model chunk 0 (n / v layers and "other")
        reduces its gradients in buckets beside its last backward (`window_us` less the other
        chunks' layers), the other chunks beside the pp - 1 chunk backwards after them; with
        overlap_param_gather (ZeRO 1/2), the parameters are gathered alike beside the next
        iteration's first forwards; what is not overlapped is exposed whole."""
        key, overlap = self.key, self.overlap
        v = key.virtual_stages
        chunk = n / v  # chunk 0's layers
        grads0, gather0 = self.dp_sync_parts_us(j, n, chunk)
        grads, gather = self.dp_sync_parts_us(j, n)
        grads_rest, gather_rest = grads - grads0, gather - gather0
        if not overlap.grad_reduce:
            return grads + gather
        params0 = (chunk * (self.block_param_bytes + self.expert_param_bytes)
                   + self.other_param_bytes[j]) / self.model.dtype_bytes
        buckets = megatron_bucket_count(params0, key.dp)
        behind = max(min(key.pp, key.num_micro_batches) - 1, 0) * chunk  # layers after chunk 0
        rest = (v > 1) * behind
        exposed = overlapped_sync_us(grads0, grads_rest,
                                     window_us - (n - chunk) * self.layer.bwd_us,
                                     rest * self.layer.bwd_us, buckets, self.overlap_coe)
        if overlap.param_gather:
            return exposed + overlapped_sync_us(gather0, gather_rest,
                                                chunk * self.layer.fwd_us + self.other.fwd_us[j],
                                                rest * self.layer.fwd_us, buckets,
                                                self.overlap_coe)
        return exposed + gather
