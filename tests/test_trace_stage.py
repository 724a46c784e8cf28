"""Issue 13 from the command line: the five seed configurations of llama2_7b (small batch and
sequence, so it stays quick) in one `stage=trace`, an invalid one skipped with its reason, the
files per configuration, and a rerun that traces nothing again."""
from __future__ import annotations

import json

from conftest import ledger, run_cli

SEED = [[8192, 16, 8], [8192, 32, 8], [8192, 32, 4], [4096, 16, 4], [2048, 8, 4]]
SMALL = ["model=llama2_7b", "trace.global_batch_size=64", "trace.seq_len=512"]


def _configs(configs) -> str:
    return "trace.configs=" + json.dumps(configs).replace(" ", "")


def test_seed_configurations_in_one_command_and_a_rerun_resumes(profiles):
    proc = run_cli("stage=trace", *SMALL, _configs(SEED + [[1000, 16, 8]]),
                   profiles_dir=profiles, timeout=600, check=0)
    assert "skipped config 5 [1000, 16, 8]: WORLD_SIZE(1000) % (PP(16) * TP(8)) != 0" \
        in proc.stdout
    root = profiles / "local" / "trace"
    index = json.loads((root / "index.json").read_text())["configurations"]
    done = {k: v for k, v in index.items() if v["state"] == "done"}
    assert len(done) == 5
    assert index["config5_1000_16_8"]["state"] == "skipped"
    ranks_traced = 0
    for i, (ws, pp, tp) in enumerate(SEED):
        dp = ws // (pp * tp)
        m = 64 // dp
        name = (f"SIM_llama2_7b_Config{i}_WS{ws}_PP{pp}_TP{tp}_DP{dp}_nMICROB{m}"
                f"_MICROB_SIZE1_GLOBAL_BATCH64")
        folder = root / name
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["ranks_traced"] == pp and summary["ranks_total"] == ws
        reps = [s * tp * dp for s in range(pp)]
        assert sorted(int(p.stem.split("_")[-1]) for p in folder.glob("fake_rank_*.jsonl")) \
            == reps
        # The last stage's representative: m micro-batches, each one forward receive from the
        # stage before; its TP all-gathers are over its own tp ranks.
        last = [json.loads(line) for line in
                (folder / f"fake_rank_{reps[-1]}.jsonl").read_text().splitlines()]
        recvs = [r for r in last if r["kind"] == "p2p" and r["op"] == "recv"]
        assert len(recvs) == m and {r["peer"] for r in recvs} == {reps[-2]}
        gathers = [r for r in last if r["kind"] == "coll" and r["group"] == "tp"]
        assert gathers and all(r["group_first"] == reps[-1] and r["group_size"] == tp
                               for r in gathers)
        log_lines = (folder / f"fake_rank_{reps[-1]}.log").read_text().splitlines()
        assert len(log_lines) == len(last)
        ranks_traced += summary["ranks_traced"]
    assert ranks_traced == 16 + 32 + 32 + 16 + 8
    entries = ledger(profiles)
    assert entries["trace/llama2_7b"]["state"] == "done"
    again = run_cli("stage=trace", *SMALL, _configs(SEED), profiles_dir=profiles, check=0)
    assert "traced SIM_" not in again.stdout


