"""`stage=train` as a user runs it, on 4 local CPU ranks (mpiexec, gloo): refusals before
launch, resume after a killed rank, a checkpoint reloaded by another layout, a text corpus, and
a PP/TP sweep with its predicted-vs-measured table."""
from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from conftest import ledger, one_error_line, run_cli, start_cli

SHORT = ["train.seq_len=64", "train.plot=false", "train.memory_interval_s=0.2"]


def _summaries(profiles, model="tiny"):
    folder = Path(profiles) / "local" / "train" / model
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def _losses(summary):
    return [summary["losses"][k] for k in sorted(summary["losses"], key=int)]


def _analytic_profiles(profiles):
    """Hardware and model profiles of this machine in seconds (no measuring)."""
    run_cli("stage=profile_hardware", "profile_hardware.source=analytic", profiles_dir=profiles,
            check=0)
    run_cli("stage=profile_model", "profile_model.source=analytic", "profile_model.plot=false",
            profiles_dir=profiles, check=0)


def test_without_a_strategy_names_the_command_that_writes_one(profiles):
    proc = run_cli("stage=train", profiles_dir=profiles)
    assert proc.returncode == 4, proc.stderr
    assert "python -m orchestrator stage=search" in proc.stderr
    assert "train.pp" in proc.stderr  # or give a layout


def test_a_garbled_layout_file_is_one_line_exit_2_before_launch(profiles, tmp_path):
    own = tmp_path / "mine.layout.json"  # the user's input, as train.load is: exit 2
    own.write_text('{"seq_len": 64, "layout": {"pp": 1,}}')
    line = one_error_line(run_cli("stage=train", f"train.layout={own}", profiles_dir=profiles),
                          2)
    assert line == (f"error: train.layout={own}: not JSON: Expecting property name enclosed in "
                    f"double quotes at line 1, column 36; fix that file (the form of "
                    f"{profiles / 'local' / 'strategy' / 'tiny.layout.json'}: "
                    f"docs/stages/train.md) or leave train.layout unset")
    assert not (profiles / "local" / "runs").exists()  # nothing launched


def test_a_layout_that_does_not_divide_is_one_line_before_launch(profiles):
    proc = run_cli("stage=train", "train.pp=3", profiles_dir=profiles)
    assert proc.returncode == 2, proc.stderr
    assert "train.pp(3) * train.tp(1) = 3 does not divide the 4 ranks" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert not (profiles / "local" / "runs").exists()  # nothing launched
    proc = run_cli("stage=train", "train.tp=4", "model.kv_heads=2", profiles_dir=profiles)
    assert proc.returncode == 2 and "tp(4) does not divide model.kv_heads(2)" in proc.stderr
    # more stages (or model chunks) than layers, in the keys the user gave
    for args, words in ((["train.pp=4", "model.layers=2"],
                         "train: train.pp(4) > the 2 layers of model=tiny: each stage holds a "
                         "layer at least"),
                        (["train.pp=2", "train.schedule=interleaved", "train.virtual_stages=3"],
                         "train.pp(2) x virtual_stages(3) = 6 chunks > the 4 layers")):
        line = one_error_line(run_cli("stage=train", *args, profiles_dir=profiles), 2)
        assert words in line, line


def test_a_layout_file_of_another_layer_count_says_so(profiles, tmp_path):
    from orchestrator.layout import ParallelLayout

    own = tmp_path / "mine.layout.json"
    own.write_text(json.dumps({"seq_len": 64,
                               "layout": ParallelLayout.uniform(4, 1, 1, 4).to_dict()}))
    line = one_error_line(run_cli("stage=train", f"train.layout={own}", "model.layers=8",
                                  profiles_dir=profiles), 2)
    assert line == (f"error: train: {own} is a layout of 4 layers; model=tiny has 8: give "
                    f"train.layout a layout of this model, or give train.pp/train.tp"), line


def test_a_load_path_without_a_checkpoint_is_one_line_before_launch(profiles, tmp_path):
    damaged = tmp_path / "damaged.ckpt"
    (damaged / "step_00000003").mkdir(parents=True)  # a save that did not finish
    explain = "a checkpoint is a folder step_<8 digits>/ holding complete.json"
    for load, words in [("/etc", ["train.load=/etc: no checkpoint in it", explain]),
                        (tmp_path / "nowhere", [f"train.load={tmp_path}/nowhere: does not "
                                                f"exist", explain]),
                        (damaged, ["step_00000003", "complete.json missing", explain]),
                        (damaged / "step_00000003", ["complete.json missing", explain])]:
        proc = run_cli("stage=train", "train.pp=1", "train.tp=1", f"train.load={load}", *SHORT,
                       profiles_dir=profiles)
        line = one_error_line(proc, 2)
        for word in words:
            assert word in line, line
    assert not (profiles / "local" / "runs").exists()  # nothing launched


