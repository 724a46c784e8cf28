"""The collective benchmarks on 4 real CPU processes over gloo: every benchmark runs, every rank
returns the same numbers, and the numbers obey the schema and the nccl-tests conventions."""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any, List

import pytest
import torch

from conftest import spawn_ranks
from orchestrator.profiling.hardware.fit import fit_points
from orchestrator.profiling.measure import busbw_factor

WORLD_SIZE = 4
NODE_OF_RANK = [0, 0, 1, 1]  # two "nodes" of two ranks: p2p has intra and inter pairs
POINT_KEYS = {"op", "group_size", "layout", "size_bytes", "dtype", "time_us_median",
              "time_us_p10", "time_us_p90", "algbw_GBps", "busbw_GBps", "iters"}
FIT_KEYS = {"op", "group_size", "layout", "alpha_us", "algbw_GBps", "max_rel_err"}


@dataclass
class _Rank:
    rank: int
    world_size: int
    node_of_rank: List[int]
    device: Any


def _worker(rank: int, out: dict) -> None:
    from orchestrator.errors import ConfigError
    from orchestrator.profiling.hardware.collectives import (SWEEPS, SweepConfig, bench_allreduce,
                                                             bench_collective)
    from orchestrator.profiling.hardware.overlap import OverlapConfig, measure_overlap
    from orchestrator.profiling.hardware.sampling import StopRule

    ctx = _Rank(rank, WORLD_SIZE, NODE_OF_RANK, torch.device("cpu"))
    sweep = SweepConfig(min_bytes=1024, max_bytes=16 * 1024, step=4,
                        stop=StopRule(warmup_iters=1, min_iters=3, max_iters=6,
                                      max_time_s=0.2, chunk_iters=3))
    progress = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated collective APIs
        benchmarks = {name: bench(ctx, sweep, on_point=lambda *a: progress.append(a))
                      for name, bench in SWEEPS.items()}
    # 4 bytes cannot be split over 4 ranks: the message grows to one element per rank.
    tiny = bench_collective("all_gather", ctx, SweepConfig(min_bytes=4, max_bytes=4,
                                                           stop=sweep.stop), [(4, "consec")])
    benchmarks["overlap"] = measure_overlap(ctx, OverlapConfig(
        matmul_dim=64, comm_bytes=64 * 1024, window_s=0.03, repeats=1))
    try:  # a bad context is refused on every rank before any collective runs
        bench_allreduce(_Rank(rank, WORLD_SIZE, [0, 0], torch.device("cpu")), sweep)
        refused = None
    except ConfigError as e:
        refused = str(e)
    out[rank] = {"benchmarks": benchmarks, "progress": progress, "refused": refused,
                 "tiny": tiny}


@pytest.fixture(scope="module")
def results() -> List[dict]:
    out = spawn_ranks(_worker, WORLD_SIZE)
    return [out[r] for r in range(WORLD_SIZE)]


def test_every_rank_returns_the_same_profile(results):
    first = results[0]["benchmarks"]
    for r in results[1:]:
        assert r["benchmarks"] == first
    json.dumps(first, allow_nan=False)


def test_benchmarks_cover_every_group_shape(results):
    b = results[0]["benchmarks"]

    def shapes(op):
        return sorted({(p["group_size"], p["layout"]) for p in b[op]["points"]})

    assert shapes("allreduce") == [(2, "consec"), (2, "strided"), (4, "consec")]
    for op in ("reduce_scatter", "all_gather", "all2all"):
        assert shapes(op) == [(2, "consec"), (4, "consec")]
    # pp=2 pairs (0,2),(1,3) cross nodes; pp=4 pairs (0,1),(2,3) stay on a node, (1,2) does not.
    assert shapes("p2p") == [(2, "inter"), (4, "inter"), (4, "intra")]
    for op in ("allreduce", "reduce_scatter", "all_gather", "all2all", "p2p"):
        assert sorted({p["size_bytes"] for p in b[op]["points"]}) == [1024, 4096, 16384]
        assert sorted((f["group_size"], f["layout"]) for f in b[op]["fits"]) == shapes(op)


def test_points_obey_schema_and_nccl_tests_conventions(results):
    b = results[0]["benchmarks"]
    for op in ("allreduce", "reduce_scatter", "all_gather", "all2all", "p2p"):
        for p in b[op]["points"]:
            assert set(p) == POINT_KEYS and p["op"] == op and p["dtype"] == "fp32"
            assert 0 < p["time_us_p10"] <= p["time_us_median"] <= p["time_us_p90"]
            assert p["iters"] >= 3  # samples (3..6) x calls per sample
            assert p["algbw_GBps"] == pytest.approx(p["size_bytes"] / p["time_us_median"] / 1e3)
            assert p["busbw_GBps"] == pytest.approx(
                p["algbw_GBps"] * busbw_factor(op, p["group_size"]))
        for f in b[op]["fits"]:
            assert set(f) == FIT_KEYS and f["alpha_us"] >= 0 and f["algbw_GBps"] > 0
        assert b[op]["fits"] == fit_points(b[op]["points"])  # the fits of these very points
        for f in b[op]["fits"]:  # max_rel_err is the worst point of its series
            series = [p for p in b[op]["points"]
                      if (p["group_size"], p["layout"]) == (f["group_size"], f["layout"])]
            worst = max(abs(f["alpha_us"] + p["size_bytes"] / (f["algbw_GBps"] * 1e3)
                            - p["time_us_median"]) / p["time_us_median"] for p in series)
            assert f["max_rel_err"] == pytest.approx(worst)


def test_overlap_coefficient_is_at_least_one(results):
    overlap = results[0]["benchmarks"]["overlap"]
    assert set(overlap) == {"compute_slowdown", "comm_slowdown", "overlap_coe"}
    assert overlap["compute_slowdown"] > 0 and overlap["comm_slowdown"] > 0
    assert overlap["overlap_coe"] == max(1.0, overlap["compute_slowdown"],
                                         overlap["comm_slowdown"])


def test_progress_reaches_every_point(results):
    progress = results[0]["progress"]
    b = results[0]["benchmarks"]
    for op in ("allreduce", "reduce_scatter", "all_gather", "all2all", "p2p"):
        calls = [(i, n) for name, i, n in progress if name == op]
        assert calls[-1] == (len(b[op]["points"]), len(b[op]["points"]))
        assert [i for i, _ in calls] == list(range(1, len(calls) + 1))


def test_a_context_with_the_wrong_node_list_is_refused(results):
    for r in results:
        assert r["refused"] and "one node id per rank" in r["refused"]


def test_sizes_that_do_not_split_evenly_are_rounded_and_recorded(results):
    (point,) = results[0]["tiny"]["points"]
    assert point["size_bytes"] == 16  # 4 fp32 elements, one per rank


@pytest.mark.parametrize("given", ["fp32", "float32"])
def test_a_sweep_dtype_given_by_name_is_parsed(given):
    # profile_hardware.dtype=fp32 reached SweepConfig and stopped every rank (frozen dataclass)
    from orchestrator.choices import Dtype
    from orchestrator.profiling.hardware.collectives import SweepConfig

    assert SweepConfig(dtype=given).dtype is Dtype.fp32
    assert SweepConfig(dtype=Dtype.bf16).dtype is Dtype.bf16
