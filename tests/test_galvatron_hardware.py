"""Galvatron's hardware files -> a whole hardware.json (import_hardware), and back: a directory
with several cluster shapes, reduce-scatter / all-gather from all-reduce, p2p intra- and
inter-node kept apart, a search on the result. The files are built here, shaped like Galvatron's
hardware_configs/, with numbers of our own."""
from __future__ import annotations

import json

import pytest

from orchestrator.errors import ProfileError
from orchestrator.interop.galvatron.hardware import (REF_SIZE_BYTES, import_hardware,
                                                     to_galvatron, write_galvatron_dir)
from orchestrator.planner import HardwareModel, ModelCost, SearchSpace, search
from orchestrator.profiling.hardware import analytic
from orchestrator.profiling.hardware.fit import predict_fit_time_us
from orchestrator.store.schema import HardwareProfile
from planner_fixtures import GiB, synthetic_model

MiB = 1 << 20
SIZE = 64 * MiB
SP_MB = [2 ** i for i in range(11)]
# sp_time lines per (op, n): time_ms = a + b * MB
SP_LINES = {("allreduce", 2): (0.010, 0.004), ("allreduce", 4): (0.020, 0.005),
            ("allreduce", 8): (0.030, 0.006), ("all2all", 2): (0.015, 0.003),
            ("all2all", 4): (0.025, 0.0035), ("all2all", 8): (0.035, 0.004)}
FILES = {
    "allreduce_bandwidth_1nodes_8gpus_per_node.json": {
        "allreduce_size_8_consec_1": 120.0, "allreduce_size_4_consec_1": 125.0,
        "allreduce_size_4_consec_0": 118.0, "allreduce_size_2_consec_1": 110.0,
        "allreduce_size_2_consec_0": 112.0},
    "p2p_bandwidth_1nodes_8gpus_per_node.json": {"pp_size_2": 100.0, "pp_size_4": 90.0,
                                                 "pp_size_8": 80.0},
    "sp_time_1nodes_8gpus_per_node.json": {
        f"{op}_size_{n}_{mb}MB_time": a + b * mb for (op, n), (a, b) in SP_LINES.items()
        for mb in SP_MB},
    "allreduce_bandwidth_2nodes_8gpus_per_node.json": {
        "allreduce_size_16_consec_1": 40.0, "allreduce_size_8_consec_1": 121.0,
        "allreduce_size_8_consec_0": 20.0, "allreduce_size_4_consec_1": 124.0,
        "allreduce_size_4_consec_0": 16.0, "allreduce_size_2_consec_1": 111.0,
        "allreduce_size_2_consec_0": 10.0, "broadcast_size_8_consec_1": 50.0},
    "p2p_bandwidth_2nodes_8gpus_per_node.json": {"pp_size_2": 10.0, "pp_size_4": 11.0,
                                                 "pp_size_8": 12.0, "pp_size_16": 9.0},
    "allreduce_bandwidth_1nodes_4gpus_per_node.json": {
        "allreduce_size_4_consec_1": 130.0, "allreduce_size_2_consec_1": 120.0,
        "allreduce_size_2_consec_0": 121.0},
    "p2p_bandwidth_1nodes_4gpus_per_node.json": {"pp_size_2": 95.0, "pp_size_4": 85.0},
    "overlap_coefficient.json": {"overlap_coe": 1.15},
}


def _write(directory, files):
    directory.mkdir(parents=True, exist_ok=True)
    for name, body in files.items():
        (directory / name).write_text(json.dumps(body))
    return directory


@pytest.fixture
def galvatron_dir(tmp_path):
    return _write(tmp_path / "hardware_configs", FILES)


def _import(directory, nodes=2, gpus_per_node=8):
    return import_hardware(directory, cluster_name="their_cluster", nodes=nodes,
                           gpus_per_node=gpus_per_node)


def _model(imported) -> HardwareModel:
    body = imported.body
    return HardwareModel.from_profile(
        HardwareProfile.from_dict({"kind": "hardware", "source": "galvatron", **body}, ""))


