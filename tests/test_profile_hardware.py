"""profile_hardware through the CLI: real ranks, a killed rank, analytic profiles, Galvatron export."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import fill_disk, ledger, run_cli, start_cli, tiny_disk
from orchestrator.commands import rerun_command
from orchestrator.errors import ProfileError
from orchestrator.profiling.hardware.fit import fit_points, predict_fit_time_us
from orchestrator.interop.galvatron.hardware import import_hardware
from orchestrator.profiling.measure import busbw_factor
from orchestrator.store import read_profile
from orchestrator.store.schema import HardwareProfile

# Small sweeps: the point is the path and the bookkeeping, not the figures.
QUICK = ["profile_hardware.max_size_bytes=1048576", "profile_hardware.max_time_s=0.1",
         "profile_hardware.size_step=8"]


def _hardware(profiles, cluster="local"):
    return json.loads((profiles / cluster / "hardware.json").read_text())


def test_full_profile_on_4_local_ranks(profiles):
    proc = run_cli("stage=profile_hardware", *QUICK, profiles_dir=profiles, check=0, timeout=600)
    assert "alpha-beta fits" in proc.stdout  # the table at the end
    assert re.search(r"overlap ━+ 1/1", proc.stdout), proc.stdout  # its bar ends done
    hw = _hardware(profiles)
    assert set(hw["benchmarks"]) == {"allreduce", "p2p", "reduce_scatter", "all_gather",
                                     "all2all", "overlap"}
    shapes = set()
    for name, section in hw["benchmarks"].items():
        if name == "overlap":
            continue
        assert section["points"] and section["fits"]
        for p in section["points"]:
            assert p["time_us_p10"] <= p["time_us_median"] <= p["time_us_p90"]
            assert p["busbw_GBps"] == pytest.approx(p["algbw_GBps"] * busbw_factor(p["op"], p["group_size"]))
            shapes.add((p["op"], p["group_size"], p["layout"]))
        for f in section["fits"]:
            assert f["alpha_us"] >= 0 and f["algbw_GBps"] > 0
        assert section["fits"] == fit_points(section["points"])
    # Both rank layouts for allreduce groups of 2, one group of 4, p2p for pp = 2 and 4.
    assert {("allreduce", 2, "consec"), ("allreduce", 2, "strided"), ("allreduce", 4, "consec"),
            ("p2p", 2, "intra"), ("p2p", 4, "intra"), ("all2all", 4, "consec")} <= shapes
    overlap = hw["benchmarks"]["overlap"]
    assert overlap["overlap_coe"] == max(1.0, overlap["compute_slowdown"], overlap["comm_slowdown"])
    assert (profiles / "local" / "hardware.png").stat().st_size > 10_000
    entries = ledger(profiles)
    assert all(entries[f"profile_hardware/{b}"]["state"] == "done" for b in
               ("inventory", "allreduce", "p2p", "reduce_scatter", "all_gather", "all2all", "overlap"))


def _rank_pids(run_marker: str):
    # The ranks themselves, not mpiexec (whose command line names the runtime too).
    out = subprocess.run(["pgrep", "-f", f"^{sys.executable} -m orchestrator.runtime .*{run_marker}"],
                         capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_killed_rank_in_all2all_then_rerun_resumes(profiles):
    args = ["stage=profile_hardware", "profile_hardware.benchmarks=[inventory,allreduce,all2all,overlap]",
            "profile_hardware.max_size_bytes=16777216", "profile_hardware.max_time_s=0.1",
            "profile_hardware.min_size_bytes=65536"]
    # An analytic profile is there: the measured run keeps it aside, not written over
    run_cli("stage=profile_hardware", "profile_hardware.source=analytic", profiles_dir=profiles)
    proc = start_cli(*args, profiles_dir=profiles)
    try:
        deadline = time.monotonic() + 300
        while ledger(profiles).get("profile_hardware/all2all", {}).get("state") != "running":
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        pids = _rank_pids(str(profiles))
        assert len(pids) == 4
        os.kill(pids[-1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 5, out
    assert "rerun the same command to resume" in out
    entries = ledger(profiles)
    assert entries["profile_hardware/inventory"]["state"] == "done"
    assert entries["profile_hardware/allreduce"]["state"] == "done"
    assert entries["profile_hardware/all2all"]["state"] == "failed"
    assert entries["profile_hardware/overlap"]["state"] == "failed"
    assert entries["profile_hardware"]["state"] == "failed"
    log_dir = entries["profile_hardware"]["log_path"]  # the run folder, with every rank's log
    assert sorted(p.name for p in Path(log_dir).glob("rank*.log")) == [f"rank{r}.log" for r in range(4)]
    hw = _hardware(profiles)  # valid, with what finished before the kill
    assert set(hw["benchmarks"]) == {"allreduce"} and len(hw["inventory"]["ranks"]) == 4
    allreduce_before = hw["benchmarks"]["allreduce"]
    (kept,) = (profiles / "local").glob("hardware.json.old-*")
    assert json.loads(kept.read_text())["source"] == "analytic"
    assert kept.with_name(kept.name.replace(".json", ".png", 1)).exists()  # its plot with it
    rank0_log = (Path(log_dir) / "rank0.log").read_text()  # mpiexec's output of an aborted job
    assert f"is of another source or shape: kept as {kept.name}" in rank0_log  # may be cut
    # The file says it is not whole: a reader refuses it, naming what to run
    assert hw["unfinished"] == ["all2all", "overlap"]
    with pytest.raises(ProfileError, match=r"unfinished: 2 part\(s\) still to make \(all2all, "
                                           r"overlap\).*Finish it: python -m orchestrator "
                                           r"stage=profile_hardware"):
        read_profile(profiles / "local" / "hardware.json", HardwareProfile,
                     rerun_command("profile_hardware"))
    # A ledger rebuilt from the files (this one lost) takes the file's word: not done
    (profiles / "local" / "ledger.json").write_text("[]")
    run_cli("stage=status", profiles_dir=profiles)
    rebuilt = ledger(profiles)
    assert rebuilt["profile_hardware"]["state"] == "cancelled"
    assert "profile_hardware/allreduce" in rebuilt and "profile_hardware/all2all" not in rebuilt

    proc = run_cli(*args, profiles_dir=profiles, check=0, timeout=600)
    assert "skipping: inventory, allreduce" in proc.stdout
    assert "(all2all, overlap)" in proc.stdout
    hw = _hardware(profiles)
    assert set(hw["benchmarks"]) == {"allreduce", "all2all", "overlap"}
    assert hw["benchmarks"]["allreduce"] == allreduce_before  # not measured again
    assert "unfinished" not in hw
    # A part a stopped run left that this command no longer plans: the next run clears it
    hw["unfinished"] = ["all_gather"]
    (profiles / "local" / "hardware.json").write_text(json.dumps(hw))
    proc = run_cli(*args, profiles_dir=profiles, check=0)
    assert "the file still lists all_gather as unfinished; finishing it" in proc.stdout
    assert "unfinished" not in _hardware(profiles)
    assert "finishing" not in run_cli(*args, profiles_dir=profiles, check=0).stdout
    # An analytic profile written whole over the measured one keeps the measured one aside too
    run_cli("stage=profile_hardware", "profile_hardware.source=analytic", profiles_dir=profiles)
    sources = {json.loads(p.read_text())["source"]
               for p in (profiles / "local").glob("hardware.json.old-*")}
    assert sources == {"analytic", "measured"} and _hardware(profiles)["source"] == "analytic"
    assert all(ledger(profiles)[f"profile_hardware/{b}"]["state"] == "done"
               for b in ("inventory", "allreduce", "all2all", "overlap"))


def _error_line(output: str) -> str:
    """The CLI's own error line: the last line of its output (ranks print theirs before it)."""
    line = output.strip().splitlines()[-1]
    assert line.startswith("error: "), output
    return line


