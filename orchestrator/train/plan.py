"""Which layout `stage=train` runs, checked before launch: the strategy search wrote, changed by
any `train.*` field given, or an explicit one (train.pp / train.tp); and what the planner
predicts for it. Pure functions of the config and the profiles on disk."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from orchestrator.choices import Backend, CpComm, Dtype, Microbatching, Recompute, Schedule
from orchestrator.commands import rerun_command
from orchestrator.config import cluster_world_size
from orchestrator.errors import ConfigError, InfeasibleError, InvalidLayout, ProfileError
from orchestrator.layout import ENGINE_CP_COMM, LayoutError, ParallelLayout
from orchestrator.models.compile_setting import train_compile  # noqa: F401 (stages read it)
from orchestrator.store import cluster_dir, hardware_path, model_profile_path, strategy_path

GiB = 2**30
# Fields of a layout a `train.*` key changes (same name in TrainConfig and ParallelLayout).
LAYOUT_FIELDS = ("zero", "sequence_parallel", "micro_batch_size", "num_micro_batches",
                 "schedule", "virtual_stages", "layers_per_stage", "cp_comm", "cp_a2a",
                 "ep", "etp")


@dataclass(frozen=True)
class TrainTarget:
    layout: ParallelLayout
    seq_len: int
    source: str  # "strategy", "file" (train.layout) or "explicit"
    strategy_file: Optional[Path]  # the layout.json read, when from the strategy


def layout_file(cfg) -> Path:
    return strategy_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name).with_suffix(
        ".layout.json")


def train_dir(cfg) -> Path:
    """profiles/<cluster>/train/<model>/: summaries, plots and checkpoints of each layout."""
    return cluster_dir(cfg.profiles_dir, cfg.cluster.name) / "train" / cfg.model.name


def layout_tag(layout: ParallelLayout) -> str:
    """A file-name-safe tag of a layout: `pp2-tp2-dp1-zero0-sp-mbs1x8-1f1b` (`-cp2` after tp
    with context parallelism, `-cp2allgather` in that flavour, `-cp4a2a2+p2p` hierarchical;
    `-ep4`, `-etp2` after dp with expert parallelism), with
    the schedule's chunks, an
    uneven split and recompute appended when they are not the defaults."""
    cp = ""
    if layout.cp > 1:
        comm = (f"a2a{layout.cp_a2a}+p2p" if layout.cp_comm == CpComm["a2a+p2p"]
                else layout.cp_comm)
        cp = f"-cp{layout.cp}" + ("" if comm == ENGINE_CP_COMM else comm)
    ep = (f"-ep{layout.ep}" if layout.ep > 1 else "") + (f"-etp{layout.etp}" if layout.etp > 1
                                                          else "")
    tag = (f"pp{layout.pp}-tp{layout.tp}{cp}-dp{layout.dp}{ep}-zero{layout.zero}"
           f"{'-sp' if layout.sequence_parallel else ''}"
           f"-mbs{layout.micro_batch_size}x{layout.num_micro_batches}-{layout.schedule}")
    if layout.virtual_stages > 1:
        tag += f"v{layout.virtual_stages}"
    if len(set(layout.layers_per_stage)) > 1:
        tag += "-L" + ".".join(map(str, layout.layers_per_stage))
    modes = {mode for mode, _ in layout.recompute}
    if modes != {Recompute.none}:
        tag += "-rc" + ".".join(m if m != Recompute.full else f"full{k}"
                                for m, k in layout.recompute)
    return tag


def train_dtype(cfg) -> Dtype:
    """train.dtype, else bf16 on GPUs (nccl) and fp32 on CPUs."""
    if cfg.train.dtype is not None:
        return Dtype.parse(cfg.train.dtype)
    return Dtype.bf16 if cfg.cluster.backend == Backend.nccl else Dtype.fp32


def train_device(cfg) -> str:
    """What the ranks compute on, as the memory model needs it: "cuda" on nccl clusters."""
    return "cuda" if cfg.cluster.backend == Backend.nccl else "cpu"


def current_calibration(cfg):
    """(Calibration, path or None, note): the cluster's calibration of this model (stage=tune)
    when it was fitted to the profiles on disk now; the identity, with why, when there is none,
    it is unreadable, or a profile changed since (then it is stale: rerun stage=tune)."""
    from orchestrator.planner.calibration import Calibration
    from orchestrator.store import calibration_path, file_sha256, read_json

    path = calibration_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)
    if not path.exists():
        return Calibration(), None, ""
    try:
        raw = read_json(path)
        folder = cluster_dir(cfg.profiles_dir, cfg.cluster.name)
        for name, recorded in raw["inputs"].items():
            if not (folder / name).exists() or file_sha256(folder / name) != recorded["sha256"]:
                return Calibration(), None, (f"calibration {path} is stale ({folder / name} "
                                             f"changed since); not used: rerun "
                                             f"{rerun_command('tune')}")
        runs = int(raw["runs"]) if not raw.get("why_not") else 0
        return Calibration.of(raw["factors"], runs), path, ""
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Calibration(), None, f"calibration {path} unreadable ({e}); not used"


def engine_options(cfg, reserve_bytes: float = 0.0, engine: Optional[str] = None):
    """The cost model's options for a layout trained with train's dtype and device: the
    engine given (default search.engine), the reserve given, and the cluster's calibration
    (current_calibration)."""
    from orchestrator.planner import CostOptions

    engine = engine or str(cfg.search.engine)
    # Megatron-LM's overlap knobs (search.*), for the engine that has them
    overlap = ({key: getattr(cfg.search, key, None) for key in OVERLAP_KNOBS}
               if engine == "megatron" else {})
    return CostOptions(reserve_bytes=reserve_bytes, engine=engine,
                       dtype=str(train_dtype(cfg)), device=train_device(cfg),
                       calibration=current_calibration(cfg)[0], **overlap)


OVERLAP_KNOBS = ("tp_comm_overlap", "overlap_grad_reduce", "overlap_param_gather")


def _global_batch(cfg, default: int) -> int:
    return cfg.train.global_batch_size or default


def explicit_layout(cfg, world: int) -> ParallelLayout:
    """train.pp / train.tp / train.cp given: dp derived, the rest from train.* or the
    defaults."""
    t, layers = cfg.train, cfg.model.layers
    pp, tp, cp = t.pp or 1, t.tp or 1, t.cp or 1
    if t.cp_comm == CpComm["a2a+p2p"] and not t.cp_a2a:
        raise LayoutError(f"train.cp_comm=a2a+p2p needs train.cp_a2a: the all-to-all degree "
                          f"inside the CP group (1 < it < train.cp({cp}), dividing it; the ring "
                          f"runs over train.cp / it groups)")
    if world % (pp * tp * cp):
        degrees = f"train.pp({pp}) * train.tp({tp})" + (f" * train.cp({cp})" if cp > 1 else "")
        raise LayoutError(f"{degrees} = {pp * tp * cp} does not divide the "
                          f"{world} ranks of cluster {cfg.cluster.name}")
    dp = world // (pp * tp * cp)
    mbs = t.micro_batch_size or 1
    gbs = _global_batch(cfg, cfg.search.global_batch_size)
    if t.num_micro_batches is None and gbs % (dp * mbs):
        raise LayoutError(f"global batch {gbs} is not divisible by dp({dp}) * "
                          f"micro_batch_size({mbs}); set train.global_batch_size or "
                          f"train.num_micro_batches")
    m = t.num_micro_batches or gbs // (dp * mbs)
    schedule = t.schedule or Schedule["1f1b"]
    v = t.virtual_stages or (2 if schedule == Schedule.interleaved else 1)
    kwargs = dict(zero=t.zero or 0, micro_batch_size=mbs, num_micro_batches=m, cp=cp,
                  cp_comm=t.cp_comm or ENGINE_CP_COMM, cp_a2a=t.cp_a2a or 1,
                  ep=t.ep or 1, etp=t.etp or 1,
                  schedule=schedule, virtual_stages=v,
                  sequence_parallel=tp > 1 if t.sequence_parallel is None
                  else bool(t.sequence_parallel))
    recompute = t.recompute or Recompute.none
    if not t.layers_per_stage and pp * v > layers:
        chunks = f"train.pp({pp})" + (f" x virtual_stages({v}) = {pp * v} chunks" if v > 1 else "")
        raise LayoutError(f"{chunks} > the {layers} layers of model={cfg.model.name}: each "
                          f"{'chunk' if v > 1 else 'stage'} holds a layer at least")
    if t.layers_per_stage:
        stages = tuple(int(n) for n in t.layers_per_stage)
        per_stage = tuple((recompute, 0 if recompute == Recompute.none else n) for n in stages)
        return ParallelLayout(world_size=world, pp=pp, tp=tp, dp=dp, layers_per_stage=stages,
                              recompute=per_stage, **kwargs)
    return ParallelLayout.uniform(world, tp, pp, layers, recompute=recompute, **kwargs)



def chosen_layout_file(cfg) -> Path:
    """The layout file train reads: train.layout when given, else the strategy's."""
    return Path(cfg.train.layout) if cfg.train.layout else layout_file(cfg)


