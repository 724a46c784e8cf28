"""A time for every compute op of a trace: from the model profile when there is one, else from a
device sheet, each op marked by its source.

- Device sheet (`device_sheet`): a roofline per op, max(FLOPs / (peak x efficiency), bytes / HBM
  bandwidth) (the bytes term only where the sheet gives `hbm_GBps`). FLOPs are torch's formulas
  (matmuls, attention); elementwise ops have none and are priced by their bytes.
- Model profile (`profile:<source>`): the profile times one block's forward and backward (and the
  embedding + head + loss, "other") per sequence at a TP degree. A chunk's traced forward is
  scaled so its ops add up to layers x block forward (+ "other" on the last stage) x micro-batch
  size; its backward to layers x block backward plus what recompute reruns. Within a chunk the
  ops keep their roofline proportions. Ops outside the chunks (loss, optimizer) keep the
  roofline: the profile does not time them on their own.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from orchestrator.choices import Recompute, Source
from orchestrator.device import op_flops_per_us


class ComputePricer:
    """Prices compute records in place (`time_us`, `time_source`)."""

    def __init__(self, sheet: dict, model_cost=None, profile_source: Source | str = "",
                 note: str = ""):
        self.sheet = sheet
        self.model_cost = model_cost
        self.profile_source = profile_source
        self.note = note  # why the profile is not used, when it is not
        hbm = sheet.get("hbm_GBps")
        self.hbm_bytes_per_us = float(hbm) * 1e3 if hbm else None
        self._peak: Dict[str, Optional[float]] = {}

    def _flops_per_us(self, dtype: str) -> Optional[float]:
        if dtype not in self._peak:
            self._peak[dtype] = op_flops_per_us(self.sheet, dtype)
        return self._peak[dtype]

    def roofline_us(self, record: dict) -> float:
        """One op's time (us) from the device sheet alone."""
        t = 0.0
        rate = self._flops_per_us(record.get("dtype") or "fp32")
        if record["flops"] and rate:
            t = record["flops"] / rate
        if self.hbm_bytes_per_us:
            t = max(t, record["bytes"] / self.hbm_bytes_per_us)
        return t

    def chunk_targets_us(self, spec, layers: int, last: bool, tp: int,
                         recompute: Recompute) -> Optional[Tuple[float, float]]:
        """(forward, backward) of one micro-batch of a chunk from the profile, or None."""
        cost = self.model_cost
        if cost is None:
            return None
        # a CP rank does 1 / cp of each sequence's work (its tokens, its balanced share of the
        # causal attention: planner/terms/compute.py's rule)
        # (a fit's constant once per call, the rest per sequence: ModelCost)
        seq, mbs = spec.seq_len, spec.layout.micro_batch_size / spec.layout.cp
        fwd = layers * cost.block_fwd_us(seq, tp, mbs)
        bwd = layers * cost.block_bwd_us(seq, tp, mbs)
        if recompute == Recompute.full:
            bwd += fwd
        elif recompute == Recompute.selective:
            bwd += layers * mbs * cost.attention_core_fwd_us(seq, tp)
        if last:
            fwd += cost.other_fwd_us(seq, tp, mbs)
            bwd += cost.other_bwd_us(seq, tp, mbs)
        return fwd, bwd

    def price(self, records: List[dict], spec, pp_rank: int) -> None:
        """Set time_us and time_source on every compute record of one rank's trace."""
        layout = spec.layout
        chunk_layers = layout.layers_per_stage[pp_rank] // layout.virtual_stages
        num_virtual = layout.pp * layout.virtual_stages
        recompute = layout.recompute[pp_rank][0]
        for r in records:
            if r["kind"] == "compute":
                r["time_us"] = self.roofline_us(r)
                r["time_source"] = "device_sheet"
        if self.model_cost is None:
            return
        # Scale each (chunk, phase) of micro-batch group to the profile's time.
        groups: Dict[Tuple[int, str, int], List[dict]] = {}
        for r in records:
            if r["kind"] == "compute" and r["phase"] in ("F", "B"):
                groups.setdefault((r["chunk"], r["phase"], r["mb"]), []).append(r)
        targets = {}
        source = f"profile:{self.profile_source}"
        for (chunk, phase, mb), ops in groups.items():
            if chunk not in targets:
                last = chunk * layout.pp + pp_rank == num_virtual - 1
                targets[chunk] = self.chunk_targets_us(spec, chunk_layers, last,
                                                       layout.tp, recompute)
            want = targets[chunk][0 if phase == "F" else 1]
            have = sum(r["time_us"] for r in ops)
            scale = want / have if have > 0 else 0.0
            for r in ops:
                r["time_us"] = r["time_us"] * scale if have > 0 else want / len(ops)
                r["time_source"] = source


def model_profile(cfg):
    """(ModelProfile or None, note): the cluster's profile of cfg.model; None, with why, when
    there is none or it is unreadable (the device sheet prices then). ProfileError (exit 4)
    when it is a profile of another model (store.schema.identity): a file that claims to be
    this model but is not is stale, not a fallback."""
    from orchestrator.commands import rerun_command
    from orchestrator.errors import ProfileError
    from orchestrator.store import check_identity, model_profile_path, read_profile
    from orchestrator.store.schema import ModelProfile

    path = model_profile_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)
    if not path.exists():
        return None, f"no model profile {path}"
    rebuild = rerun_command("profile_model")
    try:
        profile = read_profile(path, ModelProfile, rebuild)
    except ProfileError as e:
        return None, f"model profile unusable ({e})"
    check_identity(path, profile, cfg, rebuild)
    return profile, ""


def make_pricer(cfg, tps) -> ComputePricer:
    """The pricer for this cluster and model: the model profile when it exists and covers every
    TP degree traced, else the device sheet (trace.device, or h100); ProfileError when the
    profile is another model's (model_profile)."""
    from orchestrator.planner.profiles import ModelCost
    from orchestrator.device import load_device_sheet
    from orchestrator.store import model_profile_path

    sheet = load_device_sheet(cfg.trace.device)
    profile, why = model_profile(cfg)
    if profile is None:
        return ComputePricer(sheet, note=f"{why}: device sheet {sheet['name']} for every op")
    path = model_profile_path(cfg.profiles_dir, cfg.cluster.name, cfg.model.name)
    cost = ModelCost.from_profile(profile)
    missing = sorted(set(tps) - set(cost.tps))
    if missing:
        return ComputePricer(sheet, note=f"{path} has no fit for tp {missing} (profiled "
                                         f"{list(cost.tps)}): device sheet {sheet['name']}")
    return ComputePricer(sheet, cost, profile.source,
                         note=f"compute times from {path} ({profile.source})")
