"""Issue 11 from the command line: a Galvatron user's directory goes through `stage=import` ->
`stage=search` (with `search.compare`) -> `stage=export` -> `stage=import` again, and nothing that
maps is lost; bad input is refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import run_cli
from orchestrator.interop.galvatron.strategy import read_strategy
from orchestrator.layout import ParallelLayout
from orchestrator.planner import HardwareModel, ModelCost
from orchestrator.store.schema import HardwareProfile, ModelProfile
from test_galvatron_hardware import FILES, _write
from test_galvatron_model import old_layout

CLUSTER = ["cluster=dgx_a100", "cluster.nodes=2"]
# The model of test_galvatron_model's files (hidden 512, 8 heads, seq 1024, bf16).
MODEL = ["model=tiny", "model.name=small", "model.hidden=512", "model.ffn=1024",
         "model.layers=4", "model.heads=8", "model.kv_heads=8", "model.vocab=1024",
         "model.seq_len=1024", "model.dtype=bf16"]
# Layouts Galvatron can express (no ZeRO-1, interleaving or selective recompute), so the
# exported strategy holds the whole pick.
SEARCH = ["search.memory_GiB=4", "search.global_batch_size=16", "search.max_tp=2",
          "search.plot=false", "search.zero_stages=[0,2,3]", "search.schedules=[1f1b]",
          "search.recompute=[none,full]"]
THEIR_PICK = {"pp_deg": 2, "tp_sizes_enc": "2,2,2,2", "tp_consecutive_flags": "1,1,1,1",
              "dp_types_enc": "0,0,0,0", "checkpoint": "1,0,0,0", "global_bsz": 16,
              "chunks": 4, "pp_division": "2,2", "pipeline_type": "pipedream_flush",
              "default_dp_type": "zero2"}

THEIR_FILE = "galvatron_config_small_2nodes_8gpus_per_node_4GB_bf16.json"


@pytest.fixture
def user_dir(tmp_path):
    """A Galvatron user's folder: hardware_configs/ (1x4, 1x8, 2x8) and a model's configs/."""
    root = tmp_path / "galvatron"
    _write(root / "hardware_configs", FILES)
    (root / "models" / "small").mkdir(parents=True)
    configs = old_layout(root / "models" / "small" / "configs")
    (configs / THEIR_FILE).write_text(json.dumps(THEIR_PICK))
    return root


def _profiles(folder: Path):
    cluster = folder / "dgx_a100"
    hardware = HardwareProfile.from_dict(json.loads((cluster / "hardware.json").read_text()), "")
    model = ModelProfile.from_dict(json.loads((cluster / "model/small.json").read_text()), "")
    return hardware, model


def _hardware_figures(hardware: HardwareProfile) -> dict:
    """What must survive a round trip: every fit's time at two sizes, per (op, n, layout)."""
    hw = HardwareModel.from_profile(hardware)
    return {(f.op.value, f.group_size, f.layout.value):
            tuple(round(hw.time_us(f.op.value, f.group_size, f.layout.value, s), 6)
                  for s in (1 << 20, 64 << 20))
            for f in hardware.benchmarks.fits()}


def _model_figures(model: ModelProfile) -> dict:
    cost = ModelCost.from_profile(model)
    figures = {}
    for tp in cost.tps:
        block, other = cost.memory(tp)
        figures[tp] = (round(cost.block_fwd_us(1024, tp), 6), round(cost.block_bwd_us(1024, tp), 6),
                       round(cost.other_fwd_us(1024, tp), 6),
                       round(block.param_bytes + block.grad_bytes + block.optim_bytes),
                       round(other.param_bytes + other.grad_bytes + other.optim_bytes),
                       {m: round(b, 3) for m, b in block.act_bytes_per_token.items()})
    return figures


