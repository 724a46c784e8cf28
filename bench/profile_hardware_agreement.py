"""Does the profiler measure what a bare loop measures? And does its fit predict unseen sizes?

On every rank of an MPI job (4 local ranks here):
  1. the profiler's allreduce over the whole world, sizes min_bytes..max_bytes (x4);
  2. a bare torch.distributed loop: all_reduce of max_bytes back to back, time / iters;
  3. a bare mpi4py loop: comm.Allreduce of max_bytes (MPICH's own algorithm, not gloo's).
Prints busbw of each at max_bytes and the profiler / bare ratios (target: within 15% of the
torch loop; MPI uses another implementation, so it is context, not a target), and the largest
relative error of the alpha-beta fit on held-out sizes (fit on every other size).

    mpiexec -n 4 python bench/profile_hardware_agreement.py [--max-mib 64] [--iters 10]
    python bench/profile_hardware_agreement.py [--ranks 4]   # starts mpiexec -n 4 itself
    python bench/profile_hardware_agreement.py --smoke       # 2 ranks, 64 KiB, 2 iterations
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Dict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 1024 * 1024


def _bare_torch_time_us(size_bytes: int, iters: int, device) -> float:
    import torch
    import torch.distributed as dist

    t = torch.zeros(size_bytes // 4, dtype=torch.float32, device=device)
    for _ in range(2):
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters * 1e6


def _bare_mpi_time_us(comm, size_bytes: int, iters: int) -> float:
    from mpi4py import MPI

    buf = np.zeros(size_bytes // 4, dtype=np.float32)
    for _ in range(2):
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return (time.perf_counter() - t0) / iters * 1e6


def run_agreement(ctx, comm, *, min_bytes: int = 1024, max_bytes: int = 64 * MiB,
                  iters: int = 10) -> Dict[str, float]:
    """Run on every rank (torch.distributed initialised, `comm` an mpi4py communicator of the
    same ranks). Returns busbw (GB/s) of profiler / torch loop / MPI loop at max_bytes, their
    ratios and the fit's held-out relative error; identical on all ranks."""
    from mpi4py import MPI

    from orchestrator.profiling.measure import algbw_GBps, busbw_GBps
    from orchestrator.profiling.hardware.collectives import SweepConfig, bench_collective
    from orchestrator.profiling.hardware.fit import held_out_rel_err

    n = ctx.world_size
    sweep = SweepConfig(min_bytes=min_bytes, max_bytes=max_bytes, step=4, dtype="fp32")
    result = bench_collective("allreduce", ctx, sweep, [(n, "consec")])
    points = sorted(result["points"], key=lambda p: p["size_bytes"])
    size = points[-1]["size_bytes"]
    # Each rank's loop time, then the slowest rank's, as the profiler does.
    torch_us = comm.allreduce(_bare_torch_time_us(size, iters, ctx.device), op=MPI.MAX)
    mpi_us = comm.allreduce(_bare_mpi_time_us(comm, size, iters), op=MPI.MAX)
    profiler_busbw = points[-1]["busbw_GBps"]
    torch_busbw = busbw_GBps("allreduce", n, algbw_GBps(size, torch_us))
    mpi_busbw = busbw_GBps("allreduce", n, algbw_GBps(size, mpi_us))
    return {
        "size_bytes": size,
        "profiler_busbw_GBps": profiler_busbw,
        "profiler_iters": points[-1]["iters"],
        "torch_loop_busbw_GBps": torch_busbw,
        "mpi_loop_busbw_GBps": mpi_busbw,
        "profiler_over_torch": profiler_busbw / torch_busbw,
        "profiler_over_mpi": profiler_busbw / mpi_busbw,
        "fit_max_rel_err": result["fits"][0]["max_rel_err"],
        "fit_held_out_rel_err": held_out_rel_err([p["size_bytes"] for p in points],
                                                 [p["time_us_median"] for p in points]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mib", type=float, default=64)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=4,
                        help="started outside mpiexec: run under `mpiexec -n RANKS` (>= 2)")
    parser.add_argument("--smoke", action="store_true", help="2 ranks, 64 KiB, 2 iterations")
    args = parser.parse_args()
    if args.smoke:
        args.ranks, args.max_mib, args.iters = 2, 1 / 16, 2
    if not {"PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK"} & set(os.environ):  # no MPI job
        raise SystemExit(subprocess.run(["mpiexec", "-n", str(args.ranks), sys.executable,
                                         os.path.abspath(__file__), *sys.argv[1:]]).returncode)
    import torch.distributed as dist

    from mpi4py import MPI

    from orchestrator.runtime import bootstrap

    comm = MPI.COMM_WORLD
    ctx = bootstrap(comm.Get_size(), "gloo")
    try:
        out = run_agreement(ctx, comm, max_bytes=int(args.max_mib * MiB), iters=args.iters)
    finally:
        dist.destroy_process_group()
    if ctx.rank == 0:
        print(f"allreduce over {ctx.world_size} ranks, {out['size_bytes'] / MiB:g} MiB fp32:")
        print(f"  profiler   busbw {out['profiler_busbw_GBps']:.3f} GB/s "
              f"({out['profiler_iters']} iters, median)")
        print(f"  torch loop busbw {out['torch_loop_busbw_GBps']:.3f} GB/s  "
              f"ratio profiler/torch {out['profiler_over_torch']:.3f} (target 0.85..1.15)")
        print(f"  mpi4py     busbw {out['mpi_loop_busbw_GBps']:.3f} GB/s  "
              f"ratio profiler/mpi {out['profiler_over_mpi']:.3f}")
        print(f"  fit: max rel err {out['fit_max_rel_err']:.1%} on its points, "
              f"{out['fit_held_out_rel_err']:.1%} on held-out sizes")


if __name__ == "__main__":
    main()
