"""What a training run tells: a live line per logged step, the step reached in the ledger, and
at the end the performance summary (measured beside the planner's prediction) as JSON + PNG."""
from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from orchestrator.choices import Backend, Dtype, Group
from orchestrator.store import (cluster_dir, file_sha256, new_profile, read_json, set_aside,
                               write_json)

log = logging.getLogger("orchestrator.train")
GiB = 2**30
MiB = 2**20
TIME_PARTS = ("step_s", "fwd_bwd_s", "compute_s", "sync_wait_s", "norm_s", "optimizer_s")
PROGRESS_EVERY_S = 2.0  # the ledger's progress note: a file lock and a write, not every step


class StepLog:
    """Per-step figures of this rank; rank 0 prints and keeps the ledger's progress note."""

    def __init__(self, ctx, run, layout, seq_len: int, train_cfg):
        self.ctx, self.run, self.layout, self.t = ctx, run, layout, train_cfg
        self.seq_len = seq_len
        self.tokens_per_step = layout.global_batch_size * seq_len
        self.steps: List[Dict[str, Any]] = []  # this run's steps (this rank's times)
        self.losses: Dict[int, float] = {}  # step -> loss, across resumes
        self.notes: List[str] = []
        self.checkpoints: List[Dict[str, float]] = []
        self.identity = ""  # the run's checkpoint identity (stages/train.run_identity)
        self.tensor_peak_bytes = None  # every live tensor byte of one step, counted (CPU)
        # Variable-length runs: each step's plan (train/microbatching.Iteration.record) with
        # its measured time, and the step's real tokens for the tokens/s of its line.
        self.plans: List[Dict[str, Any]] = []
        self._step_tokens: Optional[int] = None
        self.started = time.time()
        self._progress_at = -PROGRESS_EVERY_S
        self.console = None
        if ctx.is_root:
            from orchestrator.console import stage_console

            self.console = stage_console()

    def restore(self, extra: dict) -> None:
        self.losses.update({int(k): float(v) for k, v in (extra.get("losses") or {}).items()})
        self.notes[:0] = extra.get("notes") or []  # why earlier runs stopped (a signal)

    def extra(self) -> dict:
        """What a checkpoint carries besides tensors."""
        return {"identity": self.identity, "model": self._model(),
                "losses": {str(k): v for k, v in sorted(self.losses.items())},
                "layout": self.layout.describe(), "notes": list(self.notes), "time": time.time(),
                "steps": self.t.steps}

    def _model(self) -> Dict[str, Any]:
        """The model's fields, kept with a checkpoint: a `train.load` of it by another model
        names them when it refuses it."""
        from orchestrator.models.config import model_fields
        from orchestrator.train.plan import model_config

        return model_fields(model_config(self.run.cfg, self.seq_len))

    def note(self, text: str) -> None:
        self.notes.append(text)
        if self.console is not None:
            self.console.print(f"train: {text}", markup=False, highlight=False)
        log.info("%s", text)

    def warn(self, text: str) -> None:
        self.notes.append(f"warning: {text}")
        if self.console is not None:
            self.console.print(f"[yellow]warning:[/] {text}", highlight=False)
        log.warning("%s", text)

    def checkpointed(self, step: int, took_s: float) -> None:
        self.checkpoints.append({"step": step, "took_s": took_s})
        log.info("checkpoint at step %d (%.2f s)", step, took_s)

    def planned(self, record: Dict[str, Any], stats) -> None:
        """A planned step ran (record: its plan): keep the plan with the measured time."""
        self.plans.append({**record, "measured_ms": stats.step_s * 1e3})
        self._step_tokens = record["real_tokens"]
        if self.ctx.is_root:
            log.info("step %d plan: %s %s, %d micro-batches on dp rank 0, predicted %.1f ms, "
                     "measured %.1f ms, planned in %.1f ms", record["step"] + 1, record["kind"],
                     record["mode"], len(record["micro_batches"][0]), record["predicted_ms"],
                     stats.step_s * 1e3, record["planning_ms"])

    def record(self, step: int, lr: float, stats) -> None:
        row = {"step": step, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm,
               "skipped": stats.skipped, **{k: getattr(stats, k) for k in TIME_PARTS}}
        moe = ""
        if getattr(stats, "tokens_per_expert", None) is not None:
            # mixture of experts: the balance loss and the load (summed over MoE layers)
            counts = stats.tokens_per_expert
            row |= {"aux_loss": stats.aux_loss, "tokens_per_expert": counts,
                    "expert_load_max_over_mean": _max_over_mean(counts)}
            moe = (f"  aux {stats.aux_loss:.4f}  expert load max/mean "
                   f"{row['expert_load_max_over_mean']:.2f}")
        self.steps.append(row)
        self.losses[step] = stats.loss
        tokens = self._step_tokens or self.tokens_per_step
        self._step_tokens = None
        if not self.ctx.is_root:
            return
        tokens_per_s = tokens / stats.step_s if stats.step_s > 0 else 0.0
        line = (f"step {step}/{self.t.steps}  loss {stats.loss:.4f}  lr {lr:.2e}  "
                f"grad {stats.grad_norm:.3f}  {stats.step_s * 1e3:.1f} ms  "
                f"{tokens_per_s:,.0f} tok/s  mem {_memory_MiB(self.ctx.device):.0f} MiB{moe}")
        log.info("%s", line)
        if step % max(1, self.t.log_every) == 0 or step == self.t.steps:
            self.console.print(line, markup=False, highlight=False)
            now = time.monotonic()
            if self.run.ledger is not None and (now - self._progress_at >= PROGRESS_EVERY_S
                                                or step == self.t.steps):
                self._progress_at = now
                self.run.ledger.set_progress(self.run.key, f"step {step}/{self.t.steps}, "
                                                           f"loss {stats.loss:.4f}")

    def timed_steps(self) -> List[Dict[str, Any]]:
        """This run's steps after the timing warm-up (all of them if too few)."""
        skip = self.t.timing_warmup_steps
        timed = self.steps[skip:] if len(self.steps) > skip else self.steps
        return timed

    def rank_summary(self, monitor) -> dict:
        """This rank's medians over the timed steps and its memory, for rank 0."""
        timed = self.timed_steps()
        medians = {k: statistics.median(r[k] for r in timed) if timed else None
                   for k in TIME_PARTS}
        peak = monitor.peak_MiB()
        # On CPU the RSS holds the interpreter and libraries too: the training's own memory is
        # the peak over the RSS before the model was built (the first sample).
        on_cpu = self.ctx.device is None or self.ctx.device.type != "cuda"
        base = monitor.samples[0]["rss_MiB"] if on_cpu and monitor.samples else 0.0
        counted = (None if self.tensor_peak_bytes is None else self.tensor_peak_bytes / MiB)
        return {"rank": self.ctx.rank, "medians_s": medians,
                "step_s": [r["step_s"] for r in self.steps],
                # the training's own peak: the tensors counted (CPU), else the allocator's (GPU)
                # or the RSS over its start
                "peak_MiB": counted if counted is not None else peak - base,
                "peak_source": ("tensors counted in one step" if counted is not None else
                                "CUDA allocator" if not on_cpu else "RSS over its start"),
                "process_peak_MiB": peak, "samples": monitor.samples}


