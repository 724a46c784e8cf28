"""A time for every compute op of a trace: what the planner charges when there is a model profile,
else a device sheet's roofline, each op marked by its source (`time_source`).

- Device sheet (`device_sheet`): a roofline per op, max(FLOPs / (peak x efficiency), bytes / HBM
  bandwidth) (the bytes term only where the sheet gives `hbm_GBps`), with the efficiency of the
  op's kind and shape where the sheet has curves (device.OpTimer: a GEMM's by its FLOPs, flash
  attention's by its keys and head dim), as analytic profiles price their ops. FLOPs are torch's
  formulas (matmuls, attention); elementwise ops have none and are priced by their bytes.
- Model profile (`profile:<source>`): the planner's own account of the layout's compute,
  planner/terms/compute.StageCompute (what StageCosts adds up for the search): per micro-batch a
  block's forward and backward (with experts a MoE block on the busiest EP rank: routing, its
  experts on the search's imbalance, the shared expert), "other" (embedding, final norm, LM head,
  loss) split as the planner splits it (CostOptions.other_time_first_share on the first stage,
  the rest on the last), recompute by its mode and k, and once per iteration the optimizer step;
  the schedule's contention and the cluster's calibration (stage=tune) included. Each chunk's
  ops of one micro-batch and pass are split into its blocks' and "other"'s, and each part is
  scaled to the planner's time for it, the ops keeping their roofline proportions
  (`fit_to_total`) but none faster than the device's dense peak FLOP/s. What the rank computes
  after its last backward (gradient scaling, norm, AdamW, copies) is the planner's optimizer
  step, or keeps the roofline when the profile has no optimizer figure.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from orchestrator.choices import Source
from orchestrator.device import OpCost, OpTimer, op_kind
from orchestrator.planner.cost_model import ConfigKey, CostOptions
from orchestrator.planner.terms import MODE_CODES
from orchestrator.planner.terms.compute import StageCompute

# Modules of "other" (the embedding, the final norm, the LM head); the loss is its own phase.
OTHER_MODULES = ("tok_emb", "norm", "lm_head")
# Phases of what a rank computes after its last backward: the planner's optimizer step.
STEP_PHASES = ("dp", "optimizer")


def fit_to_total(rooflines: Sequence[float], floors: Sequence[float],
                 want_us: float) -> List[float]:
    """Times (us) for ops whose device-sheet times are `rooflines`, scaled by one factor so they
    add up to `want_us`, except that no op goes under its floor (`floors`: its FLOPs at the
    device's peak): an op held at its floor keeps it and the others share the rest. When the
    floors alone exceed `want_us`, the sum is above it. With no roofline time at all, the ops
    share `want_us` equally."""
    n = len(rooflines)
    have = sum(rooflines)
    if have <= 0:
        return [want_us / n] * n
    held = [False] * n
    fixed_us = 0.0
    while True:
        free = have - sum(r for r, h in zip(rooflines, held) if h)
        scale = max(0.0, want_us - fixed_us) / free if free > 0 else 0.0
        newly = [i for i in range(n) if not held[i] and rooflines[i] * scale < floors[i]]
        if not newly:
            return [floors[i] if held[i] else rooflines[i] * scale for i in range(n)]
        for i in newly:
            held[i] = True
            fixed_us += floors[i]


def _module_part(record: dict) -> Optional[str]:
    """"other" for the embedding's, final norm's, LM head's and the loss's ops, "block" for a
    block's, None for an op outside any module."""
    if record["phase"] == "loss":
        return "other"
    module = record.get("module") or ""
    if not module:
        return None
    return "other" if module.split(".")[0] in OTHER_MODULES else "block"


_KINDS: Dict[str, str] = {}  # op name -> device.op_kind


def op_cost(record: dict, dtype: str) -> OpCost:
    """A compute record as device.OpTimer prices it: a flash kernel with its keys and head dim
    (query, key, ... forward; grad_out, query, key, ... backward), a GEMM, or any other op."""
    name = record["op"]
    kind = _KINDS.get(name)
    if kind is None:
        kind = _KINDS[name] = op_kind(name)
    if kind != "attention":
        return OpCost(kind, record["flops"] or 0, record["bytes"], dtype)
    shapes = record["shapes"]
    query, key = (shapes[1], shapes[2]) if name.endswith("_backward") else shapes[:2]
    return OpCost(kind, record["flops"] or 0, record["bytes"], dtype, key[-2], query[-1])


def split_parts(ops: List[dict], backward: bool) -> Dict[str, List[dict]]:
    """One chunk's compute ops of one micro-batch and pass (issue order) as {"block": ...,
    "other": ...}: an op outside any module goes with the op it follows in the forward and
    precedes in the backward (the embedding's reduce-scatter concat is the embedding's), the
    rule trace/simai.py files ops into items by."""
    parts: Dict[str, List[dict]] = {"block": [], "other": []}
    named = [_module_part(r) for r in ops]
    order = range(len(ops) - 1, -1, -1) if backward else range(len(ops))
    current = next((named[i] for i in order if named[i] is not None), "block")
    for i in order:
        current = named[i] or current
        parts[current].append(ops[i])
    return parts


class ComputePricer:
    """Prices compute records in place (`time_us`, `time_source`)."""

    def __init__(self, sheet: dict, model_cost=None, profile_source: Source | str = "",
                 note: str = "", options: CostOptions = CostOptions()):
        self.sheet = sheet
        self.model_cost = model_cost  # a ModelCost with its experts (with_moe), or None
        self.profile_source = profile_source
        self.note = note  # why the profile is not used, when it is not
        self.options = options  # the planner's: shares, calibration, MoE imbalance
        self.timer = OpTimer(sheet)
        self._stage_compute: Dict[tuple, StageCompute] = {}

    def roofline_us(self, record: dict) -> float:
        """One op's time (us) from the device sheet alone: device.OpTimer, what analytic
        profiles price their ops with (a GEMM by its FLOPs, flash attention by its keys and
        head dim, every op at least its bytes at the sheet's HBM bandwidth)."""
        return self.timer.us(op_cost(record, record.get("dtype") or "fp32"))

    def floor_us(self, record: dict) -> float:
        """The least time (us) an op can take: its FLOPs at the device's dense peak."""
        peak = self.timer.peak(record.get("dtype") or "fp32")
        return record["flops"] / peak * 1e6 if record["flops"] and peak else 0.0

    def stage_compute(self, spec) -> StageCompute:
        """The planner's compute account of `spec`'s layout (planner/terms/compute.py)."""
        key = (ConfigKey.of(spec.layout), spec.seq_len)
        if key not in self._stage_compute:
            self._stage_compute[key] = StageCompute.of(key[0], self.model_cost, spec.seq_len,
                                                       self.options)
        return self._stage_compute[key]

    def chunk_targets_us(self, spec, pp_rank: int) -> Dict[Tuple[int, str, str], float]:
        """(chunk, phase "F" | "B", part "block" | "other") -> the planner's time (us) for one
        micro-batch of that part of the rank's chunk: its blocks' forward and backward (the
        stage's recompute shared by its chunks), and the embedding's share of "other" on the
        first virtual stage, the rest on the last."""
        layout = spec.layout
        sc = self.stage_compute(spec)
        n_stage = layout.layers_per_stage[pp_rank]
        v = layout.virtual_stages
        mode, k = layout.recompute[pp_rank]
        recompute_us = float(sc.recompute_us(n_stage, MODE_CODES[mode], k))
        last_virtual = layout.pp * v - 1
        targets = {}
        layers = n_stage / v  # train splits a stage's blocks, and its recomputed ones, evenly
        for chunk in range(v):
            virtual = chunk * layout.pp + pp_rank
            other_fwd = other_bwd = 0.0
            if virtual == 0:
                other_fwd, other_bwd = sc.other_first.fwd_us, sc.other_first.bwd_us
            if virtual == last_virtual:
                other_fwd, other_bwd = (other_fwd + sc.other_last.fwd_us,
                                        other_bwd + sc.other_last.bwd_us)
            targets[(chunk, "F", "block")] = layers * sc.layer.block.fwd_us
            targets[(chunk, "B", "block")] = layers * sc.layer.block.bwd_us + recompute_us / v
            targets[(chunk, "F", "other")] = other_fwd
            targets[(chunk, "B", "other")] = other_bwd
        return targets

    def price(self, records: List[dict], spec, pp_rank: int) -> None:
        """Set time_us and time_source on every compute record of one rank's trace."""
        for r in records:
            if r["kind"] == "compute":
                r["time_us"] = self.roofline_us(r)
                r["time_source"] = "device_sheet"
        if self.model_cost is None:
            return
        # Each chunk's (micro-batch, pass, part) to the planner's time; the loss with the
        # forward of "other" (its forward and backward both run between the chunk's passes).
        groups: Dict[tuple, List[dict]] = {}
        step: List[dict] = []
        for r in records:
            if r["kind"] != "compute":
                continue
            if r["phase"] in ("F", "B", "loss"):
                phase = "B" if r["phase"] == "B" else "F"
                groups.setdefault((r["chunk"], r["mb"], phase), []).append(r)
            elif r["phase"] in STEP_PHASES:
                step.append(r)
        targets = self.chunk_targets_us(spec, pp_rank)
        source = f"profile:{self.profile_source}"
        for (chunk, _, phase), ops in groups.items():
            parts = split_parts(ops, backward=phase == "B")
            want = {part: targets[(chunk, phase, part)] for part in parts}
            for part, sibling in (("other", "block"), ("block", "other")):
                if not parts[part]:  # a part with no ops here: its time to the other part's
                    want[sibling] += want[part]
            for part, mine in parts.items():
                if mine:
                    self._fit(mine, want[part], source)
        layout = spec.layout
        step_us = float(self.stage_compute(spec).optimizer_us(
            pp_rank, layout.layers_per_stage[pp_rank]))
        if step and step_us > 0:  # 0: the profile has no optimizer figure (roofline stays)
            self._fit(step, step_us, source)

    def _fit(self, ops: List[dict], want_us: float, source: str) -> None:
        times = fit_to_total([r["time_us"] for r in ops], [self.floor_us(r) for r in ops],
                             want_us)
        for r, t in zip(ops, times):
            r["time_us"] = t
            r["time_source"] = source


def model_profile(cfg):
    """(ModelProfile or None, note): the cluster's profile of cfg.model; None, with why, when
    there is none (the device sheet prices then). ProfileError (exit 4, with the command that
    mends it) when it is corrupt, unfinished (a stopped run's) or a profile of another model
    (store.schema.identity): a file the user made for this model is never silently replaced
    by the sheet, as search and train refuse it too."""
    from orchestrator.commands import rerun_command
    from orchestrator.store import check_identity, model_profile_path, read_profile
    from orchestrator.store.schema import ModelProfile

    path = model_profile_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)
    if not path.exists():
        return None, f"no model profile {path}"
    rebuild = rerun_command("profile_model")
    profile = read_profile(path, ModelProfile, rebuild)
    check_identity(path, profile, cfg, rebuild)
    return profile, ""


