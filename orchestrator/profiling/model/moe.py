"""A mixture-of-experts model's FFN, profiled part by part beside the (seq, tp) points.

The points of a MoE model time a dense block (`models/config.dense_twin`: attention + a SwiGLU
of model.ffn, what its first `dense_layers` blocks are). The MoE FFN is timed in parts, each the training
code's own module (models/moe.py) run alone on one rank, against the tokens it processes:

- routing: `MoE` with its experts left out (its dispatch hands the permuted tokens straight
  back) and no shared expert: router GEMM, softmax, top-k, aux loss, capacity mask, sort by
  expert, gather (permute), gate, index_add (unpermute). The router is replicated over TP and
  routes the rank's sequence shard: x = the rank's tokens.
- experts: `Experts` of `experts_timed` experts at width expert_ffn / etp, each on n tokens:
  the loop of per-expert SwiGLU GEMMs train runs (one GEMM per projection per expert; no
  grouped GEMM). Times are per expert (the loop's over experts_timed): x = one expert's tokens.
- shared: `SharedExpert(hidden, shared_expert_ffn / tp)` on the gathered sequence (TP with SP:
  all-gather in, reduce-scatter out; the collectives are the hardware profile's to price).
- mlp: the same SwiGLU at ffn / tp: the dense block's FFN, so that a MoE block is the block
  less it plus the parts above (moe_costs.py).

Measured: real tensors on the rank's device (measure.Stopwatch: CUDA events on a GPU), each
backward with train's gradient accumulation (timing.MainGrads, as the points'), the
median of `iters` iterations after `warmup_iters`, every rank at once (the contention the points
see), the ranks' median. Analytic: meta tensors; on a device sheet with efficiency curves each
GEMM at its own FLOPs' efficiency and every other op's bytes at hbm_GBps (device.OpTimer, as the
points' ops); on a sheet with one efficiency, FLOPs (FlopCounterMode) / (peak x efficiency),
routing, mostly memory-bound ops around one small GEMM, adding the bytes its other ops move at
the sheet's hbm_GBps. Activation bytes: the saved-tensor counter (memory.py) on one forward.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Sequence, Tuple

from orchestrator.choices import MoePart
from orchestrator.models.config import ModelConfig, expert_width, is_moe

EXPERTS_TIMED = 8  # experts in one timed loop (fewer if the model has fewer)
EXPERT_SWEEP_POINTS = 5  # tokens per expert: the largest, then down by EXPERT_SWEEP_RATIO
EXPERT_SWEEP_RATIO = 4
TOKEN_SWEEP_POINTS = 6  # at most this many token counts for routing, shared and mlp

# (part, tokens, split): one timed MoE case; split is etp for experts, tp for shared and mlp.
MoeCase = Tuple[MoePart, int, int]


def expert_token_sweep(cfg: ModelConfig, max_seq_len: int, batch: int) -> List[int]:
    """Tokens per expert to time: a micro-batch's token copies (batch x max_seq_len x top_k,
    all on one expert: the most it can get) down by factors of EXPERT_SWEEP_RATIO."""
    most = batch * max_seq_len * cfg.top_k
    return sorted({max(1, round(most / EXPERT_SWEEP_RATIO ** i))
                   for i in range(EXPERT_SWEEP_POINTS)})


def thin(values: Sequence[int], most: int = TOKEN_SWEEP_POINTS) -> List[int]:
    """At most `most` of the distinct `values`, spread evenly in log space, the smallest and
    the largest kept."""
    import numpy as np

    v = sorted(set(int(x) for x in values))
    if len(v) <= most:
        return v
    targets = np.geomspace(v[0], v[-1], most)
    return sorted({min(v, key=lambda x: abs(np.log(x / t))) for t in targets})


def moe_cases(cfg: ModelConfig, seq_lens: Sequence[int], tps: Sequence[int],
              batch: int) -> List[MoeCase]:
    """What a MoE model's sub-part "moe" times; [] for a dense model.

    routing at the rank's tokens (batch x seq / tp over the points' lengths and TP degrees),
    experts per etp (the TP degrees that divide the expert width) at expert_token_sweep, shared
    (if any) and mlp per tp at the gathered sequence's tokens (batch x seq).
    """
    if not is_moe(cfg):
        return []
    routed = thin(batch * s // tp for s in seq_lens for tp in tps)
    gathered = thin(batch * s for s in seq_lens)
    cases: List[MoeCase] = [(MoePart.routing, t, 1) for t in routed]
    width = expert_width(cfg)
    for etp in (tp for tp in tps if width % tp == 0):
        cases += [(MoePart.experts, n, etp)
                  for n in expert_token_sweep(cfg, max(seq_lens), batch)]
    for tp in tps:
        if cfg.shared_expert_ffn:
            cases += [(MoePart.shared, t, tp) for t in gathered]
        cases += [(MoePart.mlp, t, tp) for t in gathered]
    return cases


def experts_timed(cfg: ModelConfig) -> int:
    return min(cfg.experts, EXPERTS_TIMED)


# ---------------------------------------------------------------- the modules
def _identity_dispatch(tokens, counts, experts):
    return tokens


def build_part(cfg: ModelConfig, part: MoePart, split: int, device):
    """The module of `part` in the model's dtype on `device` ("meta": shapes only), split
    `split` ways (etp for experts, tp for shared and mlp), weights std 0.02."""
    import torch

    from orchestrator.models.gpt import torch_dtype
    from orchestrator.models.moe import MoE, Experts, SharedExpert

    dtype = torch_dtype(cfg.dtype)
    with torch.device("meta"):  # the router alone gets real storage below
        if part == MoePart.routing:
            module = MoE(replace(cfg, shared_expert_ffn=0))
            module.experts = None
            module.dispatch = _identity_dispatch
        elif part == MoePart.experts:
            module = Experts(experts_timed(cfg), cfg.hidden, expert_width(cfg) // split)
        else:
            width = cfg.shared_expert_ffn if part == MoePart.shared else cfg.ffn
            module = SharedExpert(cfg.hidden, width // split)
    module = module.to_empty(device=device).to(dtype)
    if torch.device(device).type != "meta":
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0.0, 0.02)
    return module


def part_input(cfg: ModelConfig, part: MoePart, tokens: int, device, generator=None):
    """The input of `part` at `tokens` (requires grad): (1, tokens, hidden) for routing (a
    sequence shard), (experts_timed x tokens, hidden) for experts, (tokens, hidden) else."""
    import torch

    from orchestrator.models.gpt import torch_dtype

    rows = tokens * experts_timed(cfg) if part == MoePart.experts else tokens
    shape = (1, rows, cfg.hidden) if part == MoePart.routing else (rows, cfg.hidden)
    dtype = torch_dtype(cfg.dtype)
    if torch.device(device).type == "meta":
        x = torch.empty(shape, dtype=dtype, device=device)
    else:
        x = torch.randn(shape, dtype=torch.float32, generator=generator).to(device, dtype)
    return x.requires_grad_(True)


def part_forward(cfg: ModelConfig, part: MoePart, module, x, tokens: int):
    """The part's forward on `x`; every expert of the timed loop gets `tokens` tokens."""
    if part == MoePart.experts:
        return module(x, [tokens] * experts_timed(cfg))
    return module(x)