def strategy_batch_note(cfg, target) -> Optional[str]:
    """The strategy's global batch where it is not the one this command's search section asks
    (a search for another batch failed, or was never run): train runs the strategy's, and
    says so (`target`: train/plan.TrainTarget)."""
    from orchestrator.commands import rerun_command

    t, layout = cfg.train, target.layout
    if (target.source != "strategy" or t.global_batch_size or t.num_micro_batches
            or t.micro_batch_size  # the user changed the batch
            or layout.global_batch_size == cfg.search.global_batch_size):
        return None
    return (f"{target.strategy_file.name} is a layout for a global batch of "
            f"{layout.global_batch_size}, not search.global_batch_size="
            f"{cfg.search.global_batch_size}: training its {layout.global_batch_size} (search "
            f"for the other: {rerun_command('search')}; or set train.global_batch_size)")


def shared_cores_note(ctx) -> str:
    """A note when this host's CPU ranks outnumber the cores they may run on (4 ranks of the
    local cluster on a 2-core laptop): each step then waits on the other ranks' CPU, so its
    time, and the error of a prediction priced from profiles taken under other load, vary
    from run to run. '' otherwise."""
    if ctx.device.type != "cpu":
        return ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not cores or ctx.local_world_size <= cores:
        return ""
    return (f"{ctx.local_world_size} ranks share this host's {cores} CPU cores: a step waits "
            f"on the other ranks' CPU, so its time and the prediction's error vary from run to "
            f"run (stage=tune calibrates to what this host measures)")


