"""Profile files and the ledger: atomic writes, validation that names the fix, concurrent writers."""
from __future__ import annotations

import errno
import json
import multiprocessing as mp

import pytest

from conftest import fill_disk, tiny_disk
from orchestrator.errors import ProfileError
from orchestrator.store import new_profile, provenance, read_profile, write_json
from orchestrator.store.ledger import Ledger, LedgerEntry, LedgerError, State
from orchestrator.store.schema import HardwareProfile, Source

REBUILD = "python -m orchestrator stage=profile_hardware"


def _profile(hash_="abc"):
    return new_profile("hardware", "measured", provenance({}, hash_, job_id=None, hosts=["h"],
                                                          started=0.0),
                       cluster={"name": "c", "nodes": 1, "tasks_per_node": 2}, benchmarks={})


def test_write_is_atomic_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "hardware.json"
    write_json(path, _profile())
    with pytest.raises(TypeError):
        write_json(path, {"bad": object()})
    back = read_profile(path, HardwareProfile, REBUILD)
    assert (back.kind, back.source, back.cluster.world_size) == ("hardware", Source.measured, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["hardware.json"]  # no temp file left


def test_a_full_disk_names_the_file_keeps_the_old_one_and_the_ledger_can_still_end_a_run(
        tmp_path):
    with tiny_disk(tmp_path / "disk", "64k") as disk:
        ledger = Ledger(disk)
        ledger.launch("noop", [], queued=False, config_hash="h", launcher="local",
                      run_dir=str(disk))
        assert ledger.reserve.stat().st_size > 2 * ledger.path.stat().st_size
        write_json(disk / "hardware.json", _profile())
        fill_disk(disk)
        with pytest.raises(OSError) as full:
            write_json(disk / "hardware.json", _profile("x" * 100_000))
        assert (full.value.errno, full.value.filename) == (errno.ENOSPC,
                                                          str(disk / "hardware.json"))
        assert read_profile(disk / "hardware.json", HardwareProfile, REBUILD)  # intact
        assert not list(disk.glob(".*.tmp"))  # the temp file is gone
        with pytest.raises(OSError):  # an ordinary ledger write fails like any other...
            ledger.set_progress("noop", "step 1")
        ledger.mark_ended("noop", State.failed, message="disk full")  # ...an ending does not
        assert ledger.get("noop").state == State.failed


def test_missing_profile_names_file_and_command(tmp_path):
    with pytest.raises(ProfileError, match=r"hardware.json: missing. Run: python -m orchestrator"):
        read_profile(tmp_path / "hardware.json", HardwareProfile, REBUILD)


def test_corrupt_profile_names_file_and_command(tmp_path):
    path = tmp_path / "hardware.json"
    path.write_text('{"schema_version": 1, "kind": "hard')
    with pytest.raises(ProfileError, match=r"corrupt JSON.*Rerun: python -m orchestrator.*force=true"):
        read_profile(path, HardwareProfile, REBUILD)


def test_stale_profile_other_schema_or_config(tmp_path):
    path = tmp_path / "hardware.json"
    old = _profile()
    old["schema_version"] = 0
    write_json(path, old)
    with pytest.raises(ProfileError, match="stale"):
        read_profile(path, HardwareProfile, REBUILD)
    write_json(path, _profile("abc"))
    with pytest.raises(ProfileError, match="another config"):
        read_profile(path, HardwareProfile, REBUILD, expect_hash="def")
    back = read_profile(path, HardwareProfile, REBUILD, expect_hash="abc")
    assert back.provenance.config_hash == "abc"


def _hammer(folder, worker, n):
    ledger = Ledger(folder)
    for i in range(n):
        ledger.transition(f"stage/w{worker}_{i}", "running")
        ledger.transition(f"stage/w{worker}_{i}", "done")


def test_ledger_survives_concurrent_writers(tmp_path):
    procs = [mp.get_context("spawn").Process(target=_hammer, args=(tmp_path, w, 25))
             for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    entries = Ledger(tmp_path).entries()
    assert len(entries) == 100
    assert all(e.state == State.done for e in entries.values())
    json.loads((tmp_path / "ledger.json").read_text())  # still valid JSON


def test_ledger_is_done_needs_same_hash(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.start_subpart("profile_hardware/allreduce", "h1", str(tmp_path), job_id=None)
    ledger.transition("profile_hardware/allreduce", "done")
    assert ledger.is_done("profile_hardware/allreduce", "h1")
    assert not ledger.is_done("profile_hardware/allreduce", "h2")
    with pytest.raises(ValueError):
        ledger.transition("x", "weird")


def test_ledger_refuses_edges_that_would_undo_results(tmp_path):
    ledger = Ledger(tmp_path)
    with pytest.raises(LedgerError, match="None -> done"):
        ledger.transition("search/tiny", "done")  # nothing launched it
    with pytest.raises(LedgerError, match="None -> failed"):
        ledger.transition("search/tiny", "failed")
    ledger.transition("search/tiny", "running")
    ledger.transition("search/tiny", "done", summary={"path": "x"})
    with pytest.raises(LedgerError, match="done -> failed"):
        ledger.transition("search/tiny", "failed")
    assert ledger.get("search/tiny").state == State.done
    assert ledger.get("search/tiny").summary == {"path": "x"}
    # A conditional move that does not apply changes nothing and says so.
    assert not ledger.transition("search/tiny", "running", from_states=("pending",))
    assert ledger.get("search/tiny").state == State.done


def test_a_stage_a_ledger_rebuilt_mid_run_calls_cancelled_still_finishes(tmp_path):
    """The ledger lost while a profile run goes on: rebuilt from the file, which still lists
    parts, the stage is cancelled (not done); rank 0's `done` at the end still lands."""
    from orchestrator.pipeline import rebuild_entries

    write_json(tmp_path / "hardware.json", {**_profile(), "unfinished": ["p2p"]})
    (tmp_path / "ledger.json").write_text("[]")
    ledger = Ledger(tmp_path, rebuild=rebuild_entries)
    assert ledger.get("profile_hardware").state == State.cancelled
    ledger.transition("profile_hardware", "done", summary={"path": "hardware.json"})
    assert ledger.get("profile_hardware").state == State.done


def _train_plan(summary, config_hash):
    from orchestrator.choices import Ranks
    from orchestrator.stages import StagePlan

    return StagePlan(stage="train", key=f"train/tiny/{summary.stem}", former_key="train/tiny",
                     ranks=Ranks.cluster, world_size=4, outputs=(summary,),
                     config_hash=config_hash)


def _launched(ledger, key, config_hash, state):
    ledger.launch(key, [], queued=False, config_hash=config_hash, launcher="local", run_dir="r")
    ledger.transition(key, state)


def test_a_train_layout_takes_the_model_key_as_its_record_until_it_has_its_own(tmp_path):
    """Each train layout has its own ledger key; `train/<model>` (every layout's before, and
    stage=all's before search has written the layout) done under the same hash is done too,
    until the layout's own key has a record: that one decides then."""
    from orchestrator.pipeline import decide

    summary = tmp_path / "train" / "tiny" / "pp1-tp1-dp4-zero0-mbs1x2-1f1b.json"
    write_json(summary, {"kind": "train", "provenance": {"config_hash": "hA"}})
    plan, ledger = _train_plan(summary, "hA"), Ledger(tmp_path)
    assert not decide(plan, ledger).done
    _launched(ledger, "train/tiny", "hB", "done")  # another layout's, recorded before
    assert not decide(plan, ledger).done
    _launched(ledger, "train/tiny", "hA", "done")
    assert decide(plan, ledger).done
    _launched(ledger, plan.key, "hA", "failed")  # its own record now
    assert not decide(plan, ledger).done
    _launched(ledger, plan.key, "hA", "done")
    _launched(ledger, "train/tiny", "hB", "done")
    assert decide(plan, ledger).done


def test_a_rebuilt_ledger_keys_each_train_summary_as_its_run_does(tmp_path):
    from orchestrator.pipeline import rebuild_entries

    folder = tmp_path / "train" / "tiny"
    for stem in ("pp1-tp1-dp4-zero0-mbs1x2-1f1b", "pp2-tp1-dp2-zero0-mbs1x4-1f1b@pp=2",
                 "pp1-tp2-dp2-zero0-sp-mbs1x4-1f1b@tune"):
        write_json(folder / f"{stem}.json", {"kind": "train", "provenance": {"config_hash": "h"}})
    entries, _ = rebuild_entries(tmp_path)
    assert sorted(entries) == ["train/tiny/pp1-tp1-dp4-zero0-mbs1x2-1f1b",
                               "train/tiny/pp2-tp1-dp2-zero0-mbs1x4-1f1b@pp=2",
                               "train/tiny@tune=pp1-tp2-dp2-zero0-sp-mbs1x4-1f1b"]


def test_mark_ended_keeps_what_rank0_marked_done(tmp_path):
    """The launcher's failure report and rank 0's `done` race: done wins, unfinished parts fail."""
    ledger = Ledger(tmp_path)
    # an earlier launch that started p2p
    ledger.launch("profile_hardware", ["p2p"], queued=False, config_hash="h", launcher="local",
                  run_dir=str(tmp_path))
    ledger.start_subpart("profile_hardware/p2p", "h", str(tmp_path), job_id=None)
    ledger.mark_ended("profile_hardware", "failed", ["p2p"], "killed")
    assert ledger.get("profile_hardware/p2p").started is not None
    ledger.launch("profile_hardware", ["allreduce", "p2p"], queued=True, config_hash="h",
                  launcher="slurm", run_dir=str(tmp_path))
    ledger.start_subpart("profile_hardware/allreduce", "h", str(tmp_path), job_id="7")
    ledger.transition("profile_hardware/allreduce", "done")
    ledger.mark_ended("profile_hardware", "cancelled", ["allreduce", "p2p"], "scancel")
    entries = ledger.entries()
    assert entries["profile_hardware"].state == State.cancelled
    assert entries["profile_hardware"].error == "scancel"
    assert entries["profile_hardware/allreduce"].state == State.done
    assert entries["profile_hardware/p2p"].state == State.cancelled
    # p2p never started in the last launch: no start and no took (not the earlier run's)
    assert entries["profile_hardware/p2p"].started is None
    assert entries["profile_hardware/p2p"].took_s is None
    # Rank 0 finished the stage before the report arrived: the report changes nothing.
    ledger.launch("search/tiny", [], queued=False, config_hash="h", launcher="local",
                  run_dir=str(tmp_path))
    ledger.transition("search/tiny", "done")
    ledger.mark_ended("search/tiny", "failed", [], "lost")
    assert ledger.get("search/tiny").state == State.done
    assert ledger.get("search/tiny").error is None


def test_a_queued_jobs_time_counts_from_when_it_was_seen_running(tmp_path):
    """An afterok chain's last job waits in the queue for the others: its `took` is its run,
    not its wait (status showed a 0.05 s search as 74 s)."""
    import time

    ledger = Ledger(tmp_path)
    ledger.launch("search/tiny", [], queued=True, config_hash="h", launcher="slurm",
                  run_dir=str(tmp_path))
    time.sleep(0.2)  # queued
    ledger.transition("search/tiny", "running", from_states=("pending",))
    ledger.transition("search/tiny", "done")
    entry = Ledger(tmp_path).get("search/tiny")  # through the file
    assert entry.running_since - entry.started >= 0.2
    assert entry.took_s == entry.ended - entry.running_since < 0.2
    # A launch that runs at once (local) counts from its launch, as before.
    ledger.launch("search/tiny", [], queued=False, config_hash="h", launcher="local",
                  run_dir=str(tmp_path))
    ledger.transition("search/tiny", "done")
    entry = ledger.get("search/tiny")
    assert entry.running_since is None and entry.took_s == entry.ended - entry.started


def test_a_queued_jobs_rank_0_stamps_when_it_began_to_run(tmp_path):
    """A chained job that starts and ends between two of the CLI's polls (or with no CLI
    polling, wait=false) was never seen running: rank 0 marks its start itself."""
    import time
    from types import SimpleNamespace

    from orchestrator.runtime.stage_run import StageRun

    ledger = Ledger(tmp_path)
    ledger.launch("search/tiny", [], queued=True, config_hash="h", launcher="slurm",
                  run_dir=str(tmp_path))
    time.sleep(0.2)  # queued
    request = SimpleNamespace(ledger_dir=str(tmp_path), ledger_key="search/tiny", config=None,
                              plan=None, todo=[])
    StageRun(request, SimpleNamespace(is_root=True)).finish({"ok": 1})
    entry = Ledger(tmp_path).get("search/tiny")
    assert entry.state == State.done and entry.running_since - entry.started >= 0.2
    assert entry.took_s < 0.2
    # Other ranks do not touch the ledger.
    ledger.launch("search/tiny", [], queued=True, config_hash="h", launcher="slurm",
                  run_dir=str(tmp_path))
    StageRun(request, SimpleNamespace(is_root=False))
    assert ledger.get("search/tiny").state == State.pending


def test_ledger_entries_round_trip_through_the_file(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.launch("profile_model/tiny", ["seq128_tp1"], queued=True, config_hash="abc",
                  launcher="slurm", run_dir="/runs/1")
    ledger.attach_job("profile_model/tiny", ["seq128_tp1"], job_id="42", job_folder="/runs/1/s")
    raw = json.loads((tmp_path / "ledger.json").read_text())["entries"]
    assert raw["profile_model/tiny"]["state"] == "pending"
    assert raw["profile_model/tiny"]["todo"] == ["seq128_tp1"]
    again = Ledger(tmp_path).get("profile_model/tiny")
    assert isinstance(again, LedgerEntry)
    assert (again.job_id, again.job_folder, again.launcher) == ("42", "/runs/1/s", "slurm")
    assert Ledger(tmp_path).get("profile_model/tiny/seq128_tp1").job_id == "42"


def test_a_user_folder_keeps_every_file_that_is_not_ours_as_written(tmp_path):
    """store/user_folder: what the tool did not write, or what changed since, is renamed aside
    (never lost) before a write; our own unchanged files and identical ones are not copied."""
    from orchestrator.store.user_folder import MANIFEST, UserFolder

    theirs = tmp_path / "a.json"
    theirs.write_text("their own\n")  # another tool's file, in a folder we never wrote
    (tmp_path / "same.json").write_text('{\n "x": 1\n}\n')  # theirs, and what we write anyway
    with UserFolder(tmp_path) as folder:
        folder.write_json("a.json", {"x": 1})
        folder.write_json("same.json", {"x": 1})
        folder.write_json("b.json", {"y": 2})
    (kept,) = folder.kept
    assert (kept.path.name, kept.why) == ("a.json", "not written by the orchestrator")
    assert kept.copy.name.startswith("a.json.orig-") and kept.copy.read_text() == "their own\n"
    assert theirs.read_text() == '{\n "x": 1\n}\n'
    assert len(list(tmp_path.glob("*.orig-*"))) == 1

    (tmp_path / "b.json").write_text('{"y": 3}\n')  # hand-edited since we wrote it
    with UserFolder(tmp_path) as folder:  # a.json is ours as written: replaced, no copy
        folder.write_json("a.json", {"x": 2})
        folder.write_json("b.json", {"y": 2})
    (kept,) = folder.kept
    assert kept.describe().startswith("kept b.json (changed since the orchestrator wrote it) "
                                      "as b.json.orig-")
    assert kept.copy.read_text() == '{"y": 3}\n'
    assert len(list(tmp_path.glob("*.orig-*"))) == 2

    (tmp_path / MANIFEST).write_text("{broken")  # a record that does not read: nothing is ours
    with UserFolder(tmp_path) as folder:
        folder.write_json("a.json", {"x": 3})
    assert [k.why for k in folder.kept] == ["not written by the orchestrator"]
    assert len(list(tmp_path.glob("a.json.orig-*"))) == 2  # a second name, not over the first
