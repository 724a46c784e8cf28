"""Errors a user can act on: one line, the right exit code, and fix commands that work when pasted.

Issue 9, "Errors whose fix commands work" and unknown `+key` overrides.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, one_error_line, run_cli
from planner_fixtures import synthetic_hardware, synthetic_model

from orchestrator.cli import check_closed_choices, report_error
from orchestrator.commands import rerun_command, set_user_overrides
from orchestrator.config import Config
from orchestrator.errors import ConfigError, ProfileError, file_error
from orchestrator.runtime import run_inprocess
from orchestrator.runtime.request import StageRequest
from orchestrator.stages import get_stage
from orchestrator.store import write_json
from orchestrator.store.ledger import Ledger

SLURM = ["launcher=slurm", "cluster=dev", "launcher.poll_s=0.5"]


def _printed_command(line: str, after: str) -> list:
    """The argv of the command a message prints after `after` (up to the end of the line)."""
    return shlex.split(line.split(after, 1)[1])


# ---------------------------------------------------------------- commands.rerun_command
def test_rerun_command_keeps_the_overrides_that_matter_to_the_stage():
    given = ["stage=search", "profiles_dir=/tmp/my profiles", "model.hidden=192", "cluster=dev",
             "search.max_tp=2", "profile_hardware.benchmarks=[all2all]", "force=true"]
    assert rerun_command("profile_hardware", overrides=given) == (
        "python -m orchestrator stage=profile_hardware 'profiles_dir=/tmp/my profiles' "
        "model.hidden=192 cluster=dev 'profile_hardware.benchmarks=[all2all]'")
    assert rerun_command("search", "search.max_tp=4", overrides=given) == (
        "python -m orchestrator stage=search 'profiles_dir=/tmp/my profiles' model.hidden=192 "
        "cluster=dev search.max_tp=4")


def test_rerun_command_round_trips_through_a_shell():
    given = ["profiles_dir=/tmp/rc[full2,full2] $HOME 'q'", "+cluster.sbatch_args.comment=a b"]
    argv = shlex.split(rerun_command("noop", "force=true", overrides=given))
    assert argv == ["python", "-m", "orchestrator", "stage=noop",
                    "profiles_dir=/tmp/rc[full2,full2] $HOME 'q'",
                    "+cluster.sbatch_args.comment=a b", "force=true"]


# ---------------------------------------------------------------- unknown keys, before Hydra
@pytest.mark.parametrize("arg", ["+search.max_tpp=2", "search.max_tpp=2", "++search.max_tpp=2",
                                 "~search.max_tpp"])
def test_unknown_key_is_refused_with_a_close_match(arg):
    with pytest.raises(ConfigError, match=r"^unknown key search\.max_tpp; did you mean "
                                          r"search\.max_tp\?"):
        check_closed_choices(["stage=search", arg])


def test_unknown_key_in_a_sweep_is_refused():
    with pytest.raises(ConfigError, match=r"unknown key cluster\.nodez; did you mean "
                                          r"cluster\.nodes"):
        check_closed_choices(["-m", "stage=noop", "search.max_tp=1,2", "cluster.nodez=1,2"])


def test_known_keys_groups_hydra_and_free_form_dicts_pass():
    check_closed_choices(["stage=noop", "cluster=dev", "model=tiny", "launcher=local",
                          "search.max_tp=2", "+cluster.sbatch_args.comment=x",
                          "cluster.sbatch_args.exclusive=true", "~train",
                          "hydra.job.chdir=false", "hydra/job_logging=disabled",
                          "model.hidden=192",
                          "cluster.links.nic_Gbps=100", "profiles_dir=/tmp/x", "force=true"])


def test_unknown_plus_key_exits_2_in_one_line(profiles):
    proc = run_cli("stage=noop", "+search.max_tpp=2", profiles_dir=profiles)
    line = one_error_line(proc, 2)
    assert line == "error: unknown key search.max_tpp; did you mean search.max_tp?"
    assert not profiles.exists()


def test_glob_sweep_of_a_value_exits_2_in_one_line_and_of_a_group_picks_its_names(profiles):
    proc = run_cli("-m", "stage=train", "train.pp=glob(*)", profiles_dir=profiles)
    line = one_error_line(proc, 2)
    assert "train.pp=glob(...): glob picks among the names of a config group" in line, line
    assert "train.pp=a,b" in line and not profiles.exists()
    proc = run_cli("-m", "stage=glob(no*)", profiles_dir=profiles, check=0)  # stage=noop only
    assert "stage=noop" in proc.stdout and "stage=train" not in proc.stdout, proc.stdout


# ---------------------------------------------------------------- group choices, before Hydra
@pytest.mark.parametrize("argv, line", [
    (["model=tinny"], "unknown model 'tinny'; did you mean tiny or tiny_moe? allowed: "),
    (["cluster=dgx_h1000"], "unknown cluster 'dgx_h1000'; did you mean dgx_h100 or dgx_a100? "),
    (["launcher=slrum"], "unknown launcher 'slrum'; did you mean slurm? allowed: local, slurm"),
    (["-m", "model=tiny,tinny"], "unknown model 'tinny'; did you mean tiny or tiny_moe? "),
    (["-m", "cluster=local,dgx_h1000"], "unknown cluster 'dgx_h1000'; did you mean dgx_h100 "),
    (["model=null"], "unknown model 'null'; allowed: "),
])
def test_a_misspelled_group_choice_names_the_closest_and_every_name(argv, line):
    with pytest.raises(ConfigError) as error:
        check_closed_choices(["stage=noop", *argv])
    message = str(error.value)
    assert message.startswith(line) and "\n" not in message, message
    allowed = {"model": ["llama2_7b", "tiny", "tiny_moe"], "cluster": ["dgx_h100", "local"],
               "launcher": ["local", "slurm"]}[line.split()[1]]
    assert set(allowed) <= set(message.split("allowed: ")[1].split(" (")[0].split(", ")), message


def test_a_site_folders_group_choices_are_among_the_names(tmp_path, monkeypatch):
    """$ORCHESTRATOR_CONF's files and ./conf's are choices like the package's; Hydra's own
    --config-dir adds its folder's; --config-path leaves the choice to Hydra."""
    site = tmp_path / "site"
    (site / "cluster").mkdir(parents=True)
    (site / "cluster" / "mysite.yaml").write_text("name: mysite\n")
    monkeypatch.setenv("ORCHESTRATOR_CONF", str(site))
    check_closed_choices(["stage=noop", "cluster=mysite"])
    with pytest.raises(ConfigError, match=r"^unknown cluster 'mysitte'; did you mean mysite\? "
                                          r"allowed: dev, .*local, mysite "):
        check_closed_choices(["-m", "stage=noop", "cluster=mysite,mysitte"])
    monkeypatch.delenv("ORCHESTRATOR_CONF")
    (tmp_path / "work" / "conf" / "model").mkdir(parents=True)
    (tmp_path / "work" / "conf" / "model" / "mymodel.yaml").write_text("name: mymodel\n")
    monkeypatch.chdir(tmp_path / "work")
    check_closed_choices(["stage=noop", "model=mymodel"])
    with pytest.raises(ConfigError, match=r"^unknown model 'mymodle'; did you mean mymodel\?"):
        check_closed_choices(["stage=noop", "model=mymodle"])
    with pytest.raises(ConfigError, match=r"^unknown cluster 'mysite'"):
        check_closed_choices(["stage=noop", "cluster=mysite"])
    check_closed_choices([f"--config-dir={site}", "stage=noop", "cluster=mysite"])
    check_closed_choices(["--config-dir", str(site), "stage=noop", "cluster=mysite"])
    check_closed_choices(["--config-path=/elsewhere", "stage=noop", "cluster=theirs"])


