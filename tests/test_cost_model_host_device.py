"""A GPU profile tells the host's time (issuing a call) from the device's (running it): the fit
separates them over lengths and micro-batch sizes, and the cost model prices a call as the
slower of the two (they overlap) instead of a host constant added to a per-token slope. Pure
functions on synthetic profiles shaped as profile_model writes them; a CPU profile (host and
device the same) keeps its form."""
from __future__ import annotations

import copy
import time

import pytest
import torch

from orchestrator.errors import ProfileError
from orchestrator.layout import ParallelLayout
from orchestrator.planner import ModelCost, evaluate
from orchestrator.profiling.model.fit import fit_points
from orchestrator.profiling.model.report import host_device_lines
from orchestrator.models.config import ModelConfig
from orchestrator.profiling.model.host_device import combine_host_device, time_host_device
from orchestrator.profiling.model.timing import PARTS, build_point_model
from planner_fixtures import hand_hardware, synthetic_model

SEQS = (128, 512, 1024, 2048)
SIZES = (1, 2, 4, 8)
# A 7B-class block on one GPU, us: the device's own cost per call and per sequence of s tokens
# (c0 + b (c1 s + c2 s^2)), and the host's time to issue the call (the 873 / 1,410 us).
DEVICE = {"block_fwd": (20.0, 0.5, 5e-5), "block_bwd": (40.0, 1.0, 1.25e-4),
          "other_fwd": (10.0, 0.2), "other_bwd": (20.0, 0.4)}
HOST = {"block_fwd": 873.0, "block_bwd": 1410.0, "other_fwd": 300.0, "other_bwd": 450.0}


def device_us(part: str, s: float, b: float) -> float:
    c = DEVICE[part]
    return c[0] + b * sum(ci * s ** i for i, ci in enumerate(c) if i)


def true_call_us(part: str, s: float, b: float, host_per_token=None) -> float:
    """What a call takes on the GPU: the host issues while the device runs."""
    return max(host_us(part, s, b, host_per_token), device_us(part, s, b))


def host_us(part: str, s: float, b: float, host_per_token=None) -> float:
    return HOST[part] + (host_per_token or {}).get(part, 0.0) * s * b


def gpu_points(host_device: bool = True, host_per_token=None) -> list:
    """Points as profile_model writes them on a GPU: *_us are synchronised events at micro-batch
    1 (host-bound at short lengths), "host_device" the two apart per micro-batch size."""
    points = []
    for s in SEQS:
        flops = {p: 1e6 * (device_us(p, s, 1) - DEVICE[p][0]) for p in DEVICE}
        point = {"seq_len": s, "tp": 1, "source": "measured", "flops": flops,
                 **{f"{p}_us": true_call_us(p, s, 1, host_per_token) for p in DEVICE}}
        if host_device:
            point["host_device"] = [
                {"micro_batch_size": b, "flops": {p: f * b for p, f in flops.items()},
                 **{f"{p}_device_us": device_us(p, s, b) for p in DEVICE},
                 **{f"{p}_host_us": host_us(p, s, b, host_per_token) for p in DEVICE}}
                for b in SIZES]
        points.append(point)
    return points


def gpu_profile(host_device: bool = True, host_per_token=None) -> dict:
    """A model.json dict of a 4-layer 7B-shaped model whose fits are fit_points' of gpu_points."""
    prof = synthetic_model("gpu", hidden=4096, ffn=11008, layers=4, heads=32, vocab=32000,
                           seq_len=2048, tps=(1,))
    prof["points"] = gpu_points(host_device, host_per_token)
    prof["fits"] = fit_points(prof["points"])
    return prof


def test_fit_points_tells_host_from_device_over_micro_batch_sizes():
    fit = fit_points(gpu_points())["1"]
    assert fit["host_us"] == HOST
    for part in DEVICE:
        assert fit["device_us"][part] == pytest.approx(DEVICE[part], rel=1e-6, abs=1e-9)
        assert max(abs(r) for r in fit["device_rel_residuals"][part]) < 1e-6
    # a CPU's points (no host_device: the host runs the kernels) fit as before
    cpu = fit_points(gpu_points(host_device=False))["1"]
    assert "device_us" not in cpu and "host_us" not in cpu
    assert cpu["block_fwd_us"] == fit["block_fwd_us"]
    # the report prints them (profile_model's console), and nothing for a CPU's
    assert "block bwd host 1410 us, device 40 1 0.000125" in host_device_lines(gpu_profile())[0]
    assert host_device_lines(gpu_profile(host_device=False)) == []


