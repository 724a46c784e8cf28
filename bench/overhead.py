"""Launch overhead: a stage that does nothing, against the bare launcher, measured in the same run.

  python bench/overhead.py            # local: stage=noop on 4 ranks vs `mpiexec -n 4 python -c pass`
  python bench/overhead.py --slurm    # also: stage=noop on the dev Slurm cluster vs `sbatch --wait`
  python bench/overhead.py --smoke    # local, once each

Target: at most 2 s above each baseline. Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def wall_s(cmd, repeats: int, cwd=REPO) -> list:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return times


def report(name: str, ours: list, base: list) -> None:
    m_ours, m_base = statistics.median(ours), statistics.median(base)
    print(f"{name}: orchestrator {m_ours:.2f} s, bare {m_base:.2f} s, "
          f"overhead {m_ours - m_base:+.2f} s (target <= +2.00 s), median of {len(ours)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slurm", action="store_true", help="also time the dev Slurm cluster")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="local only, --repeats 1")
    args = parser.parse_args()
    if args.smoke:
        args.slurm, args.repeats = False, 1
    with tempfile.TemporaryDirectory() as tmp:
        noop = [sys.executable, "-m", "orchestrator", "stage=noop", "force=true",
                f"profiles_dir={tmp}"]
        base = ["mpiexec", "-n", "4", sys.executable, "-c", "pass"]
        report("local, 4 ranks", wall_s(noop, args.repeats), wall_s(base, args.repeats))
        if args.slurm:
            slurm_noop = noop + ["launcher=slurm", "cluster=dev", "launcher.poll_s=0.25"]
            bare = ["sbatch", "--wait", "-N2", "--ntasks-per-node=2", "-o", f"{tmp}/bare_%j.out",
                    "--wrap", f"srun --mpi=pmi2 {sys.executable} -c pass"]
            report("slurm dev cluster, 2 nodes x 2 tasks", wall_s(slurm_noop, args.repeats),
                   wall_s(bare, args.repeats))


if __name__ == "__main__":
    main()