def test_import_search_export_import_keeps_what_maps(user_dir, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    out = run_cli("stage=import", f"import.path={user_dir}", *CLUSTER, *MODEL,
                  profiles_dir=first, check=0)
    assert "not mapped:" in out.stdout and "assumed:" in out.stdout
    hardware, model = _profiles(first)
    assert hardware.source.value == model.source.value == "galvatron"
    assert hardware.cluster.nodes == 2 and hardware.cluster.tasks_per_node == 8
    assert any(name.endswith("p2p_bandwidth_2nodes_8gpus_per_node.json")
               for name in hardware.imported.files)
    assert model.imported.assumptions and model.imported.unmapped
    assert hardware.benchmarks.reduce_scatter and hardware.benchmarks.all_gather

    pick = user_dir / "models/small/configs" / THEIR_FILE
    searched = run_cli("stage=search", *CLUSTER, *MODEL, *SEARCH, f"search.compare={pick}",
                       profiles_dir=first, check=0)
    assert "dp_sync_exposed" in searched.stdout and "theirs" in searched.stdout
    strategy = json.loads((first / "dgx_a100/strategy/small.json").read_text())
    assert strategy["exports"]["galvatron_approximations"] == []

    exported = tmp_path / "exported"
    run_cli("stage=export", f"export.path={exported}", *CLUSTER, *MODEL, profiles_dir=first,
            check=0)
    names = {p.name for p in exported.iterdir()}
    assert {"allreduce_bandwidth_2nodes_8gpus_per_node.json",
            "p2p_bandwidth_1nodes_8gpus_per_node.json", "overlap_coefficient.json"} <= names
    assert any(n.startswith("computation_profiling_") for n in names)
    (config,) = [n for n in names if n.startswith("galvatron_config_")]

    run_cli("stage=import", f"import.path={exported}", *CLUSTER, *MODEL, profiles_dir=second,
            check=0)
    hardware2, model2 = _profiles(second)
    assert _hardware_figures(hardware2) == pytest.approx(_hardware_figures(hardware))
    assert hardware2.benchmarks.overlap.overlap_coe == hardware.benchmarks.overlap.overlap_coe
    assert _model_figures(model2) == _model_figures(model)
    layout, _ = read_strategy(exported / config, world_size=16, num_layers=4,
                              sequence_parallel=strategy["layout"]["sequence_parallel"])
    assert layout == ParallelLayout.from_dict(strategy["layout"])
    # The same inputs give the same answer.
    run_cli("stage=search", *CLUSTER, *MODEL, *SEARCH, profiles_dir=second, check=0)
    again = json.loads((second / "dgx_a100/strategy/small.json").read_text())
    assert again["layout"] == strategy["layout"]

    # Exported again (force=true or not) over a hand-edit: the edit is kept and named.
    edited = exported / "overlap_coefficient.json"
    exported_bytes = edited.read_bytes()
    edited.write_text('{"overlap_coe": 1.5}\n')
    ours = {n: (exported / n).read_bytes() for n in names if n != edited.name}
    proc = run_cli("stage=export", f"export.path={exported}", "force=true", *CLUSTER, *MODEL,
                   profiles_dir=first, check=0)
    (copy,) = exported.glob("overlap_coefficient.json.orig-*")
    assert copy.read_text() == '{"overlap_coe": 1.5}\n'
    assert (f"kept overlap_coefficient.json (changed since the orchestrator wrote it) as "
            f"{copy.name}" in proc.stdout), proc.stdout
    assert edited.read_bytes() == exported_bytes
    assert {n: (exported / n).read_bytes() for n in ours} == ours  # the rest: no copies
    assert len(list(exported.glob("*.orig-*"))) == 1


@pytest.mark.parametrize("args, words", [
    ([], "needs import.path="),
    (["import.path=/no/such/folder"], "no such folder"),
    (["import.pth=x"], "unknown key import.pth; did you mean import.path?"),
])
def test_bad_import_commands_exit_2_in_one_line(args, words, profiles):
    proc = run_cli("stage=import", *args, profiles_dir=profiles, check=2)
    assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_an_export_path_that_is_a_file_is_refused_in_one_line(profiles, tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    proc = run_cli("stage=export", f"export.path={afile}", profiles_dir=profiles, check=2)
    assert proc.stderr.strip() == (f"error: export.path={afile} is a file: export writes a "
                                   f"folder of files; give a folder (new or existing)")
    assert afile.read_text() == "mine"


def test_a_folder_without_known_files_and_a_missing_shape(tmp_path, user_dir, profiles):
    (tmp_path / "empty").mkdir()
    proc = run_cli("stage=import", f"import.path={tmp_path / 'empty'}", profiles_dir=profiles,
                   check=2)
    assert "no profile files of a known format" in proc.stderr
    proc = run_cli("stage=import", f"import.path={user_dir / 'hardware_configs'}",
                   "cluster=dgx_a100", "cluster.nodes=4", profiles_dir=profiles, check=4)
    assert "cluster.nodes=2 cluster.tasks_per_node=8" in proc.stderr
    assert not (profiles / "dgx_a100" / "hardware.json").exists()
