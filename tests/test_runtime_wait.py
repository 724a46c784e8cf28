"""Ranks do not fight over the cores: waiting for a slower peer they sleep instead of spinning
(MPICH polls at full speed inside a blocking collective; with more ranks than cores the spin
slows the rank they wait for), a CPU rank's intra-op threads share its host's CPUs with every
rank on that host, and a rank's start (importing torch) runs without garbage collections."""
import os
import shutil
import subprocess
import sys

import pytest

from orchestrator.runtime import cpu_threads

RANK_SCRIPT = """
import sys, time
from mpi4py import MPI
from orchestrator.runtime.context import quiet_wait
comm = MPI.COMM_WORLD
quiet_wait(comm)
if comm.rank == 0:
    time.sleep(2.0)  # rank 0 still working (writing results, importing torch)
cpu0, wall0 = time.process_time(), time.monotonic()
quiet_wait(comm)
with open(f"{sys.argv[1]}/rank{comm.rank}", "w") as out:  # mpiexec interleaves stdout lines
    out.write(f"{time.process_time() - cpu0} {time.monotonic() - wall0}")
"""


def test_waiting_ranks_use_almost_no_cpu_and_wake_when_the_last_one_arrives(tmp_path):
    proc = subprocess.run([shutil.which("mpiexec"), "-n", "3", sys.executable, "-c", RANK_SCRIPT,
                           str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {rank: tuple(map(float, (tmp_path / f"rank{rank}").read_text().split()))
            for rank in range(3)}
    for rank in (1, 2):
        cpu_s, wall_s = rows[rank]
        assert wall_s >= 1.9, f"rank {rank} left the wait before rank 0 arrived ({wall_s:.2f} s)"
        # a spinning MPI_Barrier burns about its whole 2 s wait
        assert cpu_s < 0.3, f"rank {rank} used {cpu_s:.2f} CPU-s while waiting {wall_s:.2f} s"


@pytest.mark.parametrize("hostnames,rank,ranks_on_its_host", [
    (["a", "a", "a", "a"], 2, 4),  # one node, 4 ranks
    (["a", "a", "b", "b"], 0, 2),  # two nodes of 2 ranks
    (["a", "a"], 1, 2),  # two fake Slurm nodes of 1 task on one host: 2 ranks share it
    (["a", "b", "b", "b"], 0, 1),
])
def test_cpu_threads_share_the_hosts_cpus_among_its_ranks(hostnames, rank, ranks_on_its_host):
    usable = len(os.sched_getaffinity(0))
    assert cpu_threads(hostnames, rank) == max(1, usable // ranks_on_its_host)


def test_a_ranks_start_pauses_the_collector_then_freezes_what_it_made():
    import gc

    from orchestrator.startup import collector_paused

    assert gc.isenabled()
    frozen_before = gc.get_freeze_count()
    try:
        with pytest.raises(RuntimeError):  # an import that fails still gives the collector back
            with collector_paused():
                assert not gc.isenabled()
                made = [[] for _ in range(10)]  # containers: objects the collector tracks
                raise RuntimeError("import failed")
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen_before + len(made)
    finally:
        gc.unfreeze()  # this worker's objects: collectable again


def test_every_stages_rank_imports_name_modules_that_exist():
    import importlib.util

    from orchestrator.stages import STAGES, get_stage

    named = [m for stage in STAGES for m in get_stage(stage).rank_imports]
    assert "orchestrator.train.engine" in named
    assert [m for m in named if importlib.util.find_spec(m) is None] == []
