"""The command line as Hydra is to read it (orchestrator/overrides.py): a value holding '=' (srun's
`--mpi=pmix`) is taken as typed, and one that cannot be is refused in one line saying how to
quote it; every argument Hydra's grammar already takes passes unchanged."""
from __future__ import annotations

import shlex

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import one_error_line, run_cli
from orchestrator.config import CONF_DIR, register_configs
from orchestrator.errors import ConfigError
from orchestrator.overrides import hydra_argv


def _composed(argv):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=hydra_argv(argv)))


@pytest.mark.parametrize("arg, key, value", [
    ("cluster.mpi_flag=--mpi=none", "mpi_flag", "--mpi=none"),  # as docs/config.md writes it
    ("cluster.mpi_flag='--mpi=none'", "mpi_flag", "--mpi=none"),  # quoted, as before
    ('cluster.mpi_flag="--mpi=none"', "mpi_flag", "--mpi=none"),
    ("cluster.srun_args=[--cpu-bind=cores,-v]", "srun_args", ["--cpu-bind=cores", "-v"]),
    ("cluster.srun_args=['--cpu-bind=cores',-v]", "srun_args", ["--cpu-bind=cores", "-v"]),
    ("cluster.srun_args=[]", "srun_args", []),
    ("+cluster.sbatch_args.constraint=a=b", "sbatch_args", {"constraint": "a=b"}),
    # a free-form key as docs/config.md writes it: Hydra alone wants a `+` in front
    ("cluster.sbatch_args.constraint=a100", "sbatch_args", {"constraint": "a100"}),
    ("cluster.sbatch_args.constraint=a=b", "sbatch_args", {"constraint": "a=b"}),
    ("++cluster.sbatch_args={a: 'b=c'}", "sbatch_args", {"a": "b=c"}),
])
def test_a_value_holding_equals_is_taken_as_typed(arg, key, value):
    assert getattr(_composed([arg]).cluster, key) == value


def test_a_sweep_of_such_values_stays_a_sweep_and_other_grammar_is_untouched():
    from orchestrator.sweep import swept_keys

    argv = ["-m", "stage=noop", "cluster.mpi_flag=--mpi=pmi2,--mpi=pmix", "train.pp=1,2",
            "search.schedules=[1f1b,interleaved]", "train.seq_len=${model.seq_len}",
            "hydra.job.chdir=false", "--config-dir=/a=b", "cluster.mpi_flag=a b"]
    rewritten = hydra_argv(argv)
    assert rewritten[2] == "cluster.mpi_flag='--mpi=pmi2','--mpi=pmix'"
    assert rewritten[:2] + rewritten[3:] == argv[:2] + argv[3:]
    assert swept_keys(rewritten) == ["cluster.mpi_flag", "train.pp"]
    assert hydra_argv(["import.path=a=b"]) == ["import_.path='a=b'"]  # the schema's spelling too
    assert hydra_argv(["--config-dir", "/a=b=c", "-cp", "x=y=z"]) == [  # paths, not overrides
        "--config-dir", "/a=b=c", "-cp", "x=y=z"]


@pytest.mark.parametrize("arg, example", [
    ("cluster.sbatch_args={a: b=c}", """'cluster.sbatch_args={a: "b=c"}'"""),
    ("cluster.srun_args=[[x=1]]", """'cluster.srun_args=["a=b",c]'"""),
    ("cluster.mpi_flag=(x=1)", """'cluster.mpi_flag="(x=1)"'"""),
])
def test_equals_that_cannot_be_quoted_for_the_user_says_how(arg, example):
    with pytest.raises(ConfigError) as error:
        hydra_argv(["stage=noop", arg])
    message = str(error.value)
    assert message.startswith(f"{arg}: Hydra's override grammar ends the key at the first '='")
    assert message.endswith(f"e.g. {example}") and "\n" not in message
    key, _, value = shlex.split(example)[0].partition("=")
    assert hydra_argv([f"{key}={value}"]) == [f"{key}={value}"]  # the example itself parses


def test_equals_on_the_command_line_runs_or_is_one_line_exit_2(profiles):
    proc = run_cli("--cfg", "job", "stage=noop", "cluster.mpi_flag=--mpi=none",
                   profiles_dir=profiles, check=0)
    assert "mpi_flag: --mpi=none" in proc.stdout
    line = one_error_line(run_cli("stage=noop", "cluster.sbatch_args={a: b=c}",
                                  profiles_dir=profiles), 2)
    assert line.startswith("error: cluster.sbatch_args={a: b=c}: Hydra's override grammar")
    assert not profiles.exists()


