"""One line per stage=train summary under a profiles folder: tag, predicted and measured ms per
step, error, tokens/s, peak MiB predicted and measured, each stage's (compute, pipeline wait,
optimizer) ms.

    python bench/gpu/rows.py /dev/shm/prof
"""
from __future__ import annotations

import glob
import json
import os
import sys


def row(path: str) -> str | None:
    """The summary at `path` as one line; None for a file that is not a measured summary."""
    try:
        summary = json.load(open(path))
    except (OSError, ValueError) as e:
        return f"{path} unreadable: {e}"
    if "measured" not in summary:
        return None
    measured, predicted = summary["measured"], summary.get("predicted") or {}
    error = summary.get("iteration_time_error")
    tag = f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)[:-5]}"
    stages = [(round(s["compute_ms"], 1), round(s["pipeline_wait_ms"], 1),
               round(s["optimizer_ms"], 1)) for s in measured["stages"]]
    return (f"{tag:40s} pred {predicted.get('iteration_ms', float('nan')):8.1f} "
            f"meas {measured['iteration_ms']:8.1f} "
            f"err {'%+.1f%%' % (error * 100) if error is not None else summary.get('prediction_note')} "
            f"tok/s {measured.get('tokens_per_s', 0):,.0f} "
            f"peak pred {predicted.get('peak_memory_MiB', float('nan')):.0f} "
            f"meas {max(measured['peak_memory_MiB']):.0f} MiB stages {stages}")


def main(root: str) -> None:
    for path in sorted(glob.glob(os.path.join(root, "*", "train", "*", "*.json"))):
        line = row(path)
        if line is not None:
            print(line)


if __name__ == "__main__":
    main(sys.argv[1])