@pytest.mark.parametrize("b", SIZES)
def test_a_call_costs_the_slower_of_host_and_device(b):
    cost = ModelCost.from_dict(gpu_profile())
    for s in (128, 1024, 2048):
        for part, priced in (("block_fwd", cost.block_fwd_us), ("block_bwd", cost.block_bwd_us),
                             ("other_fwd", cost.other_fwd_us), ("other_bwd", cost.other_bwd_us)):
            assert priced(s, 1, b) == pytest.approx(true_call_us(part, s, b), rel=1e-6)
    # host-bound (short, one sequence): the host alone, not host + device
    assert cost.block_fwd_us(128, 1, 1) == pytest.approx(HOST["block_fwd"])
    # GPU-bound at seq 2048: the device's time, not under it by the host constant's share
    assert cost.block_bwd_us(2048, 1, b) >= device_us("block_bwd", 2048, b) * (1 - 1e-9)


def test_a_host_time_that_grows_with_the_tokens_is_fitted_and_priced():
    """The eager loss issues its ops once per chunk of tokens (~0.26 ms a chunk of 524 on the
    H200 machine: ~0.5 us a token): its host time is fitted as a line in the call's tokens and
    priced so, where a median would price a micro-batch of 1 at the host time of 4; the
    block's host samples of that machine (flat but for noise, R^2 0.30) keep their median."""
    from orchestrator.profiling.model.fit import fit_host

    per_token = {"other_fwd": 0.5, "other_bwd": 0.5}
    fit = fit_points(gpu_points(host_per_token=per_token))["1"]
    for part in DEVICE:
        assert fit["host_us"][part] == pytest.approx(HOST[part], rel=1e-6)
        assert fit["host_us_per_token"][part] == pytest.approx(per_token.get(part, 0.0),
                                                               rel=1e-6, abs=1e-12)
    cost = ModelCost.from_dict(gpu_profile(host_per_token=per_token))
    for b in SIZES:
        for s in (512, 2048):
            assert cost.other_fwd_us(s, 1, b) == pytest.approx(
                true_call_us("other_fwd", s, b, per_token), rel=1e-6)
    assert cost.other_fwd_us(2048, 1, 1) == pytest.approx(300.0 + 0.5 * 2048)  # host-bound
    assert "other fwd host 300 us + 0.5/token" in host_device_lines(
        gpu_profile(host_per_token=per_token))[0]
    tokens = [1024, 2048, 4096, 8192, 2048, 4096, 8192, 16384]
    assert fit_host(tokens, [1730, 1599, 1643, 2020, 1956, 2087, 1829, 2073]) == (1892.5, 0.0)
    assert fit_host(tokens, [2262, 2224, 2335, 2794, 2210, 2257, 2217, 2589]) == (2259.5, 0.0)


def _step_us(cost: ModelCost, b: int, recompute: str = "none") -> float:
    layout = ParallelLayout.uniform(1, 1, 1, 4, micro_batch_size=b, num_micro_batches=8 // b,
                                    recompute=recompute)
    return evaluate(layout, cost, hand_hardware({}, world_size=1), 2048).iteration_time_us


def _true_compute_us(b: int, recompute: str = "none") -> float:
    """4 blocks and "other" over 8 // b micro-batches; full recompute reruns the forward."""
    block = true_call_us("block_fwd", 2048, b) * (2 if recompute == "full" else 1) \
        + true_call_us("block_bwd", 2048, b)
    other = true_call_us("other_fwd", 2048, b) + true_call_us("other_bwd", 2048, b)
    return 8 // b * (4 * block + other)


def test_micro_batch_sizes_are_priced_and_ranked_as_they_run():
    cost = ModelCost.from_dict(gpu_profile())
    optimizer_us = _step_us(cost, 8) - _true_compute_us(8)  # the same for every layout
    for b in SIZES:  # each step within 1% of its calls' max(host, device)
        assert _step_us(cost, b) - optimizer_us == pytest.approx(_true_compute_us(b), rel=0.01)
    steps = {b: _step_us(cost, b) for b in SIZES}
    assert sorted(SIZES, key=steps.get) == sorted(SIZES, key=_true_compute_us)  # 8 first
    # mbs 1 without recompute runs faster than mbs 8 with full recompute (the pick where only
    # that fits); the host constant added once to a slope fitted through host-bound lengths
    # prices mbs 8 below mbs 1 and ranks them the other way round
    assert _true_compute_us(1) < _true_compute_us(8, "full")
    assert _step_us(cost, 1) < _step_us(cost, 8, "full")