# Sized so that the ledger, run folder and hardware.json fit, and hardware.png (~50 KiB measured,
# ~200 KiB analytic) does not.
@pytest.mark.parametrize("size, args", [
    ("96k", ["profile_hardware.benchmarks=[inventory,allreduce]",
             "profile_hardware.max_size_bytes=65536", "profile_hardware.max_time_s=0.05"]),
    ("160k", ["profile_hardware.source=analytic"]),  # in the CLI's process, not on ranks
], ids=["measured", "analytic"])
def test_a_full_disk_names_the_file_and_the_room_needed_and_marks_the_ledger(tmp_path, size,
                                                                             args):
    with tiny_disk(tmp_path / "disk", size) as disk:
        proc = run_cli("stage=profile_hardware", *args, profiles_dir=disk)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        line = _error_line(proc.stderr)
        assert f"{disk}/local/hardware.png: No space left on device" in line, line
        need = re.search(r"free there, profile_hardware writes about (\d+) KiB\)", line)
        assert need and 20 <= int(need.group(1)) <= 2000, line  # the right order of magnitude
        assert f"Make room in the profiles folder {disk}" in line, line
        entries = ledger(disk)  # readable, and it says how the run ended
        assert entries["profile_hardware"]["state"] == "failed", entries["profile_hardware"]
        assert "hardware.png" in entries["profile_hardware"]["error"]
        parts = [k for k in entries if k.startswith("profile_hardware/")]
        assert parts and all(entries[k]["state"] == "done" for k in parts), entries
        profile = read_profile(disk / "local" / "hardware.json", HardwareProfile, "rebuild")
        assert profile.benchmarks.allreduce.points  # complete before the PNG, and intact
        assert not list(disk.rglob("*.tmp")), list(disk.rglob("*"))


