"""How long the layout search takes, exact and in fast mode, and what fast mode gives up.

    python bench/search_speed.py            # all cases
    python bench/search_speed.py --quick    # skip the 4096/8192-device cases

Profiles are synthetic, analytic-looking ones (tests/planner_fixtures.py: 8 GPUs per node,
NVLink-class inside a node, InfiniBand-class between nodes, collectives fitted up to 64 ranks and
extrapolated beyond). Targets: < 2 s for 64 devices, < 10 s for 8192 devices on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from orchestrator.planner import (CostOptions, HardwareModel, ModelCost, SearchSpace,  # noqa: E402
                                  evaluate, search)
from planner_fixtures import GiB, llama2_7b, qwen_100b, qwen_30b, synthetic_hardware  # noqa: E402

CASES = [
    # (label, model profile, world, global batch, seq_len, memory GiB)
    ("llama2_7b   16 dev", llama2_7b, 16, 64, 4096, 80),
    ("qwen_30b    64 dev", qwen_30b, 64, 128, 32768, 80),
    ("qwen_100b 2048 dev", qwen_100b, 2048, 1024, 131072, 80),
    ("qwen_100b 4096 dev", qwen_100b, 4096, 1024, 131072, 80),
    ("qwen_100b 8192 dev", qwen_100b, 8192, 1024, 131072, 80),
]


def run_case(label, profile, world, gbs, seq_len, mem_GiB, repeat=1):
    hw = HardwareModel.from_dict(synthetic_hardware(world // 8, 8, max_group=64))
    model = ModelCost.from_dict(profile())
    results = {}
    for fast in (False, True):
        space = SearchSpace(world_size=world, memory_budget_bytes=mem_GiB * GiB,
                            global_batch_size=gbs, seq_len=seq_len, max_tp=8, max_pp=64,
                            fast_mode=fast, options=CostOptions(reserve_bytes=2 * GiB))
        best = None
        for _ in range(repeat):
            t0 = time.perf_counter()
            result = search(model, hw, space)
            elapsed = time.perf_counter() - t0
            best = elapsed if best is None else min(best, elapsed)
        results[fast] = (best, result)
    space = SearchSpace(world_size=world, memory_budget_bytes=mem_GiB * GiB, global_batch_size=gbs,
                        seq_len=seq_len, options=CostOptions(reserve_bytes=2 * GiB))
    (t_exact, exact), (t_fast, fast) = results[False], results[True]
    loss = fast.prediction.iteration_time_us / exact.prediction.iteration_time_us - 1
    print(f"{label}: exact {t_exact:6.3f} s  fast {t_fast:6.3f} s  speed-up "
          f"{t_exact / t_fast:4.1f}x  quality loss {100 * loss:5.2f}%  "
          f"(configs {exact.considered}, solved {exact.solved}, pruned {exact.pruned})")
    sim = evaluate(exact.best, model, hw, seq_len, options=space.options, simulate=True)
    print(f"    best: {exact.best.describe()}  "
          f"{exact.prediction.iteration_time_us / 1e6:.3f} s/iter "
          f"(event simulation {sim.simulated_iteration_time_us / 1e6:.3f}), "
          f"peak {exact.prediction.peak_memory_bytes / GiB:.1f} GiB")
    if loss > 0:
        print(f"    fast: {fast.best.describe()}  "
              f"{fast.prediction.iteration_time_us / 1e6:.3f} s/iter")
    return t_exact, t_fast, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip the 4096/8192-device cases")
    parser.add_argument("--repeat", type=int, default=1, help="best of N timings")
    args = parser.parse_args()
    cases = CASES[:3] if args.quick else CASES
    for case in cases:
        run_case(*case, repeat=args.repeat)


if __name__ == "__main__":
    main()
