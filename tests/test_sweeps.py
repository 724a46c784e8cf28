"""Sweeps over PP/TP that compare: fixed degrees (`search.pp`, `search.tp`), one ledger key and
one set of outputs per sweep point, a table comparing the points, and bounds refused before launch
with the config key named."""
from __future__ import annotations

import csv
import json
import shutil

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import ledger, one_error_line, run_cli
from orchestrator.config import CONF_DIR, register_configs
from orchestrator.errors import ConfigError
from orchestrator.pipeline import plan_stage
from orchestrator.planner import (CostOptions, HardwareModel, ModelCost, SearchSpace, evaluate,
                                  search)
from planner_fixtures import GiB, synthetic_hardware, synthetic_model
from test_planner_search import all_layouts

register_configs()


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))


# ---------------------------------------------------------------- fixed degrees, planner level
@pytest.mark.parametrize("pp,tp", [(1, 1), (2, 2), (1, 4), (4, 2)])
def test_fixed_pp_tp_is_the_best_of_the_full_space_with_that_pair(pp, tp):
    model = ModelCost.from_dict(synthetic_model(layers=4, hidden=256, ffn=1024, heads=8))
    hw = HardwareModel.from_dict(synthetic_hardware(1, 8))
    base = dict(world_size=8, memory_budget_bytes=80 * GiB, global_batch_size=16, seq_len=512,
                micro_batch_sizes=(1, 2), zero_stages=(0, 1, 3), virtual_stages=(2,),
                options=CostOptions(reserve_bytes=0))
    full = SearchSpace(**base)
    best = None
    for layout, costs in all_layouts(model, hw, full):
        if (layout.pp, layout.tp) != (pp, tp):
            continue
        pred = evaluate(layout, model, hw, full.seq_len, full.memory_budget_bytes, full.options,
                        _costs=costs)
        if pred.feasible and (best is None or pred.iteration_time_us < best):
            best = pred.iteration_time_us
    result = search(model, hw, SearchSpace(**base, pp=pp, tp=tp))
    assert (result.best.pp, result.best.tp) == (pp, tp)
    assert all((lay.pp, lay.tp) == (pp, tp) for lay, _ in result.top)
    assert result.prediction.iteration_time_us == pytest.approx(best, rel=1e-9)


def test_fixed_tp_wins_over_max_tp():
    model = ModelCost.from_dict(synthetic_model(layers=4, heads=8))
    hw = HardwareModel.from_dict(synthetic_hardware(1, 8))
    space = SearchSpace(world_size=8, memory_budget_bytes=80 * GiB, global_batch_size=16,
                        seq_len=512, max_tp=1, tp=4)
    assert search(model, hw, space).best.tp == 4


# ---------------------------------------------------------------- bounds, before launch
BAD = [
    ("search", ["search.pp=3"], "search.pp"),  # 3 does not divide the 4 ranks
    ("search", ["search.pp=2", "search.tp=4"], "search.tp"),  # pp*tp = 8 > 4 ranks
    ("search", ["search.tp=4"], "kv_heads"),  # tiny: 2 KV heads
    ("search", ["cluster.tasks_per_node=8", "search.pp=8"], "search.pp"),  # tiny: 4 layers
    ("search", ["search.memory_GiB=0"], "search.memory_GiB"),
    ("search", ["search.memory_GiB=-1"], "search.memory_GiB"),
    ("search", ["search.max_tp=0"], "search.max_tp"),
    ("search", ["search.max_pp=0"], "search.max_pp"),
    ("search", ["search.reserve_GiB=-1"], "search.reserve_GiB"),
    ("search", ["search.reserve_GiB=4"], "search.reserve_GiB"),  # the whole 4 GiB
    ("profile_hardware", ["profile_hardware.min_size_bytes=0"], "profile_hardware.min_size_bytes"),
    ("profile_hardware", ["profile_hardware.min_size_bytes=4096",
                          "profile_hardware.max_size_bytes=1024"],
     "profile_hardware.max_size_bytes"),
    ("profile_hardware", ["profile_hardware.warmup_iters=-1"], "profile_hardware.warmup_iters"),
    ("profile_hardware", ["profile_hardware.min_iters=0"], "profile_hardware.min_iters"),
    ("profile_hardware", ["profile_hardware.max_iters=3"], "profile_hardware.max_iters"),
    ("profile_hardware", ["profile_hardware.max_time_s=0"], "profile_hardware.max_time_s"),
    ("profile_hardware", ["profile_hardware.rel_spread=-0.1"], "profile_hardware.rel_spread"),
    ("profile_hardware", ["profile_hardware.max_tp=0"], "profile_hardware.max_tp"),
    ("profile_model", ["profile_model.iters=0"], "profile_model.iters"),
    ("profile_model", ["profile_model.warmup_iters=-1"], "profile_model.warmup_iters"),
    ("profile_model", ["profile_model.micro_batch_size=0"], "profile_model.micro_batch_size"),
    ("profile_model", ["profile_model.seq_lens=[0,64]"], "profile_model.seq_lens"),
    ("profile_model", ["profile_model.seq_lens=[64,512]"], "profile_model.seq_lens"),  # > 256
    ("profile_model", ["profile_model.max_seq_len=1024"], "profile_model.max_seq_len"),
]


