"""How long profile_model takes: tiny measured on 4 local CPU ranks, qwen_100b analytic.

  python bench/profile_model_speed.py
  python bench/profile_model_speed.py --smoke   # tiny on 1 rank, one length, alone

Targets: tiny (default sweep, 4 ranks) within 60 s; qwen_100b (analytic) within 60 s. Also
prints how far the CPU device sheet's analytic times are from the measured ones (calibration).
Prints figures; asserts nothing.
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


def run(args, profiles_dir) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "orchestrator", *args, f"profiles_dir={profiles_dir}"],
                   cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - t0


# --smoke: tiny's smallest profile, one rank, one length, one iteration
SMOKE = ["cluster.tasks_per_node=1", "profile_model.max_tp=1", "profile_model.seq_lens=[64]",
         "profile_model.warmup_iters=1", "profile_model.iters=1", "profile_model.plot=false"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=" ".join(SMOKE) + "; no qwen_100b")
    args = parser.parse_args()
    ranks = 1 if args.smoke else 4
    with tempfile.TemporaryDirectory() as tmp:
        took = run(["stage=profile_model", *(SMOKE if args.smoke else [])], tmp)
        ledger = json.loads((Path(tmp) / "local" / "ledger.json").read_text())["entries"]
        parts = {k.split("/")[-1]: v["ended"] - v["started"] for k, v in ledger.items()
                 if k.startswith("profile_model/tiny/")}
        prof = json.loads((Path(tmp) / "local" / "model" / "tiny.json").read_text())
        print(f"tiny, {ranks} CPU rank{'s' if ranks > 1 else ''}, {len(parts)} points "
              f"(tp {sorted({p['tp'] for p in prof['points']})}, "
              f"seq {sorted({p['seq_len'] for p in prof['points']})}): {took:.1f} s wall "
              f"(target <= 60 s); points {sum(parts.values()):.1f} s, launch and report "
              f"{took - sum(parts.values()):.1f} s")
        if args.smoke:
            return
        took_a = run(["stage=profile_model", "model=qwen_100b"], tmp)
        qwen = json.loads((Path(tmp) / "local" / "model" / "qwen_100b.json").read_text())
        print(f"qwen_100b analytic, {len(qwen['points'])} points up to seq "
              f"{max(p['seq_len'] for p in qwen['points'])}: {took_a:.1f} s wall (target <= 60 s)")
        took_h = run(["stage=profile_model", "model=qwen_100b", "cluster=gpu_node"], tmp)
        print(f"qwen_100b analytic for an H100 node (cluster=gpu_node): {took_h:.1f} s wall")
        # calibration: the CPU sheet against what tiny measured at tp=1
        run(["stage=profile_model", "profile_model.source=analytic", "profile_model.max_tp=1",
             "cluster.name=analytic"], tmp)
        ana = json.loads((Path(tmp) / "analytic" / "model" / "tiny.json").read_text())
        by = {(p["seq_len"]): p for p in ana["points"]}
        for p in prof["points"]:
            if p["tp"] != 1:
                continue
            a = by[p["seq_len"]]
            print(f"  seq {p['seq_len']:>4} tp 1: block fwd+bwd measured "
                  f"{p['block_fwd_us'] + p['block_bwd_us']:.0f} us, analytic (cpu sheet) "
                  f"{a['block_fwd_us'] + a['block_bwd_us']:.0f} us, achieved "
                  f"{(p['flops']['block_fwd'] + p['flops']['block_bwd']) / (p['block_fwd_us'] + p['block_bwd_us']) / 1e3:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