def test_single_configuration_keys_and_bad_input(profiles):
    proc = run_cli("stage=trace", "trace.world_size=16", "trace.pp=2", "trace.tp=2",
                   "trace.global_batch_size=8", "model.layers=2", profiles_dir=profiles,
                   check=0)
    assert "traced SIM_tiny_Config0_WS16_PP2_TP2_DP4_nMICROB2" in proc.stdout
    bad = run_cli("stage=trace", "trace.world_size=16", "trace.pp=2", "trace.tp=3",
                  profiles_dir=profiles, check=2)
    assert "no configuration can be traced" in bad.stdout + bad.stderr
    cp = run_cli("stage=trace", "trace.world_size=16", "trace.pp=2", "trace.tp=2", "trace.cp=2",
                 "trace.cp_comm=allgather", "trace.global_batch_size=8", "model.layers=2",
                 "trace.export=simai", profiles_dir=profiles, check=0)
    assert "traced SIM_tiny_Config0_WS16_PP2_TP2_CP2_DP2_nMICROB4" in cp.stdout
    folder = next(profiles.glob("*/trace/SIM_tiny_Config0_WS16_PP2_TP2_CP2_DP2_*"))
    assert "ALLGATHER_EP" in next(folder.glob("*-tp2-cp2-pp2-*-stage0.txt")).read_text()
    bad_cp = run_cli("stage=trace", "trace.world_size=16", "trace.pp=2", "trace.tp=2",
                     "trace.cp_comm=ring", profiles_dir=profiles, check=2)
    assert "trace.cp_comm='ring'; allowed: p2p, a2a, allgather, a2a+p2p" in \
        bad_cp.stdout + bad_cp.stderr
    hierarchical = run_cli("stage=trace", "trace.world_size=16", "trace.pp=2", "trace.tp=1",
                           "trace.cp=4", "trace.cp_comm=a2a+p2p", "trace.cp_a2a=2",
                           "trace.export=simai", profiles_dir=profiles, check=2)
    assert "SimAI has one group that can stand for CP" in \
        hierarchical.stdout + hierarchical.stderr
    # a mixture-of-experts model traces (tests/test_trace_moe.py); the expert degrees of a
    # configuration are checked as the others
    moe = run_cli("stage=trace", "model=tiny_moe", "trace.world_size=32", "trace.pp=2",
                  "trace.tp=2", "trace.ep=16", profiles_dir=profiles, check=2)
    assert "experts(8) of tiny_moe is not divisible by ep(16)" in moe.stdout + moe.stderr


def test_a_model_that_does_not_split_over_tp_is_skipped_with_its_reason():
    from orchestrator.models.config import ModelConfig
    from orchestrator.trace.configs import TraceSettings, plan_configs

    model = ModelConfig(name="tiny", hidden=128, ffn=384, layers=4, heads=4, kv_heads=2,
                        vocab=512, seq_len=256, dtype="bf16")
    settings = TraceSettings(global_batch_size=8, micro_batch_size=1, seq_len=255,
                             sequence_parallel=False)
    specs, skipped = plan_configs([[16, 2, 2], [24, 2, 3], [32, 2, 4]], settings, model)
    assert specs == []
    assert [s.index for s in skipped] == [0, 1, 2]
    # The sequence over TP (255 % 2: trace.seq_len's, not the model's 256), then the first
    # field TP does not divide.
    assert "trace.seq_len(255) is not divisible by tp(2)" in skipped[0].reason
    assert "model.heads(4) is not divisible by tp(3)" in skipped[1].reason
    assert "model.kv_heads(2) is not divisible by tp(4)" in skipped[2].reason


def test_what_prices_the_trace_is_in_its_hash(tmp_path):
    """A rerun after the model profile changed, a calibration appeared or search.engine changed
    retraces (the hash of every configuration changes); a rerun with none of them resumes."""
    from planner_fixtures import shaped_like
    from test_limits import _cfg

    from orchestrator.pipeline import plan_stage
    from orchestrator.store import calibration_path, file_sha256, write_json

    def trace_hash(*overrides):
        return plan_stage("trace", _cfg("stage=trace", "trace.world_size=8", "trace.pp=2",
                                        "trace.tp=2", "trace.global_batch_size=8",
                                        f"profiles_dir={tmp_path}", *overrides)).config_hash

    sheet = trace_hash()
    assert trace_hash() == sheet
    assert trace_hash("search.engine=megatron") != sheet
    assert trace_hash("search.moe_imbalance=1.5") != sheet

    def profile(**kw):
        raw = shaped_like("tiny", **kw)
        raw["model"]["dtype"] = "fp32"  # tiny's
        return raw

    model = tmp_path / "local" / "model" / "tiny.json"
    write_json(model, profile())
    profiled = trace_hash()
    assert profiled != sheet
    write_json(model, profile(tflops=300.0))  # measured again: other figures
    remeasured = trace_hash()
    assert remeasured not in (sheet, profiled)
    write_json(calibration_path(tmp_path, "local", "tiny"), {
        "inputs": {"model/tiny.json": {"sha256": file_sha256(model)}},
        "runs": 2, "factors": {"compute": 1.2}})
    assert trace_hash() != remeasured


def test_an_unknown_trace_device_names_trace_device(profiles):
    """Before: `trace.device=h1000` was refused as `profile_model.device='h1000'`, a key the
    command never set."""
    from conftest import one_error_line

    line = one_error_line(run_cli("stage=trace", "trace.world_size=8", "trace.pp=1",
                                  "trace.tp=2", "trace.device=h1000", profiles_dir=profiles), 2)
    assert line.startswith("error: trace.device='h1000': no sheet "), line
    assert "available: a100, cpu, h100, h200" in line
