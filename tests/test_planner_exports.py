"""A layout written as Megatron-LM arguments and as a Galvatron strategy."""
from __future__ import annotations

import warnings
from pathlib import Path

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


def _parse_pipeline_layout(text):
    """Decoder layers per entry of a --pipeline-model-parallel-layout string, with the "E" and
    "L" positions: the syntax Megatron documents ("(x|)*n" and "t*k" unrolled, "|" between
    virtual stages), read here independently of the writer."""
    while "(" in text:
        i = text.rindex("(")
        j = text.index(")*", i)
        k = j + 2
        while k < len(text) and text[k].isdigit():
            k += 1
        text = text[:i] + text[i + 1:j] * int(text[j + 2:k]) + text[k:]
    entries = []
    for entry in text.split("|"):
        body = entry.replace("E", "").replace("L", "")
        count = sum(int(part[2:] or 1) if part.startswith("t*") else len(part)
                    for part in body.replace("t*", " t*").split())
        entries.append((count, "E" in entry, "L" in entry))
    return entries


def _chunks_of(entries, pp):
    """Per stage, its chunks' decoder layers (entry c * pp + s is chunk c of stage s)."""
    v = len(entries) // pp
    return [[entries[c * pp + s][0] for c in range(v)] for s in range(pp)]


def test_megatron_writes_uneven_middle_stages_exactly_as_a_pipeline_layout():
    """What Megatron's --decoder-first/last flags cannot say, its layout flag can: no
    approximation, strict or not (the search's [1, 2, 3, 3] of test_search_stage)."""
    layout = ParallelLayout(world_size=5, pp=5, tp=1, dp=1, num_micro_batches=5,
                            layers_per_stage=(2, 3, 4, 4, 1))
    a = _args_dict(megatron_args(layout))
    assert "--decoder-first-pipeline-num-layers" not in a
    entries = _parse_pipeline_layout(a["--pipeline-model-parallel-layout"])
    assert [n for n, _, _ in entries] == [2, 3, 4, 4, 1]
    assert entries[0][1] and entries[-1][2]  # the embedding first, the loss last
    assert a["--num-layers"] == "14"


def test_megatron_interleaved_unequal_stages_are_exact():
    """Interleaved, unequal stages (each a multiple of v): equal middle stages and other
    first/last ones by the first/last flags with Megatron's virtual size."""
    ends = ParallelLayout(world_size=4, pp=4, tp=1, dp=1, num_micro_batches=4,
                          schedule="interleaved", virtual_stages=2, layers_per_stage=(2, 4, 4, 6))
    a = _args_dict(megatron_args(ends))
    assert (a["--decoder-first-pipeline-num-layers"], a["--decoder-last-pipeline-num-layers"],
            a["--num-virtual-stages-per-pipeline-rank"]) == ("2", "6", "2")
    assert "--num-layers-per-virtual-pipeline-stage" not in a  # Megatron refuses both
    two = ParallelLayout(world_size=2, pp=2, tp=1, dp=1, num_micro_batches=4,
                         schedule="interleaved", virtual_stages=2, layers_per_stage=(2, 4))
    a = _args_dict(megatron_args(two))
    assert (a["--decoder-first-pipeline-num-layers"], a["--decoder-last-pipeline-num-layers"],
            a["--num-virtual-stages-per-pipeline-rank"]) == ("2", "4", "2")
    assert a["--overlap-p2p-comm"] is True  # Megatron's rule for v > 1 over 2 stages


LLAMA3_405B = (7,) + (8,) * 14 + (7,)  # the Llama 3 paper: one layer fewer first and last


@pytest.mark.parametrize("v,string", [(2, None), (4, "Et|(tt|)*62tL"), (8, "E|(t|)*126L")])
def test_megatron_llama3_405b_uneven_interleaved_is_exact(v, string):
    """126 layers over PP16 with v > 1: chunks equal but the first stage's first and the last
    stage's last, which are short (empty at v = 8, Megatron's layout of the Llama 3 run)."""
    layout = ParallelLayout(world_size=2048, pp=16, tp=8, dp=16, zero=1, sequence_parallel=True,
                            num_micro_batches=16, schedule="interleaved", virtual_stages=v,
                            layers_per_stage=LLAMA3_405B)
    a = _args_dict(megatron_args(layout))  # strict: an approximation would raise
    text = a["--pipeline-model-parallel-layout"]
    if string is not None:
        assert text == string
    chunks = _chunks_of(_parse_pipeline_layout(text), 16)
    c = 8 // v
    assert chunks[0] == [c - 1] + [c] * (v - 1)
    assert chunks[-1] == [c] * (v - 1) + [c - 1]
    assert all(row == [c] * v for row in chunks[1:-1])
    assert "--num-layers-per-virtual-pipeline-stage" not in a
    assert "--num-virtual-stages-per-pipeline-rank" not in a  # the layout gives v


