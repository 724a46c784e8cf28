"""profile_model: compute time and memory of one block and of the "other" parts, per (seq, tp).

Writes profiles/<cluster.name>/model/<model.name>.json (schema: docs/profile-schema.md), and next
to it a PNG (time and activation memory against sequence length). Each (sequence length, TP
degree) point is a sub-part named `seq<S>_tp<T>`: it is merged into the file and marked done in
the ledger as soon as it finishes, so a rerun after a crash redoes only the missing points.

Two sources, chosen by profile_model.source (auto decides, see model_analytic.choose_source):
- measured: on every rank of the cluster. TP groups of real size are consecutive ranks (tp=2 on 4
  ranks: {0,1} and {2,3}, all timed at once); tp=1 runs on every rank alone.
- analytic: in this process (ranks="one"), shapes only: exact memory from FakeTensorMode and a
  fake process group, time from FLOPs and a device sheet (conf/device/).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from omegaconf import OmegaConf

from orchestrator.config import cluster_world_size
from orchestrator.errors import ConfigError
from orchestrator.models.config import ModelConfig, validate_model
from orchestrator.choices import ModelSource, Ranks
from orchestrator.stages import Stage
from orchestrator.store import model_profile_path, write_json

log = logging.getLogger("orchestrator.profile_model")

SEQ_ROUND = 32  # default sweep lengths are multiples of this (sequence parallelism splits them)
ANALYTIC_MAX_TP = 8  # default largest TP degree when nothing runs: one node of 8 GPUs


# ---------------------------------------------------------------- what to profile
@dataclass(frozen=True)
class ProfilePlan:
    source: str  # measured | analytic
    reason: str  # why that source (printed)
    seq_lens: Tuple[int, ...]
    tps: Tuple[int, ...]
    device: str  # device sheet name (conf/device/<device>.yaml)

    def points(self) -> List[Tuple[int, int]]:
        """(seq_len, tp) in run order: TP degree outermost (one set of groups at a time)."""
        return [(s, t) for t in self.tps for s in self.seq_lens]


def point_name(seq_len: int, tp: int) -> str:
    return f"seq{seq_len}_tp{tp}"


def parse_point(name: str) -> Tuple[int, int]:
    seq, tp = name.split("_")
    return int(seq[len("seq"):]), int(tp[len("tp"):])


def model_config(cfg) -> ModelConfig:
    """The model section as the torch-free dataclass."""
    if isinstance(cfg.model, ModelConfig):
        return cfg.model
    return ModelConfig(**OmegaConf.to_container(cfg.model, resolve=True))


def sweep_seq_lens(pm, model_seq_len: int) -> List[int]:
    """Sequence lengths to profile: profile_model.seq_lens, else min..max by step (max: the
    model's seq_len), the max always included; without a step, 4 evenly spaced lengths (the
    inner two multiples of 32)."""
    if pm.seq_lens:
        return sorted({int(s) for s in pm.seq_lens})
    hi = int(pm.max_seq_len or model_seq_len)
    lo = min(int(pm.min_seq_len), hi)
    step = pm.seq_len_step
    if step is None:  # 4 evenly spaced lengths, inner ones rounded to multiples of SEQ_ROUND
        inner = [lo + i * (hi - lo) / 3 for i in (1, 2)]
        return sorted({lo, hi, *(max(SEQ_ROUND, round(x / SEQ_ROUND) * SEQ_ROUND) for x in inner)})
    if step < 1:
        raise ConfigError(f"profile_model.seq_len_step({step}) must be >= 1")
    seqs = list(range(lo, hi + 1, int(step)))
    if seqs[-1] != hi:
        seqs.append(hi)
    return seqs


def _is_gpu(cfg) -> bool:
    return cfg.cluster.backend == "nccl"


def _gpu_reachable(cfg) -> bool:
    """Whether ranks launched for this cluster would see a GPU: always under Slurm (the nodes
    decide), with the local launcher only if this machine has one."""
    if not _is_gpu(cfg) or cfg.launcher.name != "local":
        return True
    import torch

    return torch.cuda.is_available()


def _default_device(cfg) -> str:
    """The device sheet when profile_model.device is unset: a sheet named in the cluster's name
    (dgx_a100 -> a100), else cpu for a gloo cluster and h100 for an nccl one."""
    from orchestrator.profiling.model_analytic import device_sheets

    if not _is_gpu(cfg):
        return "cpu"
    named = [d for d in device_sheets() if d != "cpu" and d in str(cfg.cluster.name).lower()]
    return named[0] if named else "h100"


def plan_profile(cfg) -> ProfilePlan:
    """Validate profile_model against the model and the cluster; what the stage will run.

    Raises ConfigError with the model's own message for a shape that cannot be split over a TP
    degree, and names the setting to change otherwise.
    """
    from orchestrator.profiling import model_analytic

    pm = cfg.profile_model
    model = model_config(cfg)
    try:
        validate_model(model)
    except ValueError as e:
        raise ConfigError(f"model={model.name}: {e}") from None
    for key in ("micro_batch_size", "iters", "min_seq_len"):
        if getattr(pm, key) < 1:
            raise ConfigError(f"profile_model.{key}({getattr(pm, key)}) must be >= 1")
    if int(pm.warmup_iters) < 0:
        raise ConfigError(f"profile_model.warmup_iters({pm.warmup_iters}) must be >= 0")
    seqs = sweep_seq_lens(pm, model.seq_len)
    if any(s < 1 for s in seqs):
        raise ConfigError(f"profile_model.seq_lens {seqs}: lengths must be >= 1")
    device = pm.device or _default_device(cfg)
    sheet = model_analytic.load_device_sheet(device)
    model_analytic.peak_flops(sheet, model.dtype)  # the sheet must know the model's dtype
    source, reason = model_analytic.choose_source(
        pm.source, model, max(seqs), int(pm.micro_batch_size), _is_gpu(cfg),
        float(cfg.cluster.device_mem_GiB), int(cfg.cluster.tasks_per_node),
        gpu_reachable=_gpu_reachable(cfg))
    if source == "measured" and _is_gpu(cfg) and not _gpu_reachable(cfg):
        raise ConfigError("profile_model.source=measured on a GPU cluster (backend nccl) with "
                          "launcher=local, but this machine has no GPU: use launcher=slurm, "
                          "or profile_model.source=analytic")
    world = cluster_world_size(cfg.cluster)
    if pm.max_tp is not None:
        max_tp = int(pm.max_tp)
        if max_tp < 1:
            raise ConfigError(f"profile_model.max_tp({max_tp}) must be >= 1")
        if source == "measured" and max_tp > world:
            raise ConfigError(f"profile_model.max_tp({max_tp}) > the cluster's {world} ranks: "
                              f"measured TP groups need that many ranks; lower max_tp or use "
                              f"profile_model.source=analytic")
        tps = _powers_of_two(max_tp)
        for tp in tps:
            try:  # the shape first (a length tp divides), then each profiled length
                validate_model(model_analytic.model_for_point(model, tp), tp)
            except ValueError as e:
                raise ConfigError(f"profile_model.max_tp={max_tp} with model={model.name}: {e}; "
                                  f"lower profile_model.max_tp") from None
            bad = [s for s in seqs if s % tp]
            if bad:
                raise ConfigError(f"profile_model: sequence lengths {bad} are not divisible by "
                                  f"tp({tp}) (sequence parallelism splits them); change "
                                  f"profile_model.seq_lens or lower profile_model.max_tp")
        if source == "measured":
            bad = [tp for tp in tps if world % tp]
            if bad:
                raise ConfigError(f"TP degrees {bad} do not divide the cluster's {world} ranks: "
                                  f"groups of tp ranks must tile the world")
    else:
        cap = world if source == "measured" else ANALYTIC_MAX_TP
        tps = [tp for tp in _powers_of_two(cap)
               if (source == "analytic" or world % tp == 0) and _fits_tp(model, seqs, tp)]
    return ProfilePlan(source=source, reason=reason, seq_lens=tuple(seqs), tps=tuple(tps),
                       device=device)


def _powers_of_two(cap: int) -> List[int]:
    tps, tp = [], 1
    while tp <= cap:
        tps.append(tp)
        tp *= 2
    return tps


def _fits_tp(model: ModelConfig, seqs: List[int], tp: int) -> bool:
    from orchestrator.profiling.model_analytic import model_for_point

    try:
        for s in seqs:
            validate_model(model_for_point(model, s), tp)
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------- the profile file
def _model_summary(model: ModelConfig) -> dict:
    return {k: getattr(model, k) for k in
            ("name", "hidden", "ffn", "layers", "heads", "kv_heads", "vocab", "seq_len", "dtype")}


def _merge_point(profile: dict, point: dict) -> None:
    key = (point["seq_len"], point["tp"])
    profile["points"] = [p for p in profile["points"] if (p["seq_len"], p["tp"]) != key]
    profile["points"].append(point)
    profile["points"].sort(key=lambda p: (p["tp"], p["seq_len"]))


def _refresh_derived(profile: dict, model: ModelConfig, batch: int) -> None:
    from orchestrator.profiling.model_fit import fit_points
    from orchestrator.profiling.model_memory import memory_summary

    profile["fits"] = fit_points(profile["points"])
    profile["memory"] = memory_summary(profile["points"], model, batch)


# ---------------------------------------------------------------- measured, on every rank
class MeasuredRunner:
    """Builds TP groups on every rank, then times and counts each point on all of them."""

    def __init__(self, ctx, cfg, plan: ProfilePlan, tps: List[int]):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.ctx, self.cfg, self.plan = ctx, cfg, plan
        self.device = ctx.device
        self.batch = int(cfg.profile_model.micro_batch_size)
        self.model = model_config(cfg)
        # Every rank creates every group, in the same order (new_group is collective).
        self.meshes = {}
        for tp in tps:
            if tp > 1:
                mesh = init_device_mesh(self.device.type, (ctx.world_size // tp, tp),
                                        mesh_dim_names=("dp", "tp"))
                self.meshes[tp] = mesh["tp"]
        self._dist = dist
        self._pm = None
        self._fake = self._flops_model = None
        self._flops_by_seq: Dict[int, dict] = {}

    @contextlib.contextmanager
    def for_tp(self, tp: int, max_seq: int):
        """The one-layer model sharded over this rank's group of `tp` ranks, for the points of tp."""
        from orchestrator.profiling.model_timing import build_point_model

        self._pm = build_point_model(self.model, max_seq, tp, self.meshes.get(tp), self.device,
                                     self.batch)
        try:
            yield
        finally:
            self._pm = None

    def point(self, seq: int, tp: int) -> Optional[dict]:
        """Run one point on every rank; the merged record on rank 0 (None elsewhere)."""
        from orchestrator.profiling import model_memory, model_timing

        pm = self._pm
        pmc = self.cfg.profile_model
        group = self.meshes[tp].get_group() if tp > 1 else None
        barrier = (lambda: self._dist.barrier(group=group)) if group is not None else (lambda: None)
        samples = model_timing.time_point(pm, seq, int(pmc.warmup_iters), int(pmc.iters), barrier)
        times = model_timing.summarise(samples)
        memory = model_timing.memory_point(pm, seq, allocator=self.device.type == "cuda")
        states = {"block": model_memory.state_bytes(pm.block.parameters()),
                  "other": model_memory.state_bytes(pm.other_params())}
        gathered = self.ctx.gather((times, memory, states))
        if not self.ctx.is_root:
            return None
        record = {"seq_len": seq, "tp": tp, "source": "measured"}
        record.update(_combine_ranks([g[0] for g in gathered], tp))
        record["iters"] = int(pmc.iters)
        record["groups"] = len(gathered) // tp
        record.update(memory)  # rank 0's; every rank of a group holds the same shapes
        record["states"] = states
        record["flops"] = self._flops(seq, tp)
        return record

    def _flops(self, seq: int, tp: int) -> dict:
        from orchestrator.profiling import model_analytic as an
        from orchestrator.profiling.model_timing import build_point_model

        if self._flops_model is None:
            self._fake = an.fake_tensors_mode()
            with self._fake:
                self._flops_model = build_point_model(self.model, max(self.plan.seq_lens), 1,
                                                      None, "cpu", self.batch)
        if seq not in self._flops_by_seq:
            with self._fake:
                self._flops_by_seq[seq] = an.count_flops(self._flops_model, seq)
        return {k: v / tp for k, v in self._flops_by_seq[seq].items()}


