"""How long the layout search takes, exact and in fast mode, and what fast mode gives up.

    python bench/search_speed.py            # all cases
    python bench/search_speed.py --quick    # skip the 4096/8192-device cases
    python bench/search_speed.py --smoke    # the 16-device case on the test fixtures' profiles

Profiles are the project's own analytic ones, as a user planning from a laptop gets them:
hardware from `profile_hardware.source=analytic cluster=dgx_h100` (published H100/NDR figures),
models from `stage=profile_model cluster=dgx_h100` (exact memory, FLOP-based time on the H100
sheet), written once into a temporary folder by the CLI. `--synthetic` uses the test fixtures
(tests/planner_fixtures.py) instead. Targets: < 2 s for 64 devices, < 10 s for 8192 devices on
2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from orchestrator.planner import (CostOptions, HardwareModel, ModelCost, SearchSpace,  # noqa: E402
                                  evaluate, search)
from orchestrator.planner.search import auto_max_cp  # noqa: E402
from orchestrator.profiling.hardware.analytic import LinkSheet, analytic_hardware  # noqa: E402

GiB = 2**30
CASES = [
    # (label, model name, world, global batch, seq_len, memory GiB)
    ("llama2_7b   16 dev", "llama2_7b", 16, 64, 4096, 80),
    ("qwen_30b    64 dev", "qwen_30b", 64, 128, 32768, 80),
    ("qwen_100b 2048 dev", "qwen_100b", 2048, 1024, 131072, 80),
    ("qwen_100b 4096 dev", "qwen_100b", 4096, 1024, 131072, 80),
    ("qwen_100b 8192 dev", "qwen_100b", 8192, 1024, 131072, 80),
]


def analytic_model_profile(name: str, folder: str) -> dict:
    """The model profile a user gets on a laptop for an H100 cluster (via the CLI)."""
    subprocess.run([sys.executable, "-m", "orchestrator", "stage=profile_model", "cluster=dgx_h100",
                    f"model={name}", "profile_model.plot=false", f"profiles_dir={folder}"],
                   cwd=REPO, check=True, capture_output=True)
    return json.loads((Path(folder) / "dgx_h100" / "model" / f"{name}.json").read_text())


def profiles_for(name: str, world: int, folder: str, synthetic: bool, cache: dict):
    """(hardware, model) profiles for one case; each model is profiled once."""
    if synthetic:
        sys.path.insert(0, str(REPO / "tests"))
        import planner_fixtures

        return (planner_fixtures.synthetic_hardware(world // 8, 8, max_group=64),
                getattr(planner_fixtures, name)())
    if name not in cache:
        cache[name] = analytic_model_profile(name, folder)
    return analytic_hardware("dgx_h100", world, LinkSheet(gpus_per_node=8)).to_dict(), cache[name]


def run_case(label, hw_profile, model_profile, world, gbs, seq_len, mem_GiB, repeat=1):
    hw = HardwareModel.from_dict(hw_profile)
    model = ModelCost.from_dict(model_profile)
    results = {}
    for fast in (False, True):
        # context parallelism as stage=search offers it (auto_max_cp: a 128K-token sequence
        # fits no layout without it)
        space = SearchSpace(world_size=world, memory_budget_bytes=mem_GiB * GiB,
                            global_batch_size=gbs, seq_len=seq_len, max_tp=8, max_pp=64,
                            max_cp=auto_max_cp(seq_len), fast_mode=fast,
                            options=CostOptions(reserve_bytes=2 * GiB))
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
    parser.add_argument("--synthetic", action="store_true", help="the test fixtures' profiles")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest case (16 devices), --synthetic: a second or so")
    args = parser.parse_args()
    cases = CASES[:1] if args.smoke else CASES[:3] if args.quick else CASES
    args.synthetic = args.synthetic or args.smoke
    with tempfile.TemporaryDirectory() as folder:
        cache = {}
        for label, name, world, gbs, seq_len, mem in cases:
            hw, model = profiles_for(name, world, folder, args.synthetic, cache)
            run_case(label, hw, model, world, gbs, seq_len, mem, repeat=args.repeat)

if __name__ == "__main__":
    main()
