"""Runs a user can trust on a shared machine: one run per stage at a time, no orphaned ranks,
Ctrl-C exits 130, outputs readable by the user's group, run folders only for launches."""
from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, default_sigint, ledger, one_error_line, run_cli, start_cli

# Longer than any test waits, so the run cannot finish while a test looks (a loaded machine once
# let a 60 s one end before the test's Ctrl-C arrived); every test stops it.
SLOW_NOOP = ["stage=noop", "noop.sleep_s=900"]
# An upper bound on one CLI step (start, exit after a signal, a rerun), not a synchronisation:
# generous because a loaded 2-core machine can take a minute to import and exit Python.
WAIT_S = 240


def _wait_until_running(proc, profiles, key="noop", timeout_s=30) -> dict:
    """The ledger entry of `key` once its ranks started (it has a job id)."""
    deadline = time.monotonic() + timeout_s
    while True:
        entry = ledger(profiles).get(key, {})
        if entry.get("state") == "running" and entry.get("job_id"):
            return entry
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)


def _rank_pids(profiles) -> list:
    # Every process of the launch: mpiexec, its proxy and the ranks name the request's path.
    out = subprocess.run(["pgrep", "-f", f"orchestrator[.]runtime .*{profiles}"],
                         capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _wait_for_ranks_up(run_dir: Path, ranks: int, timeout_s: float = 60) -> None:
    """Until every rank logged that it joined the launch (MPI and the rendezvous are up)."""
    deadline = time.monotonic() + timeout_s
    for rank in range(ranks):
        log = run_dir / f"rank{rank}.log"
        while not (log.exists() and f"rank {rank}/{ranks} on" in log.read_text()):
            assert time.monotonic() < deadline, f"rank {rank} not up in {timeout_s} s"
            time.sleep(0.1)


def _shm_segments(pids) -> set:
    """The /dev/shm files of MPICH that processes `pids` have mapped (gone ones left out)."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except FileNotFoundError:
            continue
        found.update(re.findall(r"/dev/shm/mpich_\S+", maps))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_second_run_of_a_stage_is_refused_naming_the_first(profiles):
    first = start_cli(*SLOW_NOOP, profiles_dir=profiles)
    try:
        entry = _wait_until_running(first, profiles)
        second = run_cli("stage=noop", profiles_dir=profiles, timeout=WAIT_S)
        assert second.returncode == 5, second.stdout + second.stderr
        err = second.stderr.strip()
        assert len(err.splitlines()) == 1, err
        assert "noop is already running" in err
        assert "part(s) on" not in second.stdout  # no launch line for a launch refused
        assert f"pid {first.pid} on host" in err and f"job {entry['job_id']}" in err
        assert f"`kill {first.pid}`" in err
        assert ledger(profiles)["noop"]["job_id"] == entry["job_id"]  # the first's launch stays
        assert ledger(profiles)["noop"]["pid"] == first.pid
        assert [p.name for p in (profiles / "local" / "runs").iterdir()] == \
            [Path(entry["run_dir"]).name]  # the refused run made no folder
        # The same profiles folder seen from another login node (its own host name): the first
        # run is alive while its heartbeat is fresh, there as here.
        host = socket.gethostname()
        status = _on_host_b("stage=status", profiles)
        row = next(line for line in status.stdout.splitlines() if "│ noop " in line)
        assert f"running on {host}" in row, status.stdout + status.stderr
        second = _on_host_b("stage=noop", profiles)
        err = one_error_line(second, 5)
        assert f"noop is already running (pid {first.pid} on host {host}" in err
        assert f"`kill {first.pid}` on {host}" in err
        assert ledger(profiles)["noop"]["state"] == "running"
        assert ledger(profiles)["noop"]["pid"] == first.pid
    finally:
        _stop(first)


def _on_host_b(stage: str, profiles) -> subprocess.CompletedProcess:
    """The CLI as another login node runs it: the same files, another host name (a UTS
    namespace of its own; root may make one)."""
    cli = shlex.join([sys.executable, "-m", "orchestrator", stage, f"profiles_dir={profiles}"])
    proc = subprocess.run(["unshare", "-u", "sh", "-c", f"hostname hostb && exec {cli}"],
                          cwd=REPO, capture_output=True, text=True, timeout=WAIT_S)
    if "unshare failed" in proc.stderr or "hostname:" in proc.stderr:
        pytest.skip(f"needs a UTS namespace (root): {proc.stderr.strip()}")
    return proc


def test_kill_9_of_the_cli_takes_its_ranks_then_status_and_rerun(profiles):
    proc = start_cli(*SLOW_NOOP, profiles_dir=profiles)
    try:
        entry = _wait_until_running(proc, profiles)
        mpiexec_pid = int(entry["job_id"].split("-")[1])
        deadline = time.monotonic() + 20
        while len(_rank_pids(profiles)) < 5:  # mpiexec and its 4 ranks
            assert time.monotonic() < deadline
            time.sleep(0.1)
        pids = [mpiexec_pid] + _rank_pids(profiles)
        _wait_for_ranks_up(Path(entry["run_dir"]), 4)
        segments = _shm_segments(pids)  # MPICH's shared memory between the ranks
        assert len(segments) == 1, segments  # one per launch and host
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids):
            assert time.monotonic() < deadline, [p for p in pids if _alive(p)]
            time.sleep(0.2)
    finally:
        _stop(proc)
    assert not [s for s in segments if Path(s).exists()]  # 4 MiB of /dev/shm not leaked
    status = run_cli("stage=status", profiles_dir=profiles, check=0)
    row = next(line for line in status.stdout.splitlines() if "│ noop " in line)
    assert "failed" in row and f"processes are gone (pid {proc.pid})" in row
    entry = ledger(profiles)["noop"]
    assert entry["state"] == "failed" and "processes are gone" in entry["error"]
    rerun = run_cli("stage=noop", profiles_dir=profiles, check=0, timeout=WAIT_S)
    assert "✓ noop: done" in rerun.stdout
    assert ledger(profiles)["noop"]["state"] == "done"


def _rank_pid(rank: int, pids) -> int:
    """Which of `pids` is the Python process of local rank `rank` (hydra tells it PMI_RANK)."""
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if argv[0] == sys.executable.encode() and f"PMI_RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no process of rank {rank} among {pids}")


def test_a_killed_rank_is_named_first_with_its_signal_and_log(profiles):
    proc = start_cli(*SLOW_NOOP, profiles_dir=profiles)
    try:
        entry = _wait_until_running(proc, profiles)
        _wait_for_ranks_up(Path(entry["run_dir"]), 4)
        os.kill(_rank_pid(2, _rank_pids(profiles)), signal.SIGKILL)  # as the OOM killer would
        out, _ = proc.communicate(timeout=WAIT_S)
    finally:
        _stop(proc)
    assert proc.returncode == 5, out
    error = next(line for line in out.splitlines() if line.startswith("error: "))
    assert error.startswith("error: noop failed: rank 2 was killed by signal 9 (SIGKILL"), error
    assert f"its log: {entry['run_dir']}/rank2.log" in error
    assert "rank 0" not in error and "rank 1" not in error and "rank 3" not in error


def test_kill_9_then_an_immediate_rerun_runs(profiles):
    proc = start_cli(*SLOW_NOOP, profiles_dir=profiles)
    try:
        _wait_until_running(proc, profiles)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        _stop(proc)
    rerun = run_cli("stage=noop", profiles_dir=profiles, check=0, timeout=WAIT_S)
    assert "✓ noop: done" in rerun.stdout
    assert ledger(profiles)["noop"]["state"] == "done"


def _ctrl_c(proc) -> str:
    """SIGINT to the CLI (what a terminal's Ctrl-C sends it); its output once it ended."""
    try:
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=WAIT_S)
    finally:
        _stop(proc)
    return out


def test_ctrl_c_exits_130_then_rerun_resumes(profiles):
    proc = start_cli(*SLOW_NOOP, profiles_dir=profiles)
    try:
        _wait_until_running(proc, profiles)
    except BaseException:
        _stop(proc)
        raise
    out = _ctrl_c(proc)
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "interrupted" in out
    assert ledger(profiles)["noop"]["state"] == "cancelled"
    rerun = run_cli("stage=noop", profiles_dir=profiles, check=0, timeout=WAIT_S)
    assert "✓ noop: done" in rerun.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_of_the_cli_cancels_like_ctrl_c_then_rerun_resumes(profiles, sig):
    """`kill <pid>` (what a refused second run says to do), or SIGHUP (a closed terminal, a
    dropped ssh connection): the ranks stop, the ledger says cancelled and one line says what to
    rerun, as for a Ctrl-C; exit 128 + the signal. Python's default used to end the CLI
    silently and leave the launch `running`."""
    proc = start_cli(*SLOW_NOOP, profiles_dir=profiles)
    try:
        _wait_until_running(proc, profiles)
        os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=WAIT_S)
    finally:
        _stop(proc)
    assert proc.returncode == 128 + sig, out
    assert "Traceback" not in out and f"noop: interrupted ({sig.name})" in out, out
    assert "rerun the same command to resume" in out
    entry = ledger(profiles)["noop"]
    assert entry["state"] == "cancelled" and entry["error"] == f"interrupted ({sig.name})"
    assert not _rank_pids(profiles)
    rerun = run_cli("stage=noop", profiles_dir=profiles, check=0, timeout=WAIT_S)
    assert "✓ noop: done" in rerun.stdout


