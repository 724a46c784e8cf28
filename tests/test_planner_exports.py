"""A layout written as Megatron-LM arguments and as a Galvatron strategy."""
from __future__ import annotations

import pytest

from orchestrator.layout import ParallelLayout
from orchestrator.planner import galvatron_strategy, megatron_args
from orchestrator.planner.exports import ExportError


def _args_dict(args):
    """--flag value pairs as a dict; bare flags map to True."""
    out, i = {}, 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[args[i]] = args[i + 1]
            i += 2
        else:
            out[args[i]] = True
            i += 1
    return out


def test_megatron_args_for_interleaved_sp_distributed_optimizer_and_recompute():
    layout = ParallelLayout(world_size=32, pp=4, tp=4, dp=2, zero=1, sequence_parallel=True,
                            micro_batch_size=2, num_micro_batches=8, schedule="interleaved",
                            virtual_stages=2, layers_per_stage=(8, 8, 8, 8),
                            recompute=(("full", 4),) * 4)
    a = _args_dict(megatron_args(layout))
    assert a["--tensor-model-parallel-size"] == "4"
    assert a["--pipeline-model-parallel-size"] == "4"
    assert a["--num-layers-per-virtual-pipeline-stage"] == "4"
    assert a["--micro-batch-size"] == "2"
    assert a["--global-batch-size"] == "32"
    assert a["--sequence-parallel"] is True
    assert a["--use-distributed-optimizer"] is True
    assert a["--recompute-granularity"] == "full"
    assert a["--recompute-method"] == "block"
    assert a["--recompute-num-layers"] == "2"  # per model chunk


def test_megatron_uneven_first_and_last_stage():
    layout = ParallelLayout(world_size=4, pp=4, tp=1, dp=1, num_micro_batches=4,
                            layers_per_stage=(6, 8, 8, 7),
                            recompute=(("selective", 6), ("selective", 8), ("selective", 8),
                                       ("selective", 7)))
    a = _args_dict(megatron_args(layout))
    assert a["--decoder-first-pipeline-num-layers"] == "6"
    assert a["--decoder-last-pipeline-num-layers"] == "7"
    assert a["--recompute-granularity"] == "selective"
    assert "--sequence-parallel" not in a and "--use-distributed-optimizer" not in a


def test_megatron_cannot_express_uneven_middle_stages():
    layout = ParallelLayout(world_size=4, pp=4, tp=1, dp=1, num_micro_batches=4,
                            layers_per_stage=(6, 8, 9, 6))
    with pytest.raises(ExportError, match="equal middle pipeline stages"):
        megatron_args(layout)


def test_megatron_approximates_uneven_middle_stages_with_the_rest_on_the_last():
    layout = ParallelLayout(world_size=5, pp=5, tp=1, dp=1, num_micro_batches=5,
                            layers_per_stage=(2, 3, 4, 4, 1))
    with pytest.warns(UserWarning, match=r"equal middle pipeline stages, got layers_per_stage="
                                         r"\[2, 3, 4, 4, 1\]; written as \[2, 3, 3, 3, 3\]"):
        a = _args_dict(megatron_args(layout, strict=False))
    assert a["--decoder-first-pipeline-num-layers"] == "2"
    assert "--decoder-last-pipeline-num-layers" not in a  # 1 + 2 left over = the middle's 3
    assert a["--num-layers"] == "14"


def test_megatron_interleaved_unequal_stages_approximate_or_fail():
    even = ParallelLayout(world_size=2, pp=2, tp=1, dp=1, num_micro_batches=4,
                          schedule="interleaved", virtual_stages=2, layers_per_stage=(2, 6))
    with pytest.warns(UserWarning, match="written as 4 layers per stage"):
        a = _args_dict(megatron_args(even, strict=False))
    assert a["--num-layers-per-virtual-pipeline-stage"] == "2"
    odd = ParallelLayout(world_size=2, pp=2, tp=1, dp=1, num_micro_batches=4,
                         schedule="interleaved", virtual_stages=2, layers_per_stage=(2, 4))
    with pytest.raises(ExportError, match="interleaved schedule here needs equal stages"):
        megatron_args(odd, strict=False)


def test_megatron_per_stage_recompute_is_strict_or_conservative():
    layout = ParallelLayout(world_size=2, pp=2, tp=1, dp=1, num_micro_batches=2,
                            layers_per_stage=(4, 4), recompute=(("full", 3), ("none", 0)))
    with pytest.raises(ExportError, match="one recompute setting"):
        megatron_args(layout)
    with pytest.warns(UserWarning, match="one recompute setting"):
        a = _args_dict(megatron_args(layout, strict=False))
    assert a["--recompute-num-layers"] == "3"


def test_galvatron_strategy_fields():
    layout = ParallelLayout(world_size=16, pp=2, tp=4, dp=2, zero=3, sequence_parallel=True,
                            micro_batch_size=1, num_micro_batches=8, layers_per_stage=(3, 5),
                            recompute=(("full", 2), ("none", 0)))
    g = galvatron_strategy(layout)
    assert set(g) == {"pp_deg", "tp_sizes_enc", "tp_consecutive_flags", "dp_types_enc", "use_sp",
                      "checkpoint", "global_bsz", "chunks", "pp_division", "pipeline_type",
                      "default_dp_type", "vtp", "vsp", "embed_sdp"}
    assert g["use_sp"] == "0,0,0,0,0,0,0,0" and g["embed_sdp"] == 1
    assert g["pp_deg"] == 2
    assert g["tp_sizes_enc"] == "4,4,4,4,4,4,4,4"
    assert g["tp_consecutive_flags"] == "1,1,1,1,1,1,1,1"
    assert g["dp_types_enc"] == "1,1,1,1,1,1,1,1"  # ZeRO-3 layers
    assert g["checkpoint"] == "1,1,0,0,0,0,0,0"
    assert g["global_bsz"] == 16 and g["chunks"] == 8
    assert g["pp_division"] == "3,5"
    assert g["pipeline_type"] == "pipedream_flush"
    assert g["default_dp_type"] == "zero2"
    assert g["vtp"] == 4 and g["vsp"] == 0


def test_galvatron_has_no_interleaving():
    layout = ParallelLayout(world_size=2, pp=2, tp=1, dp=1, num_micro_batches=2,
                            schedule="interleaved", virtual_stages=2, layers_per_stage=(2, 2))
    with pytest.raises(ExportError, match="interleaved"):
        galvatron_strategy(layout)
    with pytest.warns(UserWarning):
        assert galvatron_strategy(layout, strict=False)["pipeline_type"] == "pipedream_flush"