class LayoutFileError(ValueError):
    """A layout file that cannot be read; the message says which field and what is wrong."""


def read_layout_file(path: Path) -> Tuple[ParallelLayout, int]:
    """(layout, seq_len) of a layout file (`{"seq_len": int, "layout": {...}}`, the form of
    strategy/<model>.layout.json; other keys, such as "model" or "source", are notes);
    LayoutFileError saying what is wrong with which field: not JSON (at line and column),
    missing, of the wrong JSON type, or a layout ParallelLayout refuses (its numbers); or that
    the file cannot be read at all (a folder)."""
    from orchestrator.records import FieldError, convert, show

    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LayoutFileError(f"not JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    except UnicodeDecodeError:
        raise LayoutFileError("not JSON: not UTF-8 text") from None
    except OSError as e:  # a folder, no permission
        raise LayoutFileError(f"cannot be read: {e.strerror}") from None
    if not isinstance(raw, dict):
        raise LayoutFileError(f"expected a JSON object with seq_len and layout, got {show(raw)}")
    for key in ("seq_len", "layout"):
        if key not in raw:
            raise LayoutFileError(f"{key}: missing")
    try:
        seq_len = convert(raw["seq_len"], int, "seq_len")
        layout = ParallelLayout.from_dict(raw["layout"], "layout")
    except (FieldError, LayoutError) as e:
        raise LayoutFileError(str(e)) from None
    if seq_len < 1:
        raise LayoutFileError(f"seq_len: must be >= 1, got {seq_len}")
    return layout, seq_len


def strategy_layout(cfg) -> tuple:
    """(layout, seq_len) of the strategy search wrote (or of train.layout). Search's own:
    ProfileError (exit 4) naming the command that writes it when there is none, or, when it
    cannot be read, what is wrong with which field and that search rewrites it. A file given as
    train.layout is the user's input, as train.load is: ConfigError (exit 2) when it is not
    there or cannot be read, saying which field and that the fix is theirs."""
    path = chosen_layout_file(cfg)
    fix = rerun_command("search")
    if cfg.train.layout and not path.exists():
        raise ConfigError(f"train.layout={cfg.train.layout}: no such file; give a layout file "
                           f"(the form of {layout_file(cfg)}) or leave train.layout unset")
    if not path.exists():
        raise ProfileError(f"no strategy for model {cfg.model.name} on cluster "
                           f"{cfg.cluster.name} yet ({path} missing): write one with {fix}, "
                           f"or give a layout (train.pp=... train.tp=...)")
    try:
        return read_layout_file(path)
    except LayoutFileError as e:
        if cfg.train.layout:
            raise ConfigError(f"train.layout={cfg.train.layout}: {e}; fix that file (the form "
                               f"of {layout_file(cfg)}: docs/stages/train.md) or leave "
                               f"train.layout unset") from None
        raise ProfileError(f"{path}: {e}; rewrite it with {fix} force=true") from None


def _override(layout: ParallelLayout, cfg) -> ParallelLayout:
    """The strategy's layout with the train.* fields the user set."""
    t = cfg.train
    changes = {f: getattr(t, f) for f in LAYOUT_FIELDS if getattr(t, f) is not None}
    if "schedule" in changes:
        if changes["schedule"] == Schedule["1f1b"]:
            changes.setdefault("virtual_stages", 1)
        elif layout.virtual_stages == 1:
            changes.setdefault("virtual_stages", 2)
    if "layers_per_stage" in changes:
        changes["layers_per_stage"] = tuple(int(n) for n in changes["layers_per_stage"])
    if "zero" in changes:
        changes["distributed_optimizer"] = None
    if changes.get("cp_comm", CpComm["a2a+p2p"]) != CpComm["a2a+p2p"]:
        changes["cp_a2a"] = 1  # the all-to-all degree belongs to the hierarchical flavour
    stages = changes.get("layers_per_stage", layout.layers_per_stage)
    if t.recompute is not None:
        mode = t.recompute
        changes["recompute"] = tuple((mode, 0 if mode == Recompute.none else n) for n in stages)
    elif "layers_per_stage" in changes:
        changes["recompute"] = ()
    if t.global_batch_size and t.num_micro_batches is None:
        mbs = changes.get("micro_batch_size", layout.micro_batch_size)
        if t.global_batch_size % (layout.dp * mbs):  # as an explicit layout's (explicit_layout)
            raise LayoutError(f"global batch {t.global_batch_size} is not divisible by "
                              f"dp({layout.dp}) * micro_batch_size({mbs}) of the strategy's "
                              f"layout; set train.global_batch_size or train.num_micro_batches")
        changes["num_micro_batches"] = t.global_batch_size // (layout.dp * mbs)
    return dataclasses.replace(layout, **changes) if changes else layout


def resolve(cfg) -> TrainTarget:
    """The layout and sequence length to train; InvalidLayout (exit 2) for a layout that cannot
    run here, ProfileError (exit 4) when the strategy it needs is missing."""
    world = cluster_world_size(cfg.cluster)
    t = cfg.train
    try:
        if t.pp is not None or t.tp is not None or t.cp is not None:
            layout = explicit_layout(cfg, world)
            target = TrainTarget(layout, t.seq_len or cfg.model.seq_len, "explicit", None)
        else:
            layout, seq_len = strategy_layout(cfg)
            target = TrainTarget(_override(layout, cfg), t.seq_len or seq_len,
                                 "file" if t.layout else "strategy", chosen_layout_file(cfg))
        check_target(cfg, target, world)
    except LayoutError as e:
        raise InvalidLayout(f"train: {e}") from None
    return target


def batch_key(cfg, target: TrainTarget) -> str:
    """The override that set the layout's micro-batches per iteration, as a message names it."""
    t = cfg.train
    if t.num_micro_batches is not None:
        return f"train.num_micro_batches={t.num_micro_batches}"
    if t.global_batch_size is not None:
        return f"train.global_batch_size={t.global_batch_size}"
    if target.source == "explicit":
        return f"search.global_batch_size={cfg.search.global_batch_size}"
    return f"the layout of {target.strategy_file}"


def check_work(cfg, target: TrainTarget) -> None:
    """ConfigError (exit 2, before anything runs) when the layout walks more micro-batches per
    iteration than limits.max_micro_batches, or gives the dynamic planner (normal mode) more
    samples per data-parallel rank than limits.max_dynamic_samples (limits.check_train)."""
    from orchestrator.limits import check_train

    dynamic = cfg.train.microbatching == Microbatching.dynamic and not cfg.search.fast_mode
    check_train(cfg.limits, target.layout, batch_key(cfg, target), dynamic)


def train_command(cfg, layout: Path, world_size: int) -> str:
    """A command that trains the layout file `layout` on its `world_size` ranks: this command's
    overrides with train.layout, the cluster.nodes that make those ranks, and launcher=slurm
    where that is more than one node and this command runs the local launcher. Only the key
    (`train.layout=<layout> on <n> ranks`) when no number of nodes makes them."""
    from orchestrator.config import local_cannot_reach

    per_node = cfg.cluster.tasks_per_node
    if world_size % per_node:
        return f"train.layout={layout} on {world_size} ranks"
    nodes = world_size // per_node
    extra = [] if nodes == cfg.cluster.nodes else [f"cluster.nodes={nodes}"]
    if local_cannot_reach(cfg.launcher.name, nodes):
        extra.append("launcher=slurm")
    return rerun_command("train", *extra, f"train.layout={layout}")


def world_mismatch_text(cfg, target: TrainTarget, world: int) -> str:
    """Why a layout for other ranks cannot train here, and what does: the strategy of this many
    ranks an earlier search kept (stage=search keeps the one it replaces for another size), a
    search for these ranks (which keeps this one in turn), or train.pp/train.tp."""
    from orchestrator.store import kept_strategy_path

    have = target.layout.world_size
    head = (f"the layout is for {have} ranks but cluster {cfg.cluster.name} has {world} "
            f"(nodes x tasks_per_node)")
    if target.source != "strategy":
        return f"{head}; give train.layout a layout for {world} ranks or give train.pp/train.tp"
    strategy = strategy_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)
    kept = kept_strategy_path(strategy, world).with_suffix(".layout.json")
    train_kept = (f"train the {world}-rank strategy an earlier search kept: "
                  f"{train_command(cfg, kept, world)}; or " if kept.exists() else "")
    return (f"{head}; {train_kept}search for {world} ranks: {rerun_command('search')} (it "
            f"keeps the {have}-rank strategy as "
            f"{kept_strategy_path(strategy, have).with_suffix('.layout.json').name}); or give "
            f"train.pp/train.tp")


