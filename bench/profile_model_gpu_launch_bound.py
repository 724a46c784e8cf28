"""Is one block's measured time the GPU's or the host's? (GPU only)

  python bench/profile_model_gpu_launch_bound.py [--model llama2_7b] [--seq-lens 512 1024 2048 4096]
  python bench/profile_model_gpu_launch_bound.py --smoke   # tiny at seq 256

Without a GPU it says so and exits 0 (`make bench` runs on CPU machines too).

profile_model times a block with CUDA events after a synchronize, so the GPU waits for Python to
launch each kernel: when launching a block's kernels takes longer than running them, the event
time is the host's. Per sequence length this prints the block forward and backward in ms three
ways (fastest of 10 iterations):
- events: as profile_model does (synchronize, event, pass, event);
- GPU only: the same events queued behind a ~50 ms sleep kernel, so the host has launched the whole
  pass before the GPU reaches it and the events time the kernels alone;
- host: wall-clock time Python takes to launch the pass (no synchronize inside).
Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import time

import torch

from orchestrator.models.config import ModelConfig

SLEEP_CYCLES = 100_000_000  # ~50 ms at ~2 GHz: longer than any pass here takes to launch


def load_model_cfg(name: str) -> ModelConfig:
    """conf/model/<name>.yaml as a ModelConfig."""
    import yaml

    from orchestrator.profiling.model import analytic as an

    with open(an.DEVICE_DIR.parent / "model" / f"{name}.yaml") as f:
        return ModelConfig(**yaml.safe_load(f))


def time_pass_ms(run, queue_behind_sleep: bool):
    """(event ms, host launch ms) of one call of `run`."""
    torch.cuda.synchronize()
    if queue_behind_sleep:
        torch.cuda._sleep(SLEEP_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    out = run()
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.synchronize()
    return start.elapsed_time(end), host_ms, out


def block_times_ms(pm, seq_len: int, iters: int = 10) -> dict:
    """Fastest forward and backward ms of the block at `seq_len`: events, GPU only, host."""
    x = pm.block_input(seq_len)
    dy = torch.randn_like(x)
    cos, sin = pm.rope()
    best = {}
    for i in range(iters + 2):  # two warm-up iterations
        for behind in (False, True):
            fwd_ms, fwd_host_ms, y = time_pass_ms(lambda: pm.block(x, cos, sin), behind)
            bwd_ms, bwd_host_ms, _ = time_pass_ms(lambda: y.backward(dy), behind)
            x.grad = None
            for p in pm.block.parameters():
                p.grad = None
            if i < 2:
                continue
            how = "gpu" if behind else "events"
            for key, v in ((f"fwd_{how}", fwd_ms), (f"bwd_{how}", bwd_ms),
                           ("fwd_host", fwd_host_ms), ("bwd_host", bwd_host_ms)):
                if not (behind and key.endswith("host")):  # host time behind a sleep is the same
                    best[key] = min(best.get(key, float("inf")), v)
    return best


def main() -> None:
    from orchestrator.profiling.model.timing import build_point_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama2_7b")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--smoke", action="store_true", help="tiny at seq 256 (overrides the above)")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.seq_lens = "tiny", [256]
    if not torch.cuda.is_available():
        print("skipped: needs a GPU (torch.cuda.is_available() is False)")
        return
    cfg = load_model_cfg(args.model)
    pm = build_point_model(cfg, max(args.seq_lens), 1, None, "cuda")
    print(f"{args.model} one block on {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"ms, fastest of 10")
    print(f"{'seq':>6} {'fwd events':>11} {'fwd GPU':>8} {'fwd host':>9} "
          f"{'bwd events':>11} {'bwd GPU':>8} {'bwd host':>9}")
    for s in args.seq_lens:
        t = block_times_ms(pm, s)
        print(f"{s:>6} {t['fwd_events']:>11.3f} {t['fwd_gpu']:>8.3f} {t['fwd_host']:>9.3f} "
              f"{t['bwd_events']:>11.3f} {t['bwd_gpu']:>8.3f} {t['bwd_host']:>9.3f}")


if __name__ == "__main__":
    main()
