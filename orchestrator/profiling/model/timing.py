"""One profile point (sequence length, TP degree) of a model: build it, time it, count its memory.

A point is a one-layer GPT of the profiled shape, tensor-parallel over this rank's TP group with
sequence parallelism and a vocab-parallel loss (Megatron's layout) when tp > 1. It is timed in
two parts, as a pipeline stage sees them:
- block: forward and backward of one transformer layer for one micro-batch;
- other: embedding forward + final norm, LM head and loss forward; their backwards.

The block is torch.compile'd when train compiles it (train.compile; models/compile.py, the
function train's chunks are compiled with), so that a profile times the block as train runs it;
its memory is counted eager.

Every rank of a group runs the same iterations; a barrier on the group starts each one. Times are
per rank in microseconds, the median iteration (and the fastest) of each part (measure.Stopwatch:
CUDA events on a GPU, perf_counter on a CPU); the optimizer step of the block's and of the
other parts' parameters is optimizer_step.py's.
The same builder runs under FakeTensorMode for analytic points (no data, shapes only).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, List, Optional

import torch

from orchestrator.choices import Recompute
from orchestrator.models.config import ModelConfig
from orchestrator.profiling.measure import Stopwatch, is_cuda, median_of_group_max, summarize
from orchestrator.profiling.model import memory as mem
from orchestrator.profiling.model.fit import OPTIM_KEYS, RECOMPUTE_KEYS


@dataclass
class PointModel:
    """A one-layer GPT built for sequence length `seq_len` on `tp` ranks (TP+SP when tp > 1)."""

    model: torch.nn.Module
    cfg: ModelConfig  # the profiled shape (layers=1, seq_len = the largest length it serves)
    tp: int
    device: torch.device
    batch: int
    # The block torch.compile'd as train compiles it (train.compile, models/compile.py); its
    # lines on what stays eager and why.
    compiled: bool = False
    compile_notes: List[str] = field(default_factory=list)

    @property
    def block(self):
        return self.model.blocks[0]

    def rope(self):
        return self.model.rope()

    def loss_ctx(self):
        """The context forward and backward of the loss must run in (vocab-parallel loss)."""
        if self.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def block_input(self, seq_len: int, generator: Optional[torch.Generator] = None,
                    batch: Optional[int] = None) -> torch.Tensor:
        """A (batch, seq_len / tp, hidden) activation (this rank's sequence shard), requires grad
        (`batch`: the model's when None)."""
        from orchestrator.models.gpt import torch_dtype

        shape = (batch or self.batch, seq_len // self.tp, self.cfg.hidden)
        x = torch.randn(shape, dtype=torch_dtype(self.cfg.dtype), device=self.device,
                        generator=generator)
        return x.requires_grad_(True)

    def tokens(self, seq_len: int, generator: Optional[torch.Generator] = None,
               batch: Optional[int] = None):
        """Token ids and targets (batch, seq_len), the same on every rank of the group."""
        g = generator or torch.Generator().manual_seed(seq_len)
        shape = (batch or self.batch, seq_len)
        tokens = torch.randint(0, self.cfg.vocab, shape, generator=g)
        targets = torch.randint(0, self.cfg.vocab, shape, generator=g)
        return tokens.to(self.device), targets.to(self.device)

    def block_states(self) -> list:
        return mem.states_of(self.block) + list(self.model.rope.buffers())

    def other_params(self) -> list:
        m = self.model
        return list(m.tok_emb.parameters()) + list(m.norm.parameters()) + list(m.lm_head.parameters())


def build_point_model(model_cfg: ModelConfig, max_seq_len: int, tp: int, tp_mesh, device,
                      batch: int = 1, compile: bool = False,
                      vocab_tp: Optional[int] = None) -> PointModel:
    """A one-layer GPT of `model_cfg`'s shape (a MoE model's dense block) serving lengths up to
    `max_seq_len` on `device`, sharded over `tp_mesh` (a 1-D DeviceMesh of tp ranks; None when
    tp == 1); `compile`: its block compiled by train's function (models/compile.compile_block),
    after TP as train's. Its vocabulary is padded for `vocab_tp` ranks (models/config.vocab_rows;
    None: tp), as train pads it: an unsharded model counts the FLOPs of another degree's head."""
    from orchestrator.models.compile import compile_block
    from orchestrator.models.gpt import GPT
    from orchestrator.models.parallelize import apply_tensor_parallel

    from orchestrator.models.config import dense_twin

    cfg = replace(dense_twin(model_cfg), layers=1, seq_len=max_seq_len)  # a MoE model's dense block
    # Built (and initialised from CPU generators) on the CPU, then moved: one layer is small.
    model = GPT(cfg, tp=vocab_tp or tp)
    if torch.device(device).type != "cpu":
        model = model.to(device)
    if tp > 1:
        apply_tensor_parallel(model, tp_mesh, sequence_parallel=True, loss_parallel=True)
    pm = PointModel(model=model, cfg=cfg, tp=tp, device=torch.device(device), batch=batch,
                    compiled=compile)
    if compile:
        pm.compile_notes += compile_block(model.blocks[0], on_note=pm.compile_notes.append)
        model.fused_loss = True  # the loss compiled, as train runs it
    return pm


def _zero_grads(module: torch.nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


class MainGrads:
    """What train does with each micro-batch's parameter gradients (train/grads.py): adds them
    into its fp32 buckets (Megatron's main_grad) and frees them; with fp32 weights autograd adds
    into the bucket's view in place, the same bytes. A timed backward calls `add` after it, so
    the profile prices it: 10 bytes per parameter per micro-batch for bf16 weights, ~0.5 ms a
    micro-batch for a llama2_7b block on an H200 (a fifth of its backward at micro-batch 1),
    which profiles without it left out of every step. The buffers are made up front (zeros:
    never denormal garbage on a CPU), so a counting mode sees only the adds. A step of one
    micro-batch copies instead (6 bytes, not 10): priced as an add, the larger. A timed
    backward is `backward(tensor, grad)`: autograd's, then the add."""

    def __init__(self, params):
        self.buffers = {}
        for p in params:
            local = getattr(p, "_local_tensor", p)  # a DTensor's shard on this rank
            self.buffers[p] = torch.zeros(local.numel(), dtype=torch.float32,
                                          device=local.device)

    def add(self) -> None:
        """Add every gradient the last backward left into its buffer, and free it."""
        for p, buf in self.buffers.items():
            g = p.grad
            if g is None:
                continue
            buf.add_(getattr(g, "_local_tensor", g).reshape(-1))
            p.grad = None

    def backward(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """`tensor.backward(grad)` and the add of the gradients it made, as train's step."""
        tensor.backward(grad)
        self.add()


PARTS = ("block_fwd_us", "block_bwd_us", "other_fwd_us", "other_bwd_us")


class CommTimer:
    """Time spent in collectives (issue + wait) of the regions run inside `with timer.region(k)`.

    A TorchDispatchMode sees every c10d functional op DTensor issues (forward and backward);
    on a GPU the ops are bracketed by synchronisations so the host clock measures the transfer.
    Used on separate iterations: its synchronisations would distort the compute it interleaves.
    """

    def __init__(self, device: torch.device):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.cuda = is_cuda(device)
        self.totals_us: Dict[str, float] = {}
        self._key: Optional[str] = None
        timer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ns = getattr(func, "namespace", "")
                if timer._key is None or not ns.startswith(("_c10d_functional", "c10d")):
                    return func(*args, **(kwargs or {}))
                if timer.cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = func(*args, **(kwargs or {}))
                if timer.cuda:
                    torch.cuda.synchronize()
                timer.totals_us[timer._key] += (time.perf_counter() - t0) * 1e6
                return out

        self.mode = _Mode()

    @contextlib.contextmanager
    def region(self, key: str):
        self.totals_us.setdefault(key, 0.0)
        self._key = key
        try:
            yield
        finally:
            self._key = None


def _run_once(pm: PointModel, x, dy, cos, sin, tokens, targets, clock: Stopwatch,
              barrier: Callable[[], None], grads: MainGrads,
              comm: Optional[CommTimer] = None) -> Dict[str, float]:
    """One iteration of block fwd/bwd and other fwd/bwd, each backward with train's gradient
    accumulation (`grads`); elapsed us per part."""
    region = comm.region if comm else (lambda key: contextlib.nullcontext())
    barrier()
    clock.sync()
    t0 = clock.mark()
    with region("block_fwd_us"):
        y = pm.block(x, cos, sin)
    t1 = clock.mark()
    with region("block_bwd_us"):
        grads.backward(y, dy)
    t2 = clock.mark()
    out = {"block_fwd_us": clock.elapsed_us(t0, t1), "block_bwd_us": clock.elapsed_us(t1, t2)}
    x.grad = None
    _zero_grads(pm.block)
    del y
    # other: embedding, then norm + head + loss on a detached copy (as on another stage)
    barrier()
    clock.sync()
    with pm.loss_ctx():
        t0 = clock.mark()
        with region("other_fwd_us"):
            h = pm.model.embed(tokens)
        t1 = clock.mark()
        h_in = h.detach().requires_grad_(True)
        t2 = clock.mark()
        with region("other_fwd_us"):
            loss = pm.model.head_loss(h_in, targets)
        t3 = clock.mark()
        with region("other_bwd_us"):
            loss.backward()
        t4 = clock.mark()
    with region("other_bwd_us"):
        grads.backward(h, h_in.grad)
    t5 = clock.mark()
    out["other_fwd_us"] = clock.elapsed_us(t0, t1) + clock.elapsed_us(t2, t3)
    out["other_bwd_us"] = clock.elapsed_us(t3, t4) + clock.elapsed_us(t4, t5)
    _zero_grads(pm.model)
    return out


def time_point(pm: PointModel, seq_len: int, warmup_iters: int, iters: int,
               barrier: Callable[[], None] = lambda: None) -> Dict[str, List[float]]:
    """Time block and other forward/backward at `seq_len` on this rank.

    Returns samples in us: "block_fwd_us", "block_bwd_us", "other_fwd_us", "other_bwd_us" (whole
    parts, TP collectives included) and, when tp > 1, the same keys with "_comm" before "_us"
    (time in TP collectives, measured on `iters` further iterations). `barrier` aligns the ranks
    of the TP group before every timed region (every rank of the group calls it).
    """
    from orchestrator.models.compile import eager

    if pm.compiled:
        # Each length its own static graph, compiled in the warm-up, as train's fixed-length
        # steps compile one: without the reset, dynamo would compile a dynamic-shape graph at
        # the second length (other kernels), and past its cache limit run eager.
        torch._dynamo.reset()
    clock = Stopwatch(pm.device)
    g = torch.Generator().manual_seed(1234 + seq_len) if pm.device.type == "cpu" else None
    x = pm.block_input(seq_len, g)
    dy = torch.randn_like(x)
    cos, sin = pm.rope()
    tokens, targets = pm.tokens(seq_len)
    grads = MainGrads(pm.model.parameters())
    samples: Dict[str, List[float]] = {k: [] for k in PARTS}
    for i in range(warmup_iters + iters):
        times = _run_once(pm, x, dy, cos, sin, tokens, targets, clock, barrier, grads)
        if i >= warmup_iters:
            for k, v in times.items():
                samples[k].append(v)
    if pm.tp > 1:
        comm_keys = {k: k.replace("_us", "_comm_us") for k in PARTS}
        samples.update({v: [] for v in comm_keys.values()})
        timer = CommTimer(pm.device)
        for _ in range(iters):
            timer.totals_us.clear()
            # eager: the mode sees each collective op by op (a compiled block's run inside
            # its graph); the same collectives, timed bracketed by synchronisations
            with eager(pm.model), timer.mode:
                _run_once(pm, x, dy, cos, sin, tokens, targets, clock, barrier, grads, timer)
            for k in PARTS:
                samples[comm_keys[k]].append(timer.totals_us.get(k, 0.0))
    return samples


def time_recompute(pm: PointModel, seq_len: int, warmup_iters: int,
                   iters: int) -> Dict[str, List[float]]:
    """Samples (us) of the block's forward + backward under each recompute mode, run as train
    runs it: selective checkpoints the attention core (`attn.recompute_core`), full the whole
    block (torch.utils.checkpoint, as a pipeline stage does). On a CPU the checkpoints' own
    work (saved-tensor hooks, the rerun's dispatch) costs more than the rerun's FLOPs say: one
    tiny block at seq 128 took 2.72 ms forward + backward, 3.26 selective, 4.62 full (1.8
    forwards more). Keys: fit.RECOMPUTE_KEYS's, which the fit reads."""
    from torch.utils.checkpoint import checkpoint

    clock = Stopwatch(pm.device)
    x = pm.block_input(seq_len, torch.Generator().manual_seed(4321 + seq_len))
    dy = torch.randn_like(x)
    cos, sin = pm.rope()
    grads = MainGrads(pm.block.parameters())  # as time_point's backward: what modes add
    samples: Dict[str, List[float]] = {key: [] for key in RECOMPUTE_KEYS.values()}
    attn = pm.block.attn
    for mode, key in RECOMPUTE_KEYS.items():
        attn.recompute_core = mode == Recompute.selective
        try:
            for i in range(warmup_iters + iters):
                clock.sync()
                t0 = clock.mark()
                y = (checkpoint(pm.block, x, cos, sin, use_reentrant=False)
                     if mode == Recompute.full else pm.block(x, cos, sin))
                grads.backward(y, dy)
                t1 = clock.mark()
                x.grad = None
                _zero_grads(pm.block)
                del y
                if i >= warmup_iters:
                    samples[key].append(clock.elapsed_us(t0, t1))
        finally:
            attn.recompute_core = False
    return samples


def fastest_and_median(samples: Dict[str, List[float]]) -> Dict[str, float]:
    """Per part: the median iteration (the key itself) and the fastest ("<part>_fastest_us"), us.

    The median is what the code costs beside the other ranks of a busy machine: when ranks share
    cores (4 gloo ranks on 2), the fastest iteration is one the OS happened to leave alone and
    under-reads a whole model's time. Both are kept.
    """
    out = {}
    for k, v in samples.items():
        stats = summarize(v)
        out[k] = stats.median
        out[k.replace("_us", "_fastest_us")] = stats.min
    return out


def combine_ranks(per_rank: List[Dict[str, float]], tp: int) -> Dict[str, float]:
    """A point's times (us) from every rank's fastest_and_median, ranks in consecutive TP groups:
    a group takes as long as its slowest rank; the groups (timed at once) give their median.

    "<part>_us" is compute only: the part's median iteration minus the median time an iteration
    spent in TP collectives; "<part>_total_us" keeps the whole (tp > 1), "<part>_comm_us" the
    collectives, "<part>_fastest_us" the fastest iteration (whole part). "block_optim_us" and
    "other_optim_us" (optimizer steps, time_optimizer_step_us) and the block under each
    recompute mode (time_recompute) pass through as the groups' median.
    """
    def across(key: str) -> float:
        return median_of_group_max([r.get(key, 0.0) for r in per_rank], tp)

    out = {}
    for part in PARTS:
        total, comm = across(part), across(part.replace("_us", "_comm_us"))
        out[part] = max(total - comm, 0.01 * total)
        out[part.replace("_us", "_fastest_us")] = across(part.replace("_us", "_fastest_us"))
        if tp > 1:
            out[part.replace("_us", "_total_us")] = total
            out[part.replace("_us", "_comm_us")] = comm
    for key in OPTIM_KEYS + tuple(RECOMPUTE_KEYS.values()):
        if all(key in r for r in per_rank):
            out[key] = across(key)
    return out


def local_numel(params) -> int:
    """Elements of `params` held on this rank (the local shard of a DTensor)."""
    return sum(getattr(p, "_local_tensor", p).numel() for p in params)


def memory_point(pm: PointModel, seq_len: int, gpu_kernels: bool = False,
                 allocator: bool = False) -> dict:
    """This rank's activation bytes at `seq_len` per recompute mode, for the block and the other
    parts: {"block_act_bytes": {mode: bytes}, "other_act_bytes": {mode: bytes}}.

    Counted from the tensors autograd saves (exact on CPU, GPU and under FakeTensorMode), with
    the block eager (a compiled block is counted op by op as the eager one). With
    `allocator` (GPU), block_act_bytes is the allocator's figure instead, and the count is kept
    as "block_act_bytes_saved", the forward's peak above its start as "block_act_peak_bytes".
    `gpu_kernels`: count what CUDA kernels would save (see model_memory.GpuKernelsMode).
    """
    from orchestrator.models.compile import eager

    with eager(pm.model):
        return _memory_point(pm, seq_len, gpu_kernels, allocator)


def _memory_point(pm: PointModel, seq_len: int, gpu_kernels: bool, allocator: bool) -> dict:
    cos, sin = pm.rope()
    x = pm.block_input(seq_len)
    block_states = pm.block_states()
    saved = {mode: mem.count_block_activations(pm.block, x, cos, sin, mode, block_states,
                                               gpu_kernels)
             for mode in Recompute}
    tokens, targets = pm.tokens(seq_len)
    other = mem.count_other_activations(pm.model, tokens, targets, mem.states_of(pm.model),
                                        pm.loss_ctx, gpu_kernels)
    out = {"block_act_bytes": saved, "other_act_bytes": {m: other for m in Recompute}}
    if allocator:
        alloc = {m: mem.allocator_block_activations(pm.block, x, cos, sin, m)
                 for m in Recompute}
        out["block_act_bytes"] = {m: a["act"] for m, a in alloc.items()}
        out["block_act_bytes_saved"] = saved
        out["block_act_peak_bytes"] = {m: a["peak"] for m, a in alloc.items()}
    return out