def test_a_misspelled_group_choice_in_a_sweep_exits_2_in_one_line(profiles):
    proc = run_cli("-m", "stage=noop", "model=tiny,tinny", profiles_dir=profiles)
    line = one_error_line(proc, 2)
    assert line.startswith("error: unknown model 'tinny'; did you mean tiny or tiny_moe?")
    assert not profiles.exists()  # no sweep folder, no point run


# ---------------------------------------------------------------- wrong types, before Hydra
@pytest.mark.parametrize("arg, line", [
    ("trace.configs=[[a,1,1]]", "trace.configs[0][0]='a': expected an integer"),
    ("trace.configs=[[8,2,2],[8,x,1]]", "trace.configs[1][1]='x': expected an integer"),
    ("trace.configs=[8,2,2]", "trace.configs[0]=8: expected a list of integers"),
    ("cluster.nodes=abc", "cluster.nodes='abc': expected an integer"),
    ("cluster.nodes=1.5", "cluster.nodes=1.5: expected an integer"),
    ("cluster.nodes=null", "cluster.nodes=null: expected an integer"),
    ("train.lr=fast", "train.lr='fast': expected a number"),
    ("cluster.links.nic_Gbps=[1]", "cluster.links.nic_Gbps=[1]: expected a number"),
    ("force=maybe", "force='maybe': expected true or false"),
    ("wait=2", "wait=2: expected true or false"),  # OmegaConf would take it as true
    ("search.fast_mode=7", "search.fast_mode=7: expected true or false"),
    ("search.zero_stages=[0,one]", "search.zero_stages[1]='one': expected an integer"),
    ("search.schedules=1f1b", "search.schedules='1f1b': expected a list of items from 1f1b"),
    ("train.layers_per_stage=3,1", "train.layers_per_stage=3: expected a list of integers, in "
                                   "brackets: train.layers_per_stage=[...] (a,b without them is "
                                   "a sweep: -m)"),
    ("import_.path=[a]", "import.path=['a']: expected a string"),  # as main() passes it
])
def test_a_wrong_type_names_the_key_and_the_type_expected(arg, line):
    with pytest.raises(ConfigError) as error:
        check_closed_choices(["stage=noop", arg])
    assert str(error.value).startswith(line), str(error.value)
    assert "\n" not in str(error.value)