# `python -m orchestrator <args>` run through runpy, paused at one point before any launch until
# the test's Ctrl-C; it creates the file named by argv[2] once paused there.
_PAUSED_CLI = """
import pathlib, runpy, sys, time

phase, paused = sys.argv[1], pathlib.Path(sys.argv[2])
sys.argv = ["orchestrator", *sys.argv[3:]]


def pause(*args, **kwargs):
    paused.touch()
    time.sleep(300)  # the test's SIGINT ends this
    raise AssertionError("no Ctrl-C came")


if phase == "loading":  # the CLI's own modules are being imported
    class PauseOnImport:
        def find_spec(self, name, path=None, target=None):
            if name == "orchestrator.pipeline":
                pause()

    sys.meta_path.insert(0, PauseOnImport())
elif phase == "composing":  # Hydra composes the config
    from hydra._internal.hydra import Hydra

    Hydra.compose_config = pause
elif phase == "planning":  # the stage is planned (inside the Hydra task)
    import orchestrator.pipeline

    orchestrator.pipeline.plan_stage = pause
elif phase == "launched":  # the ranks run and the ledger names them; not yet waited for
    from orchestrator.store.ledger import Ledger

    attach_job = Ledger.attach_job

    def attach_then_pause(self, *args, **kwargs):
        attach_job(self, *args, **kwargs)
        pause()

    Ledger.attach_job = attach_then_pause
elif phase == "unrecorded":  # the ranks run, and the ledger cannot take their job (disk full)
    import errno
    from orchestrator.store.ledger import Ledger

    def full_disk(self, *args, **kwargs):
        paused.touch()
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path))

    Ledger.attach_job = full_disk
runpy.run_module("orchestrator", run_name="__main__", alter_sys=True)
"""