def _combine_ranks(per_rank: List[Dict[str, float]], tp: int) -> Dict[str, float]:
    """A point's times from every rank's summary (model_timing.summarise): a TP group takes as
    long as its slowest rank, and the groups (timed at once) are summarised by their median.

    "<part>_us" is compute only: the part's fastest iteration minus the time its fastest
    iteration spent in TP collectives; "<part>_total_us" keeps the whole (tp > 1),
    "<part>_comm_us" the collectives and "<part>_median_us" the median iteration (whole part).
    """
    import numpy as np

    from orchestrator.profiling.model_timing import PARTS

    groups = [per_rank[i:i + tp] for i in range(0, len(per_rank), tp)]

    def across(key):
        return float(np.median([max(r.get(key, 0.0) for r in g) for g in groups]))

    out = {}
    for part in PARTS:
        total, comm = across(part), across(part.replace("_us", "_comm_us"))
        out[part] = max(total - comm, 0.01 * total)
        out[part.replace("_us", "_median_us")] = across(part.replace("_us", "_median_us"))
        if tp > 1:
            out[part.replace("_us", "_total_us")] = total
            out[part.replace("_us", "_comm_us")] = comm
    return out


# ---------------------------------------------------------------- analytic, in this process
class AnalyticRunner:
    """Shapes only: FakeTensorMode models on a fake process group of tp ranks; time from FLOPs."""

    def __init__(self, cfg, plan: ProfilePlan):
        from orchestrator.profiling import model_analytic as an
        from orchestrator.profiling.model_timing import build_point_model

        self.cfg, self.plan = cfg, plan
        self.model = model_config(cfg)
        self.batch = int(cfg.profile_model.micro_batch_size)
        self.sheet = an.load_device_sheet(plan.device)
        self.gpu_kernels = self.sheet["type"] == "gpu"
        self.fake = an.fake_tensors_mode()
        with self.fake:
            self.flops_model = build_point_model(self.model, max(plan.seq_lens), 1, None, "cpu",
                                                 self.batch)
        self._pm = None
        self._flops: Dict[int, dict] = {}

    @contextlib.contextmanager
    def for_tp(self, tp: int, max_seq: int):
        """A fake world of tp ranks and the one-layer model sharded over it (shapes only)."""
        from orchestrator.profiling import model_analytic as an
        from orchestrator.profiling.model_timing import build_point_model

        with an.fake_world(tp) as mesh:
            with self.fake:
                self._pm = build_point_model(self.model, max_seq, tp, mesh, "cpu", self.batch)
            try:
                yield
            finally:
                self._pm = None

    def point(self, seq: int, tp: int) -> dict:
        from orchestrator.profiling import model_analytic as an
        from orchestrator.profiling import model_memory
        from orchestrator.profiling.model_timing import memory_point

        pm = self._pm
        with self.fake:
            if seq not in self._flops:  # the same for every tp (divided below)
                self._flops[seq] = an.count_flops(self.flops_model, seq)
            flops = self._flops[seq]
            memory = memory_point(pm, seq, gpu_kernels=self.gpu_kernels)
            states = {"block": model_memory.state_bytes(pm.block.parameters()),
                      "other": model_memory.state_bytes(pm.other_params())}
        record = {"seq_len": seq, "tp": tp, "source": "analytic"}
        record.update(an.analytic_times_us(flops, tp, self.sheet, self.model.dtype))
        record.update(memory)
        record["states"] = states
        record["flops"] = {k: v / tp for k, v in flops.items()}
        return record


