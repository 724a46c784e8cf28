"""Profiling math without launching anything: bandwidth factors, groups, fits, stop rule,
analytic profiles, Galvatron files, reports."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from orchestrator.errors import ConfigError
from orchestrator.profiling import measure
from orchestrator.interop.galvatron import hardware as galvatron
from orchestrator.profiling.hardware import analytic, fit, groups, report, sampling

OPS = ("allreduce", "p2p", "reduce_scatter", "all_gather", "all2all")
POINT_KEYS = {"op", "group_size", "layout", "size_bytes", "dtype", "time_us_median",
              "time_us_p10", "time_us_p90", "algbw_GBps", "busbw_GBps", "iters"}
FIT_KEYS = {"op", "group_size", "layout", "alpha_us", "algbw_GBps", "max_rel_err"}


# --- bandwidth ---------------------------------------------------------------------------------

def test_busbw_factors_follow_nccl_tests():
    assert measure.busbw_factor("allreduce", 8) == pytest.approx(2 * 7 / 8)
    for op in ("reduce_scatter", "all_gather", "all2all"):
        assert measure.busbw_factor(op, 8) == pytest.approx(7 / 8)
    assert measure.busbw_factor("p2p", 2) == 1.0
    assert measure.busbw_factor("allreduce", 1) == 0.0


def test_every_workload_and_trace_op_names_a_measured_benchmark():
    """The workload and the trace speak torch's names (all_reduce, all_to_all, send); the
    hardware profile nccl-tests' (allreduce, all2all, p2p): one table maps them, and every op a
    layout issues is priced from a benchmark that exists."""
    from orchestrator.bandwidth import OPS, benchmark_of
    from orchestrator.errors import ConfigError
    from orchestrator.trace.recorder import _C10D, _FUNCTIONAL

    recorded = {op for op in (*_FUNCTIONAL.values(), *_C10D.values()) if op != "broadcast"}
    workload_ops = {"all_reduce", "all_gather", "reduce_scatter", "send", "recv"}  # Comm.op
    for op in recorded | workload_ops:
        assert benchmark_of(op) in OPS, op
    assert benchmark_of("all_reduce") == "allreduce" and benchmark_of("all_to_all") == "all2all"
    with pytest.raises(ConfigError, match="allreduce"):
        benchmark_of("allreduce")  # a benchmark name is not an op name


def test_algbw_is_bytes_per_time_in_GBps():
    assert measure.algbw_GBps(1e9, 1e6) == pytest.approx(1.0)  # 1 GB in 1 s
    assert measure.busbw_GBps("allreduce", 4, 2.0) == pytest.approx(3.0)
    assert measure.algbw_from_busbw_GBps("allreduce", 4, 3.0) == pytest.approx(2.0)


def test_unknown_op_and_bad_time_are_rejected():
    with pytest.raises(ConfigError, match="unknown collective"):
        measure.busbw_factor("broadcast", 4)
    with pytest.raises(ValueError, match="positive"):
        measure.algbw_GBps(1024, 0)


# --- groups ------------------------------------------------------------------------------------

def test_consecutive_and_strided_groups_partition_the_world():
    assert groups.consec_groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups.strided_groups(8, 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups.strided_groups(8, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for layout in groups.LAYOUTS:
        for s in groups.group_sizes(16):
            members = sorted(r for g in groups.groups_for(layout, 16, s) for r in g)
            assert members == list(range(16))  # every rank in exactly one group
            assert {len(g) for g in groups.groups_for(layout, 16, s)} == {s}


def test_group_sizes_are_powers_of_two_plus_the_world():
    assert groups.group_sizes(8) == [2, 4, 8]
    assert groups.group_sizes(12) == [2, 4, 12]
    assert groups.group_sizes(6) == [2, 6]
    assert groups.group_sizes(16, max_size=4) == [2, 4]
    assert groups.group_sizes(1) == []
    assert groups.layouts_for(8, 8) == ("consec",)
    assert groups.layouts_for(8, 2) == ("consec", "strided")


def test_bad_group_sizes_name_the_numbers():
    with pytest.raises(ConfigError, match=r"group size \(16\) > world size \(8\)"):
        groups.consec_groups(8, 16)
    with pytest.raises(ConfigError, match=r"does not divide world size \(6\)"):
        groups.strided_groups(6, 4)


def test_pipeline_stages_and_neighbours_follow_megatron_order():
    assert [groups.stage_of_rank(r, 8, 4) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert groups.pp_neighbours(0, 8, 4) == (None, 2)
    assert groups.pp_neighbours(3, 8, 4) == (1, 5)
    assert groups.pp_neighbours(7, 8, 4) == (5, None)
    assert groups.p2p_pairs(8, 2) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert groups.pp_sizes(12) == [2, 4]
    with pytest.raises(ConfigError, match=r"pp \(3\) does not divide world size \(8\)"):
        groups.p2p_pairs(8, 3)
    with pytest.raises(ConfigError, match=r"pp \(16\) > world size \(8\)"):
        groups.stage_of_rank(0, 8, 16)


def test_p2p_pairs_split_into_intra_and_inter_node():
    node_of_rank = [0, 0, 0, 0, 1, 1, 1, 1]
    assert groups.p2p_pairs_by_layout(8, 2, node_of_rank) == {
        "inter": [(0, 4), (1, 5), (2, 6), (3, 7)]}
    by = groups.p2p_pairs_by_layout(8, 4, node_of_rank)
    assert by == {"intra": [(0, 2), (1, 3), (4, 6), (5, 7)], "inter": [(2, 4), (3, 5)]}
    with pytest.raises(ConfigError, match="one node id per rank"):
        groups.p2p_pairs_by_layout(8, 2, [0, 0])


# --- fit ---------------------------------------------------------------------------------------

def _synthetic(alpha_us, algbw, sizes, noise, seed=0):
    rng = np.random.default_rng(seed)
    t = np.array([fit.predict_time_us(alpha_us, algbw, s) for s in sizes])
    return t * (1 + rng.uniform(-noise, noise, len(t)))


@pytest.mark.parametrize("alpha_us,algbw", [(20.0, 150.0), (300.0, 0.8), (5.0, 450.0)])
def test_fit_recovers_alpha_beta_and_predicts_held_out_sizes(alpha_us, algbw):
    sizes = [1024 * 2 ** i for i in range(19)]  # 1 KiB .. 256 MiB
    train, held_out = sizes[::2], sizes[1::2]
    ab = fit.fit_alpha_beta(train, _synthetic(alpha_us, algbw, train, noise=0.03))
    assert ab.alpha_us == pytest.approx(alpha_us, rel=0.1)
    assert ab.algbw_GBps == pytest.approx(algbw, rel=0.1)
    assert ab.max_rel_err < 0.06
    truth = _synthetic(alpha_us, algbw, held_out, noise=0.0)
    pred = np.array([ab.time_us(s) for s in held_out])
    assert np.max(np.abs(pred - truth) / truth) < 0.10


def test_fit_is_exact_on_noise_free_data_and_stays_non_negative():
    sizes = [1024 * 4 ** i for i in range(9)]
    ab = fit.fit_alpha_beta(sizes, _synthetic(12.5, 42.0, sizes, noise=0.0))
    assert ab.alpha_us == pytest.approx(12.5, rel=1e-9)
    assert ab.algbw_GBps == pytest.approx(42.0, rel=1e-9)
    # Times shrinking with size would need a negative bandwidth: clamp to latency-only, finite.
    flat = fit.fit_alpha_beta([1024, 2048, 4096], [110.0, 100.0, 90.0])
    assert flat.alpha_us > 0 and math.isfinite(flat.algbw_GBps)
    # Pure bandwidth data must not get a negative latency.
    bw = fit.fit_alpha_beta([1e6, 2e6, 4e6], [0.9e3, 2.1e3, 4.0e3])
    assert bw.alpha_us >= 0


def test_fit_points_groups_series_by_op_group_and_layout():
    points = []
    for layout, algbw in (("consec", 10.0), ("strided", 2.0)):
        for s in (1024, 65536, 1 << 20):
            points.append({"op": "allreduce", "group_size": 4, "layout": layout, "size_bytes": s,
                           "time_us_median": fit.predict_time_us(7.0, algbw, s)})
    fits = fit.fit_points(points)
    assert [(f["layout"], round(f["algbw_GBps"], 6)) for f in fits] == [("consec", 10.0),
                                                                        ("strided", 2.0)]
    assert all(set(f) == FIT_KEYS for f in fits)
    sizes = [1024 * 2 ** i for i in range(12)]
    assert fit.held_out_rel_err(sizes, _synthetic(30, 5, sizes, noise=0.02)) < 0.10


# --- timing: the stop rule every rank applies to the same numbers ------------------------------

def test_stop_rule_waits_for_min_iters_then_stable_median():
    rule = sampling.StopRule(min_iters=5, max_iters=50, max_time_s=10, rel_spread=0.1)
    assert not sampling.should_stop([100.0] * 4, 0.0, rule)
    assert sampling.should_stop([100.0] * 5, 0.0, rule)
    noisy = [100.0, 200.0, 50.0, 300.0, 120.0]
    assert not sampling.should_stop(noisy, 0.0, rule)
    assert sampling.should_stop(noisy, 11.0, rule)  # time cap
    assert sampling.should_stop(noisy * 10, 0.0, rule)  # iteration cap
    stats = measure.summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (stats.median, stats.p10, stats.p90, stats.min) == pytest.approx((3.0, 1.4, 4.6, 1.0))
    assert stats.rel_spread == pytest.approx(3.2 / 3.0)
    assert sampling.next_chunk(48, rule) == 2


def test_median_of_an_even_count_is_the_mean_of_the_middle_two():
    # overlap.py once kept the upper middle value: [1, 2, 3, 10] gave 3.
    assert measure.summarize([10.0, 1.0, 3.0, 2.0]).median == 2.5


def test_a_tp_group_takes_its_slowest_rank_and_groups_their_median():
    per_rank = [1.0, 4.0, 2.0, 3.0, 9.0, 5.0]  # groups of 2: max 4, 3, 9 -> median 4
    assert measure.median_of_group_max(per_rank, 2) == 4.0
    assert measure.median_of_group_max(per_rank, 3) == 6.5  # max 4, 9 -> mean of the two
    with pytest.raises(ValueError, match="groups of 4"):
        measure.median_of_group_max(per_rank, 4)


def test_bytes_print_in_binary_units():
    assert [measure.format_bytes(n) for n in (512, 65536, 1.5 * 2**20, 3 * 2**30, 2**42)] == \
        ["512 B", "64 KiB", "1.5 MiB", "3 GiB", "4 TiB"]


def test_stopwatch_measures_microseconds_on_cpu():
    clock = measure.Stopwatch("cpu")
    start = clock.mark()
    time.sleep(0.01)
    # microseconds: 10 ms is 10,000 (not 10 or 10,000,000), however late a loaded machine
    # wakes the sleeper
    assert 9_000 < clock.elapsed_us(start, clock.mark()) < 5_000_000


def test_nonneg_rel_lsq_is_exact_on_exact_data_and_clamps_at_zero():
    x = np.array([1.0, 2.0, 4.0, 8.0])
    exact = measure.nonneg_rel_lsq(np.stack([np.ones_like(x), x], axis=1), 3.0 + 0.5 * x)
    assert exact == pytest.approx([3.0, 0.5])
    # Falling values: the best line has a negative slope; the fit keeps it at 0 instead.
    clamped = measure.nonneg_rel_lsq(np.stack([np.ones_like(x), x], axis=1), 10.0 - x)
    assert clamped[1] == 0.0 and clamped[0] > 0


def test_benchmark_registry_is_the_config_default_in_run_order():
    from orchestrator.config import ProfileHardwareConfig
    from orchestrator.profiling.hardware.benchmarks import BENCHMARKS, sweep_config

    assert list(BENCHMARKS) == ["inventory", "allreduce", "p2p", "reduce_scatter", "all_gather",
                                "all2all", "overlap"]
    assert ProfileHardwareConfig().benchmarks == list(BENCHMARKS)
    hw = ProfileHardwareConfig(min_size_bytes=4096, size_step=8, max_iters=7, rel_spread=0.2)
    sweep = sweep_config(hw)
    assert (sweep.min_bytes, sweep.step, sweep.max_tp) == (4096, 8, 8)
    assert (sweep.stop.max_iters, sweep.stop.rel_spread) == (7, 0.2)


def test_message_sizes_sweep_and_split_evenly():
    from orchestrator.profiling.hardware.collectives import aligned_numel, message_sizes

    assert message_sizes(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    assert aligned_numel(1000, 4, 6) == 246  # 250 fp32 elements rounded down to 6 | numel
    assert aligned_numel(4, 4, 4) == 4  # never below one element per rank


def test_short_collectives_are_timed_several_calls_per_sample():
    rule = sampling.StopRule(min_sample_us=1000, max_ops_per_sample=100)
    assert sampling.ops_per_sample(20.0, rule) == 50
    assert sampling.ops_per_sample(0.5, rule) == 100
    assert sampling.ops_per_sample(5000.0, rule) == 1
    assert sampling.ops_per_sample(20.0, sampling.StopRule(min_sample_us=0)) == 1


# --- analytic ----------------------------------------------------------------------------------

def _assert_schema(bench_root):
    for op in OPS:
        assert set(bench_root[op]) == {"points", "fits"}
        for p in bench_root[op]["points"]:
            assert set(p) == POINT_KEYS
            assert p["time_us_median"] > 0 and p["algbw_GBps"] > 0
            assert p["busbw_GBps"] == pytest.approx(
                p["algbw_GBps"] * measure.busbw_factor(op, p["group_size"]))
        for f in bench_root[op]["fits"]:
            assert set(f) == FIT_KEYS and f["alpha_us"] >= 0 and f["algbw_GBps"] > 0
    assert set(bench_root["overlap"]) == {"compute_slowdown", "comm_slowdown", "overlap_coe"}


def test_analytic_profile_for_8192_gpus_is_schema_complete():
    # How fast is a bench's question (bench/search_speed.py builds this profile), not a bound
    # of the suite's: a loaded machine made such bounds fail.
    hw = analytic.analytic_hardware("h100_8192", 8192).to_dict()
    assert hw["source"] == "analytic" and hw["kind"] == "hardware"
    assert hw["cluster"]["world_size"] == 8192 and hw["cluster"]["nodes"] == 1024
    benches = hw["benchmarks"]
    _assert_schema(benches)
    shapes = {(f["group_size"], f["layout"]) for f in benches["allreduce"]["fits"]}
    assert shapes == {(s, l) for s in groups.group_sizes(8192)
                      for l in groups.layouts_for(8192, s)}
    json.dumps(hw, allow_nan=False)


def test_analytic_bandwidths_follow_the_links():
    sheet = analytic.LinkSheet()  # 8 GPUs per node, NVLink 450 GB/s, 8 x 400 Gb/s IB
    fits = {(f["op"], f["group_size"], f["layout"]): f
            for op, b in analytic.analytic_benchmarks(1024, sheet).items() if op != "overlap"
            for f in b["fits"]}

    def busbw(op, n, layout):
        return fits[(op, n, layout)]["algbw_GBps"] * measure.busbw_factor(op, n)

    assert busbw("allreduce", 8, "consec") == pytest.approx(450.0)  # one node: NVLink
    assert busbw("allreduce", 64, "consec") == pytest.approx(8 * 50 * 0.9)  # 8 NICs per group
    assert busbw("allreduce", 128, "strided") == pytest.approx(50 * 0.9)  # 1 rank/node: one NIC
    assert busbw("allreduce", 2, "strided") == pytest.approx(50 * 0.9)
    assert fits[("p2p", 2, "inter")]["algbw_GBps"] == pytest.approx(45.0)
    assert fits[("p2p", 1024, "intra")]["algbw_GBps"] == pytest.approx(sheet.intra_p2p_GBps)
    assert fits[("allreduce", 1024, "consec")]["alpha_us"] > fits[("allreduce", 8, "consec")][
        "alpha_us"]


# --- galvatron ---------------------------------------------------------------------------------

def test_galvatron_export_uses_their_names_and_units(tmp_path):
    hw = analytic.analytic_hardware("c", 16).to_dict()
    paths = galvatron.write_galvatron_dir(hw, tmp_path)
    names = sorted(p.name for p in paths)
    assert names == ["allreduce_bandwidth_1nodes_8gpus_per_node.json",
                     "allreduce_bandwidth_2nodes_8gpus_per_node.json", "overlap_coefficient.json",
                     "p2p_bandwidth_1nodes_8gpus_per_node.json",
                     "p2p_bandwidth_2nodes_8gpus_per_node.json",
                     "sp_time_2nodes_8gpus_per_node.json"]
    ar = json.loads((tmp_path / "allreduce_bandwidth_2nodes_8gpus_per_node.json").read_text())
    assert set(ar) == {"allreduce_size_2_consec_1", "allreduce_size_2_consec_0",
                       "allreduce_size_4_consec_1", "allreduce_size_4_consec_0",
                       "allreduce_size_8_consec_1", "allreduce_size_8_consec_0",
                       "allreduce_size_16_consec_1"}
    assert 350 < ar["allreduce_size_8_consec_1"] < 450  # busbw GB/s at 32 MiB on NVLink
    sp = json.loads((tmp_path / "sp_time_2nodes_8gpus_per_node.json").read_text())
    assert len([k for k in sp if k.startswith("allreduce_size_8_")]) == 11  # 1..1024 MB
    fit8 = next(f for f in hw["benchmarks"]["all2all"]["fits"] if f["group_size"] == 8)
    assert sp["all2all_size_8_32MB_time"] == pytest.approx(
        fit.predict_fit_time_us(fit8, 32 << 20) / 1e3)  # ms
    assert json.loads((tmp_path / "overlap_coefficient.json").read_text()) == {"overlap_coe": 1.2}


def test_galvatron_round_trip_keeps_what_galvatron_has(tmp_path):
    hw = analytic.analytic_hardware("c", 64).to_dict()
    galvatron.write_galvatron_dir(hw, tmp_path)
    back = galvatron.import_hardware(tmp_path, cluster_name="c", nodes=8,
                                     gpus_per_node=8).body["benchmarks"]
    ref = galvatron.REF_SIZE_BYTES
    for op in ("allreduce", "all2all", "p2p"):
        ours = {(f["group_size"], f["layout"]): f for f in hw["benchmarks"][op]["fits"]}
        theirs = {(f["group_size"], f["layout"]): f for f in back[op]["fits"]}
        assert set(theirs) == set(ours)
        for (n, layout), f in theirs.items():
            want = fit.predict_fit_time_us(ours[(n, layout)], ref)
            if (op, layout) == ("p2p", "inter"):  # one number per pp: the slowest link's
                want = max(fit.predict_fit_time_us(g, ref) for (m, _), g in ours.items()
                           if m == n)
            assert fit.predict_fit_time_us(f, ref) == pytest.approx(want, rel=1e-6), (op, n)
    consec8 = next(f for f in back["allreduce"]["fits"]
                   if (f["group_size"], f["layout"]) == (8, "consec"))
    assert consec8["alpha_us"] == pytest.approx(18.0)  # the sp_time series restores the latency
    assert back["overlap"]["overlap_coe"] == 1.2
    # And Galvatron's files survive import + export unchanged.
    again = galvatron.to_galvatron({"cluster": hw["cluster"], "benchmarks": back})
    first = galvatron.to_galvatron(hw)
    for name, body in first.items():
        assert again[name] == pytest.approx(body, rel=1e-6), name


# --- report ------------------------------------------------------------------------------------

def test_report_prints_tables_and_writes_a_png(tmp_path):
    from rich.console import Console

    hw = analytic.analytic_hardware("c", 16).to_dict()
    console = Console(record=True, width=140)
    report.print_report(hw, console)
    text = console.export_text()
    for op in OPS:
        assert op in text
    assert "busbw GB/s" in text and "overlap_coe 1.200" in text
    # a table of more points than a screen shows each group's largest message only
    many = [op for op in OPS if len(hw["benchmarks"][op]["points"]) > report.MAX_TABLE_ROWS]
    assert many
    for op in many:
        groups = {(p["group_size"], p["layout"]) for p in hw["benchmarks"][op]["points"]}
        assert (f"{op} (analytic): the largest message of each group, {len(groups)} of "
                f"{len(hw['benchmarks'][op]['points'])} points") in text
    png = report.plot_busbw(hw, tmp_path / "busbw.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
