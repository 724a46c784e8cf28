"""Numbers that make no sense (a negative learning rate, a fraction above 1, a count of 0, a
warm-up longer than the run) are refused before anything runs, in one line naming the key: one
table (orchestrator/value_rules.py) over every numeric key of the schema."""
from __future__ import annotations

import copy
import dataclasses
import typing

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO, one_error_line, run_cli
from orchestrator.config import CONF_DIR, Config, register_configs
from orchestrator.config_keys import _optional_inner
from orchestrator.errors import ConfigError
from orchestrator.value_rules import (NOT_RULED, RULES, check_override_values, check_values,
                                      value_error)

register_configs()


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))


def _numeric(hint) -> bool:
    """int or float, optional, or in (nested) lists."""
    hint, _ = _optional_inner(hint)
    while typing.get_origin(hint) in (list, typing.List):
        hint, _ = _optional_inner(typing.get_args(hint)[0])
    return hint in (int, float)


def _numeric_keys(node=Config, prefix=""):
    hints = typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        inner, _ = _optional_inner(hints[f.name])
        if dataclasses.is_dataclass(inner):
            yield from _numeric_keys(inner, f"{prefix}{f.name}.")
        elif _numeric(hints[f.name]):
            yield prefix + f.name


def test_every_numeric_key_of_the_schema_has_a_range_or_a_reason():
    keys = set(_numeric_keys())
    assert keys - set(RULES) - set(NOT_RULED) == set()
    assert set(RULES) - keys == set()  # no rule for a key the schema does not have


def _outside(bound):
    """Values just outside each end of `bound`."""
    if bound.lo is not None:
        yield bound.lo if bound.lo_open else bound.lo - (1 if float(bound.lo).is_integer() else 0.5)
    if bound.hi is not None:
        yield bound.hi if bound.hi_open else bound.hi + 1


def _inside(bound):
    """Values at each end of `bound` it allows (or just inside an open one)."""
    lo = bound.lo if not bound.lo_open else bound.lo + 0.5
    yield lo
    if bound.hi is not None:
        yield bound.hi if not bound.hi_open else bound.hi - 0.5


CASES = [(key, value) for key, bound in RULES.items() for value in _outside(bound)]


@pytest.mark.parametrize("key,value", CASES, ids=[f"{k}={v}" for k, v in CASES])
def test_a_value_out_of_range_is_named_with_its_key(key, value):
    message = value_error(key, value)
    assert message is not None and message.startswith(f"{key}({value}) must be ")
    assert all(value_error(key, ok) is None for ok in _inside(RULES[key]))
    assert "every item" in value_error(key, [*_inside(RULES[key]), value])  # a list's items
    assert value_error(key, None) is None  # an unset optional


def _flat(values: dict, prefix: str):
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


@pytest.mark.parametrize("group", ["model", "cluster"])
def test_the_shipped_group_files_are_in_range(group):
    """The package's groups and the repository's example site."""
    import yaml

    for path in sorted([*(CONF_DIR / group).glob("*.yaml"),
                        *(REPO / "conf" / group).glob("*.yaml")]):
        values = yaml.safe_load(path.read_text()) or {}
        assert [value_error(key, value) for key, value in _flat(values, f"{group}.")
                if value_error(key, value)] == [], path


def test_the_issue_values_are_refused_on_the_composed_config():
    default = _cfg()
    check_values(default)
    for key, value, named in [
            ("lr", -1.0, "train.lr(-1.0) must be > 0"),
            ("weight_decay", -0.1, "train.weight_decay(-0.1) must be >= 0"),
            ("min_lr_ratio", 1.5, "train.min_lr_ratio(1.5) must be in [0, 1]"),
            ("grad_clip", -1.0, "train.grad_clip(-1.0) must be >= 0 (0: no clipping)"),
            ("warmup_steps", 40, "train.warmup_steps(40) must be <= train.steps(30)")]:
        cfg = copy.deepcopy(default)
        setattr(cfg.train, key, value)
        with pytest.raises(ConfigError) as info:
            check_values(cfg)
        assert str(info.value).startswith(named)
    short = copy.deepcopy(default)
    short.train.steps = 2  # the default warm-up (null) shortens to the run
    check_values(short)


def test_every_value_of_a_sweep_is_checked_before_hydra():
    check_override_values(["-m", "train.lr=1e-3,2e-3", "search.micro_batch_sizes=[1,2]"])
    with pytest.raises(ConfigError, match=r"train.lr\(-1.0\) must be > 0"):
        check_override_values(["-m", "stage=train", "train.lr=1e-3,-1"])
    with pytest.raises(ConfigError, match=r"limits.max_trace_GiB\(0.0\) must be > 0"):
        check_override_values(["limits.max_trace_GiB=0"])


def test_negative_learning_rate_is_refused_in_one_line_exit_2(profiles):
    """Before: it trained with lr -1 and recorded `done`. In a sweep, no point runs first."""
    line = one_error_line(run_cli("-m", "stage=train", "train.pp=1", "train.tp=1",
                                  "train.lr=1e-3,-1", profiles_dir=profiles, timeout=120), 2)
    assert line == "error: train.lr(-1.0) must be > 0"
    assert not profiles.exists()


@pytest.mark.parametrize("key", sorted(RULES))
def test_nan_and_inf_are_refused_for_every_ruled_key(key):
    """Before: every comparison with nan is false, so `train.lr=nan` passed `> 0`, trained to
    a nan loss and recorded `done`; `cluster.device_mem_GiB: .nan` in a site file passed too."""
    for bad in (float("nan"), float("inf"), float("-inf")):
        message = value_error(key, bad)
        assert message is not None and message.startswith(f"{key}({bad}) must be "), message
        assert message.endswith("and finite")


def test_nan_on_the_command_line_and_in_a_composed_config_is_refused():
    with pytest.raises(ConfigError, match=r"train.lr\(nan\) must be > 0 and finite"):
        check_override_values(["stage=train", "train.lr=nan"])
    with pytest.raises(ConfigError, match=r"model.norm_eps\(inf\) must be > 0 and finite"):
        check_override_values(["model.norm_eps=inf"])
    cfg = _cfg()
    cfg.cluster.device_mem_GiB = float("nan")
    with pytest.raises(ConfigError, match=r"cluster.device_mem_GiB\(nan\)"):
        check_values(cfg)