# ---------------------------------------------------------------- the stage
def run_profile(ctx, run):
    cfg = run.cfg
    plan: ProfilePlan = run.plan.detail
    model = model_config(cfg)
    batch = int(cfg.profile_model.micro_batch_size)
    path = model_profile_path(cfg.profiles_dir, cfg.cluster.name, model.name)
    todo = [parse_point(n) for n in run.todo]
    tps = list(dict.fromkeys(tp for _, tp in todo))
    profile = None
    if ctx.is_root:
        profile = run.resume_profile(path, "model", plan.source, model=_model_summary(model),
                                     micro_batch_size=batch, points=[], fits={}, memory={})
        profile["method"] = _method(plan, ctx)
    if plan.source == "analytic":
        runner = AnalyticRunner(cfg, plan)
    else:
        runner = MeasuredRunner(ctx, cfg, plan, tps)
    progress = _progress(ctx, plan, len(todo))
    try:
        for tp in tps:
            seqs = [s for s, t in todo if t == tp]
            with runner.for_tp(tp, max(seqs)):
                for seq in seqs:
                    name = point_name(seq, tp)
                    if progress:
                        progress.update(progress.task, description=f"{name} ({plan.source})")
                    with run.subpart(name):
                        record = runner.point(seq, tp)
                        if ctx.is_root:
                            _add_megatron(record, model, batch)
                            _merge_point(profile, record)
                            _refresh_derived(profile, model, batch)
                            profile["provenance"] = run.provenance()
                            write_json(path, profile)
                            log.info("%s:%s", name, _point_line(record, batch, markup=False))
                    if progress:
                        progress.console.print(_point_line(record, batch))
                        progress.advance(progress.task)
    finally:
        if progress:
            progress.stop()
    if not ctx.is_root:
        return None
    from orchestrator.profiling import model_report

    model_report.print_report(profile)
    png = None
    if cfg.profile_model.plot:
        png = model_report.plot_profile(profile, path.with_suffix(".png"))
    return {"path": str(path), "png": str(png) if png else None, "source": plan.source,
            "ran": list(run.todo), "points": len(profile["points"])}


