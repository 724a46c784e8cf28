"""train: run a layout for real on the cluster's ranks and measure it against the planner.

The layout is search's (profiles/<cluster>/strategy/<model>.layout.json), changed by any
`train.*` field given, or explicit (train.pp / train.tp; dp derived). Every rank builds its part
(orchestrator/train/engine.py), trains `train.steps` iterations on seeded synthetic tokens or a
text corpus, checkpoints every `train.checkpoint_every` steps, at the end and at a signal (USR2
before a Slurm time limit: the job is requeued and resumes), and rank 0 writes
profiles/<cluster>/train/<model>/<layout-tag>.json (+ .png, memory PNG): measured iteration
times without warm-up, tokens/s, peak memory per rank, and the planner's prediction for the
same layout beside each measured part. A rerun of the same command resumes from the last
checkpoint (profiles/<cluster>/train/<model>/<layout-tag>.ckpt/). Each layout has its own ledger
key, `train/<model>/<layout-tag>`, so training another layout in between never makes one
train again.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import time
from typing import List, Optional

from orchestrator.choices import Microbatching, Ranks
from orchestrator.stages import Stage, StageInput, check_ranks_reachable
from orchestrator.train.plan import (check_length_mean, check_memory, check_work, layout_file,
                                     layout_tag, predict, resolve, train_compile,
                                     train_device, train_dir)

log = logging.getLogger("orchestrator.train")


class StrategyLayout:
    """The strategy's layout.json as a stage input (it is plain JSON, not a profile record)."""

    KIND = "layout"


def summary_path(cfg, layout, label: str = ""):
    """<layout-tag>[-<microbatching>].json: variable-length runs keep their own summary and
    checkpoints beside the fixed-length run of the same layout."""
    from orchestrator.sweep import labelled

    kind = cfg.train.microbatching
    suffix = "" if kind == Microbatching.fixed else f"-{kind}"
    return labelled(train_dir(cfg) / f"{layout_tag(layout)}{suffix}.json", label)


