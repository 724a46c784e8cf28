"""Issue 39, "A profile is the model it claims to be": a profile records every field of the
model (and cluster) that changes what it measures, and every stage that reads it compares them
with its own config by one rule (store/schema/identity.py): a profile of another model or
cluster is stale, exit 4, naming the file, each field's two values and the command that
rebuilds it."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import yaml
from conftest import one_error_line, run_cli
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from planner_fixtures import synthetic_hardware, synthetic_model

from orchestrator.choices import Dtype
from orchestrator.config import CONF_DIR, ClusterConfig, register_configs
from orchestrator.errors import ProfileError
from orchestrator.models.config import ModelConfig
from orchestrator.store import read_profile, write_json, write_profile
from orchestrator.store.schema import HardwareProfile, ModelProfile
from orchestrator.store.schema.identity import differences, model_summary

REBUILD = "python -m orchestrator stage=profile_model model=tiny_moe"


def _model(name: str, **changes) -> ModelConfig:
    model = ModelConfig(**yaml.safe_load(open(CONF_DIR / "model" / f"{name}.yaml")))
    return dataclasses.replace(model, **changes)


def _profile_dict(model: ModelConfig) -> dict:
    """A model profile of `model` as profile_model writes its `model` section (times and
    memory synthetic: only what it claims to be matters here)."""
    return {**synthetic_model(model.name, tps=(1,)), "model": model_summary(model)}


def _profile(model: ModelConfig) -> ModelProfile:
    return ModelProfile.from_dict(_profile_dict(model))


def _asks(model: ModelConfig = None, cluster: ClusterConfig = None):
    return SimpleNamespace(model=model or _model("tiny"), cluster=cluster or ClusterConfig())


def _plain(value):
    return getattr(value, "value", value)


# ---------------------------------------------------------------- the rule
def test_a_dense_models_profile_is_not_a_moe_models():
    assert differences(_profile(_model("tiny")), _asks(_model("tiny_moe"))) == [
        ("model.name", "tiny", "tiny_moe"), ("model.experts", 0, 8)]
    assert differences(_profile(_model("tiny_moe")), _asks(_model("tiny_moe"))) == []


@pytest.mark.parametrize("field, value", [
    ("hidden", 256), ("ffn", 512), ("heads", 8), ("kv_heads", 4), ("vocab", 1024),
    ("dtype", Dtype.bf16), ("layers", 8), ("top_k", 1), ("expert_ffn", 64),
    ("shared_expert_ffn", 0), ("dense_layers", 2), ("capacity_factor", 1.25),
    ("aux_loss_coef", 0.0)])
def test_every_field_that_changes_what_was_measured_is_compared(field, value):
    made = _model("tiny_moe")
    found = differences(_profile(made), _asks(dataclasses.replace(made, **{field: value})))
    assert found == [(f"model.{field}", _plain(getattr(made, field)), _plain(value))]


def test_a_runs_own_settings_are_not_the_models_identity():
    made = _model("tiny_moe")
    asked = dataclasses.replace(made, seq_len=64, rope_theta=5e5, norm_eps=1e-6)
    assert differences(_profile(made), _asks(asked)) == []
    dense = _model("tiny")  # its unused MoE fields are not compared
    assert differences(_profile(dense), _asks(dataclasses.replace(dense, top_k=1))) == []


def test_a_hardware_profile_is_the_cluster_it_claims():
    local = ClusterConfig()  # local: 1 node x 4 gloo ranks
    measured = {**synthetic_hardware(1, 4, name="local"), "source": "measured"}
    measured["cluster"]["backend"] = "gloo"
    hw = HardwareProfile.from_dict(measured)
    assert differences(hw, _asks(cluster=local)) == []
    assert differences(hw, _asks(cluster=dataclasses.replace(local, name="dev"))) == [
        ("cluster.name", "local", "dev")]
    assert differences(hw, _asks(cluster=dataclasses.replace(local, tasks_per_node=8))) == [
        ("cluster.tasks_per_node", 4, 8)]
    assert differences(hw, _asks(cluster=dataclasses.replace(local, backend="nccl"))) == [
        ("cluster.backend", "gloo", "nccl")]
    # More nodes is a note of the search (priced from the fits), not a different cluster; an
    # analytic profile prices a link sheet, whatever the backend that will run.
    assert differences(hw, _asks(cluster=dataclasses.replace(local, nodes=2))) == []
    analytic = HardwareProfile.from_dict(synthetic_hardware(1, 4, name="local"))
    assert differences(analytic, _asks(cluster=local)) == []


# ---------------------------------------------------------------- reading
def test_read_profile_names_the_file_each_field_and_the_rebuild_command(tmp_path):
    path = write_profile(tmp_path / "tiny_moe.json", _profile(_model("tiny")))
    with pytest.raises(ProfileError) as err:
        read_profile(path, ModelProfile, REBUILD, config=_asks(_model("tiny_moe")))
    assert str(err.value) == (
        f"{path} was profiled for model.name=tiny, model.experts=0; this command asks for "
        f"model.name=tiny_moe, model.experts=8: stale. Rerun: {REBUILD} force=true")
    assert err.value.exit_code == 4


def test_a_moe_profile_made_before_its_new_fields_is_stale_not_a_crash(tmp_path):
    raw = _profile(_model("tiny_moe")).to_dict()
    assert raw["model"]["capacity_factor"] is None  # dropless, written as such
    path = write_json(tmp_path / "tiny_moe.json", raw)
    assert read_profile(path, ModelProfile, REBUILD).model.aux_loss_coef == 0.01
    del raw["model"]["capacity_factor"], raw["model"]["aux_loss_coef"]
    path = write_json(tmp_path / "tiny_moe.json", raw)
    with pytest.raises(ProfileError, match=r"tiny_moe\.json: model\.capacity_factor: missing "
                                           r"\(a MoE profile written before profiles recorded "
                                           r"it: stale\)\. Rerun: .* force=true$"):
        read_profile(path, ModelProfile, REBUILD)


# ---------------------------------------------------------------- every reader
def _config(profiles, *overrides):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=[
            f"profiles_dir={profiles}", *overrides]))


def _search(cfg):
    from orchestrator.pipeline import plan_stage
    from orchestrator.stages import get_stage

    get_stage("search").read_inputs(cfg, plan_stage("search", cfg, {}))


def _train_prediction_and_tune(cfg):
    from orchestrator.train.plan import planner_profiles

    planner_profiles(cfg)


def _train_variable_length_planner(cfg):
    from orchestrator.pipeline import plan_stage
    from orchestrator.stages import get_stage

    cfg.train.microbatching = "dynamic"
    cfg.train.pp, cfg.train.tp = 1, 1
    get_stage("train").read_inputs(cfg, plan_stage("train", cfg, {}))


def _trace(cfg):
    from orchestrator.trace.timing import make_pricer

    make_pricer(cfg, {1})


def _export(cfg):
    from orchestrator.stages.export import run_export

    cfg.export.path = str(cfg.profiles_dir) + "-galvatron"
    run_export(None, SimpleNamespace(cfg=cfg))


@pytest.mark.parametrize("reader", [_search, _train_prediction_and_tune,
                                    _train_variable_length_planner, _trace, _export])
def test_every_reader_refuses_a_moe_profile_copied_to_a_dense_model(profiles, reader):
    write_json(profiles / "local" / "hardware.json", synthetic_hardware(1, 4, name="local"))
    write_json(profiles / "local" / "model" / "tiny.json", _profile_dict(_model("tiny_moe")))
    with pytest.raises(ProfileError, match=r"tiny\.json was profiled for model\.name=tiny_moe, "
                                           r"model\.experts=8; this command asks for "
                                           r"model\.name=tiny, model\.experts=0: stale"):
        reader(_config(profiles))


@pytest.mark.parametrize("reader", [_search, _train_prediction_and_tune,
                                    _train_variable_length_planner, _trace, _export])
@pytest.mark.parametrize("damage, words", [
    ("garbled", r"tiny\.json: .*Rerun: python -m orchestrator stage=profile_model"),
    ("unfinished", r"unfinished: 1 part\(s\) still to make \(seq64_tp1\).*Finish it: "
                   r"python -m orchestrator stage=profile_model")], ids=["garbled", "unfinished"])
def test_every_reader_refuses_a_garbled_or_unfinished_model_profile(profiles, reader, damage,
                                                                    words):
    """Not one of them prices from the device sheet instead (trace did): the user made this
    file, and the command that mends it is in the message."""
    write_json(profiles / "local" / "hardware.json", synthetic_hardware(1, 4, name="local"))
    path = profiles / "local" / "model" / "tiny.json"
    if damage == "garbled":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"kind": "model", ')
    else:
        write_json(path, {**_profile_dict(_model("tiny")), "unfinished": ["seq64_tp1"]})
    with pytest.raises(ProfileError, match=words):
        reader(_config(profiles))


def test_every_reader_refuses_hardware_of_another_cluster(profiles):
    write_json(profiles / "local" / "hardware.json", synthetic_hardware(2, 2, name="dev"))
    write_json(profiles / "local" / "model" / "tiny.json", _profile_dict(_model("tiny")))
    for reader in (_search, _train_prediction_and_tune, _train_variable_length_planner,
                   _export):
        with pytest.raises(ProfileError, match=r"hardware\.json was profiled for "
                                               r"cluster\.name=dev, cluster\.tasks_per_node=2; "
                                               r"this command asks for cluster\.name=local, "
                                               r"cluster\.tasks_per_node=4: stale"):
            reader(_config(profiles))


def test_search_of_a_moe_model_with_a_dense_profile_is_one_line_exit_4(profiles):
    write_json(profiles / "local" / "hardware.json", synthetic_hardware(1, 4, name="local"))
    write_json(profiles / "local" / "model" / "tiny_moe.json", _profile_dict(_model("tiny")))
    line = one_error_line(run_cli("stage=search", "model=tiny_moe", profiles_dir=profiles), 4)
    assert line == (f"error: {profiles / 'local' / 'model' / 'tiny_moe.json'} was profiled for "
                    f"model.name=tiny, model.experts=0; this command asks for "
                    f"model.name=tiny_moe, model.experts=8: stale. Rerun: python -m "
                    f"orchestrator stage=profile_model model=tiny_moe profiles_dir={profiles} "
                    f"force=true")
    assert not (profiles / "local" / "strategy").exists()
