"""Galvatron strategy files to and from our ParallelLayout, and one priced next to our best."""
from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from orchestrator.errors import ProfileError
from orchestrator.interop.galvatron.strategy import read_strategy
from orchestrator.layout import ParallelLayout
from orchestrator.planner import CostOptions, HardwareModel, ModelCost, evaluate
from orchestrator.planner import galvatron_strategy
from orchestrator.interop.galvatron.compare import (compare_predictions, compare_table,
                                          price_galvatron_strategy)
from orchestrator.planner.cost_model import BREAKDOWN_KINDS
from orchestrator.planner.exports import ExportError
from planner_fixtures import GiB, synthetic_hardware, synthetic_model


def _enc(values) -> str:
    return ",".join(str(v) for v in values)


def _strategy(**fields):
    """A Galvatron 2.4 strategy for 8 layers on 16 ranks (tp2 pp2, ZeRO-2), fields overridden."""
    base = {"pp_deg": 2, "tp_sizes_enc": _enc([2] * 8), "tp_consecutive_flags": _enc([1] * 8),
            "dp_types_enc": _enc([0] * 8), "use_sp": _enc([0] * 8),
            "checkpoint": _enc([1, 1, 1, 0, 0, 0, 0, 0]), "global_bsz": 64, "chunks": 4,
            "pp_division": "5,3", "pipeline_type": "pipedream_flush",
            "default_dp_type": "zero2", "vtp": 2, "vsp": 0, "embed_sdp": 0}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not None}


# ---------------------------------------------------------------------------- reading
def test_reads_degrees_batch_stages_and_recompute():
    layout, notes = read_strategy(_strategy(), world_size=16, num_layers=8)
    # dp = 16 / (2 * 2) = 4; 64 sequences / 4 ranks = 16 per rank in 4 chunks of 4.
    assert layout == ParallelLayout(world_size=16, pp=2, tp=2, dp=4, zero=2, micro_batch_size=4,
                                    num_micro_batches=4, layers_per_stage=(5, 3),
                                    recompute=(("full", 3), ("none", 0)))
    assert len(notes) == 1 and notes[0].startswith("sequence_parallel:")
    assert "taken as off" in notes[0]
    with_sp, _ = read_strategy(_strategy(), world_size=16, num_layers=8, sequence_parallel=True)
    assert with_sp.sequence_parallel


def test_single_stage_zero3_with_a_few_zero2_layers_like_the_shipped_examples():
    # 32 layers on 8 ranks, tp 1: dp 8, 64 / 8 = 8 sequences per rank in 8 chunks of 1.
    raw = {"pp_deg": 1, "tp_sizes_enc": _enc([1] * 32), "tp_consecutive_flags": _enc([1] * 32),
           "dp_types_enc": _enc([1] * 26 + [0] * 3 + [1] * 3), "use_sp": _enc([0] * 32),
           "checkpoint": _enc([1] * 29 + [0] * 3), "global_bsz": 64, "chunks": 8,
           "pp_division": "32", "pipeline_type": "pipedream_flush", "default_dp_type": "zero2",
           "vtp": 1, "vsp": 0}
    layout, notes = read_strategy(raw, world_size=8, num_layers=32)
    assert (layout.pp, layout.tp, layout.dp, layout.zero) == (1, 1, 8, 3)
    assert (layout.micro_batch_size, layout.num_micro_batches) == (1, 8)
    assert layout.recompute == (("full", 29),)
    zero_line, embed_line = notes
    assert zero_line.startswith("dp_types_enc: mixed per layer (zero2 on layers 26-28)")
    assert "take zero3, the most common" in zero_line
    # embed_sdp absent: the embedding follows default_dp_type (ZeRO-2), the layers are ZeRO-3.
    assert embed_line.startswith("embed_sdp: the embedding and LM head are ZeRO-2")


def test_mixed_tp_takes_the_most_common_and_ties_go_to_the_smaller():
    _, notes = read_strategy(_strategy(tp_sizes_enc=_enc([2, 2, 2, 2, 2, 4, 4, 4])),
                             world_size=16, num_layers=8)
    assert any(n.startswith("tp_sizes_enc: mixed per layer (tp4 on layers 5-7)") and "take tp2"
               in n for n in notes)
    tied, notes = read_strategy(_strategy(tp_sizes_enc=_enc([4, 4, 4, 4, 1, 1, 1, 1]),
                                          global_bsz=32),
                                world_size=16, num_layers=8)
    assert (tied.tp, tied.dp) == (1, 8)  # 4 layers each: the smaller tp prices more memory
    assert any("tp4 on layers 0-3" in n and "take tp1" in n for n in notes)