def test_megatron_deepseek_v3_pick_is_exact():
    """A partition of the shape of the search's DeepSeek-V3 pick on 256 H100s (bench/moe.py,
    engine megatron: tp8 pp32 ep8, 61 layers as [1, 2 x 15, 1, 2, ...]; one-layer stages among
    the two-layer ones), which was written as "1 layer per stage and 30 on the last" with an
    approximation warning."""
    layers = (1,) + (2,) * 15 + (1,) + (2,) * 14 + (1,)
    layout = ParallelLayout(world_size=256, pp=32, tp=8, dp=1, ep=8, sequence_parallel=True,
                            num_micro_batches=1024, layers_per_stage=layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no approximation, strict or not
        args = megatron_args(layout, strict=False)
    assert megatron_args(layout) == args
    a = _args_dict(args)
    entries = _parse_pipeline_layout(a["--pipeline-model-parallel-layout"])
    assert [n for n, _, _ in entries] == list(layers)
    assert a["--num-layers"] == "61"
    assert "--decoder-last-pipeline-num-layers" not in a


def test_megatron_recompute_per_chunk_with_short_chunks():
    """Full recompute of r layers per chunk covers all of a shorter chunk (Megatron's block
    method): one setting, exact, for stages whose counts differ."""
    layout = ParallelLayout(world_size=4, pp=4, tp=1, dp=1, num_micro_batches=4,
                            schedule="interleaved", virtual_stages=4,
                            layers_per_stage=(7, 8, 8, 7),
                            recompute=(("full", 4), ("full", 4), ("full", 4), ("full", 4)))
    assert layout.layers_per_chunk[0] == (1, 2, 2, 2)
    a = _args_dict(megatron_args(layout))
    assert a["--recompute-num-layers"] == "1"
    whole = ParallelLayout(world_size=4, pp=4, tp=1, dp=1, num_micro_batches=4,
                           schedule="interleaved", virtual_stages=4,
                           layers_per_stage=(7, 8, 8, 7),
                           recompute=(("full", 7), ("full", 8), ("full", 8), ("full", 7)))
    assert _args_dict(megatron_args(whole))["--recompute-num-layers"] == "2"


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


def test_megatron_zero3_is_fsdp2_only_where_megatron_runs_it():
    """Megatron-LM's validate_args: --use-torch-fsdp2 asserts pipeline_model_parallel_size == 1,
    expert_model_parallel_size == 1 and no gradient-accumulation fusion (on by default)."""
    a = _args_dict(megatron_args(ParallelLayout.uniform(16, 2, 1, 8, zero=3,
                                                        num_micro_batches=4)))
    assert a["--use-torch-fsdp2"] is True and a["--no-gradient-accumulation-fusion"] is True
    piped = ParallelLayout.uniform(16, 2, 2, 8, zero=3, num_micro_batches=4)
    for strict in (True, False):
        with pytest.raises(ExportError, match=r"ZeRO 3 with pp\(2\)"):
            megatron_args(piped, strict=strict)


def test_megatron_model_args_give_the_architecture_megatron_would_otherwise_default():
    """Megatron ties the embedding and the output layer, has linear biases, GELU and LayerNorm
    by default: every model here is Llama-style with an untied head, so the exported command
    says so (for llama2_7b an untied head is 131M parameters the planner priced)."""
    import yaml

    from orchestrator.models.config import ModelConfig
    from orchestrator.planner.exports import megatron_model_args

    llama = ModelConfig(**yaml.safe_load(
        (Path(__file__).parent.parent / "orchestrator/conf/model/llama2_7b.yaml").read_text()))
    a = _args_dict(megatron_model_args(llama))
    assert a["--untie-embeddings-and-output-weights"] is True
    assert a["--swiglu"] is True and a["--disable-bias-linear"] is True
    assert (a["--normalization"], a["--position-embedding-type"]) == ("RMSNorm", "rope")
    assert (a["--hidden-size"], a["--ffn-hidden-size"], a["--num-attention-heads"]) == (
        str(llama.hidden), str(llama.ffn), str(llama.heads))
    assert "--group-query-attention" not in a  # llama2_7b: as many KV heads as heads
    gqa = _args_dict(megatron_model_args(ModelConfig(heads=4, kv_heads=2, rope_theta=1e6)))
    assert gqa["--group-query-attention"] is True and gqa["--num-query-groups"] == "2"
    assert gqa["--rotary-base"] == "1000000"  # Megatron parses it as an int