class Train(Stage):
    name = "train"
    # dynamo, even where nothing compiles: DTensors, pipelining, the CPU run's live-tensor
    # count and torch.optim's step import it on first use (docs/testing.md)
    rank_imports = ("torch._dynamo", "torch.distributed.tensor", "orchestrator.train.engine",
                    "orchestrator.train.checkpoint", "orchestrator.train.data",
                    "orchestrator.train.monitor", "orchestrator.train.report")
    hash_sections = ("cluster", "model", "train")
    hash_exclude = ("train.log_every", "train.plot", "train.memory_interval_s",
                    "train.checkpoint_every", "train.keep_checkpoints", "train.allow_oom_risk",
                    "train.memory_GiB")
    sweep_section = "train"
    requeues = 50  # each run keeps its checkpoints: a short time limit only costs restarts

    def plan(self, cfg):
        from orchestrator.sweep import point_label

        # First: a layout for the cluster's ranks is no use where the launcher cannot run them.
        check_ranks_reachable(self.name, Ranks.cluster, cfg)
        train_compile(cfg, train_device(cfg))  # a bad train.compile: refused before launch
        inputs, outputs, target = [], [], None
        explicit = (cfg.train.pp is not None or cfg.train.tp is not None
                    or cfg.train.cp is not None or cfg.train.layout is not None)
        if not explicit:
            inputs.append(StageInput(layout_file(cfg), StrategyLayout, "search"))
        # the per-iteration planner prices with them
        if cfg.train.microbatching != Microbatching.fixed:
            from orchestrator.store import hardware_path, model_profile_path
            from orchestrator.store.schema import HardwareProfile, ModelProfile

            inputs += [StageInput(hardware_path(cfg.profiles_dir, cfg.cluster.name),
                                  HardwareProfile, "profile_hardware"),
                       StageInput(model_profile_path(cfg.profiles_dir, cfg.cluster.name,
                                                     cfg.model.name),
                                  ModelProfile, "profile_model")]
        if explicit or layout_file(cfg).exists():
            target = resolve(cfg)  # else search writes it first (stage=all): resolved on the ranks
            check_work(cfg, target)  # before its prediction walks the schedule
            outputs.append(summary_path(cfg, target.layout))  # the pipeline labels sweep points
            check_memory(cfg, predict(cfg, target.layout, target.seq_len)[0])
        # Without a layout yet (search writes it in this command) the sequence length will be
        # search's: search.seq_len, else model.seq_len.
        check_length_mean(cfg.train, target.seq_len if target else
                          cfg.train.seq_len or cfg.search.seq_len or cfg.model.seq_len)
        if cfg.train.load:  # no checkpoint there, or another model's: refused before launch
            from orchestrator.train.load_check import check_load

            check_load(cfg, target.layout.tp if target else None)
        if cfg.train.data:  # a bad corpus path is a config error, before launch
            from orchestrator.train.data import make_data

            make_data(cfg.train.data, cfg.model.vocab, cfg.train.seq_len or cfg.model.seq_len,
                      cfg.train.seed)
        # Each layout has its own ledger key, named as its summary (`train/tiny/<layout tag>`):
        # A, B, then A again finds A done. When search writes the layout in this command the
        # ranks name the summary themselves, under `train/<model>` (`launch_plan`), which a
        # later run of that layout takes as its own record until it has one (`former_key`).
        model_key = f"train/{cfg.model.name}"
        return self.make_plan(cfg, key=f"{model_key}/{outputs[0].stem}" if outputs else model_key,
                              former_key=model_key if outputs else None, ranks=Ranks.cluster,
                              inputs=inputs, outputs=outputs,
                              detail=point_label(cfg, self.sweep_section))

    def launch_plan(self, plan, produced_now):
        """Search ran in this command (stage=all): the strategy's layout this plan named its key
        after may have changed (the ranks train the new one), so the run is recorded under
        `train/<model>`, which the next plan of that layout takes as its record."""
        rewritten = any(i.profile is StrategyLayout and i.producer in produced_now
                        for i in plan.inputs)
        if rewritten and plan.former_key:
            return dataclasses.replace(plan, key=plan.former_key, former_key=None)
        return plan

    def read_inputs(self, cfg, plan) -> List[str]:
        strategy = [x for x in plan.inputs if x.profile is StrategyLayout]
        if strategy and not strategy[0].path.exists():
            resolve(cfg)  # the ProfileError naming the search command
        for needed in plan.inputs:
            if needed.profile is not StrategyLayout:
                needed.read(cfg)
        return []

    def run(self, ctx, run):
        return train(ctx, run)


STAGE = Train()


# ---------------------------------------------------------------------- on every rank
class StopFlag:
    """Set by USR2 (Slurm's warning before a time limit or preemption) or SIGTERM (scancel);
    the loop checkpoints at the end of the step every rank agrees on, then hands over to
    submitit's handler (task 0: requeue) or exits."""

    def __init__(self):
        self.signum: Optional[int] = None
        self.previous = {}
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            self.previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._set)

    def _set(self, signum, frame):
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "no signal"

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def hand_over(self, is_root: bool) -> None:
        """After the checkpoint: submitit's handler where there is one (on task 0 it requeues
        the job and exits), then exit: with 0 on submitit's other tasks, since a non-zero exit
        makes srun (--kill-on-bad-exit) end the step, racing task 0's requeue; else naming the
        signal."""
        signum = self.signum or signal.SIGUSR2
        handler = self.previous.get(signum)
        self.restore()
        if callable(handler):
            handler(signum, None)
            if not is_root:
                raise SystemExit(0)
        raise SystemExit(f"stopped by {self.name}; checkpoint written")