def test_absent_fields_take_galvatron_defaults_and_say_so():
    raw = _strategy(tp_sizes_enc=_enc([2] * 7), tp_consecutive_flags=_enc([1] * 7),
                    dp_types_enc=_enc([0] * 7), use_sp=None, checkpoint=None, pp_division=None,
                    pipeline_type=None, default_dp_type=None, vtp=None, vsp=None,
                    embed_sdp=None)
    layout, notes = read_strategy(raw, world_size=16, num_layers=7)
    assert layout.layers_per_stage == (3, 4)  # Galvatron's split: equal, the last takes the rest
    assert layout.zero == 0  # default_dp_type ddp
    assert layout.recompute == (("none", 0), ("none", 0))
    fields = [n.split(":")[0] for n in notes]
    assert fields == ["pp_division", "default_dp_type", "pipeline_type", "vtp", "pipeline_type",
                      "sequence_parallel"]
    assert "gpipe" in notes[4] and "memory is under-priced" in notes[4]


def test_checkpointed_layers_that_are_not_the_first_are_priced_as_the_first():
    layout, notes = read_strategy(_strategy(checkpoint=_enc([0, 1, 0, 1, 0, 0, 1, 1])),
                                  world_size=16, num_layers=8)
    assert layout.recompute == (("full", 2), ("full", 2))
    assert len([n for n in notes if n.startswith("checkpoint:")]) == 2
    assert any("stage 0 recomputes layers [1, 3], not its first 2" in n for n in notes)
    assert any("stage 1 recomputes layers [6, 7], not its first 2" in n for n in notes)


def test_ulysses_strided_tp_vocab_and_unknown_fields_are_listed():
    raw = _strategy(use_sp=_enc([0, 0, 0, 0, 0, 0, 1, 1]),
                    tp_consecutive_flags=_enc([0, 1, 1, 1, 1, 1, 1, 1]), vsp=1, embed_sdp=1,
                    extra_field=3)
    _, notes = read_strategy(raw, world_size=16, num_layers=8)
    fields = [n.split(":")[0] for n in notes]
    assert fields == ["extra_field", "use_sp", "tp_consecutive_flags", "vsp", "embed_sdp",
                      "sequence_parallel"]
    assert "use_sp1 on layers 6-7" in notes[1] and "take use_sp0" in notes[1]
    assert "layers 0 put TP over strided ranks" in notes[2]
    assert "ZeRO-3 in Galvatron; priced at the layers' ZeRO-2" in notes[4]


def test_ulysses_layers_are_context_parallel_in_the_a2a_flavour_both_ways():
    """use_sp = 1 on every layer of degree 2: each sequence over 2 ranks by all-to-alls, weights
    replicated, which is our cp2 (a2a) with tp 1; written back the same way, read back equal."""
    raw = _strategy(use_sp=_enc([1] * 8), vsp=1)
    layout, notes = read_strategy(raw, world_size=16, num_layers=8, sequence_parallel=True)
    assert (layout.tp, layout.cp, layout.cp_comm, layout.dp) == (1, 2, "a2a", 4)
    assert not layout.sequence_parallel  # Megatron-style SP needs TP
    assert [n.split(":")[0] for n in notes] == ["use_sp"]
    assert "priced as context parallelism cp2 in the a2a flavour" in notes[0]
    written = galvatron_strategy(layout)
    assert written["use_sp"] == _enc([1] * 8) and written["tp_sizes_enc"] == _enc([2] * 8)
    assert (written["vtp"], written["vsp"]) == (2, 1)
    assert read_strategy(written, world_size=16, num_layers=8)[0] == layout


def test_chunks_that_do_not_divide_follow_torch_chunk():
    # 48 / dp 4 = 12 per rank into 5 chunks: torch.chunk makes chunks of ceil(12/5) = 3, so 4.
    layout, notes = read_strategy(_strategy(global_bsz=48, chunks=5), world_size=16,
                                  num_layers=8)
    assert (layout.micro_batch_size, layout.num_micro_batches) == (3, 4)
    assert any(n.startswith("chunks: 12 sequences per rank do not split into 5") for n in notes)
    # 40 / 4 = 10 into 4: chunks of 3 -> 4 of them (3+3+3+1), priced as 12 per rank.
    layout, _ = read_strategy(_strategy(global_bsz=40), world_size=16, num_layers=8)
    assert (layout.micro_batch_size, layout.num_micro_batches) == (3, 4)


