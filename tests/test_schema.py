"""Profiles as dataclasses: what producers write reads back unchanged, a bad field is named with
its path and the command that rebuilds the file, and docs/profile-schema.md is generated."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli
from planner_fixtures import synthetic_hardware, synthetic_model

from orchestrator.errors import ProfileError
from orchestrator.layout import ParallelLayout
from orchestrator.profiling.hardware.analytic import analytic_hardware
from orchestrator.store import read_profile, write_json, write_profile
from orchestrator.store.schema import (Alternative, Exports, FieldError, HardwareProfile,
                                       LinkLayout, ModelProfile, Op, Recompute, Source)

REPO = Path(__file__).resolve().parents[1]
REBUILD = "python -m orchestrator stage=profile_hardware cluster=c"


def test_analytic_hardware_profile_round_trips_field_for_field(tmp_path):
    profile = analytic_hardware("c", 16)
    path = write_profile(tmp_path / "hardware.json", profile)
    raw = json.loads(path.read_text())
    assert HardwareProfile.from_dict(raw).to_dict() == raw
    back = read_profile(path, HardwareProfile, REBUILD)
    assert back == profile
    fit = back.benchmarks.allreduce.fits[0]
    assert (fit.op, fit.layout, fit.group_size) == (Op.allreduce, LinkLayout.consec, 2)
    assert back.benchmarks.overlap.overlap_coe == 1.2 and back.cluster.world_size == 16


def test_choices_are_enums_equal_to_their_strings():
    assert Source.analytic == "analytic" and {"none": 1}[Recompute.none] == 1
    assert {("allreduce", "strided"): 1}[(Op.allreduce, LinkLayout.strided)] == 1
    model = ModelProfile.from_dict(synthetic_model(tps=(1, 2)))
    assert model.memory[2].block.act_bytes_per_token[Recompute.full] == 2.0 * 256 / 2
    assert sorted(model.fits) == [1, 2] and model.model.kv_heads == 8


def test_model_profile_keeps_extras_and_tp_keys_as_strings():
    raw = synthetic_model(tps=(1,))
    raw["points"] = [{"seq_len": 64, "tp": 1, "block_fwd_us": 1.0, "block_bwd_us": 2.0,
                      "other_fwd_us": 3.0, "other_bwd_us": 4, "source": "measured",
                      "flops": {"block_fwd": 5.0}, "iters": 3}]
    raw["micro_batch_size"] = 1
    profile = ModelProfile.from_dict(raw)
    assert profile.points[0].extras == {"flops": {"block_fwd": 5.0}, "iters": 3}
    assert profile.points[0].other_bwd_us == 4.0
    assert profile.to_dict() == {**raw, "provenance": profile.provenance.to_dict()}
    assert list(profile.to_dict()["fits"]) == ["1"]


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["benchmarks"]["allreduce"]["fits"][3].update(alpha_us="x"),
     'benchmarks.allreduce.fits[3].alpha_us: expected a number, got "x"'),
    (lambda d: d["benchmarks"]["p2p"]["fits"][0].update(layout="diagonal"),
     "benchmarks.p2p.fits[0].layout: expected one of ['consec', 'strided', 'intra', 'inter'], "
     'got "diagonal"'),
    (lambda d: d["cluster"].pop("tasks_per_node"), "cluster.tasks_per_node: missing"),
    (lambda d: d["benchmarks"]["overlap"].update(overlap=1.0),
     "benchmarks.overlap.overlap: unknown field; known: ['compute_slowdown', 'comm_slowdown', "
     "'overlap_coe']"),
    (lambda d: d["benchmarks"]["all2all"].update(fits={}),
     "benchmarks.all2all.fits: expected a list, got {}"),
    (lambda d: d["cluster"].update(nodes=True), "cluster.nodes: expected an integer, got true"),
])
def test_read_profile_names_the_first_bad_field_and_the_rebuild_command(tmp_path, edit, message):
    raw = analytic_hardware("c", 16).to_dict()
    edit(raw)
    path = write_json(tmp_path / "hardware.json", raw)
    with pytest.raises(ProfileError) as err:
        read_profile(path, HardwareProfile, REBUILD)
    assert str(err.value) == f"{path}: {message}. Rerun: {REBUILD} force=true"
    assert err.value.exit_code == 4


def test_model_profile_checks_fit_lengths_and_recompute_modes():
    raw = synthetic_model(tps=(1,))
    raw["fits"]["1"]["block_fwd_us"] = [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(FieldError, match=r"^fits\.1\.block_fwd_us: expected 1 to 3 "
                                         r"coefficients, got 4$"):
        ModelProfile.from_dict(raw)
    raw = synthetic_model(tps=(1,))
    del raw["memory"]["1"]["other"]["act_bytes_per_token"]["selective"]
    with pytest.raises(FieldError, match=r"^memory\.1\.other\.act_bytes_per_token\.selective: "
                                         r"missing$"):
        ModelProfile.from_dict(raw)


def test_wrong_kind_is_refused_before_its_fields(tmp_path):
    path = write_json(tmp_path / "hardware.json", synthetic_model())
    with pytest.raises(ProfileError, match=r"not a hardware profile\. Rerun: .* force=true"):
        read_profile(path, HardwareProfile, REBUILD)


def test_strategy_layouts_are_checked_by_parallel_layout():
    layout = ParallelLayout.uniform(4, 2, 1, 4).to_dict()
    raw = {"layout": layout, "iteration_time_us": 1.0, "peak_memory_bytes": 2}
    assert Alternative.from_dict(raw).layout == ParallelLayout.uniform(4, 2, 1, 4)
    with pytest.raises(FieldError, match=r"^top\[0\]\.layout: global_batch_size\(99\) != dp"):
        Alternative.from_dict({**raw, "layout": {**layout, "global_batch_size": 99}}, "top[0]")
    assert Exports().to_dict() == {"megatron_approximations": [], "galvatron_approximations": []}


def test_search_refuses_a_malformed_hardware_profile_with_exit_4(profiles):
    hw = synthetic_hardware(1, 4, name="local")
    hw["benchmarks"]["allreduce"]["fits"][1]["algbw_GBps"] = -5.0
    write_json(profiles / "local" / "hardware.json", hw)
    write_json(profiles / "local" / "model" / "tiny.json", synthetic_model("tiny", layers=4))
    proc = run_cli("stage=search", profiles_dir=profiles)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert (f"{profiles / 'local' / 'hardware.json'}: benchmarks.allreduce.fits[1].algbw_GBps: "
            f"must be > 0, got -5.0. Rerun: python -m orchestrator stage=profile_hardware "
            f"profiles_dir={profiles} force=true") in proc.stderr
    assert not (profiles / "local" / "strategy" / "tiny.json").exists()


def test_profile_schema_doc_is_generated_from_the_dataclasses():
    generated = subprocess.run([sys.executable, "-m", "orchestrator.store.schema", "--markdown"],
                               cwd=REPO, capture_output=True, text=True, check=True).stdout
    committed = (REPO / "docs" / "profile-schema.md").read_text()
    assert committed == generated, ("docs/profile-schema.md is stale: run python -m "
                                    "orchestrator.store.schema --markdown > docs/profile-schema.md")
    assert "| `alpha_us` | float | required | latency, us |" in generated
    assert "time_us(size_bytes) = alpha_us + size_bytes / (algbw_GBps * 1e3)" in generated
