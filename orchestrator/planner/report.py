"""Pictures of a search: the candidates' time against memory, the chosen layout's time and memory
per stage, and how that memory sits in the device's budget."""
from __future__ import annotations

from pathlib import Path
from typing import Tuple

from orchestrator.store import save_figure
from orchestrator.store.schema import StrategyProfile

GiB = 2**30
MiB = 2**20
# The reserve is drawn in the budget panel only: for a small model it would dwarf the model's own.
OWN_KINDS_SKIPPED = ("reserve", "total")


def memory_unit(max_bytes: float) -> Tuple[str, float]:
    """("GiB", 2**30) from 1 GiB up, else ("MiB", 2**20): the unit in which `max_bytes` reads
    as a number above 1 (a small model's memory stays visible)."""
    return ("GiB", GiB) if max_bytes >= GiB else ("MiB", MiB)


def _legend_below(ax, ncol: int = 1) -> None:
    # Below the axes, so that no point or bar is hidden behind it.
    ax.legend(fontsize=7, ncol=ncol, loc="upper center", bbox_to_anchor=(0.5, -0.14))


def _candidates(ax, strategy: StrategyProfile, reserve_bytes: float, unit: Tuple[str, float]):
    name, scale = unit
    best = strategy.prediction
    ax.scatter([(alt.peak_memory_bytes - reserve_bytes) / scale for alt in strategy.top],
               [alt.iteration_time_us / 1e3 for alt in strategy.top], s=25,
               label="top candidates")
    ax.scatter([(best.peak_memory_bytes - reserve_bytes) / scale],
               [best.iteration_time_us / 1e3], s=120, marker="*", color="red",
               label=f"chosen: {strategy.describe}")
    ax.set_xlabel(f"model's peak memory per device ({name}, reserve not included)")
    ax.set_ylabel("predicted iteration time (ms)")
    ax.set_title("candidates")
    _legend_below(ax)


def _stage_times(ax, strategy: StrategyProfile):
    best = strategy.prediction
    stages = range(len(best.stage_fwd_us))
    ax.bar(stages, [t / 1e3 for t in best.stage_fwd_us], label="forward")
    ax.bar(stages, [t / 1e3 for t in best.stage_bwd_us],
           bottom=[t / 1e3 for t in best.stage_fwd_us], label="backward (+recompute)")
    ax.set_xticks(list(stages))
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("time per micro-batch (ms)")
    ax.set_title(f"layers per stage {list(strategy.layout.layers_per_stage)}")
    _legend_below(ax, ncol=2)


def _memory_by_kind(ax, strategy: StrategyProfile, unit: Tuple[str, float]):
    name, scale = unit
    per_stage = strategy.prediction.memory_bytes
    stages = range(len(per_stage))
    kinds = [k for k in per_stage[0] if k not in OWN_KINDS_SKIPPED]
    bottom = [0.0] * len(per_stage)
    for kind in kinds:
        values = [m[kind] / scale for m in per_stage]
        ax.bar(stages, values, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(list(stages))
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel(f"model's memory per device ({name})")
    ax.set_title("memory by kind (reserve apart)")
    _legend_below(ax, ncol=3)


def _budget(ax, strategy: StrategyProfile, reserve_bytes: float):
    """One bar in GiB: the model's peak, the reserve (hatched) and what is left of the budget."""
    budget_GiB = strategy.space.memory_GiB
    reserve_GiB = reserve_bytes / GiB
    own_bytes = strategy.prediction.peak_memory_bytes - reserve_bytes
    ax.bar([0], [own_bytes / GiB], color="tab:blue")
    ax.bar([0], [reserve_GiB], bottom=[own_bytes / GiB], color="none", edgecolor="grey",
           hatch="//")
    ax.axhline(budget_GiB, color="black", linestyle="--")
    ax.text(0, budget_GiB, f"budget {budget_GiB:g} GiB", ha="center", va="bottom", fontsize=8)
    ax.text(0, own_bytes / GiB + reserve_GiB / 2, f"reserve\n{reserve_GiB:g} GiB", ha="center",
            va="center", fontsize=8)
    name, scale = memory_unit(own_bytes)
    ax.set_title(f"model {own_bytes / scale:.1f} {name}\n"
                 f"({own_bytes / (budget_GiB * GiB):.1%} of budget)", fontsize=9)
    ax.set_ylim(0, budget_GiB * 1.12)
    ax.set_xticks([])
    ax.set_ylabel("per device (GiB)")


def build_strategy_figure(strategy: StrategyProfile):
    """The matplotlib Figure of a strategy (as written, or read back with read_profile), axes
    labelled "candidates" (predicted iteration time in ms against the model's peak memory per
    device, the chosen one marked), "stage time" (ms per stage), "memory" (the model's own
    memory per stage by kind, MiB below 1 GiB) and "budget" (GiB: model, reserve, budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 5.4), layout="constrained",
                             gridspec_kw={"width_ratios": [3, 3, 3, 1]})
    for ax, label in zip(axes, ("candidates", "stage time", "memory", "budget")):
        ax.set_label(label)
    best = strategy.prediction
    reserve_bytes = best.memory_bytes[0].get("reserve", 0.0)
    unit = memory_unit(max([best.peak_memory_bytes]
                           + [alt.peak_memory_bytes for alt in strategy.top]) - reserve_bytes)
    _candidates(axes[0], strategy, reserve_bytes, unit)
    _stage_times(axes[1], strategy)
    _memory_by_kind(axes[2], strategy, unit)
    _budget(axes[3], strategy, reserve_bytes)
    return fig


def plot_strategy(strategy: StrategyProfile, path) -> Path:
    """PNG at `path` of build_strategy_figure(strategy). Returns the path."""
    import matplotlib.pyplot as plt

    fig = build_strategy_figure(strategy)
    path = save_figure(fig, path)
    plt.close(fig)
    return path


def build_tune_figure(calibration):
    """The matplotlib Figure of a tune record (store.schema.CalibrationProfile): predicted
    against measured iteration time per candidate, as profiled and calibrated (axes labelled
    "before" and "after"), the diagonal marking a right prediction, the pick circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [c for c in calibration.candidates if c.state == "measured"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.4), layout="constrained", sharey=True)
    top = max([c.measured_ms["iteration"] for c in done]
              + [max(c.predicted_ms["iteration"], c.calibrated_ms["iteration"]) for c in done])
    for ax, key, label in ((axes[0], "predicted_ms", "before"),
                           (axes[1], "calibrated_ms", "after")):
        ax.set_label(label)
        ax.plot([0, top * 1.1], [0, top * 1.1], color="grey", lw=0.8)
        for c in done:
            x, y = c.measured_ms["iteration"], getattr(c, key)["iteration"]
            pick = c.describe == calibration.pick_describe
            ax.scatter([x], [y], s=60 if pick else 30, edgecolors="black" if pick else "none")
            ax.annotate(c.role, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("measured iteration (ms)")
        error = (calibration.mean_error_before if label == "before"
                 else calibration.mean_error_after) or 0.0
        ax.set_title(f"{'as profiled' if label == 'before' else 'calibrated'} "
                     f"(mean |error| {error:.1%})")
        ax.set_xlim(0, top * 1.1)
        ax.set_ylim(0, top * 1.1)
    axes[0].set_ylabel("predicted iteration (ms)")
    return fig


def plot_tune(calibration, path) -> Path:
    """PNG at `path` of build_tune_figure(calibration). Returns the path."""
    import matplotlib.pyplot as plt

    fig = build_tune_figure(calibration)
    path = save_figure(fig, path)
    plt.close(fig)
    return path
