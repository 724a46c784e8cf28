"""`stage=train train.microbatching=dynamic | padded | packed` on 4 local CPU ranks (pp2 dp2 or
pp1 tp2 dp2, tiny): variable-length samples, a plan per iteration, each plan's prediction beside
its measured time in the run summary, samples no plan can hold skipped and counted, and packed
rows whose samples stay independent (the padded run's losses)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import run_cli
from test_train_cli import _analytic_profiles, _losses

RUN = ["stage=train", "train.pp=2", "train.global_batch_size=16", "train.seq_len=128",
       "train.plot=false", "train.memory_interval_s=0.2", "train.timing_warmup_steps=1"]
# a layout whose dynamic plans pack samples into rows; a learning rate per step that does not
# depend on train.steps (warm-up, then flat), so runs of 6 and 2 steps compare step by step
RUN_TP = ["stage=train", "train.pp=1", "train.tp=2", *RUN[2:], "train.warmup_steps=2",
          "train.min_lr_ratio=1"]


def _summary(profiles, kind: str) -> dict:
    folder = Path(profiles) / "local" / "train" / "tiny"
    (path,) = folder.glob(f"*-{kind}.json")
    return json.loads(path.read_text())


def test_dynamic_trains_with_a_plan_per_step_and_baselines_see_the_same_samples(profiles):
    """At pp1 tp2 dp2 (padded lengths multiples of tp), where the dynamic plans pack short
    samples into rows: packed samples attend only to themselves, their positions from 0, so
    the padded baseline's losses are the dynamic run's, step by step."""
    _analytic_profiles(profiles)
    proc = run_cli(*RUN_TP, "train.microbatching=dynamic", "train.steps=6",
                   profiles_dir=profiles)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "dynamic micro-batching over 6 steps" in proc.stdout
    dynamic = _summary(profiles, "dynamic")
    # the table's predicted step is the plans' median, beside the measured one the error uses
    mb = dynamic["microbatching"]
    row = re.search(r"iteration, median of the planned steps\s*│\s*([\d.]+) ms\s*│\s*([\d.]+) ms",
                    proc.stdout)
    assert row and [float(x) for x in row.groups()] == [round(mb["predicted_ms"], 1),
                                                        round(mb["measured_ms"], 1)], proc.stdout
    losses = _losses(dynamic)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3, losses
    mb = dynamic["microbatching"]
    assert mb["kind"] == "dynamic" and mb["iterations"] == 6 and mb["skipped_samples"] == 0
    for step in mb["steps"]:
        assert step["kind"] == "dynamic" and step["mode"] == "normal"
        assert step["predicted_ms"] > 0 and step["measured_ms"] > 0 and step["planning_ms"] > 0
        assert len(step["micro_batches"]) == 2  # one list per dp rank
        for rank in step["micro_batches"]:
            # Every one of the rank's 8 samples runs once; a micro-batch may hold several.
            assert sum(size for size, _, _, _ in rank) == 8
            assert all(1 <= padded <= 128 for _, padded, _, _ in rank)
        # Lengths vary (lognormal): the padded tokens cannot all be the cap.
        assert step["real_tokens"] < 16 * 128
        assert step["padded_tokens"] >= step["real_tokens"]
    assert len({step["real_tokens"] for step in mb["steps"]}) > 1
    assert mb["predicted_ms"] > 0 and mb["error"] is not None

    # The padded baseline: the same samples (same real tokens per step), the layout's
    # micro-batches of one sequence padded to the longest of the step; every loss is the
    # same token mean over the same samples from the same weights (packed or not).
    # some micro-batch holds more samples than rows: packed
    assert any(0 < rows < size for step in mb["steps"] for rank in step["micro_batches"]
               for size, _, _, rows in rank), mb["steps"]
    proc = run_cli(*RUN_TP, "train.microbatching=padded", "train.steps=2",
                   profiles_dir=profiles)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    padded = _summary(profiles, "padded")
    steps = padded["microbatching"]["steps"]
    assert [s["real_tokens"] for s in steps] == [s["real_tokens"] for s in mb["steps"][:2]]
    for step in steps:
        longest = max(p for rank in step["micro_batches"] for _, p, _, _ in rank)
        assert all(size == 1 and p == longest for rank in step["micro_batches"]
                   for size, p, _, _ in rank)
        assert all(len(rank) == 8 for rank in step["micro_batches"])
    assert _losses(padded) == pytest.approx(losses[:2], rel=1e-5), (_losses(padded), losses)
    # The fixed-length run of the same layout keeps its own summary name.
    assert not list((Path(profiles) / "local" / "train" / "tiny").glob("*1f1b.json"))


def test_packed_rows_and_a_sample_over_the_budget_is_skipped_and_counted(profiles):
    _analytic_profiles(profiles)
    proc = run_cli(*RUN, "train.microbatching=packed", "train.steps=2", profiles_dir=profiles)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    steps = _summary(profiles, "packed")["microbatching"]["steps"]
    for step in steps:
        for rank in step["micro_batches"]:
            # Rows of train.seq_len tokens, several samples to a row.
            assert all(p == 128 and rows >= 1 for _, p, _, rows in rank)
            assert sum(rows for _, _, _, rows in rank) < 8
    # A budget that the longest samples cannot meet even alone with full recompute (the
    # analytic tiny profile and the engine's memory, reserve off: 9.82 MiB up to 104 tokens,
    # then 9.85 at 112, 9.96 at 120 and 10.07 at 128 on the first stage: the gradient norm's
    # and AdamW's temporaries after the backward set the floor; these steps' longest sample is
    # 115 tokens, the next 81).
    budget = ["train.memory_GiB=0.00963", "search.reserve_fraction=0", "search.reserve_GiB=0"]
    proc = run_cli(*RUN, "train.microbatching=dynamic", "train.steps=3", "force=true", *budget,
                   profiles_dir=profiles)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    mb = _summary(profiles, "dynamic")["microbatching"]
    skipped = [s for step in mb["steps"] for s in step["skipped"]]
    assert mb["skipped_samples"] == len(skipped) > 0
    kept = [p for step in mb["steps"] for rank in step["micro_batches"] for _, p, _, _ in rank]
    for rank, index, length, reason in skipped:
        assert "alone with full recompute > budget" in reason
        assert length > max(kept)  # only the long ones go
    for step in mb["steps"]:  # each step's real tokens leave the skipped samples out
        planned = sum(size * p for rank in step["micro_batches"] for size, p, _, _ in rank)
        assert step["real_tokens"] <= planned
    assert f"{mb['skipped_samples']} samples skipped" in " ".join(proc.stdout.split())
    # A budget no sample meets: nothing trains, and the run says so instead of a summary.
    proc = run_cli(*RUN, "train.microbatching=dynamic", "train.steps=2", "force=true",
                   "train.memory_GiB=0.005", *budget[1:], profiles_dir=profiles)
    assert proc.returncode != 0
    assert "fits train.memory_GiB=0.005" in " ".join((proc.stderr + proc.stdout).split())


def test_dynamic_trains_context_parallel_and_moe_with_expert_parallelism(profiles):
    """train.microbatching=dynamic with cp 2 over dp 2 (each micro-batch's sequences split over
    the CP pair, padded lengths multiples of 2 x cp) and tiny_moe with ep 2 over dp 4 (the dp
    ranks of an expert group run their micro-batches in lockstep) trains on 4 ranks, every
    sample once per step; under context parallelism the plans never pack (ring attention has
    no per-sample mask) and train.microbatching=packed is refused before launch. (Its losses
    against the fixed run's and a one-process reference: test_train_dynamic.py, on the same
    engine path.)"""
    _analytic_profiles(profiles)
    run_cli("stage=profile_model", "model=tiny_moe", "profile_model.source=analytic",
            "profile_model.plot=false", profiles_dir=profiles, check=0)
    cases = {"tiny": ["train.pp=1", "train.tp=1", "train.cp=2", "train.seq_len=128"],
             "tiny_moe": ["model=tiny_moe", "train.pp=1", "train.tp=1", "train.ep=2",
                          "train.seq_len=64"]}
    for model, layout in cases.items():
        proc = run_cli("stage=train", *layout, "train.global_batch_size=16", "train.plot=false",
                       "train.memory_interval_s=0.2", "train.timing_warmup_steps=1",
                       "train.microbatching=dynamic", "train.steps=2", profiles_dir=profiles)
        assert proc.returncode == 0, (model, proc.stderr + proc.stdout)
        (path,) = (Path(profiles) / "local" / "train" / model).glob("*-dynamic.json")
        summary = json.loads(path.read_text())
        losses = _losses(summary)
        assert len(losses) == 2 and all(0 < x < 10 for x in losses), (model, losses)
        steps = summary["microbatching"]["steps"]
        assert len(steps) == 2 and summary["microbatching"]["skipped_samples"] == 0
        for step in steps:
            sizes = [sum(size for size, _, _, _ in rank) for rank in step["micro_batches"]]
            assert sizes == [16 // len(sizes)] * len(sizes), (model, sizes)  # each sample once
            if model == "tiny":  # the CP pair cuts each sequence into 2 x cp chunks
                assert all(p % 4 == 0 for rank in step["micro_batches"] for _, p, _, _ in rank)
                assert all(rows == 0 for rank in step["micro_batches"]
                           for _, _, _, rows in rank)  # padded, never packed
            else:  # the expert groups (dp ranks 0, 1 and 2, 3) in lockstep
                counts = [len(rank) for rank in step["micro_batches"]]
                assert counts[0] == counts[1] and counts[2] == counts[3], counts
                full = [[mode == "full" for _, _, mode, _ in rank]
                        for rank in step["micro_batches"]]
                assert full[0] == full[1] and full[2] == full[3], full
        if model == "tiny_moe":
            aux = summary["moe"]["aux_loss"]  # the balance loss, over every micro-batch
            assert len(aux) == 2 and all(0 < v < 1 for v in aux.values()), aux
    proc = run_cli("stage=train", *cases["tiny"], "train.global_batch_size=16",
                   "train.microbatching=packed", "train.steps=2", profiles_dir=profiles)
    assert proc.returncode == 2, proc.stderr + proc.stdout
    assert "train.microbatching=packed needs cp=1, got cp=2" in proc.stderr, proc.stderr
