"""Galvatron's model profiles (computation_profiling_*, memory_profiling_*) to our model profile
and back. Files are built here, shaped like Galvatron's, with numbers of our own."""
import json

import pytest

from orchestrator.errors import ProfileError
from orchestrator.interop.galvatron.model import import_model, write_galvatron_model
from orchestrator.models.config import ModelConfig
from orchestrator.planner.model_cost import ModelCost
from orchestrator.store.schema import ModelProfile

MiB = 1024 * 1024
SEQ = 1024
MODEL = ModelConfig(name="small", hidden=512, ffn=1024, layers=4, heads=8, kv_heads=8,
                    vocab=1024, seq_len=SEQ, dtype="bf16")
# count_block_params by hand: wq, wo, wk, wv 4 * 512^2; SwiGLU 3 * 512 * 1024; 2 norms of 512.
N_BLOCK = 4 * 512 * 512 + 3 * 512 * 1024 + 2 * 512
S2_SHARE = SEQ * 512 / (N_BLOCK + SEQ * 512)  # causal 2 s^2 h over 2 N s + 2 s^2 h


def write(path, content):
    path.write_text(json.dumps(content))
    return path


def old_layout(tmp_path):
    """The shipped examples' layout: per-bsz times without the length, tables without seq keys.
    Batch time b * t_b = 2.0 b + 0.4 ms (block), 1.0 b + 0.2 ms (other)."""
    times = {"layernum[2]_bsz1": 9.9, "layernum[4]_bsz1": 13.9, "layertype_0": 2.5}
    for b in (1, 2, 4, 8):
        times[f"layertype_0_bsz{b}"] = 2.0 + 0.4 / b
        times[f"layertype_other_0_bsz{b}"] = 1.0 + 0.2 / b
    memory = {
        "1_2_4_vtp_sp": {"layernum[1]_bsz8_rank0_ms": 100.0},
        "layertype_0": {"parameter_size": 16.0,
                        "tp_activation_per_bsz_dict": {"1": 80.0, "2": 50.0, "checkpoint": 2.0}},
        "other_memory_pp_off": {"model_states": 33.0, "activation": 9.0},
        "layertype_0_sp": {"parameter_size": 16.0,
                           "tp_activation_per_bsz_dict": {"1": 64.0, "2": 32.0,
                                                          "checkpoint": 2.0}},
        "other_memory_pp_off_sp": {"model_states": {"1": 32.0, "2": 16.0},
                                   "activation": {"1": 8.0, "2": 4.0}},
        "other_memory_pp_on_first_sp": {"model_states": {"1": 20.0, "2": 10.0},
                                        "activation": {"1": 1.0, "2": 0.5}},
        "other_memory_pp_on_last_sp": {"model_states": {"1": 20.0, "2": 10.0},
                                       "activation": {"1": 7.0, "2": 3.5}},
    }
    name = "bf16_hidden512_head8_seqlen1024"
    tmp_path.mkdir(exist_ok=True)
    write(tmp_path / f"computation_profiling_{name}.json", times)
    write(tmp_path / f"memory_profiling_{name}.json", memory)
    return tmp_path


def profile_of(imported):
    return ModelProfile.from_dict({"kind": "model", "source": "galvatron", **imported.body}, "")


def test_old_layout_times_are_the_per_sample_slope_over_tp_with_backward_twice(tmp_path):
    cost = ModelCost.from_profile(profile_of(import_model(old_layout(tmp_path), MODEL)))
    assert cost.tps == (1, 2)
    assert cost.block_fwd_us(SEQ, 1) == pytest.approx(2000.0)
    assert cost.block_bwd_us(SEQ, 1) == pytest.approx(4000.0)
    assert cost.block_fwd_us(SEQ, 2) == pytest.approx(1000.0)
    assert cost.block_bwd_us(SEQ, 2) == pytest.approx(2000.0)
    assert cost.other_fwd_us(SEQ, 2) == pytest.approx(500.0)
    assert cost.other_bwd_us(SEQ, 1) == pytest.approx(2000.0)


def test_sequence_fit_splits_by_attention_flop_share(tmp_path):
    cost = ModelCost.from_profile(profile_of(import_model(old_layout(tmp_path), MODEL)))
    # At 2 s: the linear part doubles, the s^2 part quadruples; other is linear.
    expected = 2000.0 * ((1 - S2_SHARE) * 2 + S2_SHARE * 4)
    assert S2_SHARE == pytest.approx(0.16661, abs=1e-5)
    assert cost.block_fwd_us(2 * SEQ, 1) == pytest.approx(expected)
    assert cost.block_bwd_us(2 * SEQ, 2) == pytest.approx(expected)  # 2x fwd, / 2
    assert cost.other_fwd_us(2 * SEQ, 1) == pytest.approx(2000.0)