def _start_paused(phase: str, paused: Path, *args) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _PAUSED_CLI, phase, str(paused), *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=default_sigint)
    deadline = time.monotonic() + WAIT_S
    while not paused.exists():
        if proc.poll() is not None:
            pytest.fail(f"the CLI ended before pausing while {phase}:\n{proc.stdout.read()}")
        assert time.monotonic() < deadline, f"the CLI did not reach {phase} in {WAIT_S} s"
        time.sleep(0.05)
    return proc


def test_ctrl_c_between_the_launch_and_its_wait_stops_the_ranks_and_cancels(profiles, tmp_path):
    # The window CI once hit: the ledger already says running with a job id, the CLI has not
    # yet begun to wait; a Ctrl-C there must not leave the entry `running`.
    proc = _start_paused("launched", tmp_path / "paused", *SLOW_NOOP,
                         f"profiles_dir={profiles}")
    entry = ledger(profiles)["noop"]
    out = _ctrl_c(proc)
    assert entry["state"] == "running" and entry["job_id"]
    mpiexec_pid = int(entry["job_id"].split("-")[1])
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "noop: interrupted (Ctrl-C)" in out
    assert ledger(profiles)["noop"]["state"] == "cancelled"
    assert not _alive(mpiexec_pid)


def test_a_launch_the_ledger_cannot_record_is_stopped_and_marked_failed(profiles, tmp_path):
    # A disk that fills between the launch's ledger entry and its job id: the ranks must not
    # run on unfollowed, and the entry must not stay `running`.
    proc = _start_paused("unrecorded", tmp_path / "attached", *SLOW_NOOP,
                         f"profiles_dir={profiles}")
    try:
        out, _ = proc.communicate(timeout=WAIT_S)
    finally:
        _stop(proc)
    assert proc.returncode == 2, out
    assert "ledger.json: No space left on device" in out
    entry = ledger(profiles)["noop"]
    assert entry["state"] == "failed", entry
    assert "could not be recorded" in entry["error"] and "No space left" in entry["error"]
    assert not _rank_pids(profiles)  # stopped, not left running