@pytest.mark.parametrize("stage,overrides,key", BAD, ids=[" ".join(b[1]) for b in BAD])
def test_bad_bound_is_refused_at_planning_naming_the_key(stage, overrides, key):
    with pytest.raises(ConfigError) as info:
        plan_stage(stage, _cfg(f"stage={stage}", *overrides))
    assert key in str(info.value)


def test_fixed_degrees_plan_and_search_max_tp_is_not_required():
    plan = plan_stage("search", _cfg("stage=search", "search.pp=2", "search.tp=2",
                                     "search.max_tp=1"))
    assert (plan.detail.pp, plan.detail.tp) == (2, 2)


@pytest.mark.parametrize("args,key", [
    (["stage=profile_hardware", "profile_hardware.min_iters=0"], "profile_hardware.min_iters"),
    (["stage=search", "search.memory_GiB=0"], "search.memory_GiB"),
])
def test_bounds_refused_in_one_line_exit_2_before_launch(profiles, args, key):
    proc = run_cli(*args, profiles_dir=profiles, check=2)
    assert key in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (profiles / "local" / "ledger.json").exists()  # nothing launched


# ---------------------------------------------------------------- the CLI with analytic inputs
@pytest.fixture(scope="module")
def analytic_inputs(tmp_path_factory):
    """hardware.json and model/tiny.json for the local cluster, from analytic sources (fast)."""
    base = tmp_path_factory.mktemp("inputs") / "profiles"
    run_cli("stage=profile_hardware", "profile_hardware.source=analytic",
            "profile_hardware.plot=false", profiles_dir=base, check=0)
    run_cli("stage=profile_model", "profile_model.source=analytic", "profile_model.plot=false",
            profiles_dir=base, check=0)
    return base


@pytest.fixture
def inputs(analytic_inputs, tmp_path):
    profiles = tmp_path / "profiles"
    shutil.copytree(analytic_inputs, profiles)
    return profiles


def _sweep_table(profiles):
    (sweep_dir,) = (profiles / "local" / "multirun").iterdir()
    rows = list(csv.DictReader((sweep_dir / "sweep.csv").open()))
    assert json.loads((sweep_dir / "sweep.json").read_text())["rows"] == rows
    return rows