def check_target(cfg, target: TrainTarget, world: int) -> None:
    """LayoutError when the layout cannot run this model on these ranks."""
    from orchestrator.models.config import validate_model

    layout, model = target.layout, cfg.model
    if layout.world_size != world:
        raise LayoutError(world_mismatch_text(cfg, target, world))
    if target.source != "explicit" and layout.num_layers != model.layers:
        fix = (f"search again: {rerun_command('search')}" if target.source == "strategy"
               else "give train.layout a layout of this model, or give train.pp/train.tp")
        raise LayoutError(f"{target.strategy_file} is a layout of {layout.num_layers} layers; "
                          f"model={model.name} has {model.layers}: {fix}")
    layout.check_model_layers(model.layers, model.name)
    layout.check_equal_chunks()
    if layout.cp > 1 and layout.cp_comm in (CpComm.a2a, CpComm["a2a+p2p"]):
        try:
            layout.check_heads(model.heads, model.kv_heads, model.name)
        except LayoutError as e:
            raise LayoutError(f"train.cp_comm={layout.cp_comm}: {e} (Ulysses splits the heads "
                              f"over the CP ranks); use train.cp_comm=p2p or allgather") from None
    layout.check_sequence(target.seq_len)
    check_moe(cfg, layout)
    if 1 < layout.pp and layout.num_micro_batches < layout.pp:
        raise LayoutError(f"num_micro_batches({layout.num_micro_batches}) < pp({layout.pp}): "
                          f"the pipeline schedules need a micro-batch per stage at least; "
                          f"raise train.global_batch_size or lower train.micro_batch_size")
    for field, value in (("heads", model.heads), ("kv_heads", model.kv_heads)):
        if value % layout.tp:
            raise LayoutError(f"tp({layout.tp}) does not divide model.{field}({value})")
    model_cfg = dataclasses.replace(_model_config(cfg.model), seq_len=target.seq_len)
    # The key the length came from (it said model.seq_len(63) for train.seq_len=63).
    seq_len_key = ("train.seq_len" if cfg.train.seq_len else
                   "model.seq_len" if target.seq_len == cfg.model.seq_len else
                   f"search.seq_len (the strategy {target.strategy_file})")
    try:
        validate_model(model_cfg, tp=layout.tp, seq_len_key=seq_len_key)
    except ValueError as e:
        raise LayoutError(str(e)) from None
    if target.seq_len > cfg.model.seq_len:
        given = (f"train.seq_len({target.seq_len})" if cfg.train.seq_len
                 else f"the seq_len {target.seq_len} of {target.strategy_file} (searched with "
                      f"search.seq_len)")
        raise LayoutError(f"{given} > model.seq_len({cfg.model.seq_len}), the model's context: "
                          f"set model.seq_len={target.seq_len}, or train.seq_len=<n> up to "
                          f"{cfg.model.seq_len}")
    if cfg.train.microbatching != Microbatching.fixed and layout.zero == 3:
        raise LayoutError(f"train.microbatching={cfg.train.microbatching} runs ZeRO 0-2: with "
                          f"ZeRO-3 the dp ranks' different micro-batch counts would stall "
                          f"FSDP's gathers; set train.zero=2 (or 0/1)")
    if cfg.train.microbatching == Microbatching.packed and layout.cp > 1:
        raise LayoutError(f"train.microbatching=packed needs cp=1, got cp={layout.cp}: ring "
                          f"attention has no per-sample mask for packed rows; use "
                          f"train.microbatching=dynamic or padded (they pad under cp)")
    if cfg.train.steps < 1:
        raise LayoutError(f"train.steps({cfg.train.steps}) must be >= 1")
    backend = cfg.cluster.backend
    if backend != Backend.nccl and train_dtype(cfg) != Dtype.fp32:
        raise LayoutError(f"train.dtype={train_dtype(cfg).value} needs GPUs (cluster.backend="
                          f"nccl); CPU ranks train in fp32")