def test_a_wrong_type_in_a_sweep_value_is_refused():
    with pytest.raises(ConfigError, match=r"^train\.pp='a': expected an integer"):
        check_closed_choices(["-m", "stage=noop", "train.pp=1,a"])


def test_values_of_the_right_type_pass():
    check_closed_choices(["stage=noop", "trace.configs=[[8,2,2],[16,4,2]]", "cluster.nodes=2",
                          "train.lr=1", "train.lr=3e-4", "force=yes", "wait=0", "train.pp=null",
                          "search.zero_stages=[0,1]", "search.schedules=[1f1b,interleaved]",
                          "cluster.links={nic_Gbps: 100}", "train.seq_len=${model.seq_len}",
                          "cluster.sbatch_args.exclusive=[1,a]", "train.pp=range(1,3)"])


def test_a_wrong_type_on_the_command_line_is_one_line_exit_2(profiles):
    proc = run_cli("stage=trace", "trace.configs=[[a,1,1]]", profiles_dir=profiles)
    line = one_error_line(proc, 2)
    assert line == "error: trace.configs[0][0]='a': expected an integer"
    assert not profiles.exists()


# ---------------------------------------------------------------- fix commands that work
def test_error_line_prints_brackets_intact(capsys):
    """rich reads `[all2all]` as markup: the CLI's error line must not lose it."""
    message = ("layout rc[full2,full2] needs all2all; rerun `python -m orchestrator "
               "stage=profile_hardware 'profile_hardware.benchmarks=[all2all]'`")
    with pytest.raises(SystemExit) as exit_:
        report_error(ProfileError(message))
    assert exit_.value.code == 4
    assert capsys.readouterr().err == f"error: {message}\n"


def test_missing_input_command_keeps_profiles_dir_and_model_overrides(profiles):
    model = ["model.hidden=192", "model.heads=3", "model.kv_heads=3"]
    proc = run_cli("stage=search", *model, "search.max_tp=2",
                   "profile_hardware.benchmarks=[all2all]", profiles_dir=profiles)
    line = one_error_line(proc, 4)
    assert f"{profiles}/local/hardware.json: missing" in line
    assert _printed_command(line, "Run: ") == [
        "python", "-m", "orchestrator", "stage=profile_hardware", *model,
        "profile_hardware.benchmarks=[all2all]", f"profiles_dir={profiles}"]


