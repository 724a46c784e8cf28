"""Dynamic micro-batching: planning time (normal and fast) and predicted iteration time of the
dynamic plan vs. the padded and packed baselines, on long-tailed lengths (lognormal, mean 512,
max 8192, seeded). Prints; asserts nothing. Profiles are the test fixtures' analytic ones
(tests/planner_fixtures.py): llama2_7b on 4 nodes of 8 H100-class GPUs (pp4 tp8 sp, dp1), and
tiny on one node (pp2 tp1 dp1).

    python bench/dynamic_microbatching.py [--iterations 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from orchestrator.layout import ParallelLayout  # noqa: E402
from orchestrator.planner import HardwareModel, ModelCost  # noqa: E402
from orchestrator.planner.dynamic import (MicroBatchCosts, packed_plan, padded_plan,  # noqa: E402
                                          plan_iteration)
import planner_fixtures  # noqa: E402

GiB = float(1 << 30)


def lengths(rng, n: int, max_len: int) -> list:
    """Lognormal lengths with mean ~512 (sigma 1), clipped to [1, max_len]."""
    return np.clip(rng.lognormal(np.log(512) - 0.5, 1.0, n).astype(int), 1, max_len).tolist()


def case(label, layout, model, hw, budget, max_len, iterations):
    costs = MicroBatchCosts(layout, model, hw)
    print(f"\n## {label}: {layout.describe() if hasattr(layout, 'describe') else layout}")
    print("| seqs | plan ms normal | plan ms fast | dynamic ms | fast ms | padded ms | packed ms "
          "| gain vs better | fast loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (8, 16, 64, 256):
        rng = np.random.default_rng(n)
        rows = []
        for _ in range(iterations):
            batch = [lengths(rng, n, max_len)]
            kw = dict(max_seq_len=max_len, costs=costs)
            t0 = time.perf_counter()
            dyn = plan_iteration(batch, layout, model, hw, budget, fast_mode=False,
                                 on_bad="skip", **kw)
            t1 = time.perf_counter()
            fast = plan_iteration(batch, layout, model, hw, budget, fast_mode=True,
                                  on_bad="skip", **kw)
            t2 = time.perf_counter()
            pad = padded_plan(batch, layout, model, hw, budget, **kw).iteration_time_us
            pack = packed_plan(batch, layout, model, hw, budget, **kw).iteration_time_us
            rows.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, dyn.iteration_time_us,
                         fast.iteration_time_us, pad, pack))
        med = [statistics.median(col) for col in zip(*rows)]
        gain = statistics.median(min(r[4], r[5]) / r[2] for r in rows)
        loss = statistics.median(r[3] / r[2] - 1 for r in rows)
        print(f"| {n} | {med[0]:.1f} | {med[1]:.1f} | {med[2] / 1e3:.1f} | {med[3] / 1e3:.1f} "
              f"| {med[4] / 1e3:.1f} | {med[5] / 1e3:.1f} | {gain:.2f}x | {loss * 100:.2f}% |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    hw = HardwareModel.from_dict(planner_fixtures.synthetic_hardware(4, 8))
    llama = ModelCost.from_dict(planner_fixtures.llama2_7b())
    case("llama2_7b", ParallelLayout.uniform(32, 8, 4, llama.layers, sequence_parallel=True,
                                             micro_batch_size=1), llama, hw, 80 * GiB, 8192,
         args.iterations)
    tiny = ModelCost.from_dict(planner_fixtures.synthetic_model(seq_len=8192))
    case("tiny", ParallelLayout.uniform(2, 1, 2, tiny.layers, micro_batch_size=1), tiny,
         HardwareModel.from_dict(planner_fixtures.synthetic_hardware(1, 2)), 8 * GiB, 8192,
         args.iterations)


if __name__ == "__main__":
    main()
