"""The command line as a user meets it: composing configs, refusing bad input, running a stage locally."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from conftest import REPO, ledger, run_cli
from orchestrator.config import CONF_DIR, register_configs


def _compose(overrides=()):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_defaults_run_here():
    cfg = _compose()
    assert cfg.stage.name == "all"
    assert cfg.launcher.name == "local"
    assert (cfg.cluster.nodes, cfg.cluster.tasks_per_node, cfg.cluster.backend) == (1, 4, "gloo")
    assert cfg.profiles_dir == "profiles"


def test_typo_in_key_fails_at_compose_time():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)):
        _compose(["cluster.nodez=2"])


def test_wrong_type_fails_at_compose_time():
    with pytest.raises((ConfigCompositionException, ValidationError)):
        _compose(["cluster.nodes=abc"])


def test_group_files_are_typed_by_the_schema():
    cfg = _compose(["cluster=dev", "launcher=slurm", "stage=profile_hardware"])
    assert (cfg.cluster.nodes, cfg.cluster.tasks_per_node) == (2, 2)
    assert cfg.launcher.name == "slurm"
    assert cfg.stage.name == "profile_hardware"


@pytest.mark.parametrize("args, words", [
    (["stage=bogus"], ["unknown stage 'bogus'", "profile_hardware"]),
    (["launcher=pbs"], ["unknown launcher 'pbs'", "local, slurm"]),
    (["stage=profile_hardware", "cluster.nodes=2"], ["cluster.nodes(2)", "launcher=slurm"]),
    (["stage=profile_hardware", "cluster.backend=nccl", "cluster.gpus_per_node=8"],
     ["tasks_per_node(4) != cluster.gpus_per_node(8)"]),
    (["stage=profile_hardware", "profile_hardware.benchmarks=[allreduce,bogus]"],
     ["unknown ['bogus']", "allowed"]),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(profiles, args, words):
    proc = run_cli(*args, profiles_dir=profiles)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    for word in words:
        assert word in err
    assert not (profiles / "local" / "ledger.json").exists()


def test_help_and_cfg_job_work_as_in_any_hydra_app(profiles):
    proc = run_cli("--help", profiles_dir=profiles, check=0)
    assert "stage" in proc.stdout and "cluster" in proc.stdout
    assert proc.stdout.startswith("orchestrator: ") and "cli is powered by Hydra" not in proc.stdout
    proc = run_cli("--cfg", "job", "stage=profile_hardware", profiles_dir=profiles, check=0)
    assert "tasks_per_node: 4" in proc.stdout and "name: profile_hardware" in proc.stdout


def test_inventory_on_4_local_ranks_then_rerun_skips(profiles):
    proc = run_cli("stage=profile_hardware", "profile_hardware.benchmarks=[inventory]",
                   profiles_dir=profiles, check=0)
    profile = json.loads((profiles / "local" / "hardware.json").read_text())
    ranks = profile["inventory"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [r["local_rank"] for r in ranks] == [0, 1, 2, 3]
    assert all(r["torch"] and r["mpi"] and r["cpu_count"] >= 1 and r["mem_GiB"] > 0 for r in ranks)
    assert profile["schema_version"] == 1 and profile["kind"] == "hardware"
    prov = profile["provenance"]
    assert prov["config_hash"] and prov["ended"] >= prov["started"] and prov["hosts"]
    entries = ledger(profiles)
    assert entries["profile_hardware"]["state"] == "done"
    assert entries["profile_hardware/inventory"]["state"] == "done"
    first_job = entries["profile_hardware"]["job_id"]
    assert first_job.startswith("local-")

    proc = run_cli("stage=profile_hardware", "profile_hardware.benchmarks=[inventory]",
                   profiles_dir=profiles, check=0)
    assert "skipping" in proc.stdout
    assert ledger(profiles)["profile_hardware"]["job_id"] == first_job

    proc = run_cli("stage=profile_hardware", "profile_hardware.benchmarks=[inventory]", "force=true",
                   profiles_dir=profiles, check=0)
    assert ledger(profiles)["profile_hardware"]["job_id"] != first_job


def test_status_from_a_fresh_process(profiles):
    proc = run_cli("stage=status", profiles_dir=profiles, check=0)
    assert "nothing has run" in proc.stdout and "other clusters" not in proc.stdout
    run_cli("stage=noop", profiles_dir=profiles, check=0)
    proc = run_cli("stage=status", profiles_dir=profiles, check=0)
    assert "noop" in proc.stdout and "done" in proc.stdout
    # Another cluster's runs (a Slurm user's cluster=<name>) are not in this table: status
    # names them and the command that shows them, which does.
    run_cli("stage=noop", "cluster.name=mysite", "cluster.tasks_per_node=1",
            profiles_dir=profiles, check=0)
    said = " ".join(run_cli("stage=status", profiles_dir=profiles, check=0).stdout.split())
    assert "other clusters in" in said and "mysite (last written" in said
    command = said.split("see one with: ")[1]
    assert command.startswith("python -m orchestrator stage=status profiles_dir=")
    assert command.split()[-1] == "cluster.name=mysite"  # no cluster file of that name
    proc = run_cli(*command.split()[3:], profiles_dir=None, check=0)
    assert "mysite/ledger.json" in " ".join(proc.stdout.split()) and "noop" in proc.stdout
    assert "other clusters in" in proc.stdout and "local (last written" in proc.stdout


def test_a_relative_profiles_dir_is_recorded_absolute(tmp_path):
    # A run started as `profiles_dir=p` in one folder, seen by `stage=status` from another (a
    # second login node, a job's rank): the ledger's run folder must name the same files there.
    (tmp_path / "here").mkdir()
    run_cli("stage=noop", "cluster.tasks_per_node=1", profiles_dir="p", cwd=tmp_path / "here",
            check=0)
    entry = ledger(tmp_path / "here" / "p")["noop"]
    assert Path(entry["run_dir"]).is_absolute() and Path(entry["run_dir"]).is_dir()
    assert Path(entry["log_path"]).is_absolute()


def test_missing_input_names_the_command_that_builds_it(profiles):
    proc = run_cli("stage=search", profiles_dir=profiles)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "hardware.json: missing" in proc.stderr
    assert "python -m orchestrator stage=profile_hardware" in proc.stderr


def test_multirun_sweeps_with_the_local_launcher(profiles):
    proc = run_cli("-m", "stage=noop", "cluster.tasks_per_node=2,4", profiles_dir=profiles, check=0)
    assert "on 2 rank(s)" in proc.stdout and "on 4 rank(s)" in proc.stdout
    assert proc.stdout.count("✓ noop: done") == 2


@pytest.mark.parametrize("args, code", [
    (("stage=train", "train.pp=3"), 2),  # refused by the layout's checks
    (("stage=search",), 4),  # refused: no profiles to search from
    (("stage=status",), 0),
])
def test_the_login_nodes_checks_do_not_import_torch(tmp_path, args, code):
    # A refusal before launch, or a status, is the CLI alone: importing torch costs seconds of
    # CPU on a shared login node (and did, through train.compile's setting, for a while).
    probe = ("import runpy, sys\n"
             f"sys.argv = ['orchestrator', *{list(args)!r}, 'profiles_dir={tmp_path}']\n"
             "try:\n    runpy.run_module('orchestrator', run_name='__main__')\n"
             "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
             "print('exit', code, 'torch', 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert f"exit {code} torch False" in proc.stdout, proc.stdout + proc.stderr


def test_an_nccl_cluster_on_the_local_launcher_without_its_gpus_is_refused_before_launch(
        profiles):
    """Before: `stage=train cluster=dgx_h100` on a machine with no GPU started 8 local ranks,
    each failed with `LaunchError: ... this rank sees no GPU`, exit 5."""
    proc = run_cli("stage=train", "cluster=dgx_h100", "train.pp=1", "train.tp=1",
                   profiles_dir=profiles)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "is an nccl cluster (one rank per GPU)" in err, err
    assert "launcher=local starts its 8 ranks on this machine" in err and "launcher=slurm" in err
    assert not (profiles / "dgx_h100" / "runs").exists()