def test_memory_per_tp_in_our_bytes_per_parameter(tmp_path):
    cost = ModelCost.from_profile(profile_of(import_model(old_layout(tmp_path), MODEL)))
    block, other = cost.memory(2)
    params = 16 * MiB / 4  # parameter_size is fp32 MiB
    assert block.param_bytes == pytest.approx(params * 2 / 2)  # bf16, split over 2
    assert block.grad_bytes == pytest.approx(params * 4 / 2)
    assert block.optim_bytes == pytest.approx(params * 12 / 2)
    assert block.act_bytes_per_token["none"] == pytest.approx(32 * MiB / SEQ)
    assert block.act_bytes_per_token["full"] == pytest.approx(2 * MiB / SEQ / 2)
    assert block.act_bytes_per_token["selective"] == pytest.approx(32 * MiB / SEQ - 4 * 8 / 2)
    other_params = 16 * MiB / 16  # model_states at tp 2 / Galvatron's 16 B per parameter
    assert other.param_bytes == pytest.approx(other_params * 2)
    assert other.optim_bytes == pytest.approx(other_params * 12)
    assert other.act_bytes_per_token["full"] == pytest.approx(4 * MiB / SEQ)
    block1, other1 = cost.memory(1)
    assert block1.act_bytes_per_token["full"] == pytest.approx(2 * MiB / SEQ)
    # tp 1 runs no sequence parallelism: the plain tables (80 MiB, not the _sp table's 64),
    # as Galvatron's own search prices a tp-1 layer without use_sp.
    assert block1.act_bytes_per_token["none"] == pytest.approx(80 * MiB / SEQ)
    assert other1.act_bytes_per_token["none"] == pytest.approx(9 * MiB / SEQ)
    assert other1.param_bytes == pytest.approx(33 * MiB / 16 * 2)


def test_unmapped_and_assumptions_name_the_fields(tmp_path):
    imported = import_model(old_layout(tmp_path), MODEL)
    unmapped = "\n".join(imported.unmapped)
    for field in ("layernum[...]", "plain layertype_0", "_vtp_", "other_memory_pp_on_first",
                  "other_memory_pp_on_last", "without _sp", "embed_sdp"):
        assert field in unmapped
    assumptions = "\n".join(imported.assumptions)
    for rule in ("backward = 2 x forward", "time at tp 1 / t", "16.7% in s^2", "18 B/param",
                 "selective recompute", "checkpoint"):
        assert rule in assumptions
    assert [p.name for p in imported.files] == [
        "computation_profiling_bf16_hidden512_head8_seqlen1024.json",
        "memory_profiling_bf16_hidden512_head8_seqlen1024.json"]


def test_plain_tables_without_sequence_parallelism(tmp_path):
    """A gpt_hf-like pair: one plain forward time, tables without _sp, 'other' one number."""
    write(tmp_path / "computation_profiling_bf16_hidden512_head8.json",
          {"layernum[1]_bsz4": 7.0, "layertype_0": 3.0})
    write(tmp_path / "memory_profiling_bf16_hidden512_head8.json", {
        "layertype_0": {"parameter_size": 16.0,
                        "tp_activation_per_bsz_dict": {"1": 80.0, "2": 50.0, "checkpoint": 2.0}},
        "other_memory_pp_off": {"model_states": 32.0, "activation": 8.0}})
    with pytest.raises(ProfileError, match="layertype_other"):
        import_model(tmp_path, MODEL)
    times = json.loads((tmp_path / "computation_profiling_bf16_hidden512_head8.json").read_text())
    write(tmp_path / "computation_profiling_bf16_hidden512_head8.json",
          {**times, "layertype_other_0_bsz4": 1.5})
    cost = ModelCost.from_profile(profile_of(import_model(tmp_path, MODEL)))
    assert cost.block_fwd_us(SEQ, 2) == pytest.approx(1500.0)
    block, other = cost.memory(2)
    assert block.act_bytes_per_token["none"] == pytest.approx(50 * MiB / SEQ)
    assert block.act_bytes_per_token["full"] == pytest.approx(2 * MiB / SEQ)  # no SP: whole
    assert other.param_bytes == pytest.approx(32 * MiB / 16 / 2 * 2)  # vocab split over 2
    assert other.act_bytes_per_token["none"] == pytest.approx(8 * MiB / SEQ / 2)


