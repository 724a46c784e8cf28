"""A user's site folder (./conf or $ORCHESTRATOR_CONF) layered over the package's configs, and
names that become paths: they cannot leave the profiles folder.

The repository's own conf/ is an example site (conf/cluster/example_site.yaml,
conf/model/example_model.yaml); the CLI tests run from the repository root, so it is theirs too.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, one_error_line, run_cli
from orchestrator.config_keys import check_path_name
from orchestrator.errors import ConfigError

MYSITE = """\
# A local site cluster: this machine, 2 CPU ranks over gloo.
name: mysite
nodes: 1
tasks_per_node: 2
backend: gloo
device_mem_GiB: 4
"""
# Every stage, as fast as it goes: analytic profiles (no measuring), two training steps.
QUICK_ALL = ["profile_hardware.source=analytic", "profile_model.source=analytic",
             "profile_model.seq_lens=[128,256]", "profile_model.max_tp=1", "search.max_tp=1",
             "train.steps=2", "profile_hardware.plot=false", "profile_model.plot=false",
             "search.plot=false", "train.plot=false"]


def _site(folder: Path, files: dict) -> Path:
    """`folder` holding `files` ({"cluster/mysite.yaml": text}); returns it."""
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def _files(folder: Path) -> list:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ---------------------------------------------------------------- the example site (repo's conf/)
def test_example_site_cluster_composes_and_validates(profiles):
    proc = run_cli("--cfg", "job", "cluster=example_site", "model=example_model",
                   profiles_dir=profiles, check=0)
    assert "name: example_site" in proc.stdout and "partition: gpu" in proc.stdout
    assert "- module load cuda/12.4" in proc.stdout
    assert "name: example_model" in proc.stdout and "ffn: 2816" in proc.stdout


def test_help_lists_the_sites_choices_with_the_packages(profiles):
    proc = run_cli("--help", profiles_dir=profiles, check=0)
    assert "cluster: dev, dgx_a100, dgx_h100, example_site, gpu_node, local" in proc.stdout
    assert ("model: deepseek_v3, example_model, llama2_7b, llama3_405b, mixtral_8x7b, "
            "qwen3_30b_a3b, qwen_100b, qwen_30b, tiny, tiny_moe") in proc.stdout


def test_example_model_is_planned_on_the_example_site_with_sources_in_provenance(profiles):
    site = ["cluster=example_site", "model=example_model"]
    run_cli("stage=profile_hardware", "profile_hardware.source=analytic",
            "profile_hardware.plot=false", *site, profiles_dir=profiles, check=0)
    run_cli("stage=profile_model", "profile_model.source=analytic", "profile_model.max_tp=2",
            "profile_model.seq_lens=[1024,2048]", "profile_model.plot=false", *site,
            profiles_dir=profiles, check=0)
    run_cli("stage=search", "search.max_tp=2", "search.plot=false", *site,
            profiles_dir=profiles, check=0)
    strategy = json.loads((profiles / "example_site" / "strategy" / "example_model.json")
                          .read_text())
    layout = strategy["layout"]
    assert layout["pp"] * layout["tp"] * layout["dp"] == 16  # 2 nodes x 8 GPUs
    assert strategy["provenance"]["config_sources"] == {
        "cluster": str(REPO / "conf" / "cluster" / "example_site.yaml"),
        "model": str(REPO / "conf" / "model" / "example_model.yaml")}


# ---------------------------------------------------------------- a site of one's own
def test_a_fresh_folder_with_one_site_cluster_runs_every_stage(tmp_path):
    _site(tmp_path / "conf", {"cluster/mysite.yaml": MYSITE})
    run_cli("stage=all", "cluster=mysite", "model=tiny", *QUICK_ALL, profiles_dir=None,
            cwd=tmp_path, check=0, timeout=600)
    folder = tmp_path / "profiles" / "mysite"  # profiles_dir's default, under the working dir
    for output in ("hardware.json", "model/tiny.json", "strategy/tiny.json"):
        assert (folder / output).exists(), output
    summary = next((folder / "train" / "tiny").glob("*.json"))
    sources = {"cluster": str(tmp_path / "conf" / "cluster" / "mysite.yaml"),
               "model": "package:model/tiny.yaml"}
    for path in (folder / "hardware.json", folder / "strategy" / "tiny.json", summary):
        assert json.loads(path.read_text())["provenance"]["config_sources"] == sources, path
    run_config = next((folder / "runs").glob("*_all/config.yaml")).read_text()
    assert run_config.startswith(f"# cluster: {sources['cluster']}\n"
                                 f"# model: package:model/tiny.yaml\n")


def test_orchestrator_conf_names_a_site_folder_elsewhere(tmp_path):
    site = _site(tmp_path / "shared" / "site", {"cluster/othersite.yaml":
                                                 MYSITE.replace("mysite", "othersite")})
    work = tmp_path / "work"
    work.mkdir()
    env = {"ORCHESTRATOR_CONF": str(site)}
    proc = run_cli("--cfg", "job", "cluster=othersite", profiles_dir=None, cwd=work, env=env,
                   check=0)
    assert "name: othersite" in proc.stdout and "tasks_per_node: 2" in proc.stdout
    run_cli("stage=noop", "cluster=othersite", profiles_dir=None, cwd=work, env=env, check=0)
    run_config = next((work / "profiles" / "othersite" / "runs").glob("*_noop/config.yaml"))
    assert run_config.read_text().startswith(
        f"# cluster: {site / 'cluster' / 'othersite.yaml'}\n")


def test_orchestrator_conf_that_is_not_a_folder_fails_in_one_line(tmp_path):
    proc = run_cli("stage=noop", profiles_dir=None, cwd=tmp_path,
                   env={"ORCHESTRATOR_CONF": str(tmp_path / "missing")})
    assert "ORCHESTRATOR_CONF=" in one_error_line(proc, 2)
    assert _files(tmp_path) == []


def test_a_site_file_named_like_a_package_file_overrides_it(tmp_path):
    _site(tmp_path / "conf", {"cluster/local.yaml": "name: local\ntasks_per_node: 3\n"})
    proc = run_cli("--cfg", "job", profiles_dir=None, cwd=tmp_path, check=0)
    assert "tasks_per_node: 3" in proc.stdout


def test_a_site_sweep_runs_from_the_site_folder(tmp_path):
    _site(tmp_path / "conf", {"cluster/mysite.yaml": MYSITE})
    proc = run_cli("-m", "stage=noop", "cluster=mysite", "cluster.tasks_per_node=1,2",
                   profiles_dir=None, cwd=tmp_path, check=0)
    assert "sweep: 2 point(s)" in proc.stdout
    assert list((tmp_path / "profiles" / "mysite" / "multirun").glob("*/sweep.csv"))


@pytest.mark.parametrize("text, says", [
    ("name: mysite\nnodez: 2\n",
     "line 2: unknown key cluster.nodez; did you mean cluster.nodes?"),
    ("name: mysite\nnodes: two\n", "line 2: cluster.nodes='two': expected an integer"),
    ("name: mysite\nlinks:\n  nic_Gbps: fast\n",
     "line 3: cluster.links.nic_Gbps='fast': expected a number"),
    ("name: mysite\n  nodes: [\n", "line 2: not valid YAML: mapping values are not allowed here"),
])
def test_a_bad_site_cluster_file_fails_in_one_line_naming_the_file(tmp_path, text, says):
    site = _site(tmp_path / "conf", {"cluster/mysite.yaml": text})
    for sweep in ([], ["-m", "cluster=local,mysite"]):
        args = [*sweep, "stage=noop"] + ([] if sweep else ["cluster=mysite"])
        line = one_error_line(run_cli(*args, profiles_dir=None, cwd=tmp_path), 2)
        assert line == f"error: {site / 'cluster' / 'mysite.yaml'}: {says}"
    assert _files(tmp_path) == ["conf", "conf/cluster", "conf/cluster/mysite.yaml"]


# Every way a site file can be wrong, and what its one line says after "<file>: ".
BAD_SITE_FILES = [
    # not readable as YAML
    (b"name: \xff\n", "not UTF-8 text (byte 0xff at offset 6)"),
    ("name: mysite\n\tnodes: 2\n", "line 2: not valid YAML: found character '\\t'"),
    ("name: mysite\nname: other\n", "line 2: not valid YAML: found duplicate key name"),
    ("name: *base\n", "line 1: not valid YAML: found undefined alias 'base'"),
    # YAML a config cannot hold
    ("name: mysite\npartition: !!timestamp 2024-01-01\n",
     "line 2: cluster.partition: a YAML !!timestamp value, which a config cannot hold"),
    ("name: mysite\nsetup: !!set {a, b}\n",
     "line 2: cluster.setup: a YAML !!set value, which a config cannot hold"),
    ("name: mysite\nsbatch_args: {comment: !!binary aGVsbG8=}\n",
     "line 2: cluster.sbatch_args.comment: a YAML !!binary value"),
    ("name: mysite\nsbatch_args: !!omap [a: 1]\n", "line 2: cluster.sbatch_args: a YAML !!omap"),
    ("name: !!python/name:os.system x\n", "line 1: cluster.name: a YAML !!python/name:os.system"),
    ("name: !mine x\n", "line 1: cluster.name: a YAML !mine value"),
    ("name: mysite\nsbatch_args: {1: a}\n",
     "line 2: cluster.sbatch_args: the key '1' is a YAML !!int, not a name: quote it"),
    ("name: mysite\ntrue: 1\n", "line 2: cluster: the key 'true' is a YAML !!bool, not a name"),
    ("name: mysite\nsrun_args: &a [*a]\n", "line 2: cluster.srun_args[0]: an alias that holds"),
    # not keys
    ("- a\n- b\n", "line 1: holds a list, not keys (key: value, one a line)"),
    ("mysite\n", "line 1: holds the single value 'mysite', not keys"),
    ("defaults: base\nname: mysite\n", "line 1: defaults: Hydra's defaults list is a list"),
    # interpolations
    ("name: ${oops\n", "line 1: cluster.name: '${oops' is not a valid interpolation"),
    ("name: mysite\nnodes: ${cluster.nodez}\n",
     "line 2: cluster.nodes: '${cluster.nodez}' names no key"),
    ("name: ${nope:x}\n", "line 1: cluster.name: '${nope:x}' names no resolver"),
    # the schema's refusals, with their lines
    ("name: mysite\nlinks:\n  nic_gbps: 1\n", "line 3: unknown key cluster.links.nic_gbps"),
    ("name: mysite\nnodes: 2024-01-01\n", "line 2: cluster.nodes='2024-01-01': expected an"),
    ("name: ../up\n", "line 1: cluster.name='../up': it names a folder or file"),
    # no name of its own: it would be `local` (or its defaults' parent's) and take its profiles
    ("", "sets no name; add `name: mysite` (the file's name)"),
    ("# only a comment\n", "sets no name; add `name: mysite`"),
    ("nodes: 1\n", "sets no name; add `name: mysite`"),
    ("defaults:\n  - local\n  - _self_\nnodes: 1\n", "sets no name; add `name: mysite`"),
    ("# @package _global_\ncluster:\n  nodez: 2\n", "line 3: unknown key cluster.nodez"),
]


@pytest.mark.parametrize("content, says", BAD_SITE_FILES)
def test_every_way_a_site_file_is_wrong_is_one_line_naming_file_line_and_key(tmp_path, content,
                                                                             says):
    from orchestrator.site_files import check_group_file

    path = tmp_path / "mysite.yaml"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    with pytest.raises(ConfigError) as error:
        check_group_file("cluster", path)
    message = str(error.value)
    assert message.startswith(f"{path}: {says}") and "\n" not in message, message


@pytest.mark.parametrize("text", [
    "name: mysite\npartition: 2024-01-01\n",  # Hydra's loader keeps a plain date as text
    "name: mysite\nsbatch_args:\n  <<: {comment: x}\n",  # a YAML merge key
    "name: mysite\ntime_min: ${model.layers}\n",  # another section, resolved by Hydra
    "name: mysite-${now:%Y}\n",  # Hydra's own resolver
    "# @package _group_\nname: mysite\n",
    "name: mysite\nsbatch_args: {'1': a, comment: 'x=y'}\n",
])
def test_a_good_site_file_passes(tmp_path, text):
    from orchestrator.site_files import check_group_file

    path = tmp_path / "mysite.yaml"
    path.write_text(text)
    check_group_file("cluster", path)


@pytest.mark.parametrize("file, args, says", [
    # checked before Hydra: a YAML set in $ORCHESTRATOR_CONF's model file (Hydra: ~100 lines)
    ("model/mymodel.yaml", ["model=mymodel"],
     "line 2: model.hidden: a YAML !!set value, which a config cannot hold"),
    # only Hydra's composing finds it: an unset environment variable (Hydra: 14 lines)
    ("cluster/mysite.yaml", ["cluster=mysite"],
     "line 7: cluster.partition: KeyError raised while resolving interpolation"),
])
def test_a_bad_site_file_exits_2_in_one_line_naming_file_line_and_key(tmp_path, file, args,
                                                                      says):
    site = _site(tmp_path / "site", {
        "model/mymodel.yaml": "name: mymodel\nhidden: !!set {a}\n",
        "cluster/mysite.yaml": MYSITE + "partition: ${oc.env:ORCHESTRATOR_TEST_UNSET}\n"})
    proc = run_cli("stage=noop", *args, profiles_dir=None, cwd=tmp_path,
                   env={"ORCHESTRATOR_CONF": str(site)})
    line = one_error_line(proc, 2)
    assert line.startswith(f"error: {site / file}: {says}"), line
    assert not (tmp_path / "profiles").exists()


def test_a_site_config_yaml_is_refused_not_used_as_the_primary_config(tmp_path):
    _site(tmp_path / "conf", {"config.yaml": "defaults: []\n"})
    line = one_error_line(run_cli("stage=noop", profiles_dir=None, cwd=tmp_path), 2)
    assert "conf/config.yaml: a site folder holds config groups only" in line


# ---------------------------------------------------------------- names that become paths
REFUSED_NAMES = ["../x", "a/b", "/abs", "a\\b", "..", "a..b", "", ".hidden", "-x"]


@pytest.mark.parametrize("name", REFUSED_NAMES)
def test_a_name_that_would_leave_the_profiles_folder_is_refused(name):
    with pytest.raises(ConfigError, match=r"may hold only letters, digits, '_', '-' and '\.'"):
        check_path_name("cluster.name", name)


@pytest.mark.parametrize("name", ["local", "dgx_h100", "my-site.2", "A1"])
def test_plain_names_pass(name):
    check_path_name("model.name", name)


@pytest.mark.parametrize("override", [f"cluster.name={n}" for n in REFUSED_NAMES]
                         + ["model.name=../m", "model.name=m/../../x",
                            "profile_model.device=../../etc/h100", "trace.device=a/b"])
def test_a_path_name_on_the_command_line_exits_2_in_one_line_creating_nothing(tmp_path,
                                                                               override):
    profiles = tmp_path / "deep" / "profiles"  # ../x would land in tmp_path/deep/x
    line = one_error_line(run_cli("stage=noop", override, profiles_dir=profiles), 2)
    assert "must not start with '.' or '-' nor contain '..'" in line
    assert line.startswith(f"error: {override.split('=')[0]}=")
    assert _files(tmp_path) == []


def test_a_path_name_in_a_sweep_exits_2_before_the_sweep_folder(tmp_path):
    profiles = tmp_path / "deep" / "profiles"
    proc = run_cli("-m", "stage=noop", "cluster.name=ok,../x", profiles_dir=profiles)
    assert "cluster.name='../x'" in one_error_line(proc, 2)
    assert _files(tmp_path) == []


def test_a_path_name_from_a_site_cluster_file_exits_2_creating_nothing(tmp_path):
    site = _site(tmp_path / "conf", {"cluster/evil.yaml": "name: ../evil\n"})
    for sweep in ([], ["-m", "cluster.tasks_per_node=1,2"]):
        proc = run_cli(*sweep, "stage=noop", "cluster=evil", profiles_dir=None, cwd=tmp_path)
        line = one_error_line(proc, 2)
        assert line.startswith(f"error: {site / 'cluster' / 'evil.yaml'}: line 1: "
                               f"cluster.name='../evil'")
    assert _files(tmp_path) == ["conf", "conf/cluster", "conf/cluster/evil.yaml"]


def test_a_path_name_from_a_config_dir_file_is_refused_after_composing(tmp_path):
    """Files of Hydra's own --config-dir are not the site's pre-checked ones: the composed
    config is checked before any folder is made (the sweep folder too)."""
    extra = _site(tmp_path / "extra", {"cluster/evil.yaml": "name: ../evil\n"})
    work = tmp_path / "work"
    work.mkdir()
    for sweep in ([], ["-m", "cluster.tasks_per_node=1,2"]):
        proc = run_cli(f"--config-dir={extra}", *sweep, "stage=noop", "cluster=evil",
                       profiles_dir=None, cwd=work)
        assert "cluster.name='../evil'" in one_error_line(proc, 2)
    assert _files(work) == []
    assert not (tmp_path / "evil").exists()


def test_a_site_model_file_without_a_name_is_refused_before_it_replaces_tinys_profiles(tmp_path):
    """Before: conf/model/mymodel.yaml without `name:` was named `tiny` (the schema's default):
    profile_model said `profile_model/tiny: done`, kept the real tiny.json aside and wrote
    mymodel's shape in its place; `model=tiny` then found its profile stale."""
    site = _site(tmp_path / "conf", {"model/mymodel.yaml": "hidden: 256\nffn: 768\nlayers: 8\n"
                                     "heads: 8\nkv_heads: 8\nvocab: 32000\nseq_len: 512\n"})
    proc = run_cli("stage=profile_model", "model=mymodel", "cluster=dgx_h100",
                   profiles_dir=tmp_path / "profiles", cwd=tmp_path)
    line = one_error_line(proc, 2)
    assert line.startswith(f"error: {site / 'model' / 'mymodel.yaml'}: sets no name; add "
                           f"`name: mymodel`"), line
    assert "'tiny'" in line
    assert not (tmp_path / "profiles").exists()


@pytest.mark.parametrize("text, says", [
    ("name: mymodel\nhidden: 4096\nlayers: 32\nheads: 32\nkv_heads: 8\n",
     "sets no ffn, vocab, seq_len; a model file gives its whole shape"),
    ("name: mymodel\nhidden: 64\n", "sets no ffn, layers, heads, kv_heads, vocab, seq_len"),
])
def test_a_site_model_file_missing_part_of_its_shape_is_refused(tmp_path, text, says):
    """Before: the missing keys took tiny's values (vocab 512, seq_len 256, ...) silently."""
    from orchestrator.site_files import check_group_file

    path = tmp_path / "mymodel.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        check_group_file("model", path)
    assert str(error.value).startswith(f"{path}: {says}"), str(error.value)
    # a whole shape, or one that starts from another model's, passes
    path.write_text("name: mymodel\nhidden: 64\nffn: 192\nlayers: 2\nheads: 2\nkv_heads: 2\n"
                    "vocab: 512\nseq_len: 128\n")
    check_group_file("model", path)
    path.write_text("defaults:\n  - tiny\n  - _self_\nname: mymodel\nlayers: 2\n")
    check_group_file("model", path)