def train(ctx, run):
    import torch

    from orchestrator.train.checkpoint import (checkpoint_to_load, load_checkpoint, load_latest,
                                               latest_checkpoint)
    from orchestrator.train.data import make_data
    from orchestrator.train.engine import Engine, OptimSettings
    from orchestrator.train.lr import lr_at, warmup_steps
    from orchestrator.train.monitor import MemoryMonitor
    from orchestrator.errors import InfeasibleError
    from orchestrator.train.plan import memory_budget_GiB, model_config, train_dtype
    from orchestrator.train.report import (StepLog, shared_cores_note, strategy_batch_note,
                                           write_summary)

    cfg, t = run.cfg, run.cfg.train
    target = resolve(cfg)
    layout = target.layout
    prediction, note = predict(cfg, layout, target.seq_len)
    if ctx.is_root:
        check_memory(cfg, prediction)
    torch.manual_seed(t.seed)
    monitor = MemoryMonitor(t.memory_interval_s, ctx.device)
    monitor.start()
    engine = Engine(layout, model_config(cfg, target.seq_len), ctx.device, train_dtype(cfg),
                    seed=t.seed, optim=OptimSettings(weight_decay=t.weight_decay),
                    compile=train_compile(cfg, ctx.device.type))
    data = make_data(t.data, cfg.model.vocab, target.seq_len, t.seed)
    planner = _variable_length_planner(cfg, layout, target.seq_len, data)
    if planner is not None:
        # Shapes change every micro-batch: cuDNN's attention (torch's first choice on H100)
        # builds a graph per new shape, 110-190 ms each (docs/gpu.md); flash has no such cost.
        torch.backends.cuda.enable_cudnn_sdp(False)
    out = summary_path(cfg, layout, run.plan.detail)
    ckpt_dir = out.with_suffix(".ckpt")
    steps_log = StepLog(ctx, run, layout, target.seq_len, t)
    steps_log.identity = run_identity(cfg, layout.describe())
    if engine.compiled:
        steps_log.note(f"torch.compile: each block compiled (train.compile={t.compile}); "
                       f"the first steps include compiling")
    noted = _note_compile(engine, steps_log, 0)
    for text in (shared_cores_note(ctx), strategy_batch_note(cfg, target)):
        if text:
            steps_log.note(text)
    start, warnings = _resume(engine, ckpt_dir, t, load_latest, latest_checkpoint,
                              load_checkpoint, checkpoint_to_load, steps_log)
    for w in warnings:
        steps_log.warn(w)
    stop = StopFlag()  # until the summary is written: a signal after the last step is ignored
    samples_per_rank = layout.micro_batch_size * layout.num_micro_batches
    # Rank 0 plans one step ahead on a background thread and broadcasts each plan: planning
    # costs one rank's CPU, not every rank's (on a small host the ranks share its cores).
    planning = planner is not None and ctx.is_root
    ahead = planner.submit(start) if planning and start < t.steps else None
    try:
        for step in range(start, t.steps):
            lr = lr_at(step, t.lr, warmup_steps(t.warmup_steps, t.steps), t.steps,
                       t.min_lr_ratio)
            if planner is None:
                tokens, targets = data.rank_batch(step, engine.dp_rank, layout.dp,
                                                  samples_per_rank)
                with _tensor_count(engine, tokens, targets, step - start, t, steps_log):
                    stats = engine.train_step(tokens, targets, lr, t.grad_clip,
                                              stop=stop.signum is not None)
            else:
                iteration = _shared_plan(ctx, ahead)
                # The next plan is made while this step trains.
                ahead = planner.submit(step + 1) if planning and step + 1 < t.steps else None
                stats = _planned_step(engine, planner, iteration, data, lr, t.grad_clip,
                                      stop.signum is not None, steps_log)
                if stats is None:
                    continue
            monitor.mark(f"step {step + 1}")
            noted = _note_compile(engine, steps_log, noted)  # a part fallen back to eager
            steps_log.record(step + 1, lr, stats)
            last = step + 1 == t.steps  # done: nothing left for a requeued job to resume
            stopping = not last and stats.stop  # agreed by every rank in the step
            if stopping:  # before the save, so that the checkpoint carries the note
                steps_log.warn(
                    f"{stop.name}: checkpoint at step {step + 1} written; stopping (a requeued "
                    f"job or a rerun resumes from it)" if t.keep_checkpoints else
                    f"{stop.name}: stopping at step {step + 1} without a checkpoint "
                    f"(train.keep_checkpoints=0): a requeued job or a rerun starts again")
            due = last or stopping or (t.checkpoint_every and (step + 1) % t.checkpoint_every == 0)
            if due and t.keep_checkpoints:  # 0: a run only timed writes none
                _save(engine, ckpt_dir, step + 1, t, steps_log)
            if stopping:
                monitor.stop()
                stop.hand_over(ctx.is_root)
        monitor.stop()
        if not steps_log.steps and start < t.steps:
            # every iteration was skipped: no sample fits the memory budget even alone
            raise InfeasibleError(
                f"no sample of steps {start + 1}-{t.steps} fits train.memory_GiB="
                f"{memory_budget_GiB(cfg)} (less the search's reserve) even alone with full "
                f"recompute: nothing was trained. Raise train.memory_GiB, or shorten "
                f"train.seq_len")
        per_rank = ctx.gather(steps_log.rank_summary(monitor))
        if not ctx.is_root:
            return None
        return write_summary(run, cfg, target, prediction, note, per_rank, steps_log, out,
                             data.describe() if planner is None else
                             f"{data.describe()}, {planner.distribution.describe()}")
    finally:
        stop.restore()
        monitor.stop()
        if planner is not None:
            planner.close()