def test_a_length_mean_beyond_seq_len_is_refused_before_launch(profiles):
    """Every sample is capped at seq_len: a mean above it would silently train the fixed run."""
    for mean, words in ((100000, "must be in (0, seq_len(256)]"), (0, "must be >= 1"),
                        (-5, "must be >= 1")):  # the last two: the value rules' own range
        proc = run_cli("stage=train", "train.microbatching=dynamic",
                       f"train.length_mean={mean}", profiles_dir=profiles)
        line = one_error_line(proc, 2)
        assert f"train.length_mean({mean}) {words}" in line, line
    proc = run_cli("stage=train", "train.pp=1", "train.tp=1", "train.microbatching=dynamic",
                   "train.length_mean=65", *SHORT, profiles_dir=profiles)
    line = one_error_line(proc, 2)
    assert "train.length_mean(65) must be in (0, seq_len(64)]" in line, line
    # a length beyond the model's context: the two overrides that fix it
    proc = run_cli("stage=train", "train.pp=1", "train.tp=1", "train.seq_len=512",
                   profiles_dir=profiles)
    line = one_error_line(proc, 2)
    assert ("train.seq_len(512) > model.seq_len(256), the model's context: set "
            "model.seq_len=512, or train.seq_len=<n> up to 256") in line, line
    assert not (profiles / "local" / "runs").exists()  # nothing launched


def test_a_layout_that_does_not_fit_is_refused_with_the_estimate(profiles):
    _analytic_profiles(profiles)
    proc = run_cli("stage=train", "train.pp=1", "train.tp=1", "train.memory_GiB=0.01",
                   profiles_dir=profiles)
    assert proc.returncode == 3, proc.stderr
    assert "GiB per device by the planner's estimate" in proc.stderr
    assert "budget 0.01 GiB" in proc.stderr and "train.allow_oom_risk=true" in proc.stderr
    assert not list((profiles / "local" / "runs").glob("*_train"))  # nothing launched


