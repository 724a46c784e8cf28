"""Issue 9, "Stale inputs" and "Data never dropped": a search refuses profiles made for another
model or cluster shape, a copied profiles folder stays consistent, a sub-part redone under other
settings keeps the others, a corrupt ledger is rebuilt from the outputs, a named benchmark is
redone."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import MEASURED_CHAIN, QUICK_HW, ledger, run_cli

CHAIN = MEASURED_CHAIN
OTHERS = ("inventory", "p2p", "reduce_scatter", "all_gather", "all2all", "overlap")


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _hardware(profiles) -> dict:
    return _json(profiles / "local" / "hardware.json")


# ---------------------------------------------------------------- stale inputs
def test_search_refuses_a_model_profile_of_another_shape(chain):
    proc = run_cli("stage=search", *CHAIN, "model.hidden=192", "model.heads=6",
                   profiles_dir=chain, check=4)
    err = " ".join(proc.stderr.split())
    assert "model/tiny.json was profiled for" in err
    assert "hidden=128" in err and "hidden=192" in err and "heads=6" in err
    assert "layers" not in err  # the planner multiplies layers: not a difference
    assert "python -m orchestrator stage=profile_model" in err and "model.hidden=192" in err
    assert proc.stderr.count("\n") <= 3  # one line, before anything runs


def test_search_refuses_hardware_of_another_ranks_per_node(chain):
    proc = run_cli("stage=search", *CHAIN, "cluster.tasks_per_node=8", profiles_dir=chain, check=4)
    err = " ".join(proc.stderr.split())
    assert "hardware.json" in err and "tasks_per_node" in err and "4" in err and "8" in err
    assert "python -m orchestrator stage=profile_hardware" in err


def test_search_on_more_nodes_than_profiled_plans_with_a_note(chain):
    proc = run_cli("stage=search", *CHAIN, "search.world_size=8", profiles_dir=chain, check=0)
    out = " ".join(proc.stdout.split())
    assert "hardware.json measured 1 node x 4 ranks; planning 2 nodes" in out
    strategy = _json(chain / "local" / "strategy" / "tiny.json")
    assert strategy["space"]["world_size"] == 8
    assert any("planning 2 nodes" in n for n in strategy["notes"])


def test_all_with_a_changed_model_shape_reprofiles_then_searches(chain):
    shape = ["model.hidden=192", "model.heads=6", "model.kv_heads=2"]
    run_cli("stage=all", *CHAIN, *shape, profiles_dir=chain, check=0, timeout=600)
    assert _json(chain / "local" / "model" / "tiny.json")["model"]["hidden"] == 192


def test_strategy_inputs_are_relative_and_a_copied_folder_skips_search(chain, tmp_path):
    strategy = _json(chain / "local" / "strategy" / "tiny.json")
    assert sorted(strategy["inputs"]) == ["hardware.json", "model/tiny.json"]
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(chain, elsewhere)
    proc = run_cli("stage=all", *CHAIN, profiles_dir=elsewhere, check=0)
    assert "search/tiny: done" in proc.stdout and "skipping" in proc.stdout
    assert "runs every part" not in proc.stdout and "running every part" not in proc.stdout


def test_strategy_with_old_absolute_input_keys_is_rerun(chain):
    path = chain / "local" / "strategy" / "tiny.json"
    strategy = _json(path)
    strategy["inputs"] = {str(chain / "local" / k): v for k, v in strategy["inputs"].items()}
    path.write_text(json.dumps(strategy))
    proc = run_cli("stage=search", *CHAIN, profiles_dir=chain, check=0)
    assert "search/tiny: 1 part(s)" in proc.stdout


# ---------------------------------------------------------------- data never dropped
def test_subpart_under_changed_settings_keeps_the_others(chain):
    before = _hardware(chain)
    run_cli("stage=profile_hardware", *QUICK_HW, "profile_hardware.benchmarks=[allreduce]",
            "profile_hardware.max_time_s=0.02", profiles_dir=chain, check=0)
    after = _hardware(chain)
    for name in OTHERS[1:]:
        assert after["benchmarks"][name] == before["benchmarks"][name], name
    assert after["inventory"] == before["inventory"]
    assert after["parts"]["allreduce"]["settings"]["max_time_s"] == 0.02
    assert after["parts"]["p2p"]["settings"]["max_time_s"] == 0.05
    assert after["parts"]["allreduce"]["config_hash"] != after["parts"]["p2p"]["config_hash"]
    # The default settings again: exactly allreduce is redone.
    proc = run_cli("stage=profile_hardware", *QUICK_HW, profiles_dir=chain, check=0)
    assert "1 part(s) on 4 rank(s) via launcher=local (allreduce)" in proc.stdout
    again = _hardware(chain)
    assert again["parts"]["allreduce"]["settings"]["max_time_s"] == 0.05
    assert again["benchmarks"]["p2p"] == before["benchmarks"]["p2p"]


def test_readme_redo_one_part_remeasures_all2all_only(chain):
    before = _hardware(chain)
    # README: python -m orchestrator stage=profile_hardware profile_hardware.benchmarks=[all2all]
    proc = run_cli("stage=profile_hardware", "profile_hardware.benchmarks=[all2all]", *QUICK_HW,
                   profiles_dir=chain, check=0)
    assert "(all2all)" in proc.stdout
    after = _hardware(chain)
    assert after["parts"]["all2all"]["ended"] > before["parts"]["all2all"]["ended"]
    for name in ("allreduce", "p2p", "reduce_scatter", "all_gather", "overlap"):
        assert after["benchmarks"][name] == before["benchmarks"][name], name
        assert after["parts"][name] == before["parts"][name], name


def test_corrupt_ledger_is_rebuilt_and_intact_results_reused(chain):
    outputs = [chain / "local" / p for p in ("hardware.json", "model/tiny.json",
                                             "strategy/tiny.json")]
    stamps = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in outputs}
    (chain / "local" / "ledger.json").write_text("{ not json")
    proc = run_cli("stage=all", *CHAIN, profiles_dir=chain, check=0)
    assert proc.stderr.count("ledger.json was corrupt") == 1
    assert "rebuilt" in proc.stderr and "intact results are reused" in proc.stderr
    for p in outputs:
        assert (p.stat().st_mtime_ns, p.read_bytes()) == stamps[p], p
    assert list((chain / "local").glob("ledger.json.corrupt-*"))
    # `{}` (no entries at all) is a ledger lost, not an empty one; its copy is a second one
    (chain / "local" / "ledger.json").write_text("{}")
    proc = run_cli("stage=status", profiles_dir=chain)
    assert "ledger.json was corrupt" in proc.stderr
    assert len(list((chain / "local").glob("ledger.json.corrupt-*"))) == 2
    entries = ledger(chain)
    assert entries["profile_hardware/all2all"]["state"] == "done"
    assert entries["profile_model/tiny/seq64_tp2"]["state"] == "done"
    assert entries["search/tiny"]["state"] == "done"
