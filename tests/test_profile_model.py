"""`python -m orchestrator stage=profile_model` as a user runs it: real ranks, resume, analytic."""
from __future__ import annotations

import time

import pytest
import yaml

from conftest import ledger, run_cli
from orchestrator.config import CONF_DIR
from orchestrator.models.config import ModelConfig, count_block_params
from orchestrator.profiling.model.fit import fit_points, predict_poly
from orchestrator.store import read_profile
from orchestrator.store.schema import ModelProfile
from orchestrator.store.ledger import Ledger

# tiny with 4 KV heads, so tp=4 splits it: one group of 4, two groups of 2, four single ranks.
SMALL = ["stage=profile_model", "model.kv_heads=4", "profile_model.max_tp=4",
         "profile_model.seq_lens=[64,128,192]", "profile_model.iters=2",
         "profile_model.warmup_iters=1"]
POINTS = [f"seq{s}_tp{t}" for t in (1, 2, 4) for s in (64, 128, 192)]


def _profile(profiles, name="tiny"):
    return read_profile(profiles / "local" / "model" / f"{name}.json", ModelProfile,
                        f"python -m orchestrator stage=profile_model model={name}").to_dict()


def test_four_rank_run_writes_points_fits_memory_then_rerun_redoes_only_the_missing_point(profiles):
    run_cli(*SMALL, profiles_dir=profiles, check=0)
    prof = _profile(profiles)
    assert prof["source"] == "measured"
    # a CPU's host runs the kernels: host and device time are one, and the profile says so
    assert prof["method"]["host_device"].startswith("not told apart: on a CPU")
    assert not any("host_device" in p for p in prof["points"])
    assert sorted((p["seq_len"], p["tp"]) for p in prof["points"]) == \
        sorted((s, t) for t in (1, 2, 4) for s in (64, 128, 192))
    for p in prof["points"]:
        assert p["source"] == "measured"
        assert all(p[k] > 0 for k in ("block_fwd_us", "block_bwd_us", "other_fwd_us", "other_bwd_us"))
        assert p["groups"] == 4 // p["tp"]  # every rank ran, in TP groups of real size
        if p["tp"] > 1:
            assert p["block_fwd_comm_us"] > 0  # real collectives in the group
    assert set(prof["fits"]) == {"1", "2", "4"}
    assert prof["fits"] == fit_points(prof["points"])  # the fits of these very points
    for tp, f in prof["fits"].items():
        assert len(f["block_fwd_us"]) == 3 and len(f["other_fwd_us"]) == 2
        assert f["max_rel_err"] == max(abs(r) for rs in f["rel_residuals"].values() for r in rs)
        pts = sorted((p for p in prof["points"] if p["tp"] == int(tp)), key=lambda p: p["seq_len"])
        for key, rs in f["rel_residuals"].items():  # each residual is the fit's error at a point
            for p, r in zip(pts, rs):
                assert predict_poly(f[key], p["seq_len"]) == pytest.approx(p[key] * (1 + r))
    # a CPU at tp 1 times each recompute mode as train runs it; the fits price what they add
    # (2 iterations a loop, each loop its own, beside 3 other ranks on 2 cores: compared with
    # margins a busy stretch of one loop cannot close; tiny at 128: full 4.6 ms, selective
    # 3.3, forward 1.0; the fits are checked as these points' above)
    for p in (p for p in prof["points"] if p["tp"] == 1):
        assert p["block_full_us"] > p["block_fwd_us"]
        assert p["block_selective_us"] > p["block_fwd_us"]
    recompute = prof["fits"]["1"]["recompute_us"]
    assert all(predict_poly(recompute[mode], s) > 0 for mode in ("full", "selective")
               for s in (64, 192))
    assert "recompute_us" not in prof["fits"]["2"]  # TP: the FLOPs price it
    cfg = ModelConfig(kv_heads=4)
    n, norms = count_block_params(cfg), 2 * cfg.hidden
    for tp in (1, 2, 4):
        block = prof["memory"][str(tp)]["block"]
        assert block["param_bytes"] == 4 * ((n - norms) // tp + norms)  # fp32, norms replicated
        act = block["act_bytes_per_token"]
        assert act["none"] > act["selective"] > act["full"] > 0
    assert (profiles / "local" / "model" / "tiny.png").stat().st_size > 10_000
    entries = ledger(profiles)
    assert all(entries[f"profile_model/tiny/{p}"]["state"] == "done" for p in POINTS)

    # A crash lost one point: the rerun runs it alone and keeps the others.
    crashed = Ledger(profiles / "local")
    crashed.transition("profile_model/tiny/seq128_tp2", "running")
    crashed.transition("profile_model/tiny/seq128_tp2", "failed", error="killed")
    before = {p: entries[f"profile_model/tiny/{p}"]["ended"] for p in POINTS}
    time.sleep(0.01)
    out = run_cli(*SMALL, profiles_dir=profiles, check=0).stdout
    assert "1 part(s)" in out and "(seq128_tp2)" in out
    after = ledger(profiles)
    for p in POINTS:
        changed = after[f"profile_model/tiny/{p}"]["ended"] != before[p]
        assert changed == (p == "seq128_tp2"), p
    assert len(_profile(profiles)["points"]) == 9


def test_qwen_100b_from_a_laptop_is_fast_analytic_and_exact_in_memory(profiles):
    # How fast is bench/profile_model_speed.py's figure (a wall-clock bound fails on a loaded
    # machine: 126 s beside two CPU hogs and a gloo job, 60 s asked).
    proc = run_cli("stage=profile_model", "model=qwen_100b", profiles_dir=profiles, check=0)
    assert "analytic" in proc.stdout
    # run in the CLI's process: each point's line once, not again through Hydra's log handler
    assert "[INFO]" not in proc.stdout and proc.stdout.count("seq 131072 tp 1:") == 1
    prof = _profile(profiles, "qwen_100b")
    assert prof["source"] == "analytic"
    assert all(p["source"] == "analytic" for p in prof["points"])
    assert all(f["source"] == "analytic" for f in prof["fits"].values())
    assert max(p["seq_len"] for p in prof["points"]) == 131072
    cfg = ModelConfig(**yaml.safe_load(open(CONF_DIR / "model" / "qwen_100b.yaml")))
    n = count_block_params(cfg)
    mem1 = prof["memory"]["1"]
    assert mem1["block"]["param_bytes"] == 2 * n  # bf16, exact
    assert mem1["block"]["optim_bytes"] == 12 * n
    assert mem1["other"]["param_bytes"] == 2 * (2 * cfg.vocab * cfg.hidden + cfg.hidden)
    norms = 2 * cfg.hidden
    assert prof["memory"]["8"]["block"]["param_bytes"] == 2 * ((n - norms) // 8 + norms)
    # full recompute keeps the layer input: 2 bytes x hidden per token, sharded over tp
    assert prof["memory"]["8"]["block"]["act_bytes_per_token"]["full"] == 2 * cfg.hidden / 8
    # A rerun under another micro-batch size redoes the points and says which size it timed
    assert prof["micro_batch_size"] == 1
    run_cli("stage=profile_model", "model=qwen_100b", "profile_model.micro_batch_size=2",
            profiles_dir=profiles, check=0)
    assert _profile(profiles, "qwen_100b")["micro_batch_size"] == 2


def test_invalid_tp_for_the_model_is_exit_2_before_launch(profiles):
    proc = run_cli("stage=profile_model", "profile_model.max_tp=4", profiles_dir=profiles)
    assert proc.returncode == 2
    assert "model.kv_heads(2) is not divisible by tp(4)" in proc.stderr
    assert not (profiles / "local" / "model").exists()

