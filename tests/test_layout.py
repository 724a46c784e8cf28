"""ParallelLayout validates itself with messages that print the numbers, and round-trips JSON."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from orchestrator.errors import ConfigError, ProfileError
from orchestrator.layout import LayoutError, ParallelLayout


def _layout(**kw):
    base = dict(world_size=8, pp=2, tp=2, dp=2, layers_per_stage=(4, 4), micro_batch_size=1,
                num_micro_batches=4)
    base.update(kw)
    return ParallelLayout(**base)


def test_degrees_must_multiply_to_world_size():
    with pytest.raises(LayoutError, match=r"dp\(2\) \* tp\(4\) \* pp\(2\) != world_size\(8\)"):
        _layout(tp=4)


def test_layer_count_must_match_model():
    layout = _layout(layers_per_stage=(3, 3))
    with pytest.raises(LayoutError, match=r"sum\(layers_per_stage\)=6 != layers\(8\) of gpt"):
        layout.check_model_layers(8, "gpt")


@pytest.mark.parametrize("kw,message", [
    (dict(layers_per_stage=(8,)), r"len\(layers_per_stage\)=1 != pp\(2\)"),
    (dict(layers_per_stage=(8, 0)), r"layers_per_stage\[1\]=0"),
    (dict(zero=4), r"zero must be one of"),
    (dict(zero=0, distributed_optimizer=True), r"distributed_optimizer\(True\).*zero\(0\)"),
    (dict(tp=1, dp=4, sequence_parallel=True), r"sequence_parallel needs tp > 1"),
    (dict(schedule="gpipe"), r"schedule must be one of"),
    (dict(virtual_stages=2), r"'1f1b' has virtual_stages 1"),
    (dict(schedule="interleaved", virtual_stages=2, num_micro_batches=3),
     r"num_micro_batches\(3\) % pp\(2\) != 0"),
    (dict(schedule="interleaved", virtual_stages=3, layers_per_stage=(3, 5)),
     r"layers_per_stage\[1\]=5 % virtual_stages\(3\) != 0"),
    (dict(recompute=(("full", 5), ("none", 0))), r"\('full', 5\): k_layers must be in 1..*=4"),
    (dict(recompute=(("selective", 2), ("none", 0))), r"k_layers must be layers_per_stage\[0\]=4"),
    (dict(recompute=(("none", 1), ("none", 0))), r"\('none', 1\): k_layers must be 0"),
    (dict(recompute=(("none", 0),)), r"len\(recompute\)=1 != pp\(2\)"),
    (dict(micro_batch_size=0), r"micro_batch_size must be an integer >= 1, got 0"),
])
def test_invalid_layouts_name_the_numbers(kw, message):
    with pytest.raises(LayoutError, match=message):
        _layout(**kw)


def test_layout_error_is_a_value_error_and_a_config_error():
    assert issubclass(LayoutError, ValueError) and issubclass(LayoutError, ConfigError)


def test_global_batch_is_dp_times_micro_batch_times_count():
    layout = _layout(micro_batch_size=2, num_micro_batches=8)
    assert layout.global_batch_size == 2 * 2 * 8


def test_distributed_optimizer_follows_zero_when_unset():
    assert _layout(zero=1).distributed_optimizer is True
    assert _layout(zero=0).distributed_optimizer is False
    assert _layout(zero=3).distributed_optimizer is True


def test_json_round_trip():
    layout = _layout(zero=1, sequence_parallel=True, schedule="interleaved", virtual_stages=2,
                     layers_per_stage=(4, 6), recompute=(("full", 2), ("selective", 6)))
    again = ParallelLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert again == layout and hash(again) == hash(layout)


def test_from_dict_rejects_unknown_keys_and_wrong_global_batch():
    d = _layout().to_dict()
    with pytest.raises(LayoutError, match="unknown layout keys"):
        ParallelLayout.from_dict({**d, "tensor_parallel": 2})
    with pytest.raises(LayoutError, match=r"global_batch_size\(99\) != dp\(2\)"):
        ParallelLayout.from_dict({**d, "global_batch_size": 99})


def test_uniform_splits_layers_and_sets_recompute():
    layout = ParallelLayout.uniform(12, 2, 3, 10, recompute="full", num_micro_batches=6)
    assert layout.layers_per_stage == (4, 3, 3)
    assert layout.recompute == (("full", 4), ("full", 3), ("full", 3))
    assert layout.dp == 2


def test_uniform_rejects_degrees_that_do_not_divide_world():
    with pytest.raises(LayoutError, match=r"tp\(2\) \* pp\(3\) does not divide world_size\(16\)"):
        ParallelLayout.uniform(16, 2, 3, 10)


def test_context_parallel_ranks_sit_between_tp_and_dp():
    """Megatron's order tp-cp-dp-pp: cp groups have stride tp, dp groups stride tp * cp, and
    the weights' replicas (dp x cp) stride tp."""
    layout = ParallelLayout.uniform(32, 2, 2, 8, cp=2)  # dp 4
    assert layout.dp == 4 and layout.describe().startswith("tp2 cp2 pp2 dp4")
    rank = 2 * 1 + 4 * 3 + 16 * 1 + 1  # tp 1, cp 1, dp 3, pp 1
    assert [layout.coordinate(rank, d) for d in ("tp", "cp", "dp", "pp")] == [1, 1, 3, 1]
    assert list(layout.group_ranks("cp", rank)) == [rank - 2, rank]
    assert list(layout.group_ranks("dp", rank)) == [rank - 12, rank - 8, rank - 4, rank]
    assert list(layout.group_ranks("dp_cp", rank)) == list(range(17, 32, 2))
    assert list(layout.group_ranks("pp", rank)) == [rank - 16, rank]
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    plain = ParallelLayout.uniform(8, 2, 1, 8)
    assert "cp" not in plain.to_dict() and plain.coordinate(5, "cp") == 0
    assert ParallelLayout.uniform(8, 2, 1, 8, cp_comm="allgather") == plain  # no CP, no flavour


