"""search: the fastest layout under a per-device memory budget, from the two profiles.

Reads profiles/<cluster>/hardware.json and profiles/<cluster>/model/<model>.json; writes
profiles/<cluster>/strategy/<model>.json (best layout, prediction and breakdown, top alternatives,
counts, inputs' hashes) and, next to it, the exports: Megatron-LM arguments
(<model>.megatron.args), a Galvatron strategy (<model>.galvatron.json), the layout our own
`train` reads (<model>.layout.json), and a PNG. Runs in one process: it is arithmetic.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from orchestrator import errors
from orchestrator.choices import Ranks
from orchestrator.stages import Stage, StageInput
from orchestrator.store import (STRATEGY_SUFFIXES, atomic_write, cluster_dir, file_sha256,
                                hardware_path, kept_strategy_path, model_profile_path,
                                read_json, strategy_path, write_json,
                                write_profile)
from orchestrator.store.schema import (Alternative, HardwareProfile, ModelProfile,
                                       PredictionRecord, Provenance, SpaceSummary, Source,
                                       StrategyInput, StrategyProfile)
from orchestrator.store.schema.strategy import Headroom
from orchestrator.stages.search_config import (check_work,
                                               infeasible_advice, validate)

GiB = 2**30


def _inputs(cfg):
    """The two profiles, and the cluster's calibration when one fits them (stage=tune): a new
    or refitted calibration makes the strategy stale, so the next search uses it."""
    from orchestrator.store.schema import CalibrationProfile
    from orchestrator.train.plan import current_calibration

    inputs = [StageInput(hardware_path(cfg.profiles_dir, cfg.cluster.name), HardwareProfile,
                         "profile_hardware"),
              StageInput(model_profile_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name),
                         ModelProfile, "profile_model")]
    _, calibration, _ = current_calibration(cfg)
    if calibration is not None:
        inputs.append(StageInput(calibration, CalibrationProfile, "tune"))
    return inputs


@dataclass(frozen=True)
class SearchInputs:
    hardware: HardwareProfile
    model: ModelProfile
    notes: List[str]  # what is extrapolated from them (printed once, kept in the strategy)


def _extrapolation_notes(path: Path, made, world_size: int, per_node: int) -> List[str]:
    """A note when the search plans more ranks than were profiled (priced from the inter-node
    fits); [] otherwise."""
    if world_size <= made.world_size:
        return []
    nodes = -(-world_size // per_node)

    def n_nodes(n):
        return f"{n} node{'s' if n != 1 else ''}"

    return [f"{path.name} measured {n_nodes(made.nodes)} x {made.tasks_per_node} ranks; planning "
            f"{n_nodes(nodes)} ({world_size} ranks): groups spanning more than "
            f"{n_nodes(made.nodes)} priced from the inter-node fits"]


def read_inputs(cfg, plan) -> SearchInputs:
    """The search's input profiles, checked against the model and cluster it is asked about
    (store.schema.identity): ProfileError (exit 4) naming the difference and the command that
    rebuilds the input."""
    hw_in, model_in = plan.inputs[:2]
    hw, mp = hw_in.read(cfg), model_in.read(cfg)
    notes = _extrapolation_notes(hw_in.path, hw.cluster, plan.detail.world_size,
                                 cfg.cluster.tasks_per_node)
    return SearchInputs(hardware=hw, model=mp, notes=notes)


def model_cost(cfg, profile):
    """The planner's view of the model profile for cfg.model (its experts attached for a
    mixture-of-experts model, planner/terms/moe.py)."""
    from orchestrator.planner import ModelCost

    return ModelCost.from_profile(profile).with_moe(cfg.model)


def moe_note(cfg, space) -> List[str]:
    """What a MoE search assumed, kept in the strategy's notes: the load imbalance and its
    source, and that the dispatcher is priced exposed."""
    from orchestrator.models.config import is_moe
    from orchestrator.workload.moe import MoeShape, default_imbalance

    if not is_moe(cfg.model):
        return []
    shape = MoeShape.of(cfg.model)
    given = space.options.moe_imbalance
    imbalance = default_imbalance(shape) if given is None else given
    source = ("search.moe_imbalance" if given is not None else
              "capacity factor: padded" if shape.capacity_factor is not None else
              f"default for model.aux_loss_coef={shape.aux_loss_coef:g}")
    return [f"mixture of experts: busiest EP rank at {imbalance:g}x the mean load ({source}); "
            f"token dispatcher (all-to-all over ep, all-gather/reduce-scatter over etp) priced "
            f"exposed, not overlapped with compute; every block priced as a MoE block"]


def overlap_note(space) -> str:
    """What the search priced as overlapped, kept in the strategy's notes (docs/workload.md
    "Overlap")."""
    if space.options.engine != "megatron":
        return ("overlap: stage=train's engine has no TP overlap (each collective runs between "
                "its matmuls: priced exposed); its gradient sync runs beside the last "
                "micro-batch's backward, ZeRO 1/2's parameter all-gather after the step")
    o = space.options.megatron_overlap()
    on = {True: "on", False: "off"}
    return (f"overlap priced as Megatron-LM runs it: --tp-comm-overlap {on[o.tp_comm]} "
            f"(sequence-parallel layouts), --overlap-grad-reduce {on[o.grad_reduce]}, "
            f"--overlap-param-gather {on[o.param_gather and o.grad_reduce]} (ZeRO 1/2); the "
            f"Megatron export writes the same")


def _exporters(out: Path, model, overlap=None):
    """(name, build(layout, strict), write(path, exported), path) of each trainer's export;
    `overlap`: what the Megatron args say was overlapped (exports.megatron_args)."""
    from orchestrator.planner import galvatron_strategy, megatron_args
    from orchestrator.planner.exports import ExportError, megatron_model_args

    def write_args(path, args):
        atomic_write(path, lambda f: f.write(" ".join(args) + "\n"))

    def megatron(layout, strict):
        return megatron_args(layout, strict, overlap) + megatron_model_args(model)

    def galvatron(layout, strict):
        if model.experts:
            raise ExportError("Galvatron's strategies describe dense transformers only (no "
                              "experts, no expert parallelism)")
        return galvatron_strategy(layout, strict)

    return (("megatron", megatron, write_args, out.with_suffix(".megatron.args")),
            ("galvatron", galvatron, write_json, out.with_suffix(".galvatron.json")))


def _export(strategy: StrategyProfile, out: Path, model, overlap=None) -> None:
    """Write each export next to the strategy and record it in `strategy.exports`: its
    approximations (warnings of strict=False), or its error when it cannot be written at all.
    A failed export never costs the strategy."""
    from orchestrator.planner.exports import ExportError

    exports = strategy.exports
    for name, build, write, path in _exporters(out, model, overlap):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                exported = build(strategy.layout, strict=False)
            except ExportError as e:
                setattr(exports, f"{name}_error", str(e))
                continue
            finally:
                setattr(exports, f"{name}_approximations", [str(w.message) for w in caught])
        setattr(exports, name, exported)
        write(path, exported)


def _strategy(cfg, result, space, inputs, notes, prov: Provenance) -> StrategyProfile:
    """The strategy record of a search result, from the (path, profile) pairs it read (keyed
    relative to the cluster's profiles folder, so a copied folder stays consistent); exports
    still empty."""
    best = result.best
    sources = [profile.source for _, profile in inputs]
    reserve_GiB = space.options.reserve_bytes / GiB
    folder = cluster_dir(cfg.profiles_dir, cfg.cluster.name)
    return StrategyProfile(
        # The least measured input names the strategy's source.
        source=next((src for src in (Source.galvatron, Source.analytic) if src in sources),
                    Source.measured),
        provenance=prov, model=cfg.model.name,
        inputs={str(path.relative_to(folder)): StrategyInput(sha256=file_sha256(path),
                                                            source=profile.source)
                for path, profile in inputs}, notes=list(notes),
        space=SpaceSummary(world_size=space.world_size,
                           memory_GiB=space.memory_budget_bytes / GiB,
                           global_batch_size=space.global_batch_size, seq_len=space.seq_len,
                           fast_mode=space.fast_mode, reserve_fraction=cfg.search.reserve_fraction,
                           reserve_GiB=cfg.search.reserve_GiB, reserve_total_GiB=reserve_GiB,
                           engine=space.options.engine, max_cp=space.max_cp),
        headroom=Headroom(free_GiB=(space.memory_budget_bytes
                                    - result.prediction.peak_memory_bytes) / GiB,
                          reserve_GiB=reserve_GiB),
        layout=best, describe=best.describe(), best=best,
        prediction=PredictionRecord.from_dict(result.prediction.to_dict(), "prediction"),
        top=[Alternative(layout=layout, iteration_time_us=pred.iteration_time_us,
                         peak_memory_bytes=pred.peak_memory_bytes) for layout, pred in result.top],
        considered=result.considered, rejected=dict(result.rejected), pruned=result.pruned,
        solved=result.solved, elapsed_s=result.elapsed_s, fast_mode=result.fast_mode)


def run_search(ctx, run):
    from orchestrator.planner import HardwareModel, search

    cfg, space = run.cfg, run.plan.detail
    hw_in, model_in = run.plan.inputs[:2]
    read = read_inputs(cfg, run.plan)
    hw, mp = read.hardware, read.model
    cost = model_cost(cfg, mp)
    result = search(cost, HardwareModel.from_profile(hw), space)
    (out,) = run.plan.outputs
    inputs = [(hw_in.path, hw), (model_in.path, mp)]
    notes = list(read.notes) + moe_note(cfg, space) + [overlap_note(space)]
    folder = cluster_dir(cfg.profiles_dir, cfg.cluster.name)
    for extra in run.plan.inputs[2:]:  # the calibration its costs were scaled by
        inputs.append((extra.path, extra.read(cfg)))
        notes.append(f"cost model {space.options.calibration.describe()} "
                     f"({extra.path.relative_to(folder)})")
    if result.rejected.get("tp_not_profiled"):  # which setting widens it
        from orchestrator.commands import rerun_command

        notes.append(f"tp_not_profiled: the model profile has tp {sorted(cost.tps)}; profile "
                     f"more TP degrees to search them: "
                     f"{rerun_command('profile_model', 'profile_model.max_tp=<tp>')}")
    if not run.plan.inputs[2:]:  # a calibration stage=tune wrote that no longer fits: say so
        from orchestrator.train.plan import current_calibration

        why = current_calibration(cfg)[2]
        if why:
            notes.append(f"cost model uncalibrated: {why}")
    trained = _trained_layout(inputs[2:], space, result, notes,
                              lambda layout: _in_space(layout, space, cost,
                                                       HardwareModel.from_profile(hw)))
    strategy = _strategy(cfg, result, space, inputs, notes,
                         Provenance.from_dict(run.provenance()))
    kept = keep_other_world(out, space.world_size)
    write_profile(out, strategy)  # first: an export that fails must not cost the answer
    write_json(out.with_suffix(".layout.json"),
               {"model": cfg.model.name, "seq_len": space.seq_len, "layout": trained.to_dict()})
    _export(strategy, out, cfg.model, space.options.megatron_overlap())
    write_profile(out, strategy)
    _report(result, strategy, cfg)
    if notes[len(read.notes):]:  # the calibration used, the pick trained
        from orchestrator.console import stage_console

        for note in notes[len(read.notes):]:
            stage_console().print(f"search: {note}", markup=False, highlight=False)
    if kept is not None:
        from orchestrator.console import stage_console
        from orchestrator.train.plan import train_command

        kept_world = searched_world(kept)
        stage_console().print(
            f"search: the strategy it replaces was for {kept_world} ranks: kept as {kept.name} "
            f"and its files (train it: "
            f"{train_command(cfg, kept.with_suffix('.layout.json'), kept_world)})",
            markup=False, highlight=False)
    if cfg.search.compare:
        _compare(cfg, space, result, model_cost(cfg, mp), HardwareModel.from_profile(hw))
    summary = {"path": str(out), "layout": result.best.describe(),
               "iteration_time_ms": result.prediction.iteration_time_us / 1e3,
               "peak_memory_GiB": result.prediction.peak_memory_bytes / GiB,
               "search_s": result.elapsed_s}
    if cfg.search.plot:
        from orchestrator.planner.report import plot_strategy

        summary["plot"] = str(plot_strategy(strategy, out.with_suffix(".png")))
    return summary


def searched_world(strategy: Path) -> Optional[int]:
    """The number of ranks the strategy at `strategy` was searched for (its layout file's, else
    the strategy's own record); None when there is none or neither reads."""
    for path, section in ((strategy.with_suffix(".layout.json"), "layout"), (strategy, "space")):
        try:
            return int(read_json(path)[section]["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def keep_other_world(out: Path, world_size: int) -> Optional[Path]:
    """Before a search for `world_size` ranks writes `out`: a strategy there searched for
    another number of ranks (what `stage=train` trains on the cluster's ranks) is moved, with
    every file beside it, to kept_strategy_path (an older copy of that size replaced), so a
    search for another cluster size never costs it. Returns where it went (None: nothing
    moved: no strategy there, or one of the same size, which a new search replaces)."""
    old_world = searched_world(out)
    if old_world is None or old_world == world_size:
        return None
    kept = kept_strategy_path(out, old_world)
    for suffix in STRATEGY_SUFFIXES:
        src, dst = out.with_suffix(suffix), kept.with_suffix(suffix)
        if src.exists():
            os.replace(src, dst)
        elif dst.exists():
            dst.unlink()  # an older copy's file this strategy did not have (its plot, say)
    return kept


def _in_space(layout, space, model_cost, hardware) -> bool:
    """Whether the search could have chosen `layout`: its configuration among those the space
    enumerates (planner/space.py's own rules: degrees, ZeRO stages, micro-batch sizes,
    schedules, sequence parallelism), its recompute modes among the space's, and its memory
    within the space's budget (the reserve kept)."""
    from orchestrator.layout import LayoutError
    from orchestrator.planner import evaluate
    from orchestrator.planner.options import ConfigKey
    from orchestrator.planner.space import enumerate_configs

    if ConfigKey.of(layout) not in set(enumerate_configs(model_cost, hardware, space, {})):
        return False
    if not all(mode in space.recompute for mode, _ in layout.recompute):
        return False
    try:
        return evaluate(layout, model_cost, hardware, space.seq_len, space.memory_budget_bytes,
                        space.options).feasible
    except (LayoutError, ValueError):
        return False


def _trained_layout(calibration_inputs, space, result, notes: List[str], in_space=None):
    """What stage=train trains: stage=tune's measured fastest when the calibration read has one
    for this space (same devices, batch and length, and a layout this search could choose:
    `in_space`), else the predicted best."""
    for _, calibration in calibration_inputs:
        pick = calibration.pick
        if (pick is not None and pick.world_size == space.world_size
                and pick.global_batch_size == space.global_batch_size
                and calibration.seq_len == space.seq_len):
            if in_space is not None and not in_space(pick):
                notes.append(f"stage=tune's measured fastest ({calibration.pick_describe}) is "
                             f"outside this search's space (search.* settings): stage=train "
                             f"trains the predicted best")
                return result.best
            if pick != result.best:
                notes.append(f"stage=train trains stage=tune's measured fastest "
                             f"({calibration.pick_describe}), not the predicted best")
            return pick
    return result.best


def _compare(cfg, space, result, model_cost, hardware) -> None:
    """`search.compare`: a Galvatron strategy priced by our cost model, printed next to our
    best term by term (both at their own global batch: tokens/s is the fair figure when the
    batches differ)."""
    from rich.markup import escape

    from orchestrator.console import stage_console
    from orchestrator.interop.galvatron.compare import (compare_predictions, compare_table,
                                              price_galvatron_strategy)

    theirs, notes = price_galvatron_strategy(
        cfg.search.compare, model_cost, hardware, world_size=space.world_size,
        seq_len=space.seq_len, budget_bytes=space.memory_budget_bytes, options=space.options)
    ours = result.prediction
    batch = (ours.layout.global_batch_size, theirs.layout.global_batch_size)
    if batch[0] != batch[1]:
        notes.append(f"global batch: ours {batch[0]}, theirs {batch[1]} (iteration times are "
                     f"not comparable; tokens/s is)")
    console = stage_console()
    console.print(compare_table(compare_predictions(ours, theirs), ours_label="ours",
                                theirs_label=Path(cfg.search.compare).name, notes=notes))
    console.print(escape(f"compare: ours {ours.layout.describe()} {ours.tokens_per_s:,.0f} "
                         f"tokens/s; theirs {theirs.layout.describe()} "
                         f"{theirs.tokens_per_s:,.0f} tokens/s "
                         f"({theirs.tokens_per_s / ours.tokens_per_s - 1:+.1%})"))


def _report(result, strategy: StrategyProfile, cfg) -> None:
    from rich.markup import escape
    from rich.table import Table

    from orchestrator.console import stage_console

    console = stage_console()
    table = Table(title=f"best layouts for {cfg.model.name} on {result.best.world_size} devices "
                        f"({strategy.source.value} profiles; searched {result.considered} "
                        f"configs in {result.elapsed_s:.2f} s; communication and memory of the "
                        f"{strategy.space.engine} engine, search.engine)")
    headroom = strategy.headroom
    reserve_bytes = headroom.reserve_GiB * GiB
    # The model's own peak (the reserve is the same for every layout and would hide it).
    for col in ("#", "layout", "iteration ms", "tokens/s", "model peak GiB"):
        table.add_column(col, justify="right" if col != "layout" else "left")
    for i, (layout, pred) in enumerate(result.top):
        table.add_row(str(i + 1), escape(layout.describe()), f"{pred.iteration_time_us / 1e3:.1f}",
                      f"{pred.tokens_per_s:,.0f}",
                      f"{(pred.peak_memory_bytes - reserve_bytes) / GiB:.2f}")
    console.print(table)
    b = result.prediction.breakdown_us
    console.print("breakdown (ms): " + ", ".join(f"{k} {v / 1e3:.1f}" for k, v in b.items()))
    s = cfg.search
    console.print(f"memory per device: budget {strategy.space.memory_GiB:g} GiB = model peak "
                  f"{(result.prediction.peak_memory_bytes - reserve_bytes) / GiB:.2f} + reserve "
                  f"{headroom.reserve_GiB:.2f} (search.reserve_fraction={s.reserve_fraction} x "
                  f"budget + search.reserve_GiB={s.reserve_GiB}) + headroom "
                  f"{headroom.free_GiB:.2f} GiB")
    if result.rejected:
        console.print("rejected: " + ", ".join(f"{k} {v}" for k, v in result.rejected.items()))
    exports = strategy.exports
    for name in ("megatron", "galvatron"):
        for note in getattr(exports, f"{name}_approximations"):
            console.print(f"{name} export approximates: {escape(note)}")
        if getattr(exports, f"{name}_error"):
            console.print(f"{name} export not written: {escape(getattr(exports, f'{name}_error'))}")


class Search(Stage):
    name = "search"
    hash_sections = ("cluster", "model", "search")
    hash_exclude = ("search.plot", "search.top_k")
    sweep_section = "search"

    def plan(self, cfg):
        space = validate(cfg)
        check_work(cfg, space)
        return self.make_plan(cfg, key=f"search/{cfg.model.name}", ranks=Ranks.one,
                              inputs=_inputs(cfg),
                              outputs=[strategy_path(cfg.profiles_dir, cfg.cluster.name,
                                                     cfg.model.name)],
                              detail=space)

    def read_inputs(self, cfg, plan) -> List[str]:
        return read_inputs(cfg, plan).notes

    def run(self, ctx, run):
        from orchestrator.planner import InfeasibleError

        try:
            return run_search(ctx, run)
        except InfeasibleError as e:  # the planner's fields -> the user's config keys
            raise errors.InfeasibleError(infeasible_advice(e, run.cfg)) from None


STAGE = Search()
