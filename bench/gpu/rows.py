"""One line per stage=train summary under a profiles folder: tag, predicted and measured ms per
step, error, tokens/s, peak MiB predicted and measured, each stage's (compute, pipeline wait,
optimizer) ms; for one GPU stage (pp 1) priced from a profile with host and device apart, also
`lead`: the prediction if the host's lead carried across calls (docs/gpu.md, "The next GPU
session"), each micro-batch max(its calls' host sum, their device sum) where the cost model
sums each call's max (dense models without recompute only). The mbs 1 rows tell which holds.

    python bench/gpu/rows.py /dev/shm/prof
"""
from __future__ import annotations

import glob
import json
import os
import sys


def lead_ms(summary: dict, model_profile: str) -> float | None:
    """The summary's prediction (ms) with each micro-batch's calls priced as max(host sum,
    device sum) instead of the sum of each call's max; None where it does not apply (pp > 1,
    no host/device split in the profile)."""
    from orchestrator.planner import ModelCost

    layout, predicted = summary["layout"], summary.get("predicted") or {}
    if layout["pp"] != 1 or "iteration_ms" not in predicted or not os.path.exists(model_profile):
        return None
    # the calls counted below: a dense model's, without recompute's reruns
    if summary.get("moe") or any(kind != "none" for kind, _ in layout.get("recompute") or []):
        return None
    fit = ModelCost.from_dict(json.load(open(model_profile)))._fit(layout["tp"])
    if fit.host is None:
        return None
    s, b, m = summary["seq_len"], layout["micro_batch_size"], layout["num_micro_batches"]
    counts = {"block_fwd": layout["layers_per_stage"][0], "block_bwd": layout["layers_per_stage"][0],
              "other_fwd": 1, "other_bwd": 1}
    priced = sum(n * fit.call_us(part, s, b) for part, n in counts.items())
    host = sum(n * fit.host_us(part, s, b) for part, n in counts.items())
    device = sum(n * fit.device_us(part, s, b) for part, n in counts.items())
    return predicted["iteration_ms"] - m * (priced - max(host, device)) / 1e3


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
    model = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(path))), "model",
                         os.path.basename(os.path.dirname(path)) + ".json")
    lead = lead_ms(summary, model)
    lead_text = "" if lead is None else (
        f"lead {lead:8.1f} ({(lead / measured['iteration_ms'] - 1) * 100:+.1f}%) ")
    return (f"{tag:40s} pred {predicted.get('iteration_ms', float('nan')):8.1f} {lead_text}"
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