def _note_compile(engine, steps_log, noted: int) -> int:
    """Note the engine's compile lines from the `noted`-th on (what stays eager and why);
    returns how many are noted."""
    for text in engine.compile_notes[noted:]:
        steps_log.note(text)
    return len(engine.compile_notes)


def _variable_length_planner(cfg, layout, seq_len: int, data):
    """The per-iteration planner of train.microbatching=dynamic | padded | packed (None for
    fixed): lognormal sample lengths (mean train.length_mean, else seq_len / 4, at most
    seq_len), priced with the cluster's profiles against the memory budget minus the search's
    reserve."""
    from orchestrator.choices import Microbatching
    from orchestrator.train.data import LengthDistribution
    from orchestrator.train.microbatching import IterationPlanner, budget_bytes, with_fast_mode
    from orchestrator.train.plan import memory_budget_GiB, planner_profiles

    t = cfg.train
    kind = Microbatching.parse(t.microbatching)
    if kind == Microbatching.fixed:
        return None
    model_cost, hardware = planner_profiles(cfg)
    mean = t.length_mean or max(1, seq_len // 4)
    distribution = LengthDistribution(mean_len=float(mean), max_len=seq_len)
    s = cfg.search
    budget = budget_bytes(memory_budget_GiB(cfg), s.reserve_fraction, s.reserve_GiB)
    return IterationPlanner(kind, layout, data, distribution, model_cost, hardware, budget,
                            seq_len, with_fast_mode(kind, s.fast_mode))


def _shared_plan(ctx, ahead):
    """Rank 0's plan of this step (its background future) on every rank, over MPI; a planning
    error on rank 0 is raised on every rank (none waits for a plan that never comes)."""
    found = None
    if ctx.is_root:
        try:
            found = ahead.result()
        except Exception as exc:  # noqa: BLE001 (re-raised below, on every rank)
            found = exc
    found = ctx.bcast(found)
    if isinstance(found, Exception):
        raise found
    return found


def _planned_step(engine, planner, iteration, data, lr: float, grad_clip: float, stop: bool,
                  steps_log):
    """One step of a planned iteration on this rank; every rank skips an iteration in which
    some dp rank was left with no sample (it could not join the gradient collectives)."""
    from orchestrator.train.microbatching import empty_ranks, rank_inputs

    record = iteration.record()
    empty = empty_ranks(iteration.plan)
    if empty:
        steps_log.warn(f"step {iteration.step + 1}: dp rank(s) {empty} have no sample that "
                       f"fits (skipped: {record['skipped']}); the iteration is skipped")
        return None
    inputs = rank_inputs(iteration, data, engine.dp_rank, planner.samples_per_rank)
    stats = engine.train_step_micro_batches(
        inputs, lr, grad_clip, iteration.total_tokens, stop=stop,
        extra_warmup=iteration.plan.extra_warmup_of(engine.dp_rank),
        total_rows=iteration.total_rows)
    steps_log.planned(record, stats)
    return stats


@contextlib.contextmanager
def _tensor_count(engine, tokens, targets, index: int, t, steps_log):
    """On CPU, count every live tensor byte of this run's second step (the optimizer's states
    exist, and it is a timing warm-up step: the counting's overhead is not timed): the RSS
    cannot tell the training's memory from the allocator's and the libraries', this can, and
    the report compares it with the planner's peak. GPUs report the allocator's peak instead."""
    device = engine.device
    if device.type == "cuda" or index != 1 or t.timing_warmup_steps < 2:
        yield
        return
    from orchestrator.train.live_memory import LiveTensorBytes

    live = LiveTensorBytes(device, [engine, tokens, targets])
    with engine.eager(), live:  # dynamo refuses to run under the counting's mode
        yield
    steps_log.tensor_peak_bytes = live.peak_bytes


def _resume(engine, ckpt_dir, t, load_latest, latest_checkpoint, load_checkpoint,
            checkpoint_to_load, steps_log):
    """The step to start from: the last good checkpoint of this layout's folder, else
    train.load (any layout), else 0; the warnings about checkpoints skipped.

    The state dict a checkpoint loads into is made only when there is one to load, and dropped
    once the engine has taken it: made before the first step it held zeros beside AdamW's own
    moments (8 bytes per parameter, all run long: 31.0 GiB instead of 22.9 measured on one GPU,
    docs/gpu.md), and under ZeRO 1/2 every moment gathered whole on every rank."""
    from orchestrator.train.checkpoint import CheckpointError

    made = []

    def state() -> dict:
        if not made:
            made.append(engine.state())
        return made[0]

    _set_aside_unusable(ckpt_dir, t, steps_log, latest_checkpoint)
    info, warnings = load_latest(ckpt_dir, state)
    if info is not None:
        engine.load_state(state(), info.step, info.extra)
        steps_log.restore(info.extra)
        of = info.extra.get("steps")  # a run of other steps goes on on this run's lr schedule
        longer = (f", of a {of}-step run: on to step {t.steps} on this run's learning-rate "
                  f"schedule" if of and of != t.steps else "")
        steps_log.note(f"resumed from {info.path} (step {info.step}{longer})")
        return info.step, warnings
    if t.load:
        try:  # checked before launch too; a folder can change in between
            found, skipped = checkpoint_to_load(t.load)
        except CheckpointError as e:
            raise CheckpointError(f"train.load={t.load}: {e}") from None
        warnings = warnings + skipped
        extra = load_checkpoint(found, state())
        engine.load_state(state(), found.step, extra)
        steps_log.restore(extra)
        steps_log.note(f"loaded {found.path} (step {found.step}, layout "
                       f"{extra.get('layout', '?')})")
        return found.step, warnings
    return 0, warnings


# train.* keys that do not change the trajectory a checkpoint continues (steps: a rerun with more
# steps goes on from the last checkpoint).
_NOT_IDENTITY = ("steps", "log_every", "plot", "memory_interval_s", "checkpoint_every",
                 "keep_checkpoints", "load", "memory_GiB", "allow_oom_risk", "timing_warmup_steps")


def run_identity(cfg, layout_text: str) -> str:
    """What a checkpoint must have been made under to be resumed: model, train settings, layout."""
    import dataclasses

    from orchestrator.store import config_hash

    train = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in _NOT_IDENTITY}
    return config_hash({"model": dataclasses.asdict(cfg.model), "train": train,
                        "layout": layout_text})


