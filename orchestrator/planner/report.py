"""Pictures of a search: the candidates' time against memory, and the chosen layout per stage."""
from __future__ import annotations

from pathlib import Path

from orchestrator.store import save_figure
from orchestrator.store.schema import StrategyProfile

GiB = 2**30


def plot_strategy(strategy: StrategyProfile, path) -> Path:
    """PNG at `path` from a strategy (as written, or read back with read_profile): left,
    predicted iteration time against peak memory per device for the candidates (the chosen one
    marked); right, the chosen layout's per-stage time and memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_c, ax_t, ax_m) = plt.subplots(1, 3, figsize=(16, 4.8))
    mem = [alt.peak_memory_bytes / GiB for alt in strategy.top]
    time_ms = [alt.iteration_time_us / 1e3 for alt in strategy.top]
    ax_c.scatter(mem, time_ms, s=25, label="top candidates")
    best = strategy.prediction
    ax_c.scatter([best.peak_memory_bytes / GiB], [best.iteration_time_us / 1e3], s=120,
                 marker="*", color="red", label=f"chosen: {strategy.describe}")
    ax_c.set_xlabel("peak memory per device (GiB)")
    ax_c.set_ylabel("predicted iteration time (ms)")
    ax_c.legend(fontsize=7, loc="upper right")
    ax_c.set_title("candidates")

    stages = range(len(best.stage_fwd_us))
    ax_t.bar(stages, [t / 1e3 for t in best.stage_fwd_us], label="forward")
    ax_t.bar(stages, [t / 1e3 for t in best.stage_bwd_us],
             bottom=[t / 1e3 for t in best.stage_fwd_us], label="backward (+recompute)")
    ax_t.set_xticks(list(stages))
    ax_t.set_xlabel("pipeline stage")
    ax_t.set_ylabel("time per micro-batch (ms)")
    ax_t.set_title(f"layers per stage {list(strategy.layout.layers_per_stage)}")
    ax_t.legend(fontsize=7)

    kinds = [k for k in best.memory_bytes[0] if k != "total"]
    bottom = [0.0] * len(best.memory_bytes)
    for kind in kinds:
        values = [m[kind] / GiB for m in best.memory_bytes]
        ax_m.bar(stages, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_m.set_xticks(list(stages))
    ax_m.set_xlabel("pipeline stage")
    ax_m.set_ylabel("memory per device (GiB)")
    ax_m.set_title("memory by kind")
    ax_m.legend(fontsize=7)
    fig.tight_layout()
    path = save_figure(fig, path)
    plt.close(fig)
    return path