def test_search_sweep_points_keep_their_own_outputs_and_compare(inputs):
    proc = run_cli("-m", "stage=search", "search.pp=1,2", "search.tp=1,2", "search.plot=false",
                   profiles_dir=inputs, check=0)
    entries = ledger(inputs)
    strategy = inputs / "local" / "strategy"
    for pp in (1, 2):
        for tp in (1, 2):
            name = f"tiny@pp={pp},tp={tp}"
            assert entries[f"search/{name}"]["state"] == "done"
            layout = json.loads((strategy / f"{name}.json").read_text())["layout"]
            assert (layout["pp"], layout["tp"]) == (pp, tp)
            assert json.loads((strategy / f"{name}.layout.json").read_text())["layout"] == layout
            assert (strategy / f"{name}.megatron.args").exists()
    assert not (strategy / "tiny.json").exists()  # a plain run's file is not a sweep's
    rows = _sweep_table(inputs)
    assert [r["point"] for r in rows] == ["search.pp=1 search.tp=1", "search.pp=1 search.tp=2",
                                          "search.pp=2 search.tp=1", "search.pp=2 search.tp=2"]
    assert all(r["state"] == "done" and float(r["iteration ms"]) > 0
               and float(r["tokens/s"]) > 0 and float(r["model peak GiB"]) > 0 for r in rows)
    assert "pp2" in rows[3]["layout"].replace(" ", "") or "pp=2" in rows[3]["layout"]
    assert "tokens/s" in proc.stdout  # the table on stdout

    before = ledger(inputs)
    shutil.rmtree(inputs / "local" / "multirun")
    run_cli("-m", "stage=search", "search.pp=1,2", "search.tp=1,2", "search.plot=false",
            profiles_dir=inputs, check=0)
    after = ledger(inputs)
    for key, entry in before.items():
        assert after[key]["ended"] == entry["ended"], key  # every point skipped
    rows = _sweep_table(inputs)
    assert all(r["state"] == "done (skipped)" and float(r["iteration ms"]) > 0 for r in rows)


def test_readme_sweep_skips_a_layout_these_ranks_cannot_hold_and_exits_0(inputs):
    """The README's sweep: pp4/tp2 does not divide the 4 devices, so it is skipped with its
    reason (as a train sweep skips it), not failed. The peak columns say what they hold: the
    model's own peak (the search table's "model peak GiB") and the reserve kept free beside it."""
    proc = run_cli("-m", "stage=search", "search.pp=1,2,4", "search.tp=1,2", "search.plot=false",
                   profiles_dir=inputs, check=0)
    rows = _sweep_table(inputs)
    assert [r["state"] for r in rows] == ["done"] * 5 + ["skipped"]
    assert "does not divide the 4 devices" in rows[5]["error"]
    assert not (inputs / "local" / "strategy" / "tiny@pp=4,tp=2.json").exists()
    strategy = json.loads((inputs / "local" / "strategy" / "tiny@pp=1,tp=1.json").read_text())
    reserve_GiB = strategy["headroom"]["reserve_GiB"]
    model_peak_GiB = strategy["prediction"]["peak_memory_bytes"] / 2**30 - reserve_GiB
    assert float(rows[0]["model peak GiB"]) == pytest.approx(model_peak_GiB, abs=1e-3)
    assert float(rows[0]["reserve GiB"]) == pytest.approx(reserve_GiB, abs=1e-3)
    assert "peak GiB" not in rows[0]  # no column a user cannot place
    assert f"{model_peak_GiB:.2f}" in proc.stdout  # the search's own table, the same figure
    assert "skipped: search.tp: pp(4) * tp(2) = 8 does not divide" in proc.stderr
    assert "error:" not in proc.stderr  # nothing failed


def test_a_sweep_whose_every_point_is_skipped_exits_2_after_its_table(inputs):
    """Nothing ran: a script must not read it as success."""
    proc = run_cli("-m", "stage=search", "search.pp=3", "search.tp=1,2", "search.plot=false",
                   profiles_dir=inputs)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert [r["state"] for r in _sweep_table(inputs)] == ["skipped", "skipped"]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: every point of the sweep was skipped (2): none can run on these ranks or this "
        "model (the table says why each)")


def test_a_train_row_names_its_predicted_and_measured_peaks_apart():
    from orchestrator.sweep import COLUMNS, train_row

    row = train_row({"describe": "tp1 pp1", "iteration_time_error": 0.1,
                     "measured": {"iteration_ms": 11.0, "tokens_per_s": 5.0,
                                  "peak_memory_MiB": [512.0, 1024.0]},
                     "predicted": {"iteration_ms": 10.0, "peak_memory_MiB": 768.0}})
    assert (row["model peak GiB"], row["measured peak GiB"]) == ("0.750", "1.000")
    assert set(row) <= set(COLUMNS)


