"""Activation memory of one block, three ways, per recompute mode:

- live: bytes the forward leaves allocated (CPU: torch's MemTracker, which follows every storage
  created and freed; GPU: the CUDA allocator's memory_allocated), the block's output standing in
  for its input (allocated before, like the previous layer's output);
- saved: what profile_model records, the distinct storages autograd saves (+ checkpoint inputs);
- Megatron: sbh(34 + 5as/h), 34sbh/t (selective), 2sbh/t (full), scaled to the model's dtype.

  python bench/profile_model_memory.py
  python bench/profile_model_memory.py --smoke    # tiny alone

Shapes: tiny (fp32), a 1024-wide bf16 GQA model (CPU) and qwen_100b (analytic, FakeTensorMode:
no live figure). Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse

import torch

from orchestrator.choices import Recompute
from orchestrator.models.config import ModelConfig
from orchestrator.models.gpt import torch_dtype
from orchestrator.profiling.model import analytic as an
from orchestrator.profiling.model import memory as mem
from orchestrator.profiling.model.timing import build_point_model, memory_point

MODES = tuple(Recompute)


def live_bytes(pm, seq_len: int, mode: str) -> int:
    """The block's activations from what its forward leaves allocated (graph alive), corrected
    for output/input as model_memory.live_to_layer_bytes explains."""
    cos, sin = pm.rope()
    x = pm.block_input(seq_len)
    if torch.cuda.is_available():
        return mem.allocator_block_activations(pm.block, x, cos, sin, mode)["act"]
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(pm.model, x)
    cpu = torch.device("cpu")
    with tracker, mem.watch_saved(x) as seen:
        start = tracker.get_tracker_snapshot("current")[cpu]["Total"]
        y = mem.forward_in_mode(pm.block, x, cos, sin, mode)
        end = tracker.get_tracker_snapshot("current")[cpu]["Total"]
    return mem.live_to_layer_bytes(end - start, x, y, seen["saved"] or mode == "full")


def row(name, cfg, seq_len, tp, saved, live=None):
    elem = torch_dtype(cfg.dtype).itemsize
    cells = []
    for m in MODES:
        mega = mem.megatron_act_bytes(seq_len, 1, cfg.hidden, cfg.heads, tp, m, elem)
        live_txt = (f"live {live[m] / 2**20:8.2f} MiB (live - saved: {live[m] - saved[m]} B), "
                    if live else "")
        cells.append(f"{m}: {live_txt}saved {saved[m] / 2**20:8.2f} MiB, "
                     f"Megatron {mega / 2**20:8.2f} MiB (saved/Megatron {saved[m] / mega:.2f})")
    print(f"{name} seq {seq_len} tp {tp}:")
    for c in cells:
        print(f"    {c}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny shape alone")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = [("tiny fp32", ModelConfig(), 256),
              ("1024-wide bf16", ModelConfig(name="mid", hidden=1024, ffn=2816, heads=16,
                                             kv_heads=4, vocab=8192, dtype="bfloat16"), 1024)]
    for name, cfg, s in shapes:
        pm = build_point_model(cfg, s, 1, None, device)
        saved = memory_point(pm, s)["block_act_bytes"]
        live = {m: live_bytes(pm, s, m) for m in MODES}
        row(f"{name} ({device})", cfg, s, 1, saved, live)
        if args.smoke:
            return
    # analytic: a 100B model at 128k tokens, per TP degree (fake process group, no data)
    import yaml


    with open(an.DEVICE_DIR.parent / "model" / "qwen_100b.yaml") as f:
        qwen = ModelConfig(**yaml.safe_load(f))
    fake = an.fake_tensors_mode()
    for tp in (1, 8):
        with an.fake_world(tp) as mesh:
            with fake:
                pm = build_point_model(qwen, qwen.seq_len, tp, mesh, "cpu")
                cpu = memory_point(pm, qwen.seq_len)["block_act_bytes"]
                gpu = memory_point(pm, qwen.seq_len, gpu_kernels=True)["block_act_bytes"]
        row("qwen_100b bf16 (analytic, CPU kernels)", qwen, qwen.seq_len, tp, cpu)
        row("qwen_100b bf16 (analytic, CUDA RMSNorm)", qwen, qwen.seq_len, tp, gpu)


if __name__ == "__main__":
    main()