def test_a_fix_command_shows_such_a_value_as_typed():
    from orchestrator.commands import rerun_command, set_user_overrides

    typed = ["cluster.mpi_flag=--mpi=none", "cluster.srun_args=[--cpu-bind=cores,-v]",
             "cluster.sbatch_args.constraint=a100", "model=tiny"]
    set_user_overrides(hydra_argv(typed))  # what Hydra's overrides.task then holds
    try:
        command = rerun_command("search")
    finally:
        set_user_overrides([])
    assert shlex.split(command)[3:] == ["stage=search", *typed]


@pytest.mark.parametrize("arg, key, value", [
    # Before: Hydra's LexerNoViableAltException in 5 lines, exit code 1.
    ("train.data=~/corpus.txt", "data", "~/corpus.txt"),  # the shell leaves ~ after `a.b=`
    ("train.data=/data/données.txt", "data", "/data/données.txt"),
    ("train.load=/ckpt/日本", "load", "/ckpt/日本"),
])
def test_a_path_hydras_lexer_refuses_but_holding_no_grammar_is_taken_as_typed(arg, key, value):
    assert getattr(_composed([arg]).train, key) == value
    from orchestrator.overrides import typed_form

    assert typed_form(hydra_argv([arg])[0]) == arg  # a fix command shows it as typed
    assert hydra_argv(["-m", "train.data=a,b"]) == ["-m", "train.data=a,b"]  # a sweep as before


def test_a_tilde_path_runs_from_home_not_a_folder_named_tilde(tmp_path):
    """Before: profiles_dir='~/p' wrote ./~/p/...; train.data=~/x was a Hydra grammar error."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / "corpus.txt").write_text("x")
    proc = run_cli("stage=profile_hardware", "profile_hardware.source=analytic",
                   "cluster=dgx_h100", "profiles_dir=~/p", profiles_dir=None, cwd=cwd,
                   env={"HOME": str(home)}, check=0)
    assert (home / "p" / "dgx_h100" / "hardware.json").is_file(), proc.stdout + proc.stderr
    assert list(cwd.iterdir()) == []
    line = one_error_line(run_cli("stage=train", "train.data=~/nofile.txt", "train.pp=1",
                                  "train.tp=1", "profiles_dir=~/p", profiles_dir=None, cwd=cwd,
                                  env={"HOME": str(home)}), 2)
    assert f"{home}/nofile.txt" in line, line


def test_cfg_with_a_sweep_is_one_line_exit_2(tmp_path):
    """Before: Hydra's `ValueError: Only one of --run, --multirun, --cfg, --info and
    --shell_completion can be specified` as a 15-line traceback, exit 1."""
    for args in (["--cfg", "job", "-m", "model=tiny,tiny_moe"], ["-m", "--info", "stage=noop"]):
        line = one_error_line(run_cli(*args, profiles_dir=tmp_path / "p"), 2)
        assert "cannot be combined: Hydra takes one of --run, -m, --cfg, --info" in line, line
    assert not (tmp_path / "p").exists()
    assert run_cli("--cfg", "job", "model=tiny_moe", profiles_dir=tmp_path / "p",
                   check=0).stdout.startswith("stage:")


@pytest.mark.parametrize("arg, says", [
    ("+model.hidden=64", "+model.hidden: model.hidden is already in the config; write "
                         "model.hidden=... without the '+'"),
    ("+model=tiny", "+model: model is already chosen; write model=... without the '+'"),
    ("~cluster.name", "~cluster.name: cluster.name is a typed key and cannot be deleted"),
    ("~search.max_tp", "~search.max_tp: search.max_tp is a typed key and cannot be deleted"),
    ("~stage", "~stage: a command runs the stage it names (stage=<name>); without one it runs "
               "stage=all"),
])
def test_a_plus_or_tilde_hydra_refuses_is_one_line_before_it(arg, says):
    """Before: Hydra's 'Could not append to config' / 'does not support deletion' in 5-7
    lines, exit 1."""
    from orchestrator.cli.checks import check_closed_choices

    with pytest.raises(ConfigError) as error:
        check_closed_choices(["stage=search", arg])
    assert str(error.value).startswith(says), str(error.value)


def test_plus_and_tilde_hydra_takes_still_pass():
    from orchestrator.cli.checks import check_closed_choices

    check_closed_choices(["++model.hidden=64", "~train", "~model", "+cluster.sbatch_args.x=1",
                          "cluster.sbatch_args.x=1", "++model=tiny_moe", "hydra.verbose=true"])
