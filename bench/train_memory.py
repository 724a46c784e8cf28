"""Where a training step's memory goes: every live tensor byte of one engine step, by kind and at
the peak, next to the workload model's states (orchestrator/workload/memory.py) and, on a GPU,
torch.cuda.max_memory_allocated.

One process (world size 1: dp = tp = pp = 1), the engine of `stage=train`, random tokens.

    python bench/train_memory.py                                   # tiny, CPU
    python bench/train_memory.py --smoke                           # tiny, 1 layer, seq 32
    python bench/train_memory.py --model llama2_7b --layers 4 --seq 2048 --mbs 2 --gbs 8 \
        --dtype bf16 --device cuda [--recompute full] [--zero 0]

Prints: the states predicted vs counted at the start of the step; the peak (bytes, and the phase
it fell in: forward/backward of a module, finish_backward, grad_norm, step); the tensors alive at
the peak grouped by (phase and op that made them, shape, dtype); the CUDA allocator's peak.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.layout import ParallelLayout  # noqa: E402
from orchestrator.models.config import ModelConfig  # noqa: E402
from orchestrator.train.engine import Engine  # noqa: E402
from orchestrator.train.live_memory import LiveTensorBytes  # noqa: E402
from orchestrator.workload.states import rank_states  # noqa: E402

MiB = float(1 << 20)


def load_model(name: str, layers: int | None, seq: int) -> ModelConfig:
    import yaml

    path = Path(__file__).resolve().parents[1] / "orchestrator" / "conf" / "model" / f"{name}.yaml"
    fields = yaml.safe_load(path.read_text())
    if layers:
        fields["layers"] = layers
    fields["seq_len"] = seq
    return ModelConfig(**fields)


def label_modules(engine, live: LiveTensorBytes) -> None:
    """Mark the forward and backward of each top-level part (embedding, block i, norm, head)."""
    for mod in engine.modules:
        parts = [("tok_emb", getattr(mod, "tok_emb", None))]
        parts += [(f"block{i}", b) for i, b in getattr(mod, "blocks", {}).items()]
        parts += [("lm_head", getattr(mod, "lm_head", None))]
        for name, part in parts:
            if part is None:
                continue
            part.register_forward_pre_hook(lambda *_, n=name: live.mark(f"fwd {n}"))
            part.register_full_backward_pre_hook(lambda *_, n=name: live.mark(f"bwd {n}"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mbs", type=int, default=1)
    ap.add_argument("--gbs", type=int, default=2)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--smoke", action="store_true",
                    help="the smallest step: tiny with 1 layer at seq 32 (the rest as given)")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.seq = 1, 32

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0,
                            world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = load_model(args.model, args.layers, args.seq)
    layout = ParallelLayout.uniform(1, 1, 1, model.layers, recompute=args.recompute,
                                    micro_batch_size=args.mbs,
                                    num_micro_batches=args.gbs // args.mbs, zero=args.zero)
    engine = Engine(layout, model, device, dtype=args.dtype, seed=1)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, model.vocab, (args.gbs, args.seq + 1), generator=g)
    tokens, targets = data[:, :-1].to(device), data[:, 1:].to(device)
    engine.train_step(tokens, targets, 1e-4, 1.0)  # the optimizer's states exist from here on
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_start = torch.cuda.memory_allocated()
    live = LiveTensorBytes(device, [engine, tokens, targets], detail=True)
    optim = engine.optim
    for name in ("finish_backward", "grad_norm", "step"):
        original = getattr(optim, name)

        def marked(*a, _original=original, _name=name, **k):
            live.mark(_name)
            return _original(*a, **k)
        setattr(optim, name, marked)
    label_modules(engine, live)
    with live:
        live.mark("start")
        engine.train_step(tokens, targets, 1e-4, 1.0)
    predicted = rank_states(model, layout, 0, seq_len=args.seq, dtype=args.dtype)
    params = sum(p.numel() for p in engine.named_parameters().values())
    out = {"config": vars(args), "params": params,
           "states_predicted": predicted.as_dict(), "states_counted": live.start_bytes,
           "peak_counted": live.peak_bytes, "peak_phase": live.peak_label,
           "peak_by_phase": live.peak_by_label}
    if device.type == "cuda":
        torch.cuda.synchronize()
        out["cuda_start_allocated"] = cuda_start
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        out["cuda_reserved"] = torch.cuda.memory_reserved()
    groups = Counter()
    for what, size in live.peak_detail:
        groups[what] += size
    out["at_peak"] = groups.most_common(args.top)
    print(f"model {args.model} x{model.layers} layers, {out['params'] / 1e6:.1f} M params, "
          f"seq {args.seq}, mbs {args.mbs} x {args.gbs // args.mbs}, {args.dtype}, "
          f"recompute {args.recompute}, zero {args.zero}, {device}")
    print("states predicted (MiB): " + ", ".join(f"{k} {v / MiB:.1f}"
                                                for k, v in predicted.as_dict().items()))
    print(f"states counted at the step's start: {live.start_bytes / MiB:.1f} MiB "
          f"({live.start_bytes / predicted.total - 1:+.3%} vs predicted)")
    print(f"peak counted: {live.peak_bytes / MiB:.1f} MiB, during '{live.peak_label}'")
    if device.type == "cuda":
        print(f"cuda: allocated at start {cuda_start / MiB:.1f} MiB, max allocated "
              f"{out['cuda_max_allocated'] / MiB:.1f} MiB, reserved "
              f"{out['cuda_reserved'] / MiB:.1f}")
    print("peak per phase (MiB above the start):")
    for label, value in live.peak_by_label.items():
        print(f"  {label:20s} {(value - live.start_bytes) / MiB:10.1f}")
    print(f"alive at the peak, largest {args.top} groups (MiB):")
    for what, size in out["at_peak"]:
        print(f"  {size / MiB:10.1f}  {what}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
