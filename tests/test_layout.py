"""ParallelLayout validates itself with messages that print the numbers, and round-trips JSON."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from orchestrator.choices import Recompute
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
    (dict(schedule="interleaved", virtual_stages=3, layers_per_stage=(3, 1)),
     r"layers_per_stage\[1\]=1 % virtual_stages\(3\) != 0.*short last chunk"),
    (dict(recompute=(("full", 5), ("none", 0))), r"\('full', 5\): k_layers must be in 1..*=4"),
    (dict(recompute=(("selective", 2), ("none", 0))), r"k_layers must be layers_per_stage\[0\]=4"),
    (dict(recompute=(("none", 1), ("none", 0))), r"\('none', 1\): k_layers must be 0"),
    (dict(recompute=(("none", 0),)), r"len\(recompute\)=1 != pp\(2\)"),
    (dict(micro_batch_size=0), r"micro_batch_size must be an integer >= 1, got 0"),
])
def test_invalid_layouts_name_the_numbers(kw, message):
    with pytest.raises(LayoutError, match=message):
        _layout(**kw)


def _interleaved(layers, v, recompute=()):
    return ParallelLayout(world_size=len(layers), pp=len(layers), tp=1, dp=1,
                          num_micro_batches=len(layers), schedule="interleaved",
                          virtual_stages=v, layers_per_stage=layers, recompute=recompute)


def test_interleaved_chunks_are_equal_but_the_first_and_last_may_be_short():
    """Llama 3 405B's 7 + 14 x 8 + 7 with v = 2, 4, 8: the first stage's first chunk and the
    last stage's last hold the layer less (none at v = 8); a middle stage must split evenly,
    and an end stage's short chunk cannot go below 0 layers."""
    layers = (7,) + (8,) * 14 + (7,)
    for v in (2, 4, 8):
        c = 8 // v
        layout = _interleaved(layers, v)
        assert layout.layers_per_chunk[0] == (c - 1,) + (c,) * (v - 1)
        assert layout.layers_per_chunk[-1] == (c,) * (v - 1) + (c - 1,)
        assert set(layout.layers_per_chunk[1:-1]) == {(c,) * v}
        assert layout.short_chunks
    assert not _interleaved((8, 8), 4).short_chunks
    with pytest.raises(LayoutError, match=r"layers_per_stage\[1\]=7 % virtual_stages\(2\)"):
        _interleaved((8, 7, 8, 8), 2)  # a middle stage
    with pytest.raises(LayoutError, match=r"layers_per_stage\[0\]=5 .*short first chunk"):
        _interleaved((5, 8), 4)  # chunks of 2 leave -1 for the first


def test_full_recompute_of_short_chunks_is_r_layers_per_chunk():
    """k counts the layers recomputed: the first r of each chunk, all of a shorter one."""
    layers = (7, 8, 8, 7)
    ok = _interleaved(layers, 4, ((Recompute.full, 4), (Recompute.full, 4),
                                  (Recompute.full, 4), (Recompute.full, 7)))
    assert ok.recompute[0] == (Recompute.full, 4)
    with pytest.raises(LayoutError, match=r"recompute\[0\]=\('full', 5\)"):
        _interleaved(layers, 4, ((Recompute.full, 5),) + ((Recompute.none, 0),) * 3)


def test_stage_train_refuses_short_chunks():
    """Megatron runs short end chunks; stage=train builds equal ones and says so (train's
    check_target and build.virtual_stage_layers call this check: test_train_build)."""
    with pytest.raises(LayoutError, match=r"short model chunks .*search.engine=megatron"):
        _interleaved((7, 8, 8, 7), 4).check_equal_chunks()
    _interleaved((4, 8), 2).check_equal_chunks()


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