def _memory_MiB(device) -> float:
    import torch

    if device is not None and device.type == "cuda":
        return torch.cuda.memory_allocated(device) / MiB
    from orchestrator.train.monitor import rss_MiB

    return rss_MiB()


def measured_parts(per_rank: List[dict], layout) -> Dict[str, Any]:
    """Iteration time (the slowest rank's median), and per pipeline stage the compute,
    pipeline waits (bubble + p2p), exposed gradient sync and optimizer time (ms, medians of
    the stage's ranks), peak memory per rank."""
    med = [r["medians_s"] for r in per_rank]
    step_ms = max(m["step_s"] for m in med) * 1e3
    stages = []
    for j in range(layout.pp):
        ranks = [m for r, m in zip(per_rank, med) if layout.coordinate(r["rank"], Group.pp) == j]

        def ms(key):
            return statistics.median(m[key] for m in ranks) * 1e3
        stages.append({"compute_ms": ms("compute_s"),
                       # the norm's all-reduce waits for the slowest stage: the pipeline's drain
                       "pipeline_wait_ms": ms("fwd_bwd_s") - ms("compute_s") + ms("norm_s"),
                       "dp_sync_exposed_ms": ms("sync_wait_s"),
                       "optimizer_ms": ms("optimizer_s")})
    return {"iteration_ms": step_ms, "stages": stages,
            "peak_memory_MiB": [r["peak_MiB"] for r in per_rank],
            "peak_memory_source": per_rank[0].get("peak_source", ""),
            "process_peak_MiB": [r["process_peak_MiB"] for r in per_rank]}


def predicted_parts(prediction, layout) -> Optional[Dict[str, Any]]:
    """The same parts from the planner: per stage compute (+TP comm, recompute) over all
    micro-batches, the bubble and pp sends, dp sync exposed; memory per stage (MiB)."""
    if prediction is None:
        return None
    m = layout.num_micro_batches
    b = prediction.breakdown_us
    stages = []
    for j in range(layout.pp):
        stages.append({"compute_ms": m * prediction.stage_time_us[j] / 1e3,
                       "memory_MiB": prediction.memory_bytes[j]["total"] / MiB})
    return {"iteration_ms": prediction.iteration_time_us / 1e3, "stages": stages,
            "bubble_ms": b["bubble"] / 1e3, "pp_comm_ms": b["pp_comm"] / 1e3,
            "dp_sync_exposed_ms": b["dp_sync_exposed"] / 1e3,
            "peak_memory_MiB": prediction.peak_memory_bytes / MiB,
            "breakdown_ms": {k: v / 1e3 for k, v in b.items()}}


def relative_inputs(cfg, target) -> dict:
    """The strategy layout file read, by path relative to the cluster folder, with its digest."""
    if target.strategy_file is None:
        return {}
    folder = cluster_dir(cfg.profiles_dir, cfg.cluster.name)
    path, root = target.strategy_file.resolve(), folder.resolve()
    # train.layout may name a file anywhere: relative to the cluster's folder where it is in it
    name = path.relative_to(root) if path.is_relative_to(root) else path
    return {str(name): {"sha256": file_sha256(path), "source": None}}