@pytest.mark.parametrize("fields, message", [
    ({"chunks": None}, "field 'chunks' is missing"),
    ({"pp_division": "4,3"}, "'pp_division' [4, 3] must give pp_deg(2) stages"),
    ({"pp_division": "8"}, "'pp_division' [8] must give pp_deg(2) stages"),
    ({"tp_sizes_enc": _enc([2] * 7 + [3])}, "layer 7 has tp 3; pp_deg(2) * 3 does not divide"),
    ({"dp_types_enc": _enc([0] * 7)}, "'dp_types_enc' has 7 layers, the model has 8"),
    ({"checkpoint": _enc([2] * 8)}, "'checkpoint' holds 2"),
    ({"tp_sizes_enc": "2,2,x,2,2,2,2,2"}, "'tp_sizes_enc' must be comma-separated integers"),
    ({"default_dp_type": "zero1"}, "'default_dp_type' is 'zero1'"),
    ({"pipeline_type": "1f1b"}, "'pipeline_type' is '1f1b'"),
    ({"global_bsz": 30}, "'global_bsz' 30 does not split over dp(4)"),
    ({"pp_deg": 0}, "'pp_deg' must be an integer >= 1"),
])
def test_bad_strategies_name_the_field(tmp_path, fields, message):
    path = tmp_path / "galvatron_config_bad.json"
    path.write_text(json.dumps(_strategy(**fields)))
    with pytest.raises(ProfileError) as e:
        read_strategy(path, world_size=16, num_layers=8)
    assert str(path) in str(e.value) and message in str(e.value)


def test_unreadable_files_name_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ProfileError, match="cannot read the Galvatron strategy"):
        read_strategy(missing, world_size=16, num_layers=8)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{\"pp_deg\": 2,")
    with pytest.raises(ProfileError, match="corrupt.json is not valid JSON"):
        read_strategy(corrupt, world_size=16, num_layers=8)
    corrupt.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="is a JSON object, got list"):
        read_strategy(corrupt, world_size=16, num_layers=8)