def _engine_matrix():
    """(layout, a mixture-of-experts model) for every layout train's engine tests run on 4 gloo
    ranks (tests/test_train_engine.py dense, tests/test_moe_train.py MoE), and a few at 8192
    ranks: hierarchical CP under TP, the expert grid folded over TP, CP and DP."""
    import test_moe_train
    import test_train_engine

    out = [(test_train_engine._layout(*case), False) for case in test_train_engine.LAYOUTS]
    out += [(test_moe_train._layout(4, *case), True) for case in test_moe_train.LAYOUTS]
    big = dict(world_size=8192, micro_batch_size=1, num_micro_batches=8)
    out += [(ParallelLayout(pp=4, tp=8, dp=64, cp=4, cp_comm="a2a+p2p", cp_a2a=2,
                            layers_per_stage=(2,) * 4, **big), False),
            (ParallelLayout(pp=8, tp=4, dp=128, cp=2, ep=16, etp=2, sequence_parallel=True,
                            layers_per_stage=(1,) * 8, **big), True),
            (ParallelLayout(pp=2, tp=2, dp=2048, ep=64, sequence_parallel=True,
                            layers_per_stage=(1, 1), **big), True)]
    return out


def test_the_mesh_s_grids_give_every_group_the_layout_s_rank_order():
    """Pure (no process group, world size a number): mesh.build_mesh lays its ranks out as
    torch.arange(world) over the grid's dimensions (init_device_mesh's order); each group it
    makes (mesh.mesh_dims: a dimension, or several flattened) then holds, for every rank, exactly
    ParallelLayout.group_ranks' members in their order, for every layout of the engine matrix
    incl. each CP flavour and EP; and it makes exactly the layout's groups."""
    import torch

    from orchestrator.choices import Group
    from orchestrator.mesh import dense_dims, expert_dims, mesh_dims

    for layout, experts in _engine_matrix():
        grids = {False: dense_dims(layout), True: expert_dims(layout)}
        dims = mesh_dims(layout, experts)
        assert {Group.world, *dims} == set(layout.groups(experts)), layout.describe()
        world = layout.world_size
        sample = range(world) if world <= 64 else range(0, world, 997)
        for name, (on_experts, spanned) in dims.items():
            names = [g for g, _ in grids[on_experts]]
            grid = torch.arange(world).view(*(n for _, n in grids[on_experts]))
            # the spanned dimensions last, in their order: one row per group
            order = [i for i, g in enumerate(names) if g not in spanned] + \
                [names.index(g) for g in spanned]
            rows = grid.permute(order).reshape(-1, len(layout.group_ranks(name, 0)))
            for rank in sample:
                row = rows[(rows == rank).any(dim=1)]
                assert row.tolist() == [list(layout.group_ranks(name, rank))], \
                    (layout.describe(), name, rank)


# (layout fields, a mixture-of-experts model): world 8, each group of the enum in at least one
MESH_LAYOUTS = [
    (dict(pp=2, tp=2, dp=2), False),
    (dict(pp=2, tp=1, dp=1, cp=4, cp_comm="a2a+p2p", cp_a2a=2), False),  # Megatron's levels
    (dict(pp=1, tp=2, dp=2, cp=2, ep=2, etp=2, sequence_parallel=True), True),  # tp_cp too
    (dict(pp=2, tp=1, dp=4, ep=4), True),  # EP over the data-parallel ranks
    (dict(pp=1, tp=2, dp=4, ep=2, sequence_parallel=True), True),  # etp 1, ep = dp's stride
]