def check_moe(cfg, layout: ParallelLayout) -> None:
    """LayoutError when the engine cannot train this layout of a mixture-of-experts model (or
    ep/etp are set for a dense one)."""
    from orchestrator.models.config import expert_width, is_moe

    model = cfg.model
    layout.check_experts(model.experts, expert_width(model) if is_moe(model) else 1, model.name)
    if not is_moe(model):
        return
    if layout.zero == 3 and layout.etp > 1:
        raise LayoutError(f"zero 3 with etp({layout.etp}): FSDP shards a parameter split over "
                          f"one mesh dimension only (the experts' ep); use etp 1 or zero <= 2")


def _model_config(model):
    from omegaconf import OmegaConf

    from orchestrator.models.config import ModelConfig

    if isinstance(model, ModelConfig):
        return model
    return OmegaConf.to_object(model)


def model_config(cfg, seq_len: int):
    """The ModelConfig the engine builds: the model at the training sequence length."""
    return dataclasses.replace(_model_config(cfg.model), seq_len=seq_len)


def predict(cfg, layout: ParallelLayout, seq_len: int):
    """(prediction or None, note): the planner's evaluate() of this layout from the cluster's
    profiles, without the memory reserve (what the ranks themselves use); None with the reason
    when the profiles are missing or do not fit this model."""
    from orchestrator.planner import evaluate

    try:
        model_cost, hardware = planner_profiles(cfg)
        pred = evaluate(layout, model_cost, hardware, seq_len=seq_len,
                        options=engine_options(cfg, engine="orchestrator"))  # what train runs
    except (ProfileError, ValueError, KeyError) as e:
        return None, f"no prediction: {e}"
    return pred, ""


