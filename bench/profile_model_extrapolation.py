"""Do the fits price lengths never profiled? Fit on seq 256..1024, predict 2048 and 4096.

  python bench/profile_model_extrapolation.py            # tiny, one CPU rank (cluster.tasks_per_node=1)
  python bench/profile_model_extrapolation.py --ranks 4  # tiny, tp=1 on each of 4 ranks at once
  python bench/profile_model_extrapolation.py --smoke    # fit on 32, 64, predict 128; 1 iteration

One profile_model run measures all six lengths (tiny's model.seq_len raised to the longest);
the bench refits on the first four with the stage's own fit (model_fit.fit_points) and compares
the predictions for 2048 and 4096 with what the same run measured. Target: within 10%. Prints
figures; asserts nothing.
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
SMOKE_FIT_ON, SMOKE_PREDICT = (32, 64), (128,)


def main() -> None:
    from orchestrator.profiling.model.fit import fit_points, predict_poly

    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--smoke", action="store_true",
                        help=f"fit on {list(SMOKE_FIT_ON)}, predict {list(SMOKE_PREDICT)}, "
                             f"1 iteration after 1 warm-up")
    args = parser.parse_args()
    fit_on, predict = (SMOKE_FIT_ON, SMOKE_PREDICT) if args.smoke else (FIT_ON, PREDICT)
    warmup = ["profile_model.warmup_iters=1"] if args.smoke else []
    if args.smoke:
        args.iters = 1
    seqs = list(fit_on + predict)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "orchestrator", "stage=profile_model",
                        f"cluster.tasks_per_node={args.ranks}", "profile_model.max_tp=1",
                        f"model.seq_len={max(seqs)}",  # the stage profiles up to model.seq_len
                        f"profile_model.seq_lens=[{','.join(map(str, seqs))}]",
                        f"profile_model.iters={args.iters}", *warmup, "profile_model.plot=false",
                        f"profiles_dir={tmp}"], cwd=REPO, check=True, capture_output=True)
        prof = json.loads((Path(tmp) / "local" / "model" / "tiny.json").read_text())
    points = {p["seq_len"]: p for p in prof["points"]}
    fit = fit_points([points[s] for s in fit_on])["1"]
    print(f"tiny on {args.ranks} CPU rank(s), fit on seq {list(fit_on)} "
          f"(max rel err on them {fit['max_rel_err']:.1%}; block fits chosen: "
          f"{fit['block_models']}); target: within 10%")
    for s in seqs:
        print(f"  measured seq {s:>4}: " + ", ".join(f"{k} {points[s][k]:.0f}" for k in PARTS)
              + f" (fastest block fwd {points[s]['block_fwd_fastest_us']:.0f})")
    worst = 0.0
    for part in PARTS:
        row = []
        for s in predict:
            pred, meas = predict_poly(fit[part], s), points[s][part]
            err = (pred - meas) / meas
            worst = max(worst, abs(err))
            row.append(f"seq {s}: predicted {pred:9.0f} us, measured {meas:9.0f} us ({err:+.1%})")
        print(f"  {part:13s} " + "; ".join(row))
    both = []
    for s in predict:
        pred = sum(predict_poly(fit[p], s) for p in PARTS[:2])
        meas = sum(points[s][p] for p in PARTS[:2])
        both.append(f"seq {s}: {(pred - meas) / meas:+.1%}")
    print("  block fwd+bwd  " + "; ".join(both))
    print(f"worst part error {worst:.1%}")


if __name__ == "__main__":
    main()
