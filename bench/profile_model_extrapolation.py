"""Do the fits price lengths never profiled? Fit on seq 256..1024, predict 2048 and 4096.

  python bench/profile_model_extrapolation.py            # tiny, one CPU rank (cluster.tasks_per_node=1)
  python bench/profile_model_extrapolation.py --ranks 4  # tiny, tp=1 on each of 4 ranks at once

One profile_model run measures all six lengths; the bench refits on the first four with the
stage's own fit (model_fit.fit_points) and compares the predictions for 2048 and 4096 with what
the same run measured. Target: within 10%. Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIT_ON = (256, 512, 768, 1024)
PREDICT = (2048, 4096)
PARTS = ("block_fwd_us", "block_bwd_us", "other_fwd_us", "other_bwd_us")


def main() -> None:
    from orchestrator.profiling.model.fit import fit_points, predict_poly

    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--iters", type=int, default=7)
    args = parser.parse_args()
    seqs = list(FIT_ON + PREDICT)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "orchestrator", "stage=profile_model",
                        f"cluster.tasks_per_node={args.ranks}", "profile_model.max_tp=1",
                        f"profile_model.seq_lens=[{','.join(map(str, seqs))}]",
                        f"profile_model.iters={args.iters}", f"profiles_dir={tmp}"],
                       cwd=REPO, check=True, capture_output=True)
        prof = json.loads((Path(tmp) / "local" / "model" / "tiny.json").read_text())
    points = {p["seq_len"]: p for p in prof["points"]}
    fit = fit_points([points[s] for s in FIT_ON])["1"]
    print(f"tiny on {args.ranks} CPU rank(s), fit on seq {list(FIT_ON)} "
          f"(max rel err on them {fit['max_rel_err']:.1%}; block fits chosen: "
          f"{fit['block_models']}); target: within 10%")
    for s in seqs:
        print(f"  measured seq {s:>4}: " + ", ".join(f"{k} {points[s][k]:.0f}" for k in PARTS)
              + f" (fastest block fwd {points[s]['block_fwd_fastest_us']:.0f})")
    worst = 0.0
    for part in PARTS:
        row = []
        for s in PREDICT:
            pred, meas = predict_poly(fit[part], s), points[s][part]
            err = (pred - meas) / meas
            worst = max(worst, abs(err))
            row.append(f"seq {s}: predicted {pred:9.0f} us, measured {meas:9.0f} us ({err:+.1%})")
        print(f"  {part:13s} " + "; ".join(row))
    both = []
    for s in PREDICT:
        pred = sum(predict_poly(fit[p], s) for p in PARTS[:2])
        meas = sum(points[s][p] for p in PARTS[:2])
        both.append(f"seq {s}: {(pred - meas) / meas:+.1%}")
    print("  block fwd+bwd  " + "; ".join(both))
    print(f"worst part error {worst:.1%}")


if __name__ == "__main__":
    main()
