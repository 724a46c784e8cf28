"""One profile point (sequence length, TP degree) -> one record of the model profile.

`PointRunner` builds the one-layer point model for each TP degree, counts its memory (saved
activations per recompute mode, parameter/gradient/optimizer states) and its FLOPs (tp=1 model
under FakeTensorMode, divided by tp), and asks its timing strategy for the times:
- MeasuredTiming: on every rank of the job. TP groups of real size are consecutive ranks (tp=2
  on 4 ranks: {0,1} and {2,3}, all timed at once); tp=1 runs on every rank alone.
- AnalyticTiming: in this process, shapes only: the model on a fake process group of tp ranks
  under FakeTensorMode, time = FLOPs / (device sheet peak x efficiency).
A mixture-of-experts model's FFN parts (routing, experts, shared expert, the dense MLP) are
timed by the same strategies apart from the points (`PointRunner.moe`, profiling/model/moe.py).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional

from orchestrator.choices import Dtype
from orchestrator.models.compile import is_compiled
from orchestrator.models.compile_setting import train_compile
from orchestrator.models.config import vocab_rows
from orchestrator.profiling.model import analytic as an
from orchestrator.profiling.model import memory as mem
from orchestrator.profiling.model import moe
from orchestrator.profiling.model.plan import ProfilePlan
from orchestrator.profiling.model.host_device import combine_host_device, time_host_device
from orchestrator.profiling.model.optimizer_step import (optimizer_step_bytes_per_element,
                                                         time_optimizer_step_us)
from orchestrator.profiling.model.timing import (build_point_model, combine_ranks,
                                                 fastest_and_median, local_numel, memory_point,
                                                 time_point, time_recompute)


class MeasuredTiming:
    """Real tensors on this rank's device; TP groups built once on every rank (new_group is
    collective, so every rank creates every group in the same order)."""

    source = "measured"

    def __init__(self, ctx, cfg, tps):
        from torch.distributed.device_mesh import init_device_mesh

        self.ctx = ctx
        self.device = ctx.device
        self.warmup_iters = int(cfg.profile_model.warmup_iters)
        self.iters = int(cfg.profile_model.iters)
        self.layers = int(cfg.model.layers)
        # Micro-batch sizes a GPU times with host and device apart (time_host_device)
        self.micro_batch_sizes = [int(b) for b in cfg.profile_model.micro_batch_sizes]
        self.allocator = self.device.type == "cuda"  # the allocator's figures on a GPU
        # the block as train runs it: compiled where train compiles (train.compile)
        self.compile = train_compile(cfg, self.device.type)
        self.gpu_kernels = False  # the kernels that run are the ones counted
        self.meshes = {tp: init_device_mesh(self.device.type, (ctx.world_size // tp, tp),
                                            mesh_dim_names=("dp", "tp"))["tp"]
                       for tp in tps if tp > 1}

    @contextlib.contextmanager
    def world(self, tp: int):
        """This rank's TP mesh of `tp` ranks (None for tp == 1)."""
        yield self.meshes.get(tp)

    def tensors(self):
        """Where the point's tensors are made: real ones, on this rank's device."""
        return contextlib.nullcontext()

    def times_us(self, pm, seq: int, tp: int, flops: Dict[str, float],
                 ops=None) -> Optional[dict]:
        """Every rank times the point; rank 0 gets the combined times, "iters" and "groups"."""
        import torch.distributed as dist

        group = self.meshes[tp].get_group() if tp > 1 else None
        barrier = (lambda: dist.barrier(group=group)) if group is not None else (lambda: None)
        samples = time_point(pm, seq, self.warmup_iters, self.iters, barrier)
        if self.device.type == "cpu" and tp == 1:
            # A CPU runs a checkpoint's own work on the clock the cost model prices (a GPU's
            # host issues it while the device runs the rerun's kernels: FLOPs price those).
            samples.update(time_recompute(pm, seq, self.warmup_iters, self.iters))
        block_numel = local_numel(pm.block.parameters())
        other_numel = local_numel(pm.other_params())
        model_numel = self.layers * block_numel + other_numel  # the most a stage steps
        for key, numel in (("block_optim_us", block_numel), ("other_optim_us", other_numel)):
            samples[key] = time_optimizer_step_us(numel, self.device, self.warmup_iters,
                                                  self.iters, model_numel)
        host_device = {}
        if self.device.type == "cuda" and self.micro_batch_sizes:
            # TP groups time the profile's own size only (it fits: time_point ran it), so no
            # rank of a group runs out of memory alone in the middle of a collective.
            batches = self.micro_batch_sizes if tp == 1 else [pm.batch]
            host_device = time_host_device(pm, seq, batches, self.warmup_iters, self.iters,
                                           barrier)
        per_rank = self.ctx.gather((fastest_and_median(samples), host_device))
        if not self.ctx.is_root:
            return None
        times = combine_ranks([r for r, _ in per_rank], tp)
        if host_device:
            times["host_device"] = combine_host_device([h for _, h in per_rank], tp, times)
        return {**times, "iters": self.iters, "groups": len(per_rank) // tp}

    def moe_records(self, model, cases) -> Optional[list]:
        """Every rank times the MoE cases alone (all at once, as the points); rank 0 gets the
        records (the ranks' median)."""
        per_rank = self.ctx.gather(moe.measure_cases(model, cases, self.device,
                                                     self.warmup_iters, self.iters))
        if not self.ctx.is_root:
            return None
        return moe.combine_case_ranks(model, cases, per_rank, self.iters)

    def concurrency(self) -> dict:
        """How busy the host was while the times were taken (the cost model's contention term,
        planner/calibration.py): every rank of the job on this host times at once, each with
        torch's intra-op threads, on the CPUs it may use (CPU ranks; a GPU rank's host CPUs do
        not compute)."""
        import os

        import torch

        hosts = self.ctx.hostnames
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        return {"ranks_busy": hosts.count(hosts[self.ctx.rank]),
                "threads": torch.get_num_threads(),
                "cpus": cpus if self.device.type == "cpu" else None}

    def method(self, plan: ProfilePlan) -> dict:
        """The profile's "method": how times and memory were obtained."""
        device = str(self.device)
        if self.device.type == "cuda":
            import torch

            device = torch.cuda.get_device_name(self.device)
        return {"source": "measured", "why": plan.reason, "device": device,
                "compiled": self.compile,
                "concurrency": self.concurrency(),
                "timing": "median of `iters` iterations per rank (fastest kept as *_fastest_us); "
                          "a TP group is its slowest rank, groups summarised by their median; "
                          "*_us exclude TP collectives (kept as *_comm_us), *_total_us include "
                          "them; each backward adds its gradients into fp32 buffers, as "
                          "train's buckets accumulate them per micro-batch; *_optim_us: the "
                          "optimizer step (norm, clip, AdamW, copy) of the part's parameters",
                "activations": ("CUDA allocator (saved-tensor count in block_act_bytes_saved)"
                                if self.allocator else "saved tensors (exact)"),
                "host_device": self.host_device_note(),
                "states": mem.BYTES_PER_PARAM_NOTE}

    def host_device_note(self) -> str:
        """What the profile says about host time and device time (the cost model prices a
        call from them: planner/model_cost.TpFit.call_us)."""
        if self.device.type != "cuda":
            return ("not told apart: on a CPU the host runs the kernels, so a call's time is "
                    "both (fits: constant once per call + per-sequence terms)")
        if not self.micro_batch_sizes:
            return ("not told apart: profile_model.micro_batch_sizes is empty (fits: the "
                    "events' time, constant once per call + per-sequence terms)")
        return (f"apart: each point's parts queued behind a sleep kernel, CUDA events timing "
                f"the device alone and the wall clock the host issuing them, on micro-batches "
                f"of {self.micro_batch_sizes} sequences at tp 1 (the largest that fit) and "
                f"profile_model.micro_batch_size under TP (points' host_device); fits' "
                f"device_us and host_us: a call costs max(host, device). *_us: synchronised "
                f"events, host and device together")


class AnalyticTiming:
    """Shapes only, in this process: times from FLOPs and the plan's device sheet."""

    source = "analytic"
    device = "cpu"
    allocator = False
    compile = False  # shapes only: nothing runs

    def __init__(self, plan: ProfilePlan, dtype: str):
        self.sheet = an.load_device_sheet(plan.device)
        self.dtype = dtype
        self.gpu_kernels = self.sheet["type"] == "gpu"  # count what CUDA kernels would save
        self.fake = an.fake_tensors_mode()

    def world(self, tp: int):
        """A fake world of `tp` ranks and its mesh (None for tp == 1)."""
        return an.fake_world(tp)

    def tensors(self):
        """Where the point's tensors are made: FakeTensorMode (shapes, no data)."""
        return self.fake

    def times_us(self, pm, seq: int, tp: int, flops: Dict[str, float], ops=None) -> dict:
        """Schema times (us) of one TP rank from the tp=1 counts (`ops`: analytic.count_ops'
        ops, priced one by one on a sheet with efficiency curves); the optimizer steps from the
        bytes they move at the sheet's HBM bandwidth (none without `hbm_GBps`)."""
        times = an.analytic_times_us(flops, tp, self.sheet, self.dtype, ops,
                                     tokens=pm.batch * seq, hidden=pm.cfg.hidden)
        hbm_GBps = self.sheet.get("hbm_GBps")
        if hbm_GBps:
            per_element = optimizer_step_bytes_per_element(self.gpu_kernels)
            us_per_element = per_element / (float(hbm_GBps) * 1e3)
            times["block_optim_us"] = local_numel(pm.block.parameters()) * us_per_element
            times["other_optim_us"] = local_numel(pm.other_params()) * us_per_element
            # train's add of each micro-batch's gradients into its fp32 buckets (timing.MainGrads,
            # inside a measured backward): read the gradient and the bucket, write the bucket
            add_us = (Dtype.parse(self.dtype).bytes + 8) / (float(hbm_GBps) * 1e3)
            times["block_grad_add_us"] = local_numel(pm.block.parameters()) * add_us
            times["other_grad_add_us"] = local_numel(pm.other_params()) * add_us
        return times

    def moe_records(self, model, cases) -> list:
        """The MoE cases' records from their counts on meta tensors and the device sheet."""
        return [moe.analytic_case(model, case, self.sheet) for case in cases]

    def method(self, plan: ProfilePlan) -> dict:
        """The profile's "method": how times and memory were obtained."""
        return {"source": "analytic", "why": plan.reason, "device_sheet": self.sheet,
                "timing": ("each op on one rank by the sheet's efficiency curves: a GEMM's "
                           "FLOPs at the gemm curve, flash attention at the attention curve "
                           "(causal half), other ops' bytes / hbm_GBps"
                           if an.has_curves(self.sheet) else
                           "FLOPs (FlopCounterMode, causal attention halved) / (peak x "
                           "efficiency)")
                          + "; TP collectives excluded; *_optim_us: the bytes the "
                          "optimizer step moves (norm, clip, AdamW, copy) / hbm_GBps; "
                          "*_grad_add_us: train's add of a micro-batch's gradients into its "
                          "fp32 buckets / hbm_GBps, apart (Megatron fuses it into the "
                          "weight-gradient GEMM)"
                          + ("" if self.sheet.get("hbm_GBps") else " (not on this sheet: 0)"),
                "activations": "saved tensors under FakeTensorMode"
                               + (", CUDA RMSNorm kernel emulated" if self.gpu_kernels else ""),
                "host_device": "not told apart: the device's work alone, priced; no host time "
                               "(fits: constant once per call + per-sequence terms)",
                "states": mem.BYTES_PER_PARAM_NOTE}


class PointRunner:
    """Turns points into profile records with one timing strategy; `for_tp` builds the model of a
    TP degree, `point` runs one length on it (every rank of a measured job calls both)."""

    def __init__(self, cfg, plan: ProfilePlan, timing):
        self.plan, self.timing = plan, timing
        self.model = cfg.model
        self.batch = int(cfg.profile_model.micro_batch_size)
        self._flops_mode = an.fake_tensors_mode()
        # FLOPs of tp=1 at every length, its vocabulary padded as for the point's tp
        # (models/config.vocab_rows); a rank executes flops / tp. One model per row count.
        self._flops_models: Dict[int, object] = {}
        self._flops_by_seq: Dict[tuple, tuple] = {}
        self._pm = None

    @contextlib.contextmanager
    def for_tp(self, tp: int, max_seq: int):
        """The one-layer model sharded over this rank's group of `tp` ranks, for lengths up to
        `max_seq`."""
        with self.timing.world(tp) as mesh:
            with self.timing.tensors():
                self._pm = build_point_model(self.model, max_seq, tp, mesh, self.timing.device,
                                             self.batch, compile=self.timing.compile)
            try:
                yield
            finally:
                self._pm = None

    def _counts(self, seq: int, tp: int):
        """(FLOPs, ops) of tp=1 at `seq` (analytic.count_ops) with the vocabulary padded for
        `tp`, counted once per length and padded row count."""
        rows = vocab_rows(self.model, tp)
        if (seq, rows) not in self._flops_by_seq:
            with self._flops_mode:
                if rows not in self._flops_models:
                    self._flops_models[rows] = build_point_model(
                        self.model, max(self.plan.seq_lens), 1, None, "cpu", self.batch,
                        vocab_tp=tp)
                self._flops_by_seq[seq, rows] = an.count_ops(self._flops_models[rows], seq)
        return self._flops_by_seq[seq, rows]

    def point(self, seq: int, tp: int) -> Optional[dict]:
        """The record of (seq, tp) (schema: docs/profile-schema.md); None off rank 0 of a
        measured job."""
        pm, (flops, ops) = self._pm, self._counts(seq, tp)
        times = self.timing.times_us(pm, seq, tp, flops, ops)
        with self.timing.tensors():  # every rank of a group: the block's TP collectives run
            memory = memory_point(pm, seq, gpu_kernels=self.timing.gpu_kernels,
                                  allocator=self.timing.allocator)
            states = {"block": mem.state_bytes(pm.block.parameters()),
                      "other": mem.state_bytes(pm.other_params())}
        if times is None:
            return None
        record = {"seq_len": seq, "tp": tp, "source": self.timing.source, **times, **memory,
                  "states": states, "flops": {k: v / tp for k, v in flops.items()}}
        if pm.compiled:  # absent: eager, as every profile before train compiled
            record["compiled"] = is_compiled(pm.block)  # false: all of it stayed eager
            if pm.compile_notes:  # what stayed eager and why
                record["compile_notes"] = list(pm.compile_notes)
        for sample in record.get("host_device", ()):  # each size's FLOPs (per rank)
            sample["flops"] = {k: v * sample["micro_batch_size"] / self.batch
                               for k, v in record["flops"].items()}
        record.update(mem.megatron_comparison(seq, tp, record["block_act_bytes"], self.model,
                                              self.batch))
        return record


    def moe(self) -> Optional[list]:
        """The records of the plan's MoE cases (schema MoePoint); None off rank 0 of a
        measured job."""
        return self.timing.moe_records(self.model, self.plan.moe_cases)


def point_runner(ctx, cfg, plan: ProfilePlan, tps) -> PointRunner:
    """The runner for the plan's source; `tps` are the TP degrees this run will visit."""
    if plan.source == "analytic":
        return PointRunner(cfg, plan, AnalyticTiming(plan, cfg.model.dtype))
    return PointRunner(cfg, plan, MeasuredTiming(ctx, cfg, tps))