def test_printed_fix_commands_do_the_fix(profiles):
    """Each missing input names a command; running it as printed makes the next step pass."""
    given = ["profile_hardware.source=analytic", "profile_model.source=analytic"]
    proc = run_cli("stage=search", *given, profiles_dir=profiles)
    fix = _printed_command(one_error_line(proc, 4), "Run: ")
    assert fix[3:] == ["stage=profile_hardware", "profile_hardware.source=analytic",
                       f"profiles_dir={profiles}"]
    subprocess.run([sys.executable, *fix[1:]], cwd=REPO, check=True, capture_output=True)
    proc = run_cli("stage=search", *given, profiles_dir=profiles)
    fix = _printed_command(one_error_line(proc, 4), "Run: ")
    assert fix[3] == "stage=profile_model" and f"profiles_dir={profiles}" in fix
    subprocess.run([sys.executable, *fix[1:]], cwd=REPO, check=True, capture_output=True)
    run_cli("stage=search", *given, profiles_dir=profiles, check=0)


def test_planner_message_keeps_brackets_and_profiles_dir(profiles):
    hw = synthetic_hardware(1, 4, name="local")
    del hw["benchmarks"]["reduce_scatter"], hw["benchmarks"]["all_gather"]
    write_json(profiles / "local" / "hardware.json", hw)
    write_json(profiles / "local" / "model" / "tiny.json", synthetic_model("tiny", layers=4))
    shape = ("model.hidden=256", "model.ffn=1024", "model.heads=8", "model.kv_heads=8",
             "model.vocab=1000", "model.dtype=bf16")  # the synthetic profile's
    proc = run_cli("stage=search", "search.zero_stages=[2]", *shape, profiles_dir=profiles)
    line = one_error_line(proc, 4)
    # every benchmark the profile lacks in one command, not one per search
    assert "no fits for reduce_scatter, all_gather (this one needs all_gather)" in line
    fix = line.split("rerun `", 1)[1].rstrip("`")
    assert shlex.split(fix) == ["python", "-m", "orchestrator", "stage=profile_hardware",
                                *shape, f"profiles_dir={profiles}",
                                "profile_hardware.benchmarks=[reduce_scatter,all_gather]"]


def test_the_plan_carries_the_overrides_to_the_ranks(tmp_path):
    """Ranks never see the command line (a Slurm job); their messages' commands still keep it."""
    given = ["stage=noop", f"profiles_dir={tmp_path}", "cluster.tasks_per_node=2"]
    set_user_overrides(given)
    cfg = Config(profiles_dir=str(tmp_path))
    plan = get_stage("noop").plan(cfg)
    assert plan.user_overrides == tuple(given)
    set_user_overrides([])  # as on a rank
    Ledger(tmp_path).launch(plan.key, [], queued=False, config_hash=plan.config_hash,
                            launcher="local", run_dir=str(tmp_path / "run"))
    run_inprocess(StageRequest(plan=plan, config=cfg, todo=[], ledger_dir=str(tmp_path),
                               run_dir=str(tmp_path / "run")))
    try:
        assert rerun_command("profile_hardware") == (
            f"python -m orchestrator stage=profile_hardware profiles_dir={tmp_path} "
            f"cluster.tasks_per_node=2")
    finally:
        set_user_overrides([])


# ---------------------------------------------------------------- file-system failures
def test_file_error_names_profiles_dir_only_for_files_in_it(tmp_path):
    inside = OSError(13, "Permission denied", str(tmp_path / "p" / "local" / "ledger.json"))
    assert str(file_error(inside, str(tmp_path / "p"))) == (
        f"{tmp_path}/p/local/ledger.json: Permission denied. The profiles folder {tmp_path}/p "
        f"must be writable: make it so, or choose another with profiles_dir=<folder>")
    outside = FileNotFoundError(2, "No such file or directory", "mpiexec")
    assert str(file_error(outside, str(tmp_path / "p"))) == "mpiexec: No such file or directory"
    assert file_error(outside, "p").exit_code == 2