@pytest.mark.parametrize("phase", ["loading", "composing", "planning"])
def test_ctrl_c_before_launch_exits_130_without_traceback(profiles, tmp_path, phase):
    # Interrupted while loading, composing or planning (before any launch): 130, one line.
    proc = _start_paused(phase, tmp_path / "paused", "stage=profile_hardware",
                         f"profiles_dir={profiles}")
    out = _ctrl_c(proc)
    assert proc.returncode == 130, out
    assert "Traceback" not in out and "interrupted (Ctrl-C)" in out.strip().splitlines()[-1]
    assert not ledger(profiles)  # nothing was launched


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_outputs_follow_the_users_umask(profiles, umask, mode):
    cmd = [sys.executable, "-m", "orchestrator", "stage=profile_hardware",
           "profile_hardware.source=analytic", "cluster=dgx_h100", f"profiles_dir={profiles}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=WAIT_S,
                          preexec_fn=lambda: os.umask(umask))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    folder = profiles / "dgx_h100"
    for name in ("hardware.json", "hardware.png", "ledger.json"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == mode, name


def test_status_and_a_skipped_rerun_make_no_run_folder(profiles, tmp_path):
    run_cli("stage=noop", profiles_dir=profiles, check=0)
    runs = profiles / "local" / "runs"
    folders = sorted(runs.iterdir())
    assert len(folders) == 1 and folders[0].name.endswith("_noop")
    assert "sleep_s: 0.0" in (folders[0] / "config.yaml").read_text()  # says what ran
    run_cli("stage=status", profiles_dir=profiles, check=0)
    skipped = run_cli("stage=noop", profiles_dir=profiles, check=0)
    assert "skipping" in skipped.stdout
    assert sorted(runs.iterdir()) == folders
    assert not (REPO / ".hydra").exists() and not list(REPO.glob("*.log"))


def test_status_of_a_missing_profiles_folder_creates_nothing(tmp_path):
    profiles = tmp_path / "nothing_here"
    run_cli("stage=status", profiles_dir=profiles, check=0)
    assert not profiles.exists()


def test_multirun_points_keep_their_own_run_folder_with_the_config(profiles):
    run_cli("-m", "stage=noop", "cluster.tasks_per_node=2,4", profiles_dir=profiles, check=0)
    points = sorted((profiles / "local" / "multirun").glob("*/*_noop"))
    assert [p.name for p in points] == ["0_noop", "1_noop"]
    for point, ranks in zip(points, (2, 4)):
        assert f"tasks_per_node: {ranks}" in (point / "config.yaml").read_text()
        assert f"cluster.tasks_per_node={ranks}" in (point / "overrides.yaml").read_text()
        assert (point / "rank0.log").exists()
    assert not (profiles / "local" / "runs").exists()


# ---------------------------------------------------------------- the ledger's guard, in-process
def _other_cli_holding(folder: Path, key: str) -> subprocess.Popen:
    """Another process that launched `key` in the ledger at `folder` and still runs."""
    code = (f"import time; from orchestrator.store.ledger import Ledger; "
            f"Ledger({str(folder)!r}).launch({key!r}, ['a'], queued=False, config_hash='h', "
            f"launcher='local', run_dir='r'); print('launched', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "launched"
    return proc


def test_launch_refuses_a_live_owner_and_takes_over_a_gone_one(tmp_path):
    from orchestrator.store.ledger import Ledger, RunInProgress

    other = _other_cli_holding(tmp_path, "profile_model/tiny")
    ledger = Ledger(tmp_path)
    try:
        with pytest.raises(RunInProgress, match=rf"pid {other.pid} on host .*`kill {other.pid}`"):
            ledger.launch("profile_model/tiny", ["a"], queued=False, config_hash="h",
                          launcher="local", run_dir="r2")
        with pytest.raises(RunInProgress):  # a part of it is taken too
            ledger.launch("profile_model/tiny/a", [], queued=False, config_hash="h",
                          launcher="local", run_dir="r2")
        assert not ledger.end_if_gone("profile_model/tiny")  # status leaves a live run alone
    finally:
        other.kill()
        other.wait()
    assert ledger.end_if_gone("profile_model/tiny")
    entry = ledger.get("profile_model/tiny")
    assert entry.state.value == "failed"
    assert entry.error == (f"the run's processes are gone (pid {other.pid}); rerun its command "
                           f"to resume")
    assert ledger.get("profile_model/tiny/a").state.value == "failed"
    ledger.launch("profile_model/tiny", ["a"], queued=False, config_hash="h", launcher="local",
                  run_dir="r2")
    assert ledger.get("profile_model/tiny").pid == os.getpid()


def test_a_ctrl_c_inside_the_jobs_recording_counts_it_followed_once_written(tmp_path):
    # The Ctrl-C can land inside attach_job after its write (others already read the job id
    # there): the queued job must then run on, not be cancelled under them.
    from orchestrator.cli.run import _ledger_follows
    from orchestrator.store.ledger import Ledger

    ledger = Ledger(tmp_path)
    ledger.launch("noop", [], queued=True, config_hash="h", launcher="slurm", run_dir="r")
    job = {"job_id": "4242", "job_folder": "f"}
    assert not _ledger_follows(ledger, "noop", job)  # not yet written: stopped
    assert not _ledger_follows(ledger, "noop", None)  # the Ctrl-C before the job id was read
    ledger.attach_job("noop", [], **job)
    assert _ledger_follows(ledger, "noop", job)
    assert not _ledger_follows(ledger, "noop", {"job_id": "4243", "job_folder": "f"})


def test_a_reused_pid_is_not_the_owner_and_another_host_lives_by_its_heartbeat():
    from orchestrator.store.owner import HEARTBEAT_STALE_S, Owner

    now = time.time()
    me = Owner.this_process()
    assert me.alive(heartbeat=None) and me.pid_start is not None
    assert not Owner(me.host, me.pid, me.pid_start + 1).alive(None)  # same pid, another process
    elsewhere = Owner("hostb", me.pid + 1, 1234)  # its pid means nothing here
    assert elsewhere.alive(heartbeat=now - 1, now=now)
    assert elsewhere.alive(heartbeat=now - HEARTBEAT_STALE_S + 1, now=now)
    assert not elsewhere.alive(heartbeat=now - HEARTBEAT_STALE_S - 1, now=now)
    assert not elsewhere.alive(heartbeat=None, now=now)


def _launched_on(folder: Path, host: str, key: str, heartbeat: float) -> None:
    """A ledger entry as a CLI on `host` writes it: `key` running, owned by a pid of that host,
    its last heartbeat at `heartbeat`."""
    from orchestrator.store.ledger import Ledger

    ledger = Ledger(folder)
    ledger.launch(key, ["a"], queued=False, config_hash="h", launcher="local", run_dir="r")
    with ledger._locked() as entries:
        entries[key].host, entries[key].pid, entries[key].pid_start = host, 4242, 99
        entries[key].heartbeat = entries[key].updated = heartbeat  # its last stamp
        entries[key].started = min(entries[key].started, heartbeat)


def test_a_run_on_another_host_is_refused_while_its_heartbeat_is_fresh(tmp_path):
    from orchestrator.store.ledger import Ledger, RunInProgress
    from orchestrator.store.owner import HEARTBEAT_STALE_S

    ledger = Ledger(tmp_path)
    _launched_on(tmp_path, "hostb", "train/tiny", time.time() - 5)
    assert not ledger.end_if_gone("train/tiny")  # status leaves it alone
    assert ledger.get("train/tiny").state.value == "running"
    assert ledger.get("train/tiny").state_text() == "running on hostb"
    with pytest.raises(RunInProgress, match=r"train/tiny is already running \(pid 4242 on host "
                                            r"hostb, .*\(`kill 4242` on hostb\)") as refused:
        ledger.launch("train/tiny", [], queued=False, config_hash="h", launcher="local",
                      run_dir="r2")
    assert refused.value.exit_code == 5
    assert ledger.get("train/tiny").pid == 4242  # not taken over

    last_beat = time.time() - HEARTBEAT_STALE_S - 5
    _launched_on(tmp_path, "hostb", "train/small", last_beat)
    assert ledger.end_if_gone("train/small")  # no heartbeat for too long: gone
    entry = ledger.get("train/small")
    assert entry.state.value == "failed" and entry.state_text() == "failed"
    assert entry.ended <= last_beat + 1  # it ended at its last sign of life, not when noticed
    assert re.fullmatch(r"the run on host hostb \(pid 4242\) sent no heartbeat for \d+ s; "
                        r"rerun its command to resume", entry.error), entry.error
    ledger.launch("train/small", [], queued=False, config_hash="h", launcher="local",
                  run_dir="r2")  # and a new run takes it
    assert ledger.get("train/small").pid == os.getpid()


def test_the_owner_keeps_its_heartbeat_while_it_waits(tmp_path):
    from orchestrator.store.ledger import Ledger, State

    ledger = Ledger(tmp_path)
    ledger.launch("noop", [], queued=False, config_hash="h", launcher="local", run_dir="r")
    first = ledger.get("noop").heartbeat
    assert first is not None
    with ledger.heartbeat("noop", every_s=0.05):
        deadline = time.monotonic() + 30
        while ledger.get("noop").heartbeat == first:
            assert time.monotonic() < deadline, "no heartbeat in 30 s"
            time.sleep(0.02)
        ledger.transition("noop", State.done)
        time.sleep(0.2)  # beats of an ended launch change nothing
        ended = ledger.get("noop").heartbeat
    time.sleep(0.2)
    assert ledger.get("noop").heartbeat == ended
    assert not [t for t in threading.enumerate() if t.name.startswith("heartbeat")]


def test_a_held_ledger_lock_fails_soon_naming_its_holder(tmp_path, monkeypatch):
    from orchestrator.store import ledger as ledger_module
    from orchestrator.store.ledger import Ledger, LedgerBusy

    monkeypatch.setattr(ledger_module, "LOCK_TIMEOUT_S", 0.3)
    held, release = threading.Event(), threading.Event()

    def hold():  # another thread's lock is another holder (filelock's locks are per thread)
        with Ledger(tmp_path)._locked():
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(30)
        with pytest.raises(LedgerBusy, match=rf"ledger.json is locked by pid {os.getpid()} on "
                                             rf"host {socket.gethostname()} since "
                                             rf"\d\d:\d\d:\d\d") as busy:
            Ledger(tmp_path).launch("noop", [], queued=False, config_hash="h",
                                    launcher="local", run_dir="r")
        assert busy.value.exit_code == 5
    finally:
        release.set()
        holder.join()
    Ledger(tmp_path).launch("noop", [], queued=False, config_hash="h", launcher="local",
                            run_dir="r")  # free again


# The CLI with a shorter lock bound (the test need not wait the real one out).
_SHORT_LOCK_CLI = """
import runpy, sys
import orchestrator.store.ledger
orchestrator.store.ledger.LOCK_TIMEOUT_S = 1.0
sys.argv = ["orchestrator", *sys.argv[1:]]
runpy.run_module("orchestrator", run_name="__main__", alter_sys=True)
"""


def test_a_run_refused_by_a_held_ledger_lock_exits_5_naming_it_and_leaves_nothing(profiles):
    folder = profiles / "local"
    code = (f"import time; from orchestrator.store.ledger import Ledger\n"
            f"with Ledger({str(folder)!r})._locked():\n"
            f"    print('held', flush=True); time.sleep(120)")
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        proc = subprocess.run([sys.executable, "-c", _SHORT_LOCK_CLI, "stage=noop",
                               "force=true", f"profiles_dir={profiles}"], cwd=REPO,
                              capture_output=True, text=True, timeout=WAIT_S)
    finally:
        other.kill()
        other.wait()
    err = one_error_line(proc, 5)
    assert f"is locked by pid {other.pid} on host {socket.gethostname()} since" in err
    assert not (folder / "runs").exists() and not ledger(profiles)  # nothing left behind


@pytest.fixture
def read_only(tmp_path):
    """Mounts a folder read-only onto another (root with mount rights, as in CI); unmounts."""
    mounted = []

    def mount(src: Path, dst: Path) -> Path:
        dst.mkdir(parents=True)
        for cmd in (["mount", "--bind", str(src), str(dst)],
                    ["mount", "-o", "remount,bind,ro", str(dst)]):
            if subprocess.run(cmd, capture_output=True).returncode != 0:
                pytest.skip("needs mount rights (root) to make a read-only folder")
            mounted.append(dst)
        return dst

    yield mount
    if mounted:
        subprocess.run(["umount", str(mounted[0])], check=True)


def test_status_of_a_read_only_profiles_folder_prints_the_table(tmp_path, read_only):
    profiles = tmp_path / "profiles"
    folder = profiles / "local"
    code = (f"from orchestrator.store.ledger import Ledger; Ledger({str(folder)!r}).launch("
            f"'noop', [], queued=False, config_hash='h', launcher='local', run_dir='r')")
    subprocess.run([sys.executable, "-c", code], check=True)  # a launch whose CLI is gone
    shared = read_only(profiles, tmp_path / "shared")
    proc = run_cli("stage=status", profiles_dir=shared, check=0)
    assert "not refreshed" in proc.stderr and "Read-only file system" in proc.stderr
    row = next(line for line in proc.stdout.splitlines() if "│ noop " in line)
    assert "running" in row


def test_a_queued_slurm_job_refuses_a_second_run_naming_it(slurm_cluster, profiles):
    slurm = ["launcher=slurm", "cluster=dev"]
    held = run_cli("stage=noop", *slurm, "wait=false", "+cluster.sbatch_args.hold=true",
                   profiles_dir=profiles, check=0)
    job_id = re.search(r"submitted Slurm job (\d+)", held.stdout).group(1)
    try:  # the CLI that submitted it is gone; the job, held in the queue, is not
        second = run_cli("stage=noop", *slurm, profiles_dir=profiles, timeout=WAIT_S)
        assert second.returncode == 5, second.stdout + second.stderr
        assert (f"noop is already running (Slurm job {job_id}); wait for it or stop it "
                f"(`scancel {job_id}`)") in second.stderr
    finally:
        subprocess.run(["scancel", job_id], check=True)


def test_ctrl_c_while_waiting_on_a_slurm_job_leaves_it_queued_and_says_how_to_stop_it(
        slurm_cluster, profiles):
    # The user chose Slurm so the job outlives the terminal: Ctrl-C stops the waiting only.
    proc = start_cli("stage=noop", "launcher=slurm", "cluster=dev",
                     "+cluster.sbatch_args.hold=true", profiles_dir=profiles)
    job_id = None
    try:
        deadline = time.monotonic() + WAIT_S
        while not (job_id := ledger(profiles, "dev").get("noop", {}).get("job_id")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 130, out
        assert "Traceback" not in out
        assert f"Slurm job(s) {job_id} keep running" in out and f"`scancel {job_id}`" in out
        entry = ledger(profiles, "dev")["noop"]
        assert entry["state"] == "pending" and entry["job_id"] == job_id
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"],
                                capture_output=True, text=True).stdout.strip()
        assert queued == "PENDING"
    finally:
        _stop(proc)
        if job_id:
            subprocess.run(["scancel", job_id], check=True)


def test_stopping_a_launch_the_moment_it_starts_ends_its_ranks():
    """mpiexec loses a SIGTERM sent while it starts and would run its ranks to the end (a
    loaded CI run saw a Ctrl-C'd 60 s run finish): the stop repeats it, then kills."""
    import shutil
    import threading

    from orchestrator.launch.local import terminate

    marker = f"sleep_marker_{os.getpid()}"
    body = f"import time; time.sleep(600)  # {marker}"
    proc = subprocess.Popen([shutil.which("mpiexec"), "-n", "2", sys.executable, "-c", body],
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    stopper = threading.Thread(target=terminate, args=(proc,), daemon=True)
    stopper.start()  # at once: inside mpiexec's start-up
    stopper.join(timeout=120)
    try:
        assert not stopper.is_alive(), "mpiexec still runs 120 s after the stop began"
        deadline = time.monotonic() + 30
        while subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "ranks outlived their mpiexec"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-9", "-f", marker])


def test_an_interrupted_chain_says_to_rerun_once_its_queued_jobs_end():
    """Ctrl-C while a Slurm chain is submitted: the jobs already queued run on and hold their
    stages (a rerun meanwhile is refused, naming them), so the line says when to rerun."""
    from orchestrator.cli.run import interrupted_line

    alone = interrupted_line("search/tiny")
    assert alone.endswith("interrupted (Ctrl-C); parts finished before are kept, rerun the "
                          "same command to resume")
    chained = interrupted_line("search/tiny", "1414 1415")
    assert chained.startswith(alone)
    assert chained.endswith(" once Slurm job(s) 1414 1415 have ended (`stage=status` shows "
                            "them), or after `scancel 1414 1415`")
    # a stage that finished as the interrupt came is not called interrupted
    assert interrupted_line("train/tiny", done=True) == (
        "train/tiny: done as the interrupt (Ctrl-C) came; the command stops here: rerun it for "
        "what follows (a rerun skips what is done)")
