"""A GPU point's host time and device time apart, over micro-batch sizes (profile_model's
`host_device`): each part of timing.py's point (block forward and backward, the other parts')
queued behind a sleep kernel, so the host issues the whole call while the GPU still sleeps;
CUDA events then time the kernels alone and the wall clock the host's issuing. The cost model
prices a call from both (planner/model_cost.py: max(host, device)). A CPU has no such split: the
host runs the kernels (method.host_device says so)."""
from __future__ import annotations

import functools
import time
from typing import Callable, Dict, List, Mapping, Sequence, Tuple

import torch

from orchestrator.profiling.measure import median_of_group_max, summarize
from orchestrator.profiling.model.timing import MainGrads, PointModel, _zero_grads


# ~10 ms at ~2 GHz: longer than issuing any one part takes; doubled while it is not.
SLEEP_CYCLES = 20_000_000
SLEEP_DOUBLINGS = 4


class HostWaits(RuntimeError):
    """A call whose host waits for the device (a synchronisation inside): QueuedClock cannot
    tell its host time from its device time."""


class QueuedClock:
    """Device time alone and host time of one call (a GPU's, the queued-sleep method of
    bench/profile_model_gpu_launch_bound.py): a sleep kernel is queued first, so the host
    issues the whole call while the GPU is still asleep; CUDA events around the call then time
    the kernels alone, and the wall clock around issuing times the host. `starved` says the
    sleep ran out before the host had issued everything (the device time then includes waiting
    for the host): `measure` retries with a longer sleep."""

    def __init__(self):
        self.cycles = SLEEP_CYCLES

    def measure(self, run: Callable[[], object]) -> Tuple[float, float, object]:
        """(device us, host us, what `run` returned) of one call of `run`, doubling the sleep
        until it outlasts issuing (HostWaits after SLEEP_DOUBLINGS: `run` waits for the
        device, so the two cannot be told apart)."""
        for _ in range(SLEEP_DOUBLINGS + 1):
            device_us, host_us, out, starved = self._once(run)
            if not starved:
                return device_us, host_us, out
            self.cycles *= 2
        raise HostWaits(f"a call waited for the device through a {self.cycles // 2} cycle "
                        f"sleep: its host and device times cannot be told apart")

    def _once(self, run):
        torch.cuda.synchronize()
        torch.cuda._sleep(self.cycles)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        t0 = time.perf_counter()
        start.record()
        out = run()
        end.record()
        host_us = (time.perf_counter() - t0) * 1e6
        starved = start.query()  # the sleep has ended: the device may have waited for the host
        end.synchronize()
        return float(start.elapsed_time(end)) * 1e3, host_us, out, starved


class _Untimed:
    """A warm-up's clock: runs the call, times nothing (a first call may compile or allocate
    for seconds, past any sleep)."""

    @staticmethod
    def measure(run: Callable[[], object]) -> Tuple[float, float, object]:
        return 0.0, 0.0, run()


def _host_device_once(pm: PointModel, x, dy, cos, sin, tokens, targets, clock: QueuedClock,
                      barrier: Callable[[], None],
                      grads: MainGrads) -> Dict[str, Tuple[float, float]]:
    """One iteration of _run_once's parts, each call queued: {part: (device us, host us)};
    each backward with train's gradient accumulation (`grads`), as _run_once's."""
    out = {}
    barrier()
    fwd_dev, fwd_host, y = clock.measure(lambda: pm.block(x, cos, sin))
    bwd_dev, bwd_host, _ = clock.measure(functools.partial(grads.backward, y, dy))
    out["block_fwd_us"], out["block_bwd_us"] = (fwd_dev, fwd_host), (bwd_dev, bwd_host)
    x.grad = None
    _zero_grads(pm.block)
    del y
    barrier()
    with pm.loss_ctx():
        emb_dev, emb_host, h = clock.measure(lambda: pm.model.embed(tokens))
        h_in = h.detach().requires_grad_(True)
        head_dev, head_host, loss = clock.measure(lambda: pm.model.head_loss(h_in, targets))
        lb_dev, lb_host, _ = clock.measure(lambda: loss.backward())
    eb_dev, eb_host, _ = clock.measure(functools.partial(grads.backward, h, h_in.grad))
    out["other_fwd_us"] = (emb_dev + head_dev, emb_host + head_host)
    out["other_bwd_us"] = (lb_dev + eb_dev, lb_host + eb_host)
    _zero_grads(pm.model)
    return out


def time_host_device(pm: PointModel, seq_len: int, batches: Sequence[int], warmup_iters: int,
                     iters: int, barrier: Callable[[], None] = lambda: None,
                     clock=None) -> Dict[int, dict]:
    """A GPU point's parts on micro-batches of each size in `batches` (ascending), device time
    alone and host time apart (`clock`: a QueuedClock when None): {batch: {"<part>_device_us":
    median, "<part>_host_us": median}} for the PARTS. A size the GPU has no memory for, or
    whose calls wait for the device (HostWaits), ends the sweep (it and the larger ones are left
    out; none measured: the point has no host_device and the fits price from *_us): call it
    with one size only where ranks must agree (TP groups run collectives)."""
    clock = clock or QueuedClock()
    cos, sin = pm.rope()
    grads = MainGrads(pm.model.parameters())
    out: Dict[int, dict] = {}
    for batch in sorted(set(batches)):
        try:
            x = pm.block_input(seq_len, batch=batch)
            dy = torch.randn_like(x)
            tokens, targets = pm.tokens(seq_len, batch=batch)
            samples: Dict[str, List[float]] = {}
            for i in range(warmup_iters + iters):
                times = _host_device_once(pm, x, dy, cos, sin, tokens, targets,
                                          clock if i >= warmup_iters else _Untimed, barrier,
                                          grads)
                if i < warmup_iters:
                    continue
                for part, (device_us, host_us) in times.items():
                    samples.setdefault(part.replace("_us", "_device_us"), []).append(device_us)
                    samples.setdefault(part.replace("_us", "_host_us"), []).append(host_us)
        except (torch.cuda.OutOfMemoryError, HostWaits):  # this size and the larger ones: none
            x = dy = tokens = targets = None
            _zero_grads(pm.model)
            torch.cuda.empty_cache()
            break
        out[batch] = {k: summarize(v).median for k, v in samples.items()}
    return out


def combine_host_device(per_rank: List[Dict[int, dict]], tp: int,
                        comm_us: Mapping[str, float]) -> List[dict]:
    """The point's "host_device" samples from every rank's time_host_device, ranks in
    consecutive TP groups (a group is its slowest rank, groups give their median, as
    combine_ranks): one {"micro_batch_size": b, "<part>_device_us", "<part>_host_us"} per size
    every rank measured, device times less the part's TP collectives (`comm_us`: combine_ranks'
    "<part>_comm_us"; compute only, as the fitted *_us)."""
    sizes = sorted(set.intersection(*(set(r) for r in per_rank))) if per_rank else []
    out = []
    for b in sizes:
        sample = {"micro_batch_size": b}
        for key in per_rank[0][b]:
            value = median_of_group_max([r[b][key] for r in per_rank], tp)
            if key.endswith("_device_us"):
                comm = comm_us.get(key.replace("_device_us", "_comm_us"), 0.0)
                value = max(value - comm, 0.01 * value)
            sample[key] = value
        out.append(sample)
    return out
