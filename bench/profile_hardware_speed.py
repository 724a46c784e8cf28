"""The full default hardware profile on 4 local CPU ranks: how long, and how good are its fits?

  python bench/profile_hardware_speed.py
  python bench/profile_hardware_speed.py --smoke   # the all-reduce alone, 2 ranks, <= 256 KiB

Prints the wall time of `python -m orchestrator stage=profile_hardware` (target: 60 s or less)
and, from the profile it wrote, how well alpha-beta fits predict held-out message sizes (fit on
every other size, predict the rest; target: within 10%). Asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.profiling.hardware.fit import held_out_rel_err  # noqa: E402


# --smoke: the all-reduce alone, with the test suite's quick sweep (tests/conftest.py QUICK_HW),
# on 2 ranks
SMOKE = ["cluster.tasks_per_node=2", "profile_hardware.benchmarks=[allreduce]",
         "profile_hardware.max_size_bytes=262144", "profile_hardware.max_time_s=0.05",
         "profile_hardware.size_step=8", "profile_hardware.plot=false"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=" ".join(SMOKE))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "orchestrator", "stage=profile_hardware",
                        *(SMOKE if args.smoke else []), f"profiles_dir={tmp}"], cwd=REPO,
                       check=True, capture_output=True)
        wall_s = time.perf_counter() - t0
        hw = json.loads((Path(tmp) / "local" / "hardware.json").read_text())
    if args.smoke:
        print(f"smoke profile ({' '.join(SMOKE)}): {wall_s:.1f} s")
    else:
        print(f"full default profile, 4 local ranks: {wall_s:.1f} s (target <= 60 s)")
    errors = []
    for name, section in hw["benchmarks"].items():
        if name == "overlap":
            continue
        series = {}
        for p in section["points"]:
            series.setdefault((p["op"], p["group_size"], p["layout"]), []).append(p)
        for key, points in sorted(series.items()):
            points.sort(key=lambda p: p["size_bytes"])
            err = held_out_rel_err([p["size_bytes"] for p in points],
                                   [p["time_us_median"] for p in points])
            errors.append(err)
            print(f"  {key[0]:>14} n={key[1]:<3} {key[2]:<8} held-out error {err:6.1%}")
    print(f"alpha-beta fits on held-out sizes: median {np.median(errors):.1%}, "
          f"max {max(errors):.1%} (target <= 10%) over {len(errors)} series")
    if "overlap" in hw["benchmarks"]:  # not in --smoke's
        print(f"overlap_coe {hw['benchmarks']['overlap']['overlap_coe']:.2f}")


if __name__ == "__main__":
    main()