def test_full_recompute_reruns_the_forward_inside_the_backwards_call():
    """The backward of a fully recomputed block is one call: the host issues the rerun's
    kernels and the backward's while the device runs both, so a host-bound forward (one
    sequence) reruns under a device-bound backward for less than its own call, and a
    device-bound one costs its device time, as before."""
    from orchestrator.planner.terms.compute import LayerCompute

    cost = ModelCost.from_dict(gpu_profile())
    for s, b in ((2048, 1), (2048, 8), (1280, 1), (128, 1)):
        fwd, bwd = (device_us(part, s, b) for part in ("block_fwd", "block_bwd"))
        call = max(HOST["block_fwd"] + HOST["block_bwd"], fwd + bwd)
        layer = LayerCompute.from_model(cost, s, 1, b)
        assert layer.block.bwd_us + layer.full_rerun_us == pytest.approx(call, rel=1e-9)
    mixed = LayerCompute.from_model(cost, 1280, 1, 1)  # a host-bound forward, then ...
    assert HOST["block_fwd"] > device_us("block_fwd", 1280, 1)
    assert device_us("block_bwd", 1280, 1) > HOST["block_bwd"]  # ... a device-bound backward
    assert mixed.full_rerun_us < 0.9 * mixed.block.fwd_us
    device_bound = LayerCompute.from_model(cost, 2048, 1, 8)
    assert device_bound.full_rerun_us == pytest.approx(device_us("block_fwd", 2048, 8))
    # the step prices it: mbs 1 full costs the layer's rerun more per micro-batch, and no more
    rerun = 8 * 4 * LayerCompute.from_model(cost, 2048, 1, 1).full_rerun_us
    assert _step_us(cost, 1, "full") - _step_us(cost, 1) == pytest.approx(rerun, rel=1e-6)


def test_a_profile_without_host_time_prices_as_before_and_a_half_one_is_refused():
    old = gpu_profile(host_device=False)  # a CPU's, an analytic or an older GPU profile
    cost = ModelCost.from_dict(old)
    c0, c1, c2 = old["fits"]["1"]["block_fwd_us"]
    for b in SIZES:  # the fit's constant once per call, the rest per sequence
        assert cost.block_fwd_us(2048, 1, b) == pytest.approx(c0 + b * (c1 * 2048 + c2 * 2048 ** 2))
    half = copy.deepcopy(gpu_profile())
    del half["fits"]["1"]["device_us"]
    with pytest.raises(ProfileError, match=r"fits\.1\.device_us: missing"):
        ModelCost.from_dict(half)


def test_ranks_host_device_samples_combine_as_the_points_times():
    def rank(device, host, sizes=(1, 2)):
        return {b: {"block_fwd_device_us": device * b, "block_fwd_host_us": host}
                for b in sizes}

    # two TP groups of 2: each is its slowest rank, the groups give their median; the device
    # time less the part's TP collectives; a size one rank ran out of memory for is left out
    per_rank = [rank(100, 10), rank(120, 12), rank(80, 8), rank(90, 9, sizes=(1,))]
    assert combine_host_device(per_rank, 2, {"block_fwd_comm_us": 5.0}) == [
        {"micro_batch_size": 1, "block_fwd_device_us": 105.0 - 5.0,
         "block_fwd_host_us": 10.5}]


class WallClock:
    """QueuedClock's interface on a CPU (no sleep kernel to queue behind: host is device):
    each call's wall time as both, and the micro-batch each call saw."""

    def __init__(self):
        self.batches = []

    def measure(self, run):
        t0 = time.perf_counter()
        out = run()
        us = (time.perf_counter() - t0) * 1e6
        if hasattr(out, "shape") and out.dim() == 3:  # (batch, seq, hidden)
            self.batches.append(out.shape[0])
        return us, us, out


def test_each_micro_batch_size_runs_every_part_on_its_own_batch():
    pm = build_point_model(ModelConfig(), 64, 1, None, "cpu")  # tiny, one block, micro-batch 1
    clock = WallClock()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: intra-op threads only spin on a shared machine
    try:
        times = time_host_device(pm, 64, [4, 1, 2], warmup_iters=1, iters=1, clock=clock)
    finally:
        torch.set_num_threads(threads)
    assert sorted(times) == [1, 2, 4]
    for b, sample in times.items():
        assert set(sample) == {p.replace("_us", f"_{k}_us") for p in PARTS
                               for k in ("device", "host")}
        assert all(v > 0 for v in sample.values())
    # the block's and the embedding's outputs, on each size in turn, smallest first (the
    # warm-up iteration of each size runs untimed)
    assert clock.batches == [1, 1, 2, 2, 4, 4]
