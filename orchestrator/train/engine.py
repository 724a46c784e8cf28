"""The training engine: a GPT split by a ParallelLayout over this rank's slice of the layout's
DeviceMesh, torch-native and applied from outside the model.

- Mesh: ParallelLayout.build_mesh (orchestrator/mesh.py), (pp, dp, cp, tp) in the layout's rank
  order (tp fastest, then cp, dp, pp) and the expert grid (pp, edp, ep, etp); this rank's model
  chunks and optimizer from train/build.py (the builder trace records too).
- TP + sequence parallel: models/parallelize.apply_tensor_parallel on the TP mesh; the loss is
  vocab-parallel (Megatron's): the logits stay sharded over TP and the forward and backward run
  inside torch's `loss_parallel()`, three all-reduces of one value per token instead of an
  all-gather of the whole logits (and 1/tp of their memory).
- Pipeline: torch.distributed.pipelining, 1F1B or interleaved 1F1B with v model chunks per rank
  (chunk c of rank r is virtual stage c * pp + r, Megatron's order); uneven layers per stage.
- Data parallel: ZeRO 0/1/2 by hand (train/grads.py: bucketed collectives overlapping the
  backward, sharded AdamW), ZeRO-3 with FSDP2 `fully_shard` per block and per stage.
- Recompute per pipeline stage: selective (the attention core of every layer) or full (the first
  k layers of the stage, k / v per chunk).
- Precision (Megatron-LM's): bf16 trains bf16 weights (so the residual stream and pipeline
  messages are bf16), their fp32 masters in the (sharded) optimizer, gradients accumulated and
  reduced in fp32 buckets, ZeRO 1/2 all-gather the updated weights in bf16; ZeRO-3's FSDP2
  shards are the fp32 masters, gathered in bf16 (MixedPrecisionPolicy), gradients reduced in
  fp32. fp16 autocasts fp32 weights with a dynamic loss scale; fp32 is fp32 throughout.
- Regional torch.compile (`compile`, train.compile): each block compiled on its own after TP
  and the recompute flags, before FSDP2 (models/compile.py, the function profile_model's block
  is compiled with).
- Variable-length micro-batches (`train_step_micro_batches`): train/executor.py runs a plan of
  micro-batches of different shapes and recompute modes; the loss is the mean over real tokens.
The model is built on the meta device and only this rank's stages are materialised.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from orchestrator.choices import Dtype, Group
from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig, expert_width, is_moe
from orchestrator.models.compile import eager, is_compiled
from orchestrator.models.gpt import cross_entropy_loss, token_loss_sum
from orchestrator.models.moe import MoE
from orchestrator.profiling.measure import Stopwatch
from orchestrator.train.build import (OptimSettings, apply_recompute, build_chunks,
                                      build_optimizer, context_parallel)
from orchestrator.train.executor import MicroBatchInput, PipelineExecutor, run_plain
from orchestrator.train.grads import local_tensor
from orchestrator.workload.states import half_weights

# AdamW's moments a checkpoint keeps per parameter ("optim.<parameter>.<moment>").
OPTIM_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class StepStats:
    """One iteration on this rank (seconds) and its global results."""

    loss: float
    grad_norm: float
    step_s: float  # the whole iteration
    fwd_bwd_s: float  # forward + backward of all micro-batches (pipeline waits included)
    compute_s: float  # this rank's forward/backward work alone (TP communication included)
    sync_wait_s: float  # waiting for the data-parallel gradient collectives after the backward
    # the global gradient norm's sum over ranks (its all-reduce waits for the slowest stage);
    # this rank's own sum of squares is optimizer work, in optimizer_s
    norm_s: float
    optimizer_s: float  # the local gradient norm, clipping, AdamW, parameter all-gather
    skipped: bool = False  # fp16 overflow: no update
    stop: bool = False  # some rank was asked to stop (a signal): every rank knows it
    # mixture of experts: the mean load-balancing loss (times its coefficient) over MoE layers
    # and micro-batches, and the tokens routed to each expert summed over MoE layers (global)
    aux_loss: Optional[float] = None
    tokens_per_expert: Optional[List[int]] = None


def _device_type(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


class Engine:
    """This rank's part of the model, its optimizer, and `train_step`."""

    def __init__(self, layout: ParallelLayout, model: ModelConfig, device: torch.device,
                 dtype: Dtype = Dtype.fp32, seed: int = 0,
                 optim: OptimSettings = OptimSettings(), compile: bool = False):
        layout.check_model_layers(model.layers, model.name)
        if dist.get_world_size() != layout.world_size:
            raise ValueError(f"layout world_size({layout.world_size}) != the "
                             f"{dist.get_world_size()} ranks running")
        self.layout, self.device, self.dtype = layout, device, Dtype.parse(dtype)
        self.moe = is_moe(model)
        self.layout_experts = model.experts
        if self.moe:
            layout.check_experts(model.experts, expert_width(model), model.name)
            if layout.zero == 3 and layout.etp > 1:
                raise ValueError(f"ZeRO-3 with etp({layout.etp}): FSDP shards a parameter "
                                 f"split over one mesh dimension only; use etp 1 or ZeRO 0-2")
        self.mesh = layout.build_mesh(_device_type(device), experts=self.moe)
        rank = dist.get_rank()
        self.pp_rank = layout.coordinate(rank, Group.pp)
        self.dp_rank = layout.coordinate(rank, Group.dp)
        self.context = context_parallel(layout, self.mesh)
        self.is_first, self.is_last = self.pp_rank == 0, self.pp_rank == layout.pp - 1
        half = half_weights(self.dtype)
        weights = Dtype.bf16 if half and layout.zero < 3 else Dtype.fp32
        # the dtype activations and their gradients travel in between pipeline stages
        self.residual = self.dtype.torch if half else torch.float32
        # train.compile: each block compiled (models/compile.py); what stays eager and why
        # (lines added at build and when a part falls back at its first forward)
        self.compile_notes: List[str] = []
        self.modules = build_chunks(
            layout, dataclasses.replace(model, dtype=weights), self.mesh, self.pp_rank,
            context=self.context, device=device, seed=seed,
            autocast=None if half or self.dtype == Dtype.fp32 else self.dtype.torch,
            fsdp_dtype=self.dtype.torch if half and layout.zero == 3 else None,
            compile=compile, notes=self.compile_notes)
        self.fused_loss = compile  # the loss compiled too (models/loss.py)
        self.optim = build_optimizer(self.modules, layout, self.mesh, optim, self.moe)
        # fp16: dynamic loss scale (GradScaler's rule: halve on overflow, double every 2000 steps)
        self.loss_scale = 2.0**16 if self.dtype == Dtype.fp16 else 1.0
        self._good_steps = 0
        # AdamW updates made (a step whose norm is not finite makes none, nor does an iteration
        # stage=train skips): its bias correction counts these, and a checkpoint carries them
        self.optimizer_steps = 0
        # Marks of the step's parts (CUDA events on a GPU), read after the step: no host sync
        # inside it but the gradient norm's (the clip is decided on the host)
        self.clock = Stopwatch(device)
        self.compute_spans: List[Tuple[object, object]] = []
        self.schedule = self._make_schedule() if layout.pp > 1 else None
        self.hidden = model.hidden
        self._executor = None  # built on the first train_step_micro_batches

    # ------------------------------------------------------------------ build
    @property
    def compiled(self) -> bool:
        """Whether some part of this rank's blocks runs torch.compile'd (not fallen back)."""
        return any(is_compiled(mod) for mod in self.modules)

    @contextlib.contextmanager
    def eager(self):
        """Inside, every compiled part of this rank runs eager, its blocks and its loss (what
        counts tensors under a dispatch mode needs the eager ops: dynamo does not run under
        one); restored after."""
        with contextlib.ExitStack() as stack:
            for module in self.modules:
                stack.enter_context(eager(module))
            stack.callback(setattr, self, "fused_loss", self.fused_loss)
            self.fused_loss = False
            yield

    def _apply_recompute(self) -> None:
        """The layout's recompute (also restored after a step of per-micro-batch modes)."""
        apply_recompute(self.modules, self.layout, self.pp_rank)

    def _make_schedule(self):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import (Schedule1F1B,
                                                            ScheduleInterleaved1F1B)

        layout, group = self.layout, self.mesh.group(Group.pp)
        n_virtual = layout.pp * layout.virtual_stages
        stages = [PipelineStage(mod, stage_index=c * layout.pp + self.pp_rank,
                                num_stages=n_virtual, device=self.device, group=group)
                  for c, mod in enumerate(self.modules)]
        for stage in stages:
            self._time_chunks(stage)
        cls = Schedule1F1B if layout.virtual_stages == 1 else ScheduleInterleaved1F1B
        arg = stages[0] if layout.virtual_stages == 1 else stages
        # Gradients are averaged over micro-batches by the optimizer, not by the schedule.
        kwargs = {"scale_grads": False} if "scale_grads" in inspect.signature(cls).parameters \
            else {}
        self._step_kwargs = ({"return_outputs": False}
                             if "return_outputs" in inspect.signature(cls.step).parameters
                             else {})
        return cls(arg, n_microbatches=layout.num_micro_batches, loss_fn=self._loss, **kwargs)

    def _time_chunks(self, stage) -> None:
        """Mark the stage's forward/backward chunks into `compute_spans`; MoE layers log their
        routing only inside them."""
        moe_layers = [m for m in stage.submod.modules() if isinstance(m, MoE)]
        for moe in moe_layers:  # torch's first-step shape inference runs forwards of its own
            moe.record_stats = False
        for name in ("forward_one_chunk", "backward_one_chunk"):
            original = getattr(stage, name)

            def timed(*args, _original=original, **kwargs):
                start = self.clock.mark()
                for moe in moe_layers:
                    moe.record_stats = True
                try:
                    return _original(*args, **kwargs)
                finally:
                    for moe in moe_layers:
                        moe.record_stats = False
                    self.compute_spans.append((start, self.clock.mark()))
            setattr(stage, name, timed)

    def _seconds(self, start, end) -> float:
        """Seconds between two marks of this step (waits for `end` on a GPU)."""
        return self.clock.elapsed_us(start, end) / 1e6

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(logits, targets, self.fused_loss) * self.loss_scale

    def _loss_parallel(self):
        """The context a forward and backward run in: with TP the logits are vocab-sharded
        DTensors, whose loss torch computes only inside `loss_parallel()`."""
        if self.layout.tp == 1:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    # ------------------------------------------------------------------ step
    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor, lr: float,
                   grad_clip: float, stop: bool = False) -> StepStats:
        """One iteration on this data-parallel rank's samples (micro_batch_size *
        num_micro_batches sequences): forward, backward, gradient sync, clipping, AdamW.
        `stop` (this rank was signalled) comes back agreed over all ranks."""
        start = self.clock.mark()
        self.compute_spans = []
        self._begin_moe_step()
        self.optim.begin_step(self.layout.num_micro_batches)
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        if self.context is not None:  # this rank's tokens of each sequence
            tokens, targets = self.context.split(tokens), self.context.split(targets)
        with self._loss_parallel():
            # a vocab-parallel loss is a DTensor, replicated over TP
            losses = [local_tensor(loss) for loss in self._forward_backward(tokens, targets)]
        local = torch.stack([loss.double() for loss in losses]).mean() if losses else 0.0
        return self._finish_step(start, local, self.layout.replicas * self.layout.tp,
                                 lr, grad_clip, stop)

    def train_step_micro_batches(self, batches: Sequence[MicroBatchInput], lr: float,
                                 grad_clip: float, total_tokens: int, stop: bool = False,
                                 extra_warmup: int = 0,
                                 total_rows: Optional[int] = None) -> StepStats:
        """One iteration over this data-parallel rank's planned micro-batches, each of its own
        shape and recompute mode, run in order (pp > 1: the planner's 1F1B, eager 1F1B with
        `extra_warmup` more warm-up forwards per stage, or interleaved op order). `total_tokens`:
        the real (non-padded) targets of the whole global batch, over every dp rank; the loss
        and the gradients are the mean over exactly those tokens. Under context parallelism
        each micro-batch's sequences are split over the CP ranks as train_step splits them (its
        padded length a multiple of 2 x cp, x tp with sequence parallelism). A mixture-of-experts
        model's balance loss (per sequence) counts each micro-batch by its share of the
        `total_rows` rows (sequences) of the global batch: for equal micro-batches the mean
        over them, as train_step. StepStats as train_step (loss in nats per real token)."""
        if not batches or total_tokens < 1:
            raise ValueError(f"train_step_micro_batches needs micro-batches and total_tokens "
                             f">= 1, got {len(batches)} and {total_tokens}")
        if self.layout.zero == 3:
            # FSDP all-gathers parameters per forward: dp ranks with different micro-batch
            # counts would issue different numbers of collectives and hang.
            raise NotImplementedError("variable-length micro-batches with ZeRO-3 are not "
                                      "supported (dp ranks run different micro-batch counts): "
                                      "use zero<=2")
        if self.moe and not total_rows:
            raise ValueError("train_step_micro_batches of a mixture-of-experts model needs "
                             "total_rows (the global batch's rows): its balance loss is per "
                             "sequence")
        start = self.clock.mark()
        self._begin_moe_step()
        self.optim.begin_step(len(batches), grad_divisor=float(total_tokens))
        batches = [self._rank_micro_batch(mb, total_tokens, total_rows) for mb in batches]
        with self._loss_parallel(), self._recording_moe():
            if self.layout.pp > 1:
                losses, self.compute_spans = self._pipeline_executor().run(batches,
                                                                           extra_warmup)
            else:
                losses, self.compute_spans = run_plain(self.modules[0], batches,
                                                       self._token_loss, self.clock.mark)
        losses = [local_tensor(loss) for loss in losses]
        self._apply_recompute()
        local = torch.stack([loss.double() for loss in losses]).sum() if losses else 0.0
        return self._finish_step(start, local, self.layout.tp * total_tokens, lr, grad_clip,
                                 stop)

    def _rank_micro_batch(self, mb: MicroBatchInput, total_tokens: int,
                          total_rows: Optional[int]) -> MicroBatchInput:
        """A planned micro-batch as this rank runs it: on its device, its share of each
        sequence under context parallelism, and (MoE) its balance loss's gradient: the global
        gradient divides by total_tokens (the summed token losses'), so its rows' share of the
        batch's balance loss is injected times total_tokens (the CP ranks of a sequence each
        carry their part of its one loss, summed over them)."""
        mb = mb.to(self.device)
        if self.context is not None:
            if mb.segments is not None:
                raise ValueError("packed rows under context parallelism are not supported: "
                                 "the planner pads there (planner/dynamic.py)")
            mb = dataclasses.replace(mb, tokens=self.context.split(mb.tokens),
                                     targets=self.context.split(mb.targets))
        if self.moe:
            share = mb.tokens.shape[0] / total_rows
            mb = dataclasses.replace(mb, aux_grad_scale=self.loss_scale * total_tokens * share)
        return mb

    @contextlib.contextmanager
    def _recording_moe(self):
        """MoE layers log their routing (balance loss, tokens per expert) inside: the torch
        pipeline schedule turns it off outside its own chunks (_time_chunks), and the
        executor runs every forward itself."""
        layers = self._moe_layers()
        before = [moe.record_stats for moe in layers]
        for moe in layers:
            moe.record_stats = True
        try:
            yield
        finally:
            for moe, flag in zip(layers, before):
                moe.record_stats = flag

    def _pipeline_executor(self) -> PipelineExecutor:
        if self._executor is None:
            layout = self.layout
            self._executor = PipelineExecutor(
                self.modules, self.pp_rank, layout.pp, layout.schedule,
                self.mesh.group(Group.pp), self.device, self.hidden,
                layout.tp if layout.sequence_parallel else 1, self._token_loss, self.clock.mark,
                wire_dtype=self.residual)
        return self._executor

    def _token_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # where train compiles, the loss's chunks are compiled too (models/loss.py)
        return token_loss_sum(logits, targets, self.fused_loss) * self.loss_scale

    def _finish_step(self, start, local_loss, loss_divisor: float, lr: float,
                     grad_clip: float, stop: bool) -> StepStats:
        """After the forward/backward: gradient sync, norm, clipping, AdamW; the global loss is
        the sum of every rank's `local_loss` / loss_divisor."""
        fwd_bwd_end = self.clock.mark()
        self.optim.finish_backward()
        sync_end = self.clock.mark()
        inv_scale = 1.0 / self.loss_scale
        local_sumsq = self.optim.local_sumsq()
        local_end = self.clock.mark()
        norm = self.optim.reduce_norm(local_sumsq) * inv_scale
        norm_end = self.clock.mark()
        skipped = not math.isfinite(norm)
        if skipped:
            self.optim.zero_grads()
        else:
            self.optim.step(lr, grad_clip, inv_scale, norm)
            self.optimizer_steps += 1
        self._update_loss_scale(skipped)
        end = self.clock.mark()
        loss, stop = self._global_loss(local_loss, stop)
        aux_loss, tokens_per_expert = self._moe_stats()
        secs = self._seconds
        return StepStats(loss=loss / loss_divisor * inv_scale, grad_norm=norm,
                         step_s=secs(start, end), fwd_bwd_s=secs(start, fwd_bwd_end),
                         compute_s=sum(secs(a, b) for a, b in self.compute_spans),
                         sync_wait_s=secs(fwd_bwd_end, sync_end),
                         norm_s=secs(local_end, norm_end),
                         optimizer_s=secs(sync_end, local_end) + secs(norm_end, end),
                         skipped=skipped, stop=stop,
                         aux_loss=aux_loss, tokens_per_expert=tokens_per_expert)

    def _moe_layers(self) -> List[MoE]:
        return [sub for mod in self.modules for sub in mod.modules() if isinstance(sub, MoE)]

    def _begin_moe_step(self) -> None:
        for moe in self._moe_layers():
            moe.reset_stats()
            # Gradients average over the dp x cp ranks; the CP ranks of a sequence each carry
            # their share of its one balance loss, so theirs count cp times (the LM loss's are
            # means over each rank's own tokens).
            moe.aux_grad_scale = self.loss_scale * self.layout.cp

    def _moe_stats(self):
        """(mean aux loss, tokens per expert summed over MoE layers) over every rank: one
        all-reduce (after the step's own, off its timed parts); (None, None) for a dense model."""
        if not self.moe:
            return None, None
        layers = self._moe_layers()
        experts = self.layout_experts
        local = torch.zeros(2 + experts, dtype=torch.float64)
        for moe in layers:
            local[0] += moe.aux_loss_sum
            local[1] += moe.aux_calls
            local[2:] += moe.tokens_per_expert.double()
        local = local.to(self.device)
        dist.all_reduce(local)
        local = local.cpu()
        aux = float(local[0] / local[1]) if local[1] > 0 else 0.0
        return aux, [int(n) for n in local[2:].tolist()]

    def _forward_backward(self, tokens, targets) -> List[torch.Tensor]:
        layout = self.layout
        if self.schedule is not None:
            losses: List[torch.Tensor] = []
            if self.is_first:
                self.schedule.step(tokens, **self._step_kwargs)
            elif self.is_last:
                self.schedule.step(target=targets, losses=losses, **self._step_kwargs)
            else:
                self.schedule.step(**self._step_kwargs)
            return [loss.detach() for loss in losses]
        (mod,) = self.modules
        mbs, m = layout.micro_batch_size, layout.num_micro_batches
        losses = []
        # ZeRO-3 reduce-scatters every micro-batch's gradients (FSDP2's default): the shards
        # accumulate, 4 / dp bytes per parameter, where deferring the sync would keep every
        # unit's unsharded fp32 gradients through the accumulation (Megatron-FSDP's choice too).
        for i in range(m):
            begin = self.clock.mark()
            loss = self._loss(mod(tokens[i * mbs:(i + 1) * mbs]), targets[i * mbs:(i + 1) * mbs])
            loss.backward()
            self.compute_spans.append((begin, self.clock.mark()))
            losses.append(loss.detach())
        return losses

    def _global_loss(self, local_loss, stop: bool):
        """(the sum of every last-stage rank's local_loss, whether any rank asked to stop), on
        every rank: one all-reduce for both."""
        local = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.is_last:
            local[0] += local_loss
        local[1] = float(stop)
        dist.all_reduce(local)
        return float(local[0]), bool(local[1] > 0)

    def _update_loss_scale(self, skipped: bool) -> None:
        if self.dtype != Dtype.fp16:
            return
        if skipped:
            self.loss_scale, self._good_steps = max(self.loss_scale / 2, 1.0), 0
            return
        self._good_steps += 1
        if self._good_steps % 2000 == 0:
            self.loss_scale *= 2

    # ------------------------------------------------------------------ checkpoint state
    def named_parameters(self) -> Dict[str, torch.nn.Parameter]:
        """This rank's parameters by the whole model's names ("blocks.5.attn.wq.weight")."""
        out = {}
        for mod in self.modules:
            for name, p in mod.named_parameters():
                out[name.replace("_fsdp_wrapped_module.", "")] = p
        return out

    def state(self) -> dict:
        """What a checkpoint holds: {"model": {name: param}, "optim": {name.exp_avg[_sq]: ...}},
        tensors placed as their parameters (DTensors when sharded), so any layout reloads it;
        bf16 weights are saved as their fp32 masters (any dtype reloads it)."""
        states = self.optim.state_tensors()
        masters = self.optim.master_tensors()
        model, optim = {}, {}
        for name, p in self.named_parameters().items():
            model[name] = _placed_like(masters[p], p) if p in masters else p
            for key, t in states[p].items():
                optim[f"{name}.{key}"] = _placed_like(t, p)
        return {"model": model, "optim": optim}

    def checkpoint_extra(self) -> dict:
        """What a checkpoint carries of the engine besides tensors (JSON): the AdamW updates
        made, which the training step overcounts when updates were skipped; under fp16 the
        dynamic loss scale and its count of good steps (GradScaler's state)."""
        extra = {"optimizer_steps": self.optimizer_steps}
        if self.dtype == Dtype.fp16:
            extra |= {"loss_scale": self.loss_scale, "loss_scale_good_steps": self._good_steps}
        return extra

    def load_state(self, state: dict, step: int, extra: Optional[dict] = None) -> None:
        """After a checkpoint of `step` was loaded into `state()`'s tensors: hand them to the
        optimizer, whose update count is the checkpoint's `extra` one (checkpoint_extra), or
        `step` for a checkpoint without it; an fp16 run's loss scale where an fp16 run saved
        one (another dtype's checkpoint starts the scale afresh)."""
        extra = extra or {}
        self.optimizer_steps = int(extra.get("optimizer_steps", step))
        step = self.optimizer_steps
        if self.dtype == Dtype.fp16 and "loss_scale" in extra:
            self.loss_scale = float(extra["loss_scale"])
            self._good_steps = int(extra.get("loss_scale_good_steps", 0))
        states, masters = {}, {}
        for name, p in self.named_parameters().items():
            states[p] = {key: _local_like(state["optim"][f"{name}.{key}"], p)
                         for key in OPTIM_MOMENTS}
            if local_tensor(p).dtype != torch.float32:  # bf16 weights: their masters' values
                masters[p] = _local_like(state["model"][name], p)
        self.optim.load_state_tensors(states, step, masters)


def _placed_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A local tensor as a DTensor placed as parameter p (or t itself, already placed)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor) and not isinstance(t, DTensor):
        return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False)
    return t


def _local_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The inverse of _placed_like for the optimizer: local tensors for ZeRO 0-2, as placed for
    FSDP (whose optimizer works on DTensors)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) and not _is_fsdp(p):
        return t.to_local()
    return t


def _is_fsdp(p: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    # FSDP's mesh is the replicas' (dp, or dp_cp with context parallelism; the experts': edp)
    return isinstance(p, DTensor) and any(
        name in (Group.dp, Group.dp_cp, Group.edp)
        for name in (p.device_mesh.mesh_dim_names or ()))
