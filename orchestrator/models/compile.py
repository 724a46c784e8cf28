"""Regional torch.compile, as torchtitan does it: each transformer block compiled on its own
(`fullgraph`), after tensor parallelism and the recompute flags are set and before FSDP2 wraps
the block. Identical blocks share one compiled code: every block runs nn.Module's `_call_impl`,
whose parameters dynamo takes as graph inputs, so the second block reuses the first's graph.

One function, `compile_block`, for every caller: train's chunks (train/build.py) and the block
profile_model times (profiling/model/timing.py), so that a profile times the block as train runs
it. The parts of a block that cannot be traced stay eager, each with one line saying why
(`eager_parts`); a part whose compile fails at its first forward falls back to eager, with one
line saying why, instead of failing the run. Under tensor parallelism the blocks compile with
their DTensor layers; two torch bugs are kept out of their way (`_plain_inputs`,
`_selective_under_tp`; bench/compile_tp_torch.py shows both).
"""
from __future__ import annotations

import contextlib
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn
from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException
from torch.distributed._functional_collectives import AsyncCollectiveTensor

# What a compiled call raises before its graph runs, for which the caller runs the eager code
# instead: dynamo's and the backend's failures, and the recompile limit (a full graph raises it
# where dynamo would run the frame eager; torch._dynamo.config.recompile_limit, 8 graphs)
COMPILE_ERRORS = (TorchDynamoException, FailOnRecompileLimitHit)


def eager_parts(is_moe: bool, context_parallel: bool = False
                ) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
    """(the sub-modules of a block to compile, "" the whole block; why the rest stays eager,
    one line each) for a block with a mixture-of-experts FFN (`is_moe`), under context
    parallelism (`context_parallel`). Tensor parallelism changes nothing: its DTensor layers
    and sequence parallelism's autograd function trace (the block's inputs made plain
    first, _plain_inputs)."""
    if not is_moe and not context_parallel:
        return ("",), ()
    units, why = [], []
    if context_parallel:
        why.append("attention stays eager under context parallelism (cp > 1): its exchanges "
                   "of K/V between the CP ranks (isend/irecv, all-to-all) are not traceable")
    else:
        units.append("attn")
    if is_moe:
        why.append("the MoE FFN stays eager: its routing sends the tokens per expert to the "
                   "host (data-dependent shapes), which a full graph cannot hold")
    else:
        units.append("mlp")
    return tuple(units), tuple(why)


def compile_block(block: nn.Module, context_parallel: bool = False,
                  on_note: Optional[Callable[[str], None]] = None) -> List[str]:
    """Compile `block` (models/gpt.Block) in place, or the parts of it eager_parts allows
    (under context parallelism); returns the lines saying what stays eager and why. `on_note`
    hears the line of a part whose compile fails at its first forward (then eager), and the
    one of a TP block's first call with selective recompute (that call eager)."""
    from orchestrator.models.moe import MoE

    units, why = eager_parts(isinstance(block.mlp, MoE), context_parallel)
    for path in units:
        label = path or "block"
        # the attention (in the block or alone) holds the selective recompute's checkpoint
        eager_now = _selective_under_tp(block.attn, label) if path in ("", "attn") else None
        _compile_in_place(block.get_submodule(path) if path else block, label, on_note,
                          eager_now)
    return list(why)


