"""A tune whose every candidate fails has nothing to learn from: the calibration an earlier tune
fitted to the same profiles stays (it was written over with an uncalibrated one, runs 0, so the
next search silently priced as profiled)."""
from __future__ import annotations

import json

from conftest import run_cli

from orchestrator.store import file_sha256

TUNE = ["stage=tune", "search.max_tp=2", "tune.steps=3", "tune.timing_warmup_steps=1",
        "tune.plot=false"]


def test_a_tune_whose_every_candidate_fails_keeps_the_fitted_calibration(chain):
    folder = chain / "local"
    digest = {name: file_sha256(folder / name) for name in ("hardware.json", "model/tiny.json")}
    path = folder / "calibration" / "tiny.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({  # what an earlier, successful tune wrote (the fields read)
        "kind": "calibration", "model": "tiny", "runs": 4, "why_not": None, "candidates": [],
        "factors": {"compute": 0.5}, "inputs": {n: {"sha256": d} for n, d in digest.items()}}))
    before = path.read_text()
    proc = run_cli(*TUNE, "tune.top_k=1", "train.memory_GiB=0.0001", profiles_dir=chain,
                   check=3, timeout=300)
    assert "every candidate failed" in proc.stderr and "GiB" in proc.stderr
    assert "calibration fitted before is kept" in proc.stderr
    assert path.read_text() == before