def planner_profiles(cfg):
    """(ModelCost, HardwareModel) of the cluster's profiles; ProfileError naming the command
    that writes a missing or unreadable one, or one made for another model or cluster."""
    from orchestrator.planner import HardwareModel, ModelCost
    from orchestrator.store import read_profile
    from orchestrator.store.schema import HardwareProfile, ModelProfile

    hw_path = hardware_path(cfg.profiles_dir, cfg.cluster.name)
    mp_path = model_profile_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)
    hw = read_profile(hw_path, HardwareProfile, rerun_command("profile_hardware"), config=cfg)
    mp = read_profile(mp_path, ModelProfile, rerun_command("profile_model"), config=cfg)
    return ModelCost.from_profile(mp).with_moe(cfg.model), HardwareModel.from_profile(hw)


def check_length_mean(train, seq_len: int) -> None:
    """ConfigError when variable-length samples (train.microbatching other than fixed) are asked
    for with a mean length outside (0, seq_len] tokens: every sample is capped at seq_len, so a
    larger mean trains the fixed-length run under another name."""
    mean = train.length_mean
    if train.microbatching == Microbatching.fixed or mean is None or 0 < mean <= seq_len:
        return
    raise ConfigError(f"train.length_mean({mean}) must be in (0, seq_len({seq_len})]: samples "
                      f"are capped at seq_len, so train.microbatching={train.microbatching} "
                      f"would train every sample at seq_len, the fixed run; set "
                      f"train.length_mean to at most {seq_len}, or leave it unset for "
                      f"seq_len / 4 = {max(1, seq_len // 4)}")


