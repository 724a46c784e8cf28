"""The two torch bugs that shape how train compiles tensor-parallel blocks
(models/compile.py), each checked on this torch:

  python bench/compile_tp_torch.py          # starts its two ranks itself (~6 s)
  torchrun --nproc_per_node 2 bench/compile_tp_torch.py
  python bench/compile_tp_torch.py --smoke  # the same (test_bench_smoke)

Two gloo ranks on the CPU (any machine, a GPU one too; `aot_eager`, no inductor). Rank 0
prints one line per case, `torch <version> <check> / <case>: <result>`:

1. `async collective input`: under TP the embedding's output is reduce-scattered with
   `async_op=True` and `to_local()` gives an AsyncCollectiveTensor, which the first compiled
   block takes. torch 2.13's AOTAutograd waits for such an input before tracing
   (process_inputs, torch/_functorch/_aot_autograd/frontend_utils.py: `trigger_wait()`) and
   keeps the inner tensor, which does not require grad: the input gets no gradient and, in
   train, the eager redistribute before it fails in the backward (AttributeError: 'Tensor'
   object has no attribute '_local_tensor', NestedRedistribute in
   torch/distributed/tensor/_redistribute.py). Right: `w.grad sum 64.0`. `eager` and `compiled,
   plain input` (models/compile._plain_inputs, what train does) must give it; `compiled, as
   is` shows whether this torch has the bug.
2. `checkpointed attention`: a compiled module with column-parallel (DTensor) q/k/v whose
   SDPA is checkpointed (selective recompute). torch 2.13 fails at the first forward:
   AssertionError "expected all tensors_saved_with_vc_check to be Tensors" (a DeviceMesh among
   them; _AutogradSavedState.save_from_forward, torch/_functorch/_aot_autograd/
   runtime_wrappers.py). `no checkpoint` must be ok; `checkpoint` shows whether this torch has
   the bug (where it has, train runs such a call eager, models/compile._selective_under_tp).

Asserts nothing.
"""
from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from orchestrator.models.compile import _plain_inputs


def outcome(run) -> str:
    """What run() returned, or the first line of what it raised (what this torch does is the
    finding)."""
    try:
        return run()
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def say(check: str, case: str, result: str) -> None:
    if dist.get_rank() == 0:
        print(f"torch {torch.__version__} {check} / {case}: {result}", flush=True)
    dist.barrier()


def async_collective_input(mesh) -> None:
    w = torch.ones(4, 8, requires_grad=True)

    def double(x):
        return x * 2

    compiled = torch.compile(double, backend="aot_eager", fullgraph=True)
    for case, fn, plain in (("eager", double, False), ("compiled, as is", compiled, False),
                            ("compiled, plain input", compiled, True)):
        torch._dynamo.reset()
        # TP's embedding output: partial sums reduce-scattered to a sequence shard, async
        x = DTensor.from_local(w * 1, mesh, [Partial()]).redistribute(
            mesh, [Shard(1)], async_op=True).to_local()
        kind = type(x).__name__
        if plain:
            (x,) = _plain_inputs((x,))

        def run():
            fn(x).sum().backward()
            return f"input {kind}: w.grad sum {w.grad.sum().item()}"

        say("async collective input", case, outcome(run))
        w.grad = None


class Attention(nn.Module):
    def __init__(self, hidden: int = 32, head_dim: int = 8, checkpointed: bool = False):
        super().__init__()
        self.head_dim, self.checkpointed = head_dim, checkpointed
        self.wq, self.wk, self.wv = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        if self.checkpointed:
            return checkpoint(causal_attention, q, k, v, use_reentrant=False)
        return causal_attention(q, k, v)


def causal_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def checkpointed_attention(mesh) -> None:
    for case, checkpointed in (("no checkpoint", False), ("checkpoint", True)):
        torch._dynamo.reset()
        torch.manual_seed(0)
        attn = parallelize_module(Attention(checkpointed=checkpointed), mesh,
                                  {name: ColwiseParallel() for name in ("wq", "wk", "wv")})
        attn.compile(backend="aot_eager", fullgraph=True)
        x = torch.randn(2, 8, 32, requires_grad=True)

        def run():
            attn(x).sum().backward()
            return f"ok, x.grad norm {x.grad.norm().item():.4f}"

        say("checkpointed attention", case, outcome(run))


def checks() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    async_collective_input(mesh)
    checkpointed_attention(mesh)
    dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    checks()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the same checks (seconds)")
    parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        checks()
        return
    with socket.socket() as s:  # a free port for the two ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_spawned, args=(2, port), nprocs=2)


if __name__ == "__main__":
    main()