def test_a_disk_filled_during_a_run_still_ends_its_ledger_entry(tmp_path):
    """The ledger lives on the full disk too: its reserve makes room to record the failure."""
    with tiny_disk(tmp_path / "disk", "200k") as disk:
        proc = start_cli("stage=noop", "noop.sleep_s=3", profiles_dir=disk)
        try:
            deadline = time.monotonic() + 120
            # Running, with its job recorded: the CLI's writes are done (the run folder, the
            # job id) and the ranks are starting: rank 0's next ledger write fails.
            while not (entry := ledger(disk).get("noop", {})).get("job_id"):
                assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
                time.sleep(0.05)
            assert entry["state"] == "running", entry
            fill_disk(disk)
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        assert proc.returncode == 2, out
        line = _error_line(out)
        assert f"{disk}/local/ledger.json: No space left on device" in line, line
        entry = ledger(disk)["noop"]
        assert entry["state"] == "failed" and "ledger.json: No space left" in entry["error"], entry
        assert not list(disk.rglob("*.tmp")), list(disk.rglob("*"))


@pytest.mark.parametrize("arg, words", [
    ("profile_hardware.max_group=8", "group size (8) > world size (4)"),
    ("profile_hardware.max_pp=3", "pp (3) does not divide world size (4)"),
    ("profile_hardware.dtype=int8", "allowed: fp32, bf16, fp16"),
])
def test_impossible_groups_refused_before_launch(profiles, arg, words):
    proc = run_cli("stage=profile_hardware", arg, profiles_dir=profiles)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
    assert not (profiles / "local" / "ledger.json").exists()
    assert not (profiles / "local" / "hardware.json").exists()


def test_analytic_profile_for_8192_gpus_and_galvatron_round_trip(profiles):
    # No wall-clock bound (30.1 s on a loaded machine where 30 was asked): bench/ times it.
    run_cli("stage=profile_hardware", "profile_hardware.source=analytic", "cluster=dgx_h100",
            "cluster.nodes=1024", "profile_hardware.export=galvatron", "profile_hardware.plot=false",
            profiles_dir=profiles, check=0)
    hw = _hardware(profiles, "dgx_h100")
    assert hw["source"] == "analytic" and hw["cluster"]["world_size"] == 8192
    fits = {(f["group_size"], f["layout"]): f for f in hw["benchmarks"]["allreduce"]["fits"]}
    assert (8, "consec") in fits and (8192, "consec") in fits
    # Inside a node NVLink; across nodes InfiniBand: the strided group of 8 is much slower.
    assert fits[(8, "consec")]["algbw_GBps"] > 3 * fits[(8, "strided")]["algbw_GBps"]

    back = import_hardware(profiles / "dgx_h100" / "galvatron", cluster_name="dgx_h100",
                           nodes=1024, gpus_per_node=8).body["benchmarks"]
    size = 32 * 2**20
    for f in back["allreduce"]["fits"]:
        ours = fits[(f["group_size"], f["layout"])]
        assert predict_fit_time_us(f, size) == pytest.approx(predict_fit_time_us(ours, size), rel=1e-3)
    assert back["overlap"]["overlap_coe"] == pytest.approx(hw["benchmarks"]["overlap"]["overlap_coe"])


def test_a_plot_that_failed_is_made_by_the_rerun_and_status_agrees(profiles):
    # A late write (the plot, after every part) fails: the stage is not done, however done its
    # parts are, and the rerun finishes it rather than "done, skipping". One rule (pipeline's
    # `decide`) for every stage with parts; the analytic profile is the cheapest of them.
    args = ["stage=profile_hardware", "profile_hardware.source=analytic"]
    png = profiles / "local" / "hardware.png"
    png.mkdir(parents=True)  # what a full disk does to the last write, made repeatable
    failed = run_cli(*args, profiles_dir=profiles)
    assert failed.returncode != 0 and "hardware.png" in failed.stderr, failed.stderr
    entries = ledger(profiles)
    assert entries["profile_hardware"]["state"] == "failed"
    assert entries["profile_hardware/analytic"]["state"] == "done"
    png.rmdir()
    rerun = run_cli(*args, profiles_dir=profiles, check=0)
    assert "skipping (force=true" not in rerun.stdout and "finishing it" in rerun.stdout
    assert png.stat().st_size > 10_000
    assert ledger(profiles)["profile_hardware"]["state"] == "done"
    status = run_cli("stage=status", profiles_dir=profiles, check=0).stdout
    row = next(line for line in status.splitlines() if "│ profile_hardware " in line)
    assert "done" in row, status
    again = run_cli(*args, profiles_dir=profiles, check=0)  # now done: skipped, as status says
    assert "profile_hardware: done" in again.stdout and "skipping" in again.stdout