def _set_aside_unusable(ckpt_dir, t, steps_log, latest_checkpoint) -> None:
    """Move this layout's checkpoints aside when they cannot be continued: made under other
    settings, already at the last step (a forced or stale rerun trains anew), or `force=true`.
    Rank 0 decides and moves; every rank learns it (collective)."""
    import torch.distributed as dist

    from orchestrator.store import set_aside

    note = [None]
    if steps_log.ctx.is_root:
        info = latest_checkpoint(ckpt_dir) if ckpt_dir.exists() else None
        why = "" if info is None else (
            "force=true" if steps_log.run.cfg.force
            else "made under other settings" if info.extra.get("identity") != steps_log.identity
            else f"already at step {info.step} of {t.steps}" if info.step >= t.steps else "")
        if why:
            aside = set_aside(ckpt_dir)
            note[0] = (f"checkpoints in {ckpt_dir} {why}: moved to {aside.name}; "
                       f"training from step 0")
    dist.broadcast_object_list(note, src=0)
    if note[0]:
        steps_log.note(note[0])


def _save(engine, ckpt_dir, step: int, t, steps_log) -> None:
    from orchestrator.train.checkpoint import save_checkpoint

    start = time.perf_counter()
    extra = {**steps_log.extra(), **engine.checkpoint_extra()}
    save_checkpoint(ckpt_dir, step, engine.state(), extra, keep=t.keep_checkpoints)
    steps_log.checkpointed(step, time.perf_counter() - start)