def test_context_parallel_needs_a_sequence_of_2cp_chunks_over_tp():
    layout = ParallelLayout.uniform(16, 2, 1, 8, cp=4)
    layout.check_sequence(4096)
    with pytest.raises(LayoutError, match=r"seq_len\(4100\) % \(2 \* cp\(4\) \* tp\(2\)\) != 0"):
        layout.check_sequence(4100)
    with pytest.raises(LayoutError, match=r"dp\(2\) \* tp\(2\) \* cp\(4\) \* pp\(1\) != "
                                          r"world_size\(8\)"):
        ParallelLayout(world_size=8, pp=1, tp=2, dp=2, cp=4, layers_per_stage=(8,))
    with pytest.raises(LayoutError, match="cp_comm must be one of"):
        ParallelLayout.uniform(8, 2, 1, 8, cp=2, cp_comm="ring")


def test_closed_choices_are_members_of_one_enum_each_and_read_as_their_strings():
    """schedule, cp_comm and the recompute modes of a layout, and the config keys that give
    them or the cost model's engine, are members of one Choice each (orchestrator/choices.py),
    given as strings or members; equality, JSON and config hashes see the strings."""
    from orchestrator.choices import CpComm, Engine, Recompute, Schedule
    from orchestrator.config_keys import choice_type
    from orchestrator.planner import CostOptions

    layout = ParallelLayout.uniform(32, 1, 2, 8, cp=4, cp_comm="a2a+p2p", cp_a2a=2,
                                    schedule="interleaved", virtual_stages=2,
                                    num_micro_batches=2, recompute="selective")
    assert layout.cp_comm is CpComm["a2a+p2p"] and layout.schedule is Schedule.interleaved
    assert {mode for mode, _ in layout.recompute} == {Recompute.selective}
    assert layout.cp_comm == "a2a+p2p" and layout.schedule == "interleaved"
    text = json.dumps(layout.to_dict())
    assert '"cp_comm": "a2a+p2p"' in text and '"schedule": "interleaved"' in text
    assert '"recompute": [["selective", 4], ["selective", 4]]' in text
    back = ParallelLayout.from_dict(json.loads(text))
    assert back == layout and back.cp_comm is CpComm["a2a+p2p"]
    assert hash(back) == hash(ParallelLayout.uniform(
        32, 1, 2, 8, cp=4, cp_comm=CpComm["a2a+p2p"], cp_a2a=2, schedule=Schedule.interleaved,
        virtual_stages=2, num_micro_batches=2, recompute=Recompute.selective))
    for key in ("train.cp_comm", "trace.cp_comm", "search.cp_comms"):
        assert choice_type(key) is CpComm, key
    assert choice_type("search.engine") is Engine and choice_type("trace.schedule") is Schedule
    assert CostOptions(engine="megatron").engine is Engine.megatron
    with pytest.raises(ValueError, match="allowed: orchestrator, megatron"):
        CostOptions(engine="deepspeed")