@pytest.mark.parametrize("fields,experts", MESH_LAYOUTS)
def test_the_mesh_and_a_rank_s_own_groups_hold_the_ranks_group_ranks_says(fields, experts):
    """On torch's fake backend, every rank of world 8: ParallelLayout.build_mesh (train's
    DeviceMeshes, every group of the world) and mesh.rank_mesh (trace's, the rank's own groups
    only) give each of the layout's groups exactly ParallelLayout.group_ranks' members, each
    rank at the layout's coordinate, the experts placed on the same ep x etp block, and the
    same sequence group (a MoE layer's balance statistics)."""
    from torch.distributed import get_process_group_ranks

    from orchestrator.choices import Group
    from orchestrator.mesh import rank_mesh
    from orchestrator.trace.tracer import fake_world

    layout = ParallelLayout(world_size=8, layers_per_stage=(1,) * fields["pp"], **fields)
    for rank in range(8):
        wanted = layout.rank_groups(rank, experts)
        assert tuple(wanted) == layout.groups(experts)
        with fake_world(rank, 8):
            built = layout.build_mesh("cpu", experts=experts)
            assert set(built.groups) == set(wanted), rank
            for name, ranks in wanted.items():
                assert built.ranks(name) == tuple(ranks), (rank, name)
                if name != Group.world:
                    assert built.mesh(name).get_local_rank() == layout.coordinate(rank, name)
            placed = built.experts.mesh.tolist() if built.experts is not None else None
            sequence = built.sequence_group()
            sequence = get_process_group_ranks(sequence) if sequence is not None else None
        with fake_world(rank, 8):
            own = rank_mesh(layout, rank, experts=experts)
            # an expert dimension of size 1 sends nothing: trace makes no group for it
            assert set(own.groups) == {name for name, ranks in wanted.items()
                                       if len(ranks) > 1 or name not in (Group.ep, Group.etp)}
            for name in own.groups:
                assert own.ranks(name) == tuple(wanted[name]), (rank, name)
            assert (own.experts.mesh.tolist() if own.experts is not None else None) == placed
            mine = own.sequence_group()
            assert (get_process_group_ranks(mine) if mine is not None else None) == sequence
    if experts:
        assert placed is not None


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
    with pytest.raises(ConfigError) as err:  # the user's input: exit 2
        strategy_layout(cfg)
    assert str(err.value) == (f"train.layout={own}: seq_len: missing; fix that file (the form "
                              f"of {strategy}: docs/stages/train.md) or leave train.layout unset")


def test_a_global_batch_the_strategys_layout_cannot_split_is_refused_not_rounded():
    """train.global_batch_size over the strategy's layout: refused as over an explicit one
    (it trained 8 where 3 was asked)."""
    from orchestrator.train.plan import LAYOUT_FIELDS, _override

    layout = ParallelLayout.uniform(4, 1, 1, 4, num_micro_batches=2)  # dp 4, mbs 1
    train = SimpleNamespace(**dict.fromkeys(LAYOUT_FIELDS), recompute=None, global_batch_size=3)
    train.micro_batch_size = 2
    with pytest.raises(LayoutError, match=r"^global batch 3 is not divisible by dp\(4\) \* "
                                          r"micro_batch_size\(2\) of the strategy's layout"):
        _override(layout, SimpleNamespace(train=train))
    train.global_batch_size = 16
    assert _override(layout, SimpleNamespace(train=train)).num_micro_batches == 2


def test_training_a_strategy_of_another_batch_says_so():
    """A search for another batch failed (the strategy it would replace is kept): train runs
    the strategy's batch, and its note says which, and how to get the other."""
    from pathlib import Path

    from orchestrator.train.plan import LAYOUT_FIELDS, TrainTarget
    from orchestrator.train.report import strategy_batch_note

    layout = ParallelLayout.uniform(4, 1, 1, 4, num_micro_batches=1)  # dp 4 x mbs 1 x 1: 4
    train = SimpleNamespace(**dict.fromkeys(LAYOUT_FIELDS), global_batch_size=None)
    cfg = SimpleNamespace(train=train, search=SimpleNamespace(global_batch_size=8))
    target = TrainTarget(layout, 64, "strategy", Path("/p/local/strategy/tiny.layout.json"))
    assert strategy_batch_note(cfg, target).startswith(
        "tiny.layout.json is a layout for a global batch of 4, not search.global_batch_size=8: "
        "training its 4 (search for the other: python -m orchestrator stage=search")
    cfg.search.global_batch_size = 4
    assert strategy_batch_note(cfg, target) is None
    cfg.search.global_batch_size, train.global_batch_size = 8, 4  # the user chose the batch
    assert strategy_batch_note(cfg, target) is None
    train.global_batch_size, train.micro_batch_size = None, 2  # or its micro-batches
    assert strategy_batch_note(cfg, target) is None
