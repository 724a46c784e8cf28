"""Profile files and the ledger: atomic writes, validation that names the fix, concurrent writers."""
from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from orchestrator.errors import ProfileError
from orchestrator.store import new_profile, provenance, read_profile, write_json
from orchestrator.store.ledger import Ledger
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
        ledger.update(f"stage/w{worker}_{i}", state="done", job_id=str(worker))


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
    assert all(e["state"] == "done" for e in entries.values())
    json.loads((tmp_path / "ledger.json").read_text())  # still valid JSON


def test_ledger_is_done_needs_same_hash(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.update("profile_hardware/allreduce", state="done", config_hash="h1")
    assert ledger.is_done("profile_hardware/allreduce", "h1")
    assert not ledger.is_done("profile_hardware/allreduce", "h2")
    with pytest.raises(ValueError):
        ledger.update("x", state="weird")