def per_expert(cfg: ModelConfig, part: MoePart) -> int:
    """What a part's loop figures are divided by: experts_timed for experts, else 1."""
    return experts_timed(cfg) if part == MoePart.experts else 1


# ---------------------------------------------------------------- counts (shapes only)
def count_case(cfg: ModelConfig, part: MoePart, tokens: int, split: int) -> Dict[str, float]:
    """One case on meta tensors, per expert for experts: FLOPs ("fwd", "bwd"), bytes moved by
    its ops other than GEMMs ("fwd_bytes", "bwd_bytes"), activation bytes ("act_bytes"), and
    its GEMMs as (batch, m, k, n, element bytes) ("fwd_gemms", "bwd_gemms": every expert's,
    not divided)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from orchestrator.profiling.model import memory as mem
    from orchestrator.profiling.model.analytic import ops_mode

    module = build_part(cfg, part, split, "meta")
    x = part_input(cfg, part, tokens, "meta")
    div = per_expert(cfg, part)
    counter = mem.SavedTensorCounter(mem.states_of(module))
    with FlopCounterMode(display=False) as fwd, ops_mode() as moved_fwd, counter.hooks():
        y = part_forward(cfg, part, module, x, tokens)
    act = counter.total_bytes
    counter.release()
    with FlopCounterMode(display=False) as bwd, ops_mode() as moved_bwd:
        y.backward(torch.empty_like(y))
    return {"fwd": fwd.get_total_flops() / div, "bwd": bwd.get_total_flops() / div,
            "fwd_bytes": moved_fwd.bytes / div, "bwd_bytes": moved_bwd.bytes / div,
            "act_bytes": act / div, "fwd_gemms": moved_fwd.ops.gemms,
            "bwd_gemms": moved_bwd.ops.gemms}


def analytic_case(cfg: ModelConfig, case: MoeCase, sheet: dict) -> dict:
    """A case's record from its counts and a device sheet (moe module docstring): on a sheet
    with efficiency curves each GEMM at its own FLOPs' efficiency and the other ops' bytes at
    hbm_GBps (device.OpTimer, as a dense block's ops); on one with a single efficiency, the
    FLOPs at it and, for routing, the bytes at hbm_GBps."""
    from orchestrator.device import OpCost, OpTimer, flops_to_us, has_curves

    part, tokens, split = case
    counts = count_case(cfg, part, tokens, split)
    div = per_expert(cfg, part)
    timer = OpTimer(sheet)
    times = {}
    for phase in ("fwd", "bwd"):
        if has_curves(sheet):
            us = timer.us(OpCost("memory", 0.0, counts[f"{phase}_bytes"], cfg.dtype))
            us += sum(timer.us(OpCost("gemm", 2.0 * b * m * k * n,
                                          float(e * b * (m * k + k * n + m * n)), cfg.dtype))
                      for b, m, k, n, e in counts[f"{phase}_gemms"]) / div
        else:
            us = flops_to_us(counts[phase], sheet, cfg.dtype)
            if part == MoePart.routing and sheet.get("hbm_GBps"):
                us += counts[f"{phase}_bytes"] / (float(sheet["hbm_GBps"]) * 1e3)
        times[f"{phase}_us"] = us
    return {"part": part.value, "tokens": tokens, "split": split, "source": "analytic",
            **times, "act_bytes": counts["act_bytes"],
            "flops": {"fwd": counts["fwd"], "bwd": counts["bwd"]}}


# ---------------------------------------------------------------- measured
def time_case(cfg: ModelConfig, case: MoeCase, device, warmup_iters: int,
              iters: int, module=None) -> Dict[str, List[float]]:
    """Samples (us, per expert for experts) of the case's forward ("fwd_us") and backward
    ("bwd_us") on `device`, and its activation bytes counted on one more forward
    ("act_bytes": [bytes])."""
    import torch

    from orchestrator.profiling.measure import Stopwatch
    from orchestrator.profiling.model import memory as mem
    from orchestrator.profiling.model.timing import MainGrads

    part, tokens, split = case
    module = module if module is not None else build_part(cfg, part, split, device)
    # train's gradient accumulation, as the points' backward (an expert's: ~0.44 ms a
    # micro-batch for one of mixtral_8x7b's on an H200, whatever its tokens)
    grads = MainGrads(module.parameters())
    g = torch.Generator().manual_seed(4321 + tokens)
    x = part_input(cfg, part, tokens, device, g)
    y = part_forward(cfg, part, module, x, tokens)
    dy = torch.randn(y.shape, generator=g).to(y.device, y.dtype)
    del y
    div = per_expert(cfg, part)
    clock = Stopwatch(torch.device(device))
    samples: Dict[str, List[float]] = {"fwd_us": [], "bwd_us": []}
    for i in range(warmup_iters + iters):
        clock.sync()
        t0 = clock.mark()
        y = part_forward(cfg, part, module, x, tokens)
        t1 = clock.mark()
        grads.backward(y, dy)
        t2 = clock.mark()
        if i >= warmup_iters:
            samples["fwd_us"].append(clock.elapsed_us(t0, t1) / div)
            samples["bwd_us"].append(clock.elapsed_us(t1, t2) / div)
        x.grad = None
        for p in module.parameters():
            p.grad = None
        del y
    counter = mem.SavedTensorCounter(mem.states_of(module))
    with counter.hooks():
        y = part_forward(cfg, part, module, x, tokens)
    samples["act_bytes"] = [counter.total_bytes / div]
    counter.release()
    del y
    return samples


def measure_cases(cfg: ModelConfig, cases: Sequence[MoeCase], device, warmup_iters: int,
                  iters: int) -> List[Dict[str, float]]:
    """This rank's figures per case: median and fastest fwd/bwd (us) and act_bytes. A module
    is built once per (part, split) and reused over its token counts."""
    from orchestrator.profiling.measure import summarize

    modules: Dict[Tuple[MoePart, int], object] = {}
    out = []
    for case in cases:
        part, _, split = case
        if (part, split) not in modules:
            modules.clear()  # one module alive at a time (a big model's experts)
            modules[(part, split)] = build_part(cfg, part, split, device)
        samples = time_case(cfg, case, device, warmup_iters, iters, modules[(part, split)])
        fwd, bwd = summarize(samples["fwd_us"]), summarize(samples["bwd_us"])
        out.append({"fwd_us": fwd.median, "bwd_us": bwd.median, "fwd_fastest_us": fwd.min,
                    "bwd_fastest_us": bwd.min, "act_bytes": samples["act_bytes"][0]})
    return out


def combine_case_ranks(cfg: ModelConfig, cases: Sequence[MoeCase],
                       per_rank: Sequence[Sequence[Dict[str, float]]], iters: int) -> List[dict]:
    """The records of measured cases from every rank's measure_cases: each figure the ranks'
    median (every rank ran alone, all at once), FLOPs per rank from the shapes."""
    import numpy as np

    records = []
    for i, (part, tokens, split) in enumerate(cases):
        figures = {k: float(np.median([r[i][k] for r in per_rank])) for k in per_rank[0][i]}
        counts = count_case(cfg, part, tokens, split)
        records.append({"part": part.value, "tokens": tokens, "split": split,
                        "source": "measured", **figures,
                        "flops": {"fwd": counts["fwd"], "bwd": counts["bwd"]},
                        "iters": iters, "groups": len(per_rank)})
    return records


# ---------------------------------------------------------------- the profile's section
def moe_section(cfg: ModelConfig, records: Sequence[dict]) -> dict:
    """The schema's "moe" section (MoeSection) from a MoE sub-part's records: per part (and
    split) fits of fwd/bwd time (c0 + c1 tokens, fit.fit_tokens) and activation bytes."""
    from orchestrator.profiling.model.fit import fit_token_bytes, fit_tokens

    groups: Dict[Tuple[str, int], List[dict]] = {}
    for r in records:
        groups.setdefault((r["part"], int(r["split"])), []).append(r)
    fits: Dict[str, Dict[int, dict]] = {}
    for (part, split), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["tokens"])
        tokens = [r["tokens"] for r in rs]
        entry, resid = {}, {}
        for key in ("fwd_us", "bwd_us"):
            entry[key], resid[key] = fit_tokens(tokens, [r[key] for r in rs])
        entry["act_bytes"] = fit_token_bytes(tokens, [r["act_bytes"] for r in rs])
        entry["tokens"] = tokens
        entry["max_rel_err"] = max(abs(x) for rr in resid.values() for x in rr)
        entry["source"] = rs[0]["source"]  # one sub-part: one source
        entry["rel_residuals"] = resid
        fits.setdefault(part, {})[split] = entry
    section = {"kernel": "loop", "block": "dense", "experts_timed": experts_timed(cfg),
               "routing": fits[MoePart.routing.value][1],
               "experts": {str(k): v for k, v in fits[MoePart.experts.value].items()},
               "mlp": {str(k): v for k, v in fits[MoePart.mlp.value].items()},
               "points": sorted(records, key=lambda r: (r["part"], r["split"], r["tokens"])),
               "source": records[0]["source"]}
    if MoePart.shared.value in fits:
        section["shared"] = {str(k): v for k, v in fits[MoePart.shared.value].items()}
    return section

