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
    moe = run_cli("stage=trace", "trace.world_size=16", "trace.pp=2", "trace.tp=2",
                  "+model.num_experts=8", profiles_dir=profiles)
    assert moe.returncode != 0 and "mixture-of-experts" in moe.stdout + moe.stderr