def test_2_4_layout_picks_the_model_sequence_length(tmp_path):
    times = {}
    for seq, ms in ((512, 0.8), (1024, 2.0)):
        for b in range(1, 9):
            times[f"layertype_0_bsz{b}_seq{seq}"] = ms
            times[f"layertype_other_bsz{b}_seq{seq}"] = ms / 4
    table = {str(seq): {"parameter_size": 16.0,
                        "tp_activation_per_bsz_dict": {"1": mib, "2": mib / 2, "4": mib / 4,
                                                       "checkpoint": mib / 32}}
             for seq, mib in ((512, 30.0), (1024, 64.0))}
    other = {str(seq): {"model_states": {"1": 32.0, "2": 16.0, "4": 8.0},
                        "activation": {"1": 8.0, "2": 4.0, "4": 2.0}} for seq in (512, 1024)}
    write(tmp_path / "computation_profiling_bf16_hidden512_head8.json", times)
    write(tmp_path / "memory_profiling_bf16_hidden512_head8.json",
          {"layertype_0_sp": table, "other_memory_pp_off_sp": other})
    cost = ModelCost.from_profile(profile_of(import_model(tmp_path, MODEL, max_tp=2)))
    assert cost.tps == (1, 2)
    assert cost.block_fwd_us(SEQ, 2) == pytest.approx(1000.0)
    assert cost.other_fwd_us(SEQ, 1) == pytest.approx(500.0)
    block, _ = cost.memory(1)
    assert block.act_bytes_per_token["none"] == pytest.approx(64 * MiB / SEQ)
    assert block.act_bytes_per_token["full"] == pytest.approx(2 * MiB / SEQ)


def test_export_then_import_keeps_the_fields_that_map(tmp_path):
    first = profile_of(import_model(old_layout(tmp_path / "in"), MODEL))
    paths = write_galvatron_model(first, tmp_path / "out")
    assert sorted(p.name for p in paths) == [
        "computation_profiling_bf16_hidden512_head8_seqlen1024.json",
        "memory_profiling_bf16_hidden512_head8_seqlen1024.json"]
    memory = json.loads(paths[1].read_text())
    assert memory["layertype_0_sp"]["1024"]["parameter_size"] == pytest.approx(16.0)
    assert memory["other_memory_pp_on_last_sp"]["1024"]["model_states"]["2"] == pytest.approx(8.0)
    again = ModelCost.from_profile(profile_of(import_model(tmp_path / "out", MODEL)))
    before = ModelCost.from_profile(first)
    assert again.tps == before.tps
    for tp in before.tps:
        for seq in (SEQ, 2 * SEQ):
            for term in ("block_fwd_us", "block_bwd_us", "other_fwd_us", "other_bwd_us"):
                assert getattr(again, term)(seq, tp) == pytest.approx(
                    getattr(before, term)(seq, tp), rel=1e-12)
        for part_again, part in zip(again.memory(tp), before.memory(tp)):
            assert part_again.param_bytes == pytest.approx(part.param_bytes, rel=1e-12)
            assert part_again.optim_bytes == pytest.approx(part.optim_bytes, rel=1e-12)
            assert part_again.act_bytes_per_token == pytest.approx(part.act_bytes_per_token,
                                                                   rel=1e-12)


def test_no_matching_file_names_what_was_found_and_the_overrides(tmp_path):
    old_layout(tmp_path)
    other = ModelConfig(name="wide", hidden=1024, ffn=2048, layers=2, heads=8, kv_heads=8,
                        vocab=1024, seq_len=SEQ, dtype="bf16")
    with pytest.raises(ProfileError, match=r"model.hidden=512 model.heads=8 model.seq_len=1024"):
        import_model(tmp_path, other)
    with pytest.raises(ProfileError, match="matches model small"):
        import_model(tmp_path, ModelConfig(**{**MODEL.__dict__, "dtype": "fp16"}))


def test_corrupt_json_is_a_profile_error(tmp_path):
    old_layout(tmp_path)
    (tmp_path / "memory_profiling_bf16_hidden512_head8_seqlen1024.json").write_text('{"layer')
    with pytest.raises(ProfileError, match="memory_profiling_bf16.*cannot be read"):
        import_model(tmp_path, MODEL)