# ---------------------------------------------------------------------------- round trip
def _expressible_layouts():
    """1F1B layouts over pp, tp, zero (no ZeRO-1 in Galvatron), recompute, SP and batch."""
    layers, world = 12, 16
    for pp in (1, 2, 4):
        for tp in (1, 2, 4):
            for zero in (0, 2, 3):
                for recompute in ("none", "all", "some"):
                    for sp in {False, tp > 1}:
                        stages = [layers // pp] * pp
                        if pp > 1:  # uneven: one layer moves from the first stage to the last
                            stages[0] -= 1
                            stages[-1] += 1
                        rc = [("none", 0)] * pp
                        if recompute == "all":
                            rc = [("full", n) for n in stages]
                        elif recompute == "some":
                            rc = [("full", 1 + j % n) if j % 2 == 0 else ("none", 0)
                                  for j, n in enumerate(stages)]
                        yield ParallelLayout(
                            world_size=world, pp=pp, tp=tp, dp=world // (pp * tp), zero=zero,
                            sequence_parallel=sp, micro_batch_size=1 + pp % 2,
                            num_micro_batches=2 * pp, layers_per_stage=tuple(stages),
                            recompute=tuple(rc))


def test_galvatron_export_reads_back_to_the_same_layout(tmp_path):
    count = 0
    for layout in _expressible_layouts():
        exported = galvatron_strategy(layout)
        back, notes = read_strategy(exported, world_size=16, num_layers=12,
                                    sequence_parallel=layout.sequence_parallel)
        assert back == layout, layout.describe()
        # Only the SP assumption is noted: nothing else is approximated.
        assert [n.split(":")[0] for n in notes] == (["sequence_parallel"] if layout.tp > 1
                                                    else [])
        count += 1
    assert count == 3 * 3 * 3 * 3 + 2 * 3 * 3 * 3  # SP on and off for tp > 1
    path = tmp_path / "galvatron_config.json"
    path.write_text(json.dumps(galvatron_strategy(layout)))
    assert read_strategy(path, world_size=16, num_layers=12,
                         sequence_parallel=layout.sequence_parallel)[0] == layout


def test_zero1_is_written_as_zero2_with_a_warning():
    layout = ParallelLayout(world_size=4, pp=1, tp=1, dp=4, zero=1, layers_per_stage=(4,))
    with pytest.raises(ExportError, match="no ZeRO-1"):
        galvatron_strategy(layout)
    with pytest.warns(UserWarning, match="written as zero2"):
        exported = galvatron_strategy(layout, strict=False)
    assert read_strategy(exported, world_size=4, num_layers=4)[0].zero == 2


# ---------------------------------------------------------------------------- compare
@pytest.fixture(scope="module")
def model():
    return ModelCost.from_dict(synthetic_model(layers=8, hidden=256, ffn=1024, heads=8,
                                               vocab=1000))


@pytest.fixture(scope="module")
def hw():
    return HardwareModel.from_dict(synthetic_hardware(2, 8))


def test_their_strategy_is_priced_as_the_layout_it_reads(model, hw):
    theirs, notes = price_galvatron_strategy(_strategy(), model, hw, world_size=16, seq_len=512,
                                             budget_bytes=80 * GiB)
    layout = ParallelLayout(world_size=16, pp=2, tp=2, dp=4, zero=2, micro_batch_size=4,
                            num_micro_batches=4, layers_per_stage=(5, 3),
                            recompute=(("full", 3), ("none", 0)))
    assert theirs.layout == layout
    assert theirs.iteration_time_us == evaluate(layout, model, hw, 512).iteration_time_us
    assert theirs.feasible and [n.split(":")[0] for n in notes] == ["sequence_parallel"]
    tight, notes = price_galvatron_strategy(_strategy(), model, hw, world_size=16, seq_len=512,
                                            budget_bytes=1e6)
    assert not tight.feasible and notes[-1].startswith("over the memory budget: stage 0 needs")


def test_compare_rows_add_up_and_diff_is_theirs_minus_ours(model, hw):
    opts = CostOptions(reserve_bytes=GiB)
    ours = evaluate(ParallelLayout.uniform(16, 2, 1, 8, num_micro_batches=4), model, hw, 512,
                    2 * GiB, opts)
    theirs, _ = price_galvatron_strategy(_strategy(), model, hw, world_size=16, seq_len=512,
                                         budget_bytes=2 * GiB, options=opts)
    rows = compare_predictions(ours, theirs)
    assert [r.term for r in rows] == list(BREAKDOWN_KINDS) + ["iteration", "peak_memory",
                                                              "feasible"]
    terms, iteration, peak, feasible = rows[:-3], rows[-3], rows[-2], rows[-1]
    assert sum(r.ours for r in terms) == pytest.approx(iteration.ours, rel=1e-9)
    assert sum(r.theirs for r in terms) == pytest.approx(iteration.theirs, rel=1e-9)
    assert sum(r.diff for r in terms) == pytest.approx(iteration.diff, rel=1e-9)
    assert iteration.ours == ours.iteration_time_us / 1e3
    assert iteration.theirs == theirs.iteration_time_us / 1e3
    for row in rows[:-1]:
        assert row.diff == row.theirs - row.ours
        if row.ours:
            assert row.diff_pct == pytest.approx(100 * (row.theirs - row.ours) / row.ours)
    bubble = rows[BREAKDOWN_KINDS.index("bubble")]
    assert bubble.ours == 0.0 and bubble.diff_pct is None  # one stage: no fill or drain
    assert bubble.theirs > 0  # two stages fill and drain
    assert peak.unit == "GiB" and peak.theirs == theirs.peak_memory_bytes / GiB
    assert peak.ours > 1.0  # the 1 GiB reserve is part of the peak
    assert feasible.diff is None and feasible.ours is ours.feasible


def test_compare_table_prints_both_labels_rows_and_notes(model, hw):
    ours = evaluate(ParallelLayout.uniform(16, 2, 1, 8, num_micro_batches=4), model, hw, 512)
    theirs, notes = price_galvatron_strategy(_strategy(), model, hw, world_size=16, seq_len=512,
                                             budget_bytes=None)
    table = compare_table(compare_predictions(ours, theirs), ours_label="ours: tp2 pp1",
                          theirs_label="galvatron_config.json", notes=notes)
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(table)
    text = console.export_text()
    assert "galvatron_config.json" in text and "ours: tp2 pp1" in text
    assert "iteration (ms)" in text and "peak_memory (GiB)" in text
    assert "feasible" in text and "yes" in text
    assert "sequence_parallel: Megatron-style" in text


def test_a_strategy_our_model_cannot_price_is_a_profile_error(model, hw):
    # tp 16 does not divide the model's 8 heads.
    raw = _strategy(pp_deg=1, tp_sizes_enc=_enc([16] * 8), pp_division="8", vtp=16,
                    global_bsz=4, chunks=4)
    with pytest.raises(ProfileError, match=r"cannot be priced for tiny: tp\(16\) must divide"):
        price_galvatron_strategy(raw, model, hw, world_size=16, seq_len=512, budget_bytes=None)
    with pytest.raises(ProfileError, match="has 8 layers, the model has 12"):
        price_galvatron_strategy(_strategy(), ModelCost.from_dict(synthetic_model(layers=12)),
                                 hw, world_size=16, seq_len=512, budget_bytes=None)