def _method(plan: ProfilePlan, ctx) -> dict:
    from orchestrator.profiling.model_memory import BYTES_PER_PARAM_NOTE

    if plan.source == "analytic":
        from orchestrator.profiling.model_analytic import load_device_sheet

        sheet = load_device_sheet(plan.device)
        return {"source": "analytic", "why": plan.reason, "device_sheet": sheet,
                "timing": "FLOPs (FlopCounterMode, causal attention halved) / (peak x efficiency); "
                          "TP collectives excluded",
                "activations": "saved tensors under FakeTensorMode"
                               + (", CUDA RMSNorm kernel emulated" if sheet["type"] == "gpu" else ""),
                "states": BYTES_PER_PARAM_NOTE}
    device = str(ctx.device)
    if ctx.device is not None and ctx.device.type == "cuda":
        import torch

        device = torch.cuda.get_device_name(ctx.device)
    return {"source": "measured", "why": plan.reason, "device": device,
            "timing": "fastest of `iters` iterations per rank (median kept as *_median_us); a TP "
                      "group is its slowest rank, groups summarised by their median; *_us exclude "
                      "TP collectives (kept as *_comm_us), *_total_us include them",
            "activations": ("CUDA allocator (saved-tensor count in block_act_bytes_saved)"
                            if ctx.device is not None and ctx.device.type == "cuda"
                            else "saved tensors (exact)"),
            "states": BYTES_PER_PARAM_NOTE}


