"""Whether this torch's compiled region keeps the gradient of an AsyncCollectiveTensor input,
the case that kept tensor-parallel blocks eager before `models/compile._plain_inputs`.

  torchrun --nproc_per_node 2 bench/compile_async_collective_input.py

Two gloo ranks on the CPU (any machine, a GPU one too). Under TP the embedding's output is
reduce-scattered with `async_op=True` and `to_local()` gives an AsyncCollectiveTensor, which
the first compiled block takes. torch 2.13's AOTAutograd waits for such an input before
tracing (process_inputs in torch/_functorch/_aot_autograd/frontend_utils.py, `trigger_wait()`)
and keeps the inner tensor, which does not require grad: the compiled region gives the input
no gradient, and the eager redistribute before it fails in the backward (AttributeError:
'Tensor' object has no attribute '_local_tensor', in torch/distributed/tensor/_redistribute.py's
NestedRedistribute). Rank 0 prints one line per case:

  torch <version> <case>: input <type>: <w.grad sum, or the error>

The right sum is 64.0 (every element of the 4 x 8 weight gets gradient 2, on both ranks).
`eager` and `compiled, plain input` (the project's way) must give it on every torch; `compiled,
as is` shows whether this torch has the bug (a RuntimeError "does not require grad" where it
has). Asserts nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard

from orchestrator.models.compile import _plain_inputs


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    w = torch.ones(4, 8, requires_grad=True)

    def double(x):
        return x * 2

    compiled = torch.compile(double, backend="aot_eager", fullgraph=True)
    for case, fn, plain in (("eager", double, False), ("compiled, as is", compiled, False),
                            ("compiled, plain input", compiled, True)):
        torch._dynamo.reset()
        # the reduce-scatter of TP's embedding: partial sums to a sequence shard, async
        x = DTensor.from_local(w * 1, mesh, [Partial()]).redistribute(
            mesh, [Shard(1)], async_op=True).to_local()
        kind = type(x).__name__
        if plain:
            (x,) = _plain_inputs((x,))
        try:
            fn(x).sum().backward()
            result = f"w.grad sum {w.grad.sum().item()}"
        except Exception as e:  # what this torch does is the finding
            result = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        if dist.get_rank() == 0:
            print(f"torch {torch.__version__} {case}: input {kind}: {result}", flush=True)
        w.grad = None
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
