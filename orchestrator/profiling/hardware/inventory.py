"""What each rank runs on: host, CPU, memory, GPU, library versions."""
from __future__ import annotations

import os
import platform
import socket


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_GiB() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 0.0


def rank_inventory(ctx) -> dict:
    """This rank's record for hardware.json's inventory (sizes in GiB)."""
    import torch

    from orchestrator.store import library_versions

    versions = library_versions()
    record = {
        "rank": ctx.rank,
        "host": socket.gethostname(),
        "node": ctx.node_name,
        "node_rank": ctx.node_rank,
        "local_rank": ctx.local_rank,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_GiB": round(_mem_GiB(), 2),
        "gpu_model": None,
        "gpu_mem_GiB": None,
        "torch": versions.get("torch"),
        "nccl": versions.get("nccl"),
        "mpi": versions.get("mpi"),
    }
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        record.update(gpu_model=props.name, gpu_mem_GiB=round(props.total_memory / 2**30, 2))
    return record