def test_import_gives_the_cluster_block_and_a_valid_hardware_profile(galvatron_dir):
    imported = _import(galvatron_dir)
    assert imported.body["cluster"] == {"name": "their_cluster", "nodes": 2, "tasks_per_node": 8,
                                        "world_size": 16, "backend": "nccl", "gpus_per_node": 8}
    model = _model(imported)
    assert model.world_size == 16 and model.tasks_per_node == 8
    assert model.overlap_coe == 1.15
    # the whole world from the 2-node figure: 40 GB/s busbw = 40 / (2 * 15 / 16) algbw
    assert model.time_us("allreduce", 16, "consec", SIZE) == pytest.approx(SIZE * 1.875 / 40e3)
    # 1x8 + 2x8 used, 1x4 skipped (not unmapped), plus the overlap file
    assert sorted(p.name for p in imported.files) == sorted(
        n for n in FILES if "4gpus" not in n and "sp_time_2" not in n)


def test_reduce_scatter_and_all_gather_take_half_an_allreduce(galvatron_dir):
    model = _model(_import(galvatron_dir))
    # (n, layout): all-reduce time at 64 MiB worked by hand, us
    allreduce_us = {
        (16, "consec"): SIZE * 1.875 / 40e3,  # 3145.728: figure, busbw factor 2 * 15 / 16
        (8, "strided"): SIZE * 1.75 / 20e3,  # 5872.03: across the two nodes
        (4, "consec"): 20.0 + 64 * 5.0,  # 340: the one-node sp_time line (alpha 20 us)
    }
    for (n, layout), ar_us in allreduce_us.items():
        assert model.time_us("allreduce", n, layout, SIZE) == pytest.approx(ar_us, rel=1e-6)
        for op in ("reduce_scatter", "all_gather"):
            assert model.time_us(op, n, layout, SIZE) == pytest.approx(ar_us / 2, rel=1e-6)
    assert model.time_us("reduce_scatter", 16, "consec", SIZE) == pytest.approx(1572.864)


def test_p2p_inside_a_node_from_the_one_node_file_across_nodes_from_the_two_node_file(
        galvatron_dir):
    imported = _import(galvatron_dir)
    model = _model(imported)
    # pp=4 on 2x8: stages 4 ranks apart; rank 0 -> 4 stays on node 0 (one-node pp_size_2:
    # 100 GB/s, the same distance), rank 4 -> 8 crosses (the 2-node pp_size_4: 11 GB/s).
    assert model.p2p_time_us(SIZE, intra=True, pp=4) == pytest.approx(SIZE / 100e3)
    assert model.p2p_time_us(SIZE, intra=False, pp=4) == pytest.approx(SIZE / 11e3)
    assert model.p2p_time_us(SIZE, intra=True, pp=16) == pytest.approx(SIZE / 80e3)
    assert model.p2p_time_us(SIZE, intra=False, pp=2) == pytest.approx(SIZE / 10e3)
    p2p = {(f["group_size"], f["layout"]) for f in imported.body["benchmarks"]["p2p"]["fits"]}
    assert (2, "intra") not in p2p  # pp=2 on 2 nodes: every hop crosses
    assert any("inter-node link" in line for line in imported.assumptions)


def test_without_the_one_node_file_intra_node_hops_get_the_multi_node_figure(tmp_path):
    directory = _write(tmp_path, {n: b for n, b in FILES.items() if "2nodes" in n})
    imported = _import(directory)
    assert _model(imported).p2p_time_us(SIZE, intra=True, pp=4) == pytest.approx(SIZE / 11e3)
    assert any("pessimistic" in line and "4" in line for line in imported.assumptions)


def test_unmapped_lists_unknown_keys_and_strided_groups_inside_one_node(galvatron_dir):
    unmapped = _import(galvatron_dir).unmapped
    assert any("broadcast_size_8_consec_1" in line for line in unmapped)
    assert any("1nodes_8gpus" in line and "allreduce_size_4_consec_0" in line
               for line in unmapped)
    assert not any("4gpus" in line for line in unmapped)
    assert len(unmapped) == 3