def planner_options(cfg) -> CostOptions:
    """The cost model's options the search prices with (train.plan.engine_options: the
    cluster's calibration; search.moe_imbalance)."""
    from orchestrator.train.plan import engine_options

    return dataclasses.replace(engine_options(cfg), moe_imbalance=cfg.search.moe_imbalance)


def make_pricer(cfg, tps) -> ComputePricer:
    """The pricer for this cluster and model: the planner's compute from the model profile
    when it exists and covers every TP degree traced, else the device sheet (trace.device, or
    h100); ProfileError when the profile cannot be used (model_profile)."""
    from orchestrator.planner.model_cost import ModelCost
    from orchestrator.device import load_device_sheet
    from orchestrator.store import model_profile_path

    sheet = load_device_sheet(cfg.trace.device, key="trace.device")
    profile, why = model_profile(cfg)
    if profile is None:
        return ComputePricer(sheet, note=f"{why}: device sheet {sheet['name']} for every op")
    path = model_profile_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)
    cost = ModelCost.from_profile(profile).with_moe(cfg.model)  # as the search reads it
    missing = sorted(set(tps) - set(cost.tps))
    if missing:
        return ComputePricer(sheet, note=f"{path} has no fit for tp {missing} (profiled "
                                         f"{list(cost.tps)}): device sheet {sheet['name']}")
    options = planner_options(cfg)
    extras = ""
    if cost.moe is not None:
        from orchestrator.planner.terms.moe import moe_imbalance

        extras += (f"; MoE blocks on the busiest EP rank at {moe_imbalance(cost, options):g}x "
                   f"the mean load")
    if options.calibration.runs:
        extras += f"; {options.calibration.describe()}"
    return ComputePricer(sheet, cost, profile.source, options=options,
                         note=f"compute times from {path} ({profile.source}) as the planner "
                              f"charges them{extras}")
