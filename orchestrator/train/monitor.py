"""Memory over time on one rank: a background sampler, and a PNG of every rank's samples.

A sample is a dict (it goes into the run summary's JSON as is): elapsed_s since the monitor was
made, rss_MiB of this process, label (None, or what `mark` was given), and on a CUDA device
allocated_MiB, reserved_MiB and peak_MiB (torch's allocator: memory_allocated, memory_reserved,
max_memory_allocated).
"""
from __future__ import annotations

import os
import resource
import sys
import threading
import time
from pathlib import Path

import torch

from orchestrator.store import save_figure

MiB = float(1 << 20)


def rss_MiB() -> float:
    """This process's resident set size in MiB: /proc/self/statm on Linux, else psutil when
    installed, else the peak RSS from getrusage (the best the resource module knows)."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE") / MiB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return psutil.Process().memory_info().rss / MiB
    except ImportError:
        pass
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss / MiB if sys.platform == "darwin" else max_rss / 1024.0  # bytes vs KiB


class MemoryMonitor:
    """Samples this rank's memory every interval_s seconds on a daemon thread while started
    (`start`/`stop`, or `with MemoryMonitor(...)`); interval_s <= 0 takes no background samples.
    `samples` holds the readings in time order."""

    def __init__(self, interval_s: float, device=None):
        self.interval_s = float(interval_s)
        self.device = torch.device(device if device is not None else "cpu")
        self.samples: list[dict] = []
        self._start_s = time.monotonic()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def read(self, label: str | None = None) -> dict:
        """One reading now (not added to `samples`)."""
        sample = {"elapsed_s": time.monotonic() - self._start_s, "rss_MiB": rss_MiB(),
                  "label": label}
        if self.on_cuda:
            sample["allocated_MiB"] = torch.cuda.memory_allocated(self.device) / MiB
            sample["reserved_MiB"] = torch.cuda.memory_reserved(self.device) / MiB
            sample["peak_MiB"] = torch.cuda.max_memory_allocated(self.device) / MiB
        return sample

    def mark(self, label: str) -> dict:
        """Add a reading labelled `label` (e.g. "step 10") to `samples`; returns it."""
        sample = self.read(label)
        with self._lock:
            self.samples.append(sample)
        return sample

    def _sample_until_stopped(self) -> None:
        while not self._stopped.wait(self.interval_s):
            sample = self.read()
            with self._lock:
                self.samples.append(sample)

    def start(self) -> MemoryMonitor:
        """Take a first reading and start the sampling thread (none when interval_s <= 0)."""
        if self.interval_s <= 0 or self._thread is not None:
            return self
        self.mark("start")
        self._stopped.clear()
        self._thread = threading.Thread(target=self._sample_until_stopped,
                                        name="memory-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, wait for it, and take a last reading."""
        if self._thread is None:
            return
        self._stopped.set()
        self._thread.join()
        self._thread = None
        self.mark("stop")

    def __enter__(self) -> MemoryMonitor:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def peak_MiB(self) -> float:
        """The highest memory seen, in MiB: RSS on CPU, allocated on CUDA (torch's
        max_memory_allocated, which also sees peaks between samples). Includes a reading now,
        so it answers even when sampling is disabled."""
        key = "peak_MiB" if self.on_cuda else "rss_MiB"
        with self._lock:
            seen = [sample[key] for sample in self.samples]
        return max(seen + [self.read()[key]])


def memory_key(samples: list[dict]) -> str:
    """The key plotted and compared for a rank's samples: allocated_MiB on CUDA, else rss_MiB."""
    return "allocated_MiB" if samples and "allocated_MiB" in samples[0] else "rss_MiB"


def build_memory_figure(samples_by_rank: dict[int, list[dict]]):
    """A matplotlib Figure with one axes labelled "memory": one line per rank (label
    "rank <r>") of memory in MiB (RSS on CPU, allocated on CUDA) against elapsed seconds,
    labelled samples marked with a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = {rank: samples for rank, samples in sorted(samples_by_rank.items()) if samples}
    if not ranks:
        raise ValueError("no memory samples to plot (train.memory_interval_s <= 0 takes none)")
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    ax.set_label("memory")
    for rank, samples in ranks.items():
        key = memory_key(samples)
        line, = ax.plot([s["elapsed_s"] for s in samples], [s[key] for s in samples],
                        label=f"rank {rank}")
        marked = [s for s in samples if s.get("label")]
        ax.plot([s["elapsed_s"] for s in marked], [s[key] for s in marked], "o",
                color=line.get_color(), markersize=3)
    kinds = {memory_key(samples) for samples in ranks.values()}
    ylabels = {"allocated_MiB": "allocated (MiB)", "rss_MiB": "RSS (MiB)"}
    ax.set_ylabel(ylabels[kinds.pop()] if len(kinds) == 1 else "memory (MiB)")
    ax.set_xlabel("time (s)")
    ax.set_title("memory per rank over time")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small", ncol=max(1, len(ranks) // 8))
    return fig


def plot_memory(samples_by_rank: dict[int, list[dict]], path) -> Path:
    """PNG at `path` (written atomically) of build_memory_figure(samples_by_rank). Returns the
    path."""
    import matplotlib.pyplot as plt

    fig = build_memory_figure(samples_by_rank)
    path = save_figure(fig, path)
    plt.close(fig)
    return path