def test_a_missing_shape_names_the_shapes_found_and_their_overrides(galvatron_dir):
    with pytest.raises(ProfileError) as err:
        _import(galvatron_dir, nodes=4)
    msg = str(err.value)
    assert "4nodes_8gpus_per_node" in msg
    for n, g in ((1, 4), (1, 8), (2, 8)):
        assert f"{n}nodes_{g}gpus_per_node (cluster.nodes={n} cluster.tasks_per_node={g})" in msg


@pytest.mark.parametrize("text, words", [("{not json", "not readable JSON"),
                                         ('{"pp_size_2": "fast"}', "pp_size_2 = 'fast'"),
                                         ("[1, 2]", "JSON list")])
def test_a_corrupt_file_is_named(galvatron_dir, text, words):
    (galvatron_dir / "p2p_bandwidth_2nodes_8gpus_per_node.json").write_text(text)
    with pytest.raises(ProfileError, match=words) as err:
        _import(galvatron_dir)
    assert "p2p_bandwidth_2nodes_8gpus_per_node.json" in str(err.value)
    _import(galvatron_dir, nodes=1, gpus_per_node=4)  # other shapes still import


def test_round_trip_keeps_every_fit_that_maps(tmp_path):
    hw = analytic.analytic_hardware("c", 16).to_dict()  # 2 nodes of 8
    write_galvatron_dir(hw, tmp_path)
    back = import_hardware(tmp_path, cluster_name="c", nodes=2, gpus_per_node=8).body
    ours, theirs = hw["benchmarks"], back["benchmarks"]

    def by_shape(section):
        return {(f["group_size"], f["layout"]): f for f in section["fits"]}

    for op in ("allreduce", "p2p"):  # one number per (n, layout) / (pp, intra|inter)
        want, got = by_shape(ours[op]), by_shape(theirs[op])
        assert set(got) == set(want)
        assert {"intra", "inter"} <= {layout for _, layout in got} or op != "p2p"
        for key, fit in got.items():
            assert predict_fit_time_us(fit, REF_SIZE_BYTES) == pytest.approx(
                predict_fit_time_us(want[key], REF_SIZE_BYTES), rel=1e-6), (op, key)
    sp_time = json.loads((tmp_path / "sp_time_2nodes_8gpus_per_node.json").read_text())
    for op in ("allreduce", "all2all"):
        points = {(p["group_size"], p["size_bytes"]): p["time_us_median"]
                  for p in theirs[op]["points"]}
        assert len(points) == len([k for k in sp_time if k.startswith(op)])
        for (n, size), t_us in points.items():
            assert t_us == pytest.approx(sp_time[f"{op}_size_{n}_{size // MiB}MB_time"] * 1e3)
        consec = {k: f for k, f in by_shape(ours[op]).items() if k[1] == "consec"}
        for key, fit in by_shape(theirs[op]).items():
            if key in consec and key[0] <= 8:  # a series: latency and bandwidth both back
                assert fit["alpha_us"] == pytest.approx(consec[key]["alpha_us"], rel=1e-6)
                assert fit["algbw_GBps"] == pytest.approx(consec[key]["algbw_GBps"], rel=1e-6)
    assert theirs["overlap"]["overlap_coe"] == ours["overlap"]["overlap_coe"]
    for name, body in to_galvatron(hw).items():  # and the files survive import + export
        assert to_galvatron(back)[name] == pytest.approx(body, rel=1e-6), name


def test_search_runs_with_zero_and_sequence_parallel_on_imported_files(galvatron_dir):
    hardware = _model(_import(galvatron_dir))
    model = ModelCost.from_dict(synthetic_model(layers=8, hidden=256, ffn=1024, heads=8,
                                                vocab=1000))
    space = SearchSpace(world_size=16, memory_budget_bytes=80 * GiB, global_batch_size=32,
                        seq_len=512, zero_stages=(1, 2), sequence_parallel=(True,))
    result = search(model, hardware, space)
    assert result.best.zero in (1, 2) and result.best.sequence_parallel
    assert result.prediction.iteration_time_us > 0