# ---------------------------------------------------------------- layout files
def _layout_file(**changes) -> dict:
    """A layout file as search writes strategy/<model>.layout.json, with `changes` to its
    layout (None: the key left out)."""
    layout = {**ParallelLayout.uniform(4, 1, 2, 4, num_micro_batches=2).to_dict(), **changes}
    return {"model": "tiny", "seq_len": 256,
            "layout": {k: v for k, v in layout.items() if v is not None}}


@pytest.mark.parametrize("text, problem", [
    ('{"seq_len": 256,\n "layout": {', "not JSON: Expecting property name enclosed in double "
                                       "quotes at line 2, column 13"),
    ("[]", "expected a JSON object with seq_len and layout, got []"),
    (json.dumps({"seq_len": 256}), "layout: missing"),
    (json.dumps({**_layout_file(), "seq_len": "long"}), 'seq_len: expected an integer, got "long"'),
    (json.dumps({**_layout_file(), "layout": "pp2"}), 'layout: expected an object, got "pp2"'),
    (json.dumps(_layout_file(pp=None)), "layout.pp: missing"),
    (json.dumps(_layout_file(pp="two")), 'layout.pp: expected an integer, got "two"'),
    (json.dumps(_layout_file(sequence_parallel="yes")),
     'layout.sequence_parallel: expected true or false, got "yes"'),
    (json.dumps(_layout_file(layers_per_stage=4)), "layout.layers_per_stage: expected a list, "
                                                   "got 4"),
    (json.dumps(_layout_file(recompute=[["none"], ["none", 0]])),
     'layout.recompute[0]: expected a list of 2 items, got ["none"]'),
    (json.dumps(_layout_file(pipeline=2)), "layout: unknown layout keys ['pipeline']; known: "
                                           + str(sorted(ParallelLayout.__dataclass_fields__))),
    (json.dumps(_layout_file(dp=1)), "layout: dp(1) * tp(1) * pp(2) != world_size(4)"),
], ids=["not-json", "not-an-object", "no-layout", "seq-len-type", "layout-type", "no-pp",
        "pp-type", "bool-type", "list-type", "pair-length", "unknown-key", "refused"])
def test_a_layout_file_says_what_is_wrong_with_which_field(tmp_path, text, problem):
    from orchestrator.train.plan import LayoutFileError, read_layout_file

    path = tmp_path / "tiny.layout.json"
    path.write_text(text)
    with pytest.raises(LayoutFileError) as err:
        read_layout_file(path)
    assert str(err.value) == problem


def test_a_good_layout_file_reads_back_and_a_folder_is_refused(tmp_path):
    from orchestrator.train.plan import read_layout_file

    path = tmp_path / "tiny.layout.json"
    path.write_text(json.dumps(_layout_file()))
    assert read_layout_file(path) == (ParallelLayout.uniform(4, 1, 2, 4, num_micro_batches=2),
                                      256)
    with pytest.raises(ValueError, match="^cannot be read: Is a directory$"):
        read_layout_file(tmp_path)


def test_the_fix_named_is_for_the_file_that_is_wrong(tmp_path):
    """search rewrites its own layout.json; a file given as train.layout is the user's to fix
    (search never writes it)."""
    from orchestrator.train.plan import strategy_layout

    cfg = SimpleNamespace(profiles_dir=tmp_path, cluster=SimpleNamespace(name="local"),
                          model=SimpleNamespace(name="tiny"), train=SimpleNamespace(layout=None))
    strategy = tmp_path / "local" / "strategy" / "tiny.layout.json"
    strategy.parent.mkdir(parents=True)
    strategy.write_text(json.dumps(_layout_file(pp="two")))
    with pytest.raises(ProfileError) as err:
        strategy_layout(cfg)
    assert str(err.value) == (f'{strategy}: layout.pp: expected an integer, got "two"; rewrite '
                              f"it with python -m orchestrator stage=search force=true")
    own = tmp_path / "mine.layout.json"
    own.write_text(json.dumps({"layout": _layout_file()["layout"]}))
    cfg.train.layout = str(own)
    with pytest.raises(ProfileError) as err:
        strategy_layout(cfg)
    assert str(err.value) == (f"train.layout={own}: seq_len: missing; fix that file (the form "
                              f"of {strategy}: docs/stages/train.md) or leave train.layout unset")