def _add_megatron(record: dict, model: ModelConfig, batch: int) -> None:
    from orchestrator.models.gpt import torch_dtype
    from orchestrator.profiling.model_memory import RECOMPUTE_MODES, megatron_act_bytes

    elem = torch_dtype(model.dtype).itemsize
    mega = {m: megatron_act_bytes(record["seq_len"], batch, model.hidden, model.heads,
                                  record["tp"], m, elem) for m in RECOMPUTE_MODES}
    record["megatron_act_bytes"] = mega
    record["megatron_ratio"] = {m: record["block_act_bytes"][m] / mega[m] for m in RECOMPUTE_MODES}


def _point_line(record: Optional[dict], batch: int, markup: bool = True) -> str:
    if not record:
        return ""
    tag = "[yellow]analytic[/]" if record["source"] == "analytic" and markup else record["source"]
    act = record["block_act_bytes"]["none"] / (record["seq_len"] * batch)
    return (f"  seq {record['seq_len']:>6} tp {record['tp']}: block fwd {record['block_fwd_us']:.0f} us "
            f"bwd {record['block_bwd_us']:.0f} us, other fwd {record['other_fwd_us']:.0f} us "
            f"bwd {record['other_bwd_us']:.0f} us, block act {act:.0f} B/token ({tag})")


def _progress(ctx, plan: ProfilePlan, total: int):
    if not ctx.is_root or total == 0:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from orchestrator.console import stage_console

    console = stage_console()
    console.print(f"profile_model: {plan.source} ({plan.reason}); seq {list(plan.seq_lens)}, "
                  f"tp {list(plan.tps)}" + (f", device sheet {plan.device}"
                                            if plan.source == "analytic" else ""))
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True)
    progress.task = progress.add_task("points", total=total)
    progress.start()
    return progress


class ProfileModel(Stage):
    name = "profile_model"
    hash_sections = ("cluster", "model", "profile_model")
    hash_exclude = ("profile_model.plot",)

    def plan(self, cfg):
        profile = plan_profile(cfg)
        return self.make_plan(
            cfg, key=f"profile_model/{cfg.model.name}",
            ranks=Ranks.one if profile.source == ModelSource.analytic else Ranks.cluster,
            subparts=[point_name(s, t) for s, t in profile.points()],
            outputs=[model_profile_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)],
            detail=profile)

    def run(self, ctx, run):
        return run_profile(ctx, run)


STAGE = ProfileModel()