def _set_aside_another_configs(out: Path, config_hash: str, steps_log: StepLog) -> None:
    """The layout's result written under another config (steps, lr, data, the model's shape)
    is a measurement of its own: moved aside with its plots (store.set_aside), not
    overwritten, and said in a note."""
    try:
        written = read_json(out)["provenance"]["config_hash"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # none, or nothing readable to keep
    if written == config_hash:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside = set_aside(out, stamp)
    for plot in (out.with_suffix(".png"), out.with_suffix(".memory.png")):
        if plot.exists():
            set_aside(plot, stamp)
    steps_log.note(f"{out.name} was written under another config: kept as {aside.name}")


def write_summary(run, cfg, target, prediction, note, per_rank, steps_log: StepLog, out: Path,
                  data_text: str) -> dict:
    """Rank 0: the summary file (+ PNGs), a table on the console; the stage's result row."""
    from orchestrator.train.plan import train_dtype

    _set_aside_another_configs(out, run.request.config_hash, steps_log)

    layout = target.layout
    measured = measured_parts(per_rank, layout)
    predicted = predicted_parts(prediction, layout)
    tokens = layout.global_batch_size * target.seq_len
    mfu = _mfu(cfg, target, measured["iteration_ms"], layout)
    error, microbatching = None, None
    if steps_log.plans:
        microbatching = _microbatching(cfg, steps_log)
        # Every step has its own plan: the fixed layout's prediction does not apply.
        predicted, note, mfu = None, "variable-length samples: see microbatching", None
        error = microbatching["error"]
        tokens = microbatching["real_tokens"] / max(1, microbatching["iterations"])
    elif predicted is not None:
        error = (predicted["iteration_ms"] - measured["iteration_ms"]) / measured["iteration_ms"]
    measured["tokens_per_s"] = tokens / (measured["iteration_ms"] / 1e3)
    losses = dict(sorted(steps_log.losses.items()))
    summary = new_profile(
        "train", "measured", run.provenance(), model=cfg.model.name,
        inputs=relative_inputs(cfg, target), layout=layout.to_dict(),
        describe=layout.describe(), layout_source=target.source, seq_len=target.seq_len,
        dtype=train_dtype(cfg).value,
        data=data_text, steps=cfg.train.steps, timed_steps=len(steps_log.timed_steps()),
        losses={str(k): v for k, v in losses.items()},
        first_loss=losses[min(losses)] if losses else None,
        last_loss=losses[max(losses)] if losses else None,
        measured=measured, predicted=predicted, prediction_note=note,
        iteration_time_error=error, mfu=mfu, notes=steps_log.notes,
        checkpoints=steps_log.checkpoints,
        step_times_ms={str(r["rank"]): [s * 1e3 for s in r["step_s"]] for r in per_rank},
        microbatching=microbatching, moe=_moe_section(steps_log))
    write_json(out, summary)
    if cfg.train.plot:
        from orchestrator.train.monitor import plot_memory

        if any(r["samples"] for r in per_rank):
            plot_memory({r["rank"]: r["samples"] for r in per_rank},
                        out.with_suffix(".memory.png"))
        plot_summary(summary, out.with_suffix(".png"))
    print_summary(summary, steps_log.console)
    return {"path": str(out), "layout": layout.describe(),
            "measured_ms": measured["iteration_ms"],
            "predicted_ms": predicted["iteration_ms"] if predicted else None,
            "error": error, "tokens_per_s": measured["tokens_per_s"],
            "first_loss": summary["first_loss"], "last_loss": summary["last_loss"]}


def _moe_section(steps_log: StepLog) -> Optional[Dict[str, Any]]:
    """A mixture-of-experts run's routing per step of this run: the balance loss, the tokens
    each expert received (summed over MoE layers and ranks) and the busiest over the mean."""
    rows = [r for r in steps_log.steps if "tokens_per_expert" in r]
    if not rows:
        return None
    return {"aux_loss": {str(r["step"]): r["aux_loss"] for r in rows},
            "tokens_per_expert": {str(r["step"]): r["tokens_per_expert"] for r in rows},
            "expert_load_max_over_mean": {str(r["step"]): r["expert_load_max_over_mean"]
                                          for r in rows}}


def _microbatching(cfg, steps_log: StepLog) -> Dict[str, Any]:
    """The summary's section of a variable-length run: medians of predicted vs measured
    iteration time and planning time over the timed steps, and every step's plan."""
    from orchestrator.train.microbatching import summarize

    t = cfg.train
    return {"kind": str(t.microbatching),
            **summarize(steps_log.plans, steps_log.plans[0]["step"] + t.timing_warmup_steps),
            "steps": steps_log.plans}


def _mfu(cfg, target, iteration_ms: float, layout) -> Optional[float]:
    """Model FLOPs utilisation on GPUs: 6 N tokens + attention FLOPs per iteration over the
    devices' bf16 dense peak (conf/device/<name>.yaml); None on CPUs."""
    if cfg.cluster.backend != Backend.nccl:
        return None
    from orchestrator.device import dense_peak_flops, load_device_sheet, model_flops
    from orchestrator.errors import ConfigError
    from orchestrator.models.config import count_active_params

    model = cfg.model
    tokens = layout.global_batch_size * target.seq_len
    flops = model_flops(count_active_params(model), model.layers, model.hidden, target.seq_len, tokens)
    dtype = cfg.train.dtype or Dtype.bf16
    try:
        peak = dense_peak_flops(load_device_sheet(cfg.profile_model.device or "h100"), dtype)
    except (ConfigError, ValueError, OSError):  # no sheet for it: no MFU, the rest stands
        return None
    return flops / (iteration_ms / 1e3) / (peak * layout.world_size)


def print_summary(summary: dict, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    m, p = summary["measured"], summary["predicted"]
    table = Table(title=escape(f"train {summary['model']}: {summary['describe']}"))
    for col in ("part", "predicted", "measured"):
        table.add_column(col, justify="left" if col == "part" else "right")

    def fmt(v, unit=" ms"):
        return f"{v:.1f}{unit}" if v is not None else "-"
    table.add_row("iteration", fmt(p["iteration_ms"]) if p else "-", fmt(m["iteration_ms"]))
    mb = summary.get("microbatching")
    if mb and not p:  # variable lengths: each step's plan is its prediction
        table.add_row("iteration, median of the planned steps", fmt(mb["predicted_ms"]),
                      fmt(mb["measured_ms"]))
    for j, stage in enumerate(m["stages"]):
        table.add_row(f"stage {j} compute", fmt(p["stages"][j]["compute_ms"]) if p else "-",
                      fmt(stage["compute_ms"]))
        table.add_row(f"stage {j} pipeline wait", "", fmt(stage["pipeline_wait_ms"]))
        table.add_row(f"stage {j} dp sync exposed", "", fmt(stage["dp_sync_exposed_ms"]))
        table.add_row(f"stage {j} optimizer", "", fmt(stage["optimizer_ms"]))
    if p:
        table.add_row("bubble + pp sends", fmt(p["bubble_ms"] + p["pp_comm_ms"]), "")
        table.add_row("dp sync exposed", fmt(p["dp_sync_exposed_ms"]), "")
    source = m.get("peak_memory_source")
    table.add_row("peak memory" + (f" ({source})" if source else ""),
                  fmt(p["peak_memory_MiB"], " MiB") if p else "-",
                  fmt(max(m["peak_memory_MiB"]), " MiB"))
    console.print(table)
    if mb:
        console.print(f"{mb['kind']} micro-batching over {mb['iterations']} steps: predicted "
                      f"{mb['predicted_ms']:.1f} ms vs measured {mb['measured_ms']:.1f} ms "
                      f"(medians), planned in {mb['planning_ms']:.1f} ms; "
                      f"{mb['real_tokens'] / max(1, mb['padded_tokens']) * 100:.0f}% of the "
                      f"tokens computed are real; {mb['skipped_samples']} samples skipped",
                      highlight=False, markup=False)
    err = summary["iteration_time_error"]
    console.print(f"tokens/s {m['tokens_per_s']:,.0f}; loss {summary['first_loss']:.4f} -> "
                  f"{summary['last_loss']:.4f}"
                  + (f"; predicted/measured error {err * 100:+.1f}%" if err is not None else
                     f"; {summary['prediction_note']}")
                  + (f"; MFU {summary['mfu'] * 100:.1f}%" if summary["mfu"] else ""),
                  highlight=False, markup=False)


def plot_summary(summary: dict, path: Path) -> Path:
    """Loss over steps, and iteration time per step (each rank), predicted as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from orchestrator.store import save_figure

    fig, (ax_loss, ax_time) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = sorted(int(k) for k in summary["losses"])
    ax_loss.plot(steps, [summary["losses"][str(s)] for s in steps])
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    for rank, times in summary["step_times_ms"].items():
        ax_time.plot(range(1, len(times) + 1), times, lw=0.8, label=f"rank {rank}")
    if summary["predicted"]:
        ax_time.axhline(summary["predicted"]["iteration_ms"], color="k", ls="--",
                        label="predicted")
    ax_time.set(xlabel="step (this run)", ylabel="ms", title="iteration time")
    ax_time.legend(fontsize=7)
    fig.suptitle(summary["describe"], fontsize=9)
    fig.tight_layout()
    out = save_figure(fig, path)
    plt.close(fig)
    return out


def measured_run_parts(measured: Dict[str, Any]) -> Dict[str, float]:
    """A summary's `measured` as the parts calibration fits (planner.prediction.run_parts_ms):
    iteration, each stage's compute, the first stage's exposed sync and optimizer step (ms)."""
    stages = measured["stages"]
    parts = {"iteration": float(measured["iteration_ms"]),
             "dp_sync_exposed": float(stages[0]["dp_sync_exposed_ms"]),
             "optimizer": float(stages[0]["optimizer_ms"])}
    parts.update({f"compute/{j}": float(s["compute_ms"]) for j, s in enumerate(stages)})
    return parts


def _max_over_mean(counts) -> float:
    """The busiest expert's tokens over the mean (1.0: perfectly balanced)."""
    mean = sum(counts) / len(counts) if counts else 0.0
    return max(counts) / mean if mean else 0.0