def test_an_invalid_point_is_a_row_and_the_sweep_exits_with_its_code(inputs):
    """A point whose layout cannot exist here is skipped; one the stage refuses (a budget below
    its own reserve) fails: a row each, the others run, and the sweep exits with the failed
    point's code."""
    proc = run_cli("-m", "stage=search", "search.pp=4,1", "search.memory_GiB=1,16",
                   "search.tp=2", "search.plot=false", profiles_dir=inputs, check=2)
    rows = _sweep_table(inputs)
    assert [r["state"] for r in rows] == ["failed", "skipped", "failed", "done"]
    assert "search.tp" in rows[1]["error"] and "search.memory_GiB" in rows[2]["error"]
    assert ledger(inputs)["search/tiny@pp=1,memory_GiB=16.0"]["state"] == "done"  # tp not swept
    assert "search.memory_GiB" in proc.stdout + proc.stderr


def test_a_value_out_of_range_in_any_point_refuses_the_sweep_before_it_runs(inputs):
    line = one_error_line(run_cli("-m", "stage=search", "search.pp=1,0", "search.plot=false",
                                  profiles_dir=inputs), 2)
    assert "search.pp(0) must be >= 1" in line, line
    assert not (inputs / "local" / "multirun").exists() and "search/tiny@pp=1" not in ledger(inputs)


def test_infeasible_names_config_keys_and_a_command(inputs):
    proc = run_cli("stage=search", "search.memory_GiB=0.001", "search.reserve_GiB=0",
                   "search.plot=false",
                   profiles_dir=inputs, check=3)
    assert "memory_budget_bytes" not in proc.stderr
    assert "search.memory_GiB" in proc.stderr
    assert "python -m orchestrator stage=search" in proc.stderr


def test_point_names_are_readable_and_filesystem_safe():
    from orchestrator.sweep import labelled, point_label, set_swept_keys

    cfg = _cfg("stage=search", "search.zero_stages=[1,3]", "search.pp=2", "model.layers=8",
               "search.recompute=[none,full]")
    set_swept_keys(["-m", "search.zero_stages=[0],[1,3]", "search.pp=1,2", "model.layers=4,8",
                    "search.tp=2", "search.recompute=[full],[none,full]"])
    try:
        assert point_label(cfg, "search") == "zero_stages=1+3,pp=2,recompute=none+full"
        assert point_label(cfg, "profile_model") == ""
        plan = plan_stage("search", cfg)
    finally:
        set_swept_keys([])
    assert plan.key == "search/tiny@zero_stages=1+3,pp=2,recompute=none+full"
    assert plan.outputs[0].name == "tiny@zero_stages=1+3,pp=2,recompute=none+full.json"
    assert labelled(plan.outputs[0], "").name == plan.outputs[0].name
    assert plan_stage("search", cfg).key == "search/tiny"  # not a sweep: the plain key


def test_slurm_sweep_without_waiting_rows_say_submitted(slurm_cluster, tmp_path):
    """Points submitted from the CLI (wait=false): rows with job ids; each job its own file."""
    import time

    profiles = tmp_path / "profiles"
    dev = ["cluster=dev"]
    run_cli("stage=profile_hardware", "profile_hardware.source=analytic", *dev,
            "profile_hardware.plot=false", profiles_dir=profiles, check=0)
    run_cli("stage=profile_model", "profile_model.source=analytic", "profile_model.plot=false",
            *dev, profiles_dir=profiles, check=0)
    run_cli("-m", "stage=search", "launcher=slurm", *dev, "wait=false", "search.pp=1,2",
            "search.plot=false", profiles_dir=profiles, check=0)
    (sweep_dir,) = (profiles / "dev" / "multirun").iterdir()
    rows = list(csv.DictReader((sweep_dir / "sweep.csv").open()))
    assert [r["state"] for r in rows] == ["submitted", "submitted"]
    assert all(r["job id"].isdigit() for r in rows)
    strategy = profiles / "dev" / "strategy"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not all(
            (strategy / f"tiny@pp={pp}.json").exists() for pp in (1, 2)):
        time.sleep(1)
    for pp in (1, 2):
        assert json.loads((strategy / f"tiny@pp={pp}.json").read_text())["layout"]["pp"] == pp