def memory_budget_GiB(cfg) -> float:
    t = cfg.train
    return t.memory_GiB if t.memory_GiB is not None else cfg.cluster.device_mem_GiB


def check_memory(cfg, prediction) -> None:
    """InfeasibleError (exit 3) when the planner says a stage does not fit the budget (with the
    search's reserve, memory_reserve_GiB, kept free), unless train.allow_oom_risk."""
    budget = memory_budget_GiB(cfg)
    if prediction is None or not budget or cfg.train.allow_oom_risk:
        return
    if cfg.train.microbatching != Microbatching.fixed:
        return  # variable-length samples: each iteration's plan keeps to the budget itself
    from orchestrator.planner.cost_model import memory_reserve_GiB

    s = cfg.search
    reserve = memory_reserve_GiB(budget, s.reserve_fraction, s.reserve_GiB)
    need = prediction.peak_memory_bytes / GiB
    if need + reserve > budget:
        raise InfeasibleError(
            f"train: {prediction.layout.describe()} needs {need:.2f} GiB per device by the "
            f"planner's estimate (+ a reserve of {reserve:.2f} GiB: search.reserve_fraction="
            f"{s.reserve_fraction} x budget + search.reserve_GiB={s.reserve_GiB}) > budget "
            f"{budget} GiB "
            f"(train.memory_GiB, else cluster.device_mem_GiB); choose another layout, add "
            f"recompute (train.recompute=full), or launch anyway with train.allow_oom_risk=true")