def _as_user(cmd: list) -> list:
    """`cmd` without root's power to write where the permissions say no (tests run as root)."""
    if os.geteuid() != 0:
        return cmd
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--inh-caps={caps}", f"--bounding-set={caps}", *cmd]


def _cli_as_user(*args, profiles_dir, env=None):
    cmd = [sys.executable, "-m", "orchestrator", *args, f"profiles_dir={profiles_dir}"]
    return subprocess.run(_as_user(cmd), cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_an_empty_profiles_dir_is_refused_not_the_current_folder(tmp_path):
    """`profiles_dir=$UNSET`: nothing lands in the folder the command runs in."""
    line = one_error_line(run_cli("stage=noop", profiles_dir="", cwd=tmp_path), 2)
    assert line == ("error: profiles_dir is empty: give the folder for profiles and runs "
                    "(profiles_dir=profiles is the default)")
    assert list(tmp_path.iterdir()) == []


def test_read_only_profiles_folder_is_one_line_exit_2(profiles):
    run_cli("stage=noop", profiles_dir=profiles, check=0)
    cluster_dir = profiles / "local"
    cluster_dir.chmod(0o555)  # runs/ stays writable: the ledger is what cannot be written
    try:
        proc = _cli_as_user("stage=noop", "force=true", profiles_dir=profiles)
    finally:
        cluster_dir.chmod(0o755)
    line = one_error_line(proc, 2)
    assert str(cluster_dir) in line and "profiles_dir=" in line


def test_status_works_on_a_read_only_folder(profiles):
    """status only reads: a launch it would re-attach to does not make it write."""
    run_cli("stage=noop", profiles_dir=profiles, check=0)
    path = profiles / "local" / "ledger.json"
    raw = json.loads(path.read_text())
    raw["entries"]["noop"].update(state="pending", launcher="slurm", job_id="999999",
                                  job_folder=str(profiles / "gone"))
    path.write_text(json.dumps(raw))
    (profiles / "local").chmod(0o555)
    try:
        proc = _cli_as_user("stage=status", profiles_dir=profiles)
    finally:
        (profiles / "local").chmod(0o755)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "noop" in proc.stdout and "Traceback" not in proc.stderr


# ---------------------------------------------------------------- Slurm submission failures
@pytest.mark.parametrize("bad, cause", [("cluster.partition=nope", "invalid partition"),
                                        ("cluster.mem_GiB=100000", "Memory specification")])
def test_sbatch_refusal_is_one_line_exit_5(slurm_cluster, profiles, bad, cause):
    proc = run_cli("stage=noop", *SLURM, bad, profiles_dir=profiles)
    line = one_error_line(proc, 5)
    assert "sbatch refused" in line and cause in line


def test_slurm_not_configured_is_one_line_exit_2(slurm_cluster, profiles):
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    cmd = [sys.executable, "-m", "orchestrator", "stage=noop", *SLURM, f"profiles_dir={profiles}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    line = one_error_line(proc, 2)
    assert "SLURM_CONF" in line
    # SLURM_CONF naming no file: at once (sbatch would retry it for 60 s), no launch made
    runs = sorted(profiles.rglob("runs/*"))
    missing = profiles.parent / "nowhere.conf"
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=30,
                          env={**env, "SLURM_CONF": str(missing)})
    assert one_error_line(proc, 2) == (f"error: SLURM_CONF={missing}: no such file; set it to "
                                       f"the cluster's slurm.conf, or unset it for Slurm's own "
                                       f"default")
    assert sorted(profiles.rglob("runs/*")) == runs


def test_no_slurm_commands_is_one_line_exit_2(profiles, tmp_path):
    bin_dir = tmp_path / "bin"  # a PATH without sbatch/srun
    bin_dir.mkdir()
    cmd = [sys.executable, "-m", "orchestrator", "stage=noop", *SLURM, f"profiles_dir={profiles}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": str(bin_dir)})
    line = one_error_line(proc, 2)
    assert "sbatch" in line and "PATH" in line
    assert shutil.which("sbatch")  # the suite's own PATH has it