def _selective_under_tp(attn: nn.Module, label: str) -> Optional[Callable[[], Optional[str]]]:
    """For an attention with tensor-parallel (DTensor) weights, in the part `label`: a function
    giving, while the attention checkpoints its core (selective recompute, which train sets per
    step or per micro-batch; gradients on), the line saying why that call of the part runs
    eager, else None; None for an attention without (nothing to watch). torch 2.13's
    AOTAutograd fails on a compiled TP block that checkpoints its SDPA
    (bench/compile_tp_torch.py)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(attn.wq.weight, DTensor):
        return None
    line = (f"the {label} runs eager under tensor parallelism with selective recompute: torch "
            "fails on a compiled TP block that checkpoints its attention (AOTAutograd counts a "
            "DeviceMesh among the saved tensors, torch 2.13)")
    return lambda: line if attn.recompute_core and torch.is_grad_enabled() else None


def _compile_in_place(module: nn.Module, label: str,
                      on_note: Optional[Callable[[str], None]],
                      eager_now: Optional[Callable[[], Optional[str]]] = None) -> None:
    """nn.Module.compile (the module keeps its names: FSDP, checkpoints and the optimizer see
    the same parameters), its call guarded: a dynamo or backend failure at compile time (before
    the graph runs) puts the module back to eager for good and reports one line; a call for
    which `eager_now()` gives a line runs eager (the line reported the first time), the next
    compiled again."""
    module.compile(fullgraph=True)
    compiled = module._compiled_call_impl  # what nn.Module.compile installs; None: eager
    said = set()

    def guarded(*args, **kwargs):
        why = eager_now() if eager_now is not None else None
        if why is not None:
            if why not in said and on_note is not None:
                on_note(why)
            said.add(why)
            return module._call_impl(*args, **kwargs)
        try:
            return compiled(*_plain_inputs(args), **kwargs)
        except COMPILE_ERRORS as e:
            module._compiled_call_impl = None
            if on_note is not None:
                on_note(fallback_line(label, _cause(e)))
            return module._call_impl(*args, **kwargs)

    module._compiled_call_impl = guarded


def _plain_inputs(args: tuple) -> tuple:
    """`args` with each AsyncCollectiveTensor (what a DTensor's to_local() gives after an async
    redistribute: under TP, the embedding's output that the first block takes) waited for and
    made a plain tensor, its gradient kept. A compiled region must not take one: torch 2.13's
    AOTAutograd waits for it as an input without its requires_grad (process_inputs in
    torch/_functorch/_aot_autograd/frontend_utils.py), so the input's gradient is dropped and
    the eager redistribute before it fails in the backward; older torch traces it as a
    subclass input (a recompile when a plain tensor comes, tangent type mismatches)."""
    if not any(isinstance(a, AsyncCollectiveTensor) for a in args):
        return args
    return tuple(_Waited.apply(a) if isinstance(a, AsyncCollectiveTensor) else a
                 for a in args)


class _Waited(torch.autograd.Function):
    """An AsyncCollectiveTensor's waited value as a plain tensor; the gradient passes as is."""

    @staticmethod
    def forward(ctx, act):
        waited = act.trigger_wait()
        # a new tensor object: autograd writes its history into the output, which must not
        # be the tensor the DTensor the ACT came from still holds
        return waited.view_as(waited)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _cause(e: BaseException) -> str:
    """The first line of what went wrong: the backend's own error where dynamo wraps one
    (BackendCompilerFailed's first line names only the backend)."""
    inner = getattr(e, "inner_exception", None) or e.__cause__
    shown = inner if inner is not None else e
    first = (str(shown).strip().splitlines() or [""])[0]
    return f"{type(shown).__name__}: {first}" if first else type(shown).__name__


def fallback_line(label: str, cause: str) -> str:
    """The one line a part that torch.compile could not compile reports: it runs eager."""
    return f"torch.compile failed for the {label}, which runs eager: {cause[:300]}"


def is_compiled(module: nn.Module) -> bool:
    """Whether any module in `module` runs compiled (compile_block, not fallen back)."""
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


@contextlib.contextmanager
def eager(module: nn.Module):
    """Inside, every compiled part of `module` runs eager, its loss too (`fused_loss`, a GPT's
    head_loss: what counts saved tensors or intercepts collectives op by op needs the eager
    ops); restored after."""
    saved = [(m, m._compiled_call_impl) for m in module.modules()
             if getattr(m, "_compiled_call_impl", None) is not None]
    fused = [m for m in module.modules() if getattr(m, "fused_loss", False)]
    for m, _ in saved:
        m._compiled_call_impl = None
    for m in fused:
        m.fused_loss = False
    try:
        yield
    finally:
        for m, call in saved:
            m._compiled_call_impl = call
        for m in fused:
            m.fused_loss = True