def _rank_pids(profiles) -> list:
    """Local rank processes of a launch into `profiles` (their request lives under it)."""
    out = subprocess.run(["pgrep", "-f", f"orchestrator.runtime.*{profiles}"],
                         capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_kill_one_rank_then_rerun_resumes_the_same_loss_trajectory(tmp_path):
    args = ["stage=train", "train.pp=2", "train.tp=1", "train.steps=40",
            "train.checkpoint_every=2", *SHORT]
    reference = tmp_path / "reference"
    run_cli(*args, profiles_dir=reference, check=0)
    (want,) = _summaries(reference).values()
    # 4 CPU ranks on a host of fewer cores (CI's 2): the run says its times are noisy
    shared = [n for n in want["notes"] if "ranks share this host's" in n]
    assert len(shared) == (4 > len(os.sched_getaffinity(0))), want["notes"]

    killed = tmp_path / "killed"
    cli = start_cli(*args, profiles_dir=killed)
    key = "train/tiny/pp2-tp1-dp2-zero0-mbs1x4-1f1b"  # the layout's own ledger key
    ckpt = killed / "local" / "train" / "tiny" / "pp2-tp1-dp2-zero0-mbs1x4-1f1b.ckpt"
    deadline = time.time() + 120
    while not (ckpt / "step_00000004").exists() and time.time() < deadline:
        time.sleep(0.2)
    assert (ckpt / "step_00000004").exists(), cli.stdout.read() if cli.poll() is not None else ""
    pids = _rank_pids(killed)
    assert pids, "no rank processes found"
    # Frozen while the test looks: a loaded machine's `stage=status` can take as long as the
    # 36 steps left, and a run that finished cannot be killed half-way.
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        status = run_cli("stage=status", profiles_dir=killed, check=0)
        assert "step " in status.stdout  # the ledger tells how far the run is
        assert ledger(killed)[key]["state"] == "running"
        os.kill(pids[-1], signal.SIGKILL)
    finally:
        for pid in pids:
            if pid != pids[-1]:
                # mpiexec may already have ended the others after the kill: nothing to wake
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    out, _ = cli.communicate(timeout=120)
    assert cli.returncode == 5, out
    # the killed rank is named, not rank 0 that saw its socket close (gloo) and aborted
    assert re.search(r"rank \d was killed by signal 9 \(SIGKILL", out), out
    assert ledger(killed)[key]["state"] == "failed"

    proc = run_cli(*args, profiles_dir=killed, check=0)
    assert "resumed from" in proc.stdout
    (got,) = _summaries(killed).values()
    assert any("resumed from" in note for note in got["notes"])
    assert len(_losses(got)) == 40
    for step, (a, b) in enumerate(zip(_losses(want), _losses(got)), start=1):
        assert abs(a - b) <= 1e-6 * abs(a), f"step {step}: {b} != {a}"


def test_a_checkpoint_reloads_in_another_layout(profiles):
    common = ["train.steps=6", "train.checkpoint_every=3", *SHORT]
    run_cli("stage=train", "train.pp=1", "train.tp=1", *common, profiles_dir=profiles, check=0)
    dp4 = profiles / "local" / "train" / "tiny" / "pp1-tp1-dp4-zero0-mbs1x2-1f1b"
    # Another model's load is refused before launch (the ranks would refuse it after).
    runs = set((profiles / "local" / "runs").iterdir())
    proc = run_cli("stage=train", "model=tiny_moe", "train.pp=1", "train.tp=1", *common,
                   f"train.load={dp4}.ckpt", profiles_dir=profiles)
    line = one_error_line(proc, 2)
    for words in (f"checkpoint {dp4}.ckpt/step_00000006 is of another model (model tiny, "
                  f"model.experts=0", "here model tiny_moe, experts=8", "keys missing",
                  "(model.blocks.1.mlp.router.weight, model.blocks.1.mlp.experts.w_gate, ",
                  "a checkpoint of tiny_moe",
                  "(model=tiny)"):
        assert words in line, line
    assert set((profiles / "local" / "runs").iterdir()) == runs  # nothing launched
    assert not [k for k in ledger(profiles) if k.startswith("train/tiny_moe")]
    proc = run_cli("stage=train", "train.pp=2", "train.tp=2", *common,
                   f"train.load={dp4}.ckpt/step_00000003", profiles_dir=profiles, check=0)
    assert "loaded" in proc.stdout
    want = json.loads(dp4.with_suffix(".json").read_text())["losses"]
    got = json.loads((dp4.parent / "pp2-tp2-dp1-zero0-sp-mbs1x8-1f1b.json").read_text())["losses"]
    assert sorted(got, key=int) == [str(s) for s in range(1, 7)]  # 1-3 from the checkpoint
    for step in ("4", "5", "6"):  # trained by pp2*tp2 from dp4's state
        assert abs(got[step] - want[step]) <= 1e-4 * abs(want[step]), step
    # The same layout for longer: it goes on from its step 6, and says on whose schedule; the
    # 6-step result (another config) is kept beside the new one, not overwritten.
    proc = run_cli("stage=train", "train.pp=1", "train.tp=1", "train.steps=7",
                   "train.checkpoint_every=3", *SHORT, profiles_dir=profiles, check=0)
    assert (f"resumed from {dp4}.ckpt/step_00000006 (step 6, of a 6-step run: on to step 7 on "
            f"this run's learning-rate schedule)") in " ".join(proc.stdout.split()), proc.stdout
    (kept,) = dp4.parent.glob(f"{dp4.name}.json.old-*")
    assert json.loads(kept.read_text())["losses"] == want
    assert sorted(json.loads(dp4.with_suffix(".json").read_text())["losses"], key=int) == [
        str(s) for s in range(1, 8)]


def test_layouts_a_b_a_keep_a_done_each_under_its_own_ledger_key(profiles):
    """Before: one ledger entry `train/<model>` held the last layout's hash, so A, then B, then A
    again trained A from step 0 and moved its finished checkpoints aside. Each layout has its
    own record now: the third run says A is done and launches nothing."""
    common = ["stage=train", "cluster.tasks_per_node=2", "train.steps=2",
              "train.timing_warmup_steps=1", *SHORT]
    a, b = ["train.pp=1", "train.tp=1"], ["train.pp=2", "train.tp=1"]
    a_tag, b_tag = "pp1-tp1-dp2-zero0-mbs1x4-1f1b", "pp2-tp1-dp1-zero0-mbs1x8-1f1b"
    run_cli(*common, *a, profiles_dir=profiles, check=0)
    run_cli(*common, *b, profiles_dir=profiles, check=0)
    folder = profiles / "local" / "train" / "tiny"
    first = (folder / f"{a_tag}.json").read_text()
    runs = set((profiles / "local" / "runs").iterdir())
    again = run_cli(*common, *a, profiles_dir=profiles, check=0)
    assert f"train/tiny/{a_tag}: done" in again.stdout, again.stdout
    assert "moved to" not in again.stdout and "training from step 0" not in again.stdout
    assert set((profiles / "local" / "runs").iterdir()) == runs  # nothing launched
    assert (folder / f"{a_tag}.json").read_text() == first
    assert (folder / f"{a_tag}.ckpt" / "step_00000002" / "complete.json").exists()
    assert not list(folder.glob("*.ckpt.old-*"))
    entries = ledger(profiles)
    assert {k: entries[k]["state"] for k in entries if k.startswith("train/")} == {
        f"train/tiny/{a_tag}": "done", f"train/tiny/{b_tag}": "done"}
    status = run_cli("stage=status", profiles_dir=profiles, check=0).stdout
    assert a_tag in status and b_tag in status


def test_stage_all_whose_search_changes_the_layout_records_the_layout_it_trained(profiles):
    """stage=all plans train before search runs: when search then writes another layout, the
    ranks train that one, so the run is recorded as `train/<model>` rather than under the key
    of the layout planned (the old one's). Before, the same command run again found the new
    layout with no record, trained it from step 0 and moved its checkpoints aside."""
    common = ["stage=all", "cluster.tasks_per_node=2", "profile_hardware.source=analytic",
              "profile_model.source=analytic", "profile_model.plot=false", "train.steps=2",
              "train.timing_warmup_steps=1", *SHORT]
    run_cli(*common, "search.pp=1", profiles_dir=profiles, check=0)
    changed = run_cli(*common, "search.pp=2", profiles_dir=profiles, check=0)
    assert "✓ train/tiny: done -> " in changed.stdout, changed.stdout
    runs = set((profiles / "local" / "runs").iterdir())
    again = run_cli(*common, "search.pp=2", profiles_dir=profiles, check=0)
    assert re.search(r"✓ train/tiny/pp2-\S+: done \(config", again.stdout), again.stdout
    assert "moved to" not in again.stdout
    assert set((profiles / "local" / "runs").iterdir()) == runs  # nothing launched


def test_a_text_corpus_trains_and_its_loss_falls(profiles):
    corpus = os.path.dirname(os.__file__)  # the standard library's own sources
    proc = run_cli("stage=train", "train.pp=1", "train.tp=1", f"train.data={corpus}",
                   "train.steps=20", "train.lr=3e-3", *SHORT, profiles_dir=profiles, check=0)
    (summary,) = _summaries(profiles).values()
    assert summary["data"].startswith("text:"), summary["data"]
    assert summary["last_loss"] < summary["first_loss"] - 1.0, proc.stdout
    bad = run_cli("stage=train", "train.pp=1", "train.data=/no/such/corpus", profiles_dir=profiles)
    assert bad.returncode == 2 and "/no/such/corpus" in bad.stderr


def test_a_pp_tp_sweep_skips_what_cannot_run_and_compares(profiles):
    _analytic_profiles(profiles)
    proc = run_cli("-m", "stage=train", "train.pp=1,4", "train.tp=1,2", "train.steps=3",
                   "train.allow_oom_risk=true", "train.memory_GiB=0.01", *SHORT,
                   profiles_dir=profiles, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pp(4) * train.tp(2) = 8 does not divide" in proc.stdout + proc.stderr
    names = set(_summaries(profiles))
    assert names == {"pp1-tp1-dp4-zero0-mbs1x2-1f1b@pp=1,tp=1.json",
                     "pp1-tp2-dp2-zero0-sp-mbs1x4-1f1b@pp=1,tp=2.json",
                     "pp4-tp1-dp1-zero0-mbs1x8-1f1b@pp=4,tp=1.json"}, names
    (table,) = (profiles / "local" / "multirun").glob("*/sweep.csv")
    rows = list(csv.DictReader(table.open()))
    assert [r["state"] for r in rows].count("skipped") == 1
    for row in rows:
        if row["state"] != "skipped":
            assert float(row["measured ms"]) > 0 and float(row["iteration ms"]) > 0
            assert row["error %"] and float(row["tokens/s"]) > 0
    status = run_cli("stage=status", profiles_dir=profiles, check=0)
    assert "predicted vs measured" in status.stdout


def test_a_train_seq_len_tp_cannot_split_names_train_seq_len(tmp_path):
    """Before: `train.seq_len=63 train.tp=2` was refused as `model.seq_len(63)`, a key the
    command never set (trace's twin was fixed with validate_model's seq_len_key)."""
    from conftest import one_error_line, run_cli

    line = one_error_line(run_cli("stage=train", "train.pp=1", "train.tp=2", "train.seq_len=63",
                                  profiles_dir=tmp_path / "p"), 2)
    assert line == ("error: train: train.seq_len(63) is not divisible by tp(2); needed for "
                    "sequence parallelism"), line
    line = one_error_line(run_cli("stage=train", "train.pp=1", "train.tp=2", "model.seq_len=63",
                                  profiles_dir=tmp_path / "p"), 2)
    assert "model.seq_len(63) is not divisible by tp(2)" in line, line
