"""Measured against analytic model profiles: block times, MFU and activation memory per point.

  python bench/profile_model_gpu_vs_analytic.py MEASURED.json ANALYTIC.json [--peak-TFLOPs 989.4]
  python bench/profile_model_gpu_vs_analytic.py     # tiny, profiled here both ways first

Both files are profile_model outputs of the same model (e.g. `cluster=gpu_node` measured on an
H100, and `profile_model.source=analytic profile_model.device=h100`); without them `model=tiny`
is profiled on cluster=local into a temporary folder, measured on one rank and analytic (its
device sheet), and those two are compared. For every (seq_len, tp) point in both it prints
block forward/backward ms (measured / analytic), the block's MFU (FLOPs / measured time / peak;
peak defaults to the analytic file's device sheet for the model's dtype) and the block's
activation MiB per recompute mode (measured / analytic), plus the measured forward peak. Prints
figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent

MODES = ("none", "selective", "full")


def load_points(path: str) -> Tuple[dict, Dict[Tuple[int, int], dict]]:
    """The profile and its points keyed by (seq_len, tp)."""
    with open(path) as f:
        profile = json.load(f)
    return profile, {(p["seq_len"], p["tp"]): p for p in profile["points"]}


def sheet_peak_TFLOPs(analytic: dict) -> Optional[float]:
    """The analytic profile's device-sheet peak for the model's dtype, TFLOP/s (None if absent)."""
    sheet = analytic.get("method", {}).get("device_sheet") or {}
    return sheet.get("peak_TFLOPs", {}).get(analytic["model"]["dtype"])


def mfu(flops: float, time_us: float, peak_TFLOPs: float) -> float:
    """Model FLOPs utilisation: `flops` done in `time_us` over the peak (a fraction)."""
    return flops / (time_us * 1e-6) / (peak_TFLOPs * 1e12)


def ratio_cell(measured: float, analytic: float, scale: float, fmt: str) -> str:
    """"measured / analytic (x ratio)" of two figures divided by `scale`."""
    return (f"{measured / scale:{fmt}} / {analytic / scale:{fmt}} "
            f"(x{measured / analytic:.2f})")


def time_rows(meas: dict, ana: dict, keys, peak_TFLOPs: float) -> None:
    print(f"block times, ms: measured / analytic (x measured/analytic); "
          f"MFU at {peak_TFLOPs:g} TFLOP/s peak")
    print(f"{'seq':>6} {'tp':>3} {'fwd ms':>26} {'bwd ms':>26} {'other fwd+bwd ms':>26} "
          f"{'MFU fwd':>8} {'MFU bwd':>8} {'MFU f+b':>8} {'TFLOP/s':>8}")
    for key in keys:
        m, a = meas[key], ana[key]
        other_m = m["other_fwd_us"] + m["other_bwd_us"]
        other_a = a["other_fwd_us"] + a["other_bwd_us"]
        f_fwd, f_bwd = m["flops"]["block_fwd"], m["flops"]["block_bwd"]
        t_fwd, t_bwd = m["block_fwd_us"], m["block_bwd_us"]
        achieved_TFLOPs = (f_fwd + f_bwd) / ((t_fwd + t_bwd) * 1e-6) / 1e12
        print(f"{key[0]:>6} {key[1]:>3} "
              f"{ratio_cell(t_fwd, a['block_fwd_us'], 1e3, '.3f'):>26} "
              f"{ratio_cell(t_bwd, a['block_bwd_us'], 1e3, '.3f'):>26} "
              f"{ratio_cell(other_m, other_a, 1e3, '.3f'):>26} "
              f"{mfu(f_fwd, t_fwd, peak_TFLOPs):>8.1%} {mfu(f_bwd, t_bwd, peak_TFLOPs):>8.1%} "
              f"{mfu(f_fwd + f_bwd, t_fwd + t_bwd, peak_TFLOPs):>8.1%} {achieved_TFLOPs:>8.0f}")


def memory_rows(meas: dict, ana: dict, keys) -> None:
    mib = 2.0 ** 20
    print("block activations, MiB: measured (allocator) / analytic (saved tensors); "
          "measured forward peak above its start")
    print(f"{'seq':>6} {'tp':>3} " + " ".join(f"{m:>26}" for m in MODES)
          + f" {'peak none MiB':>14}")
    for key in keys:
        m, a = meas[key], ana[key]
        cells = [ratio_cell(m["block_act_bytes"][mode], a["block_act_bytes"][mode], mib, ".1f")
                 for mode in MODES]
        peak = m.get("block_act_peak_bytes", {}).get("none")
        peak_txt = f"{peak / mib:.1f}" if peak is not None else "-"
        print(f"{key[0]:>6} {key[1]:>3} " + " ".join(f"{c:>26}" for c in cells)
              + f" {peak_txt:>14}")


def profile_tiny(folder: Path) -> Tuple[str, str]:
    """(measured, analytic) model profiles of tiny on cluster=local, written under `folder`."""
    paths = []
    for source, extra in (("measured", ["cluster.tasks_per_node=1", "profile_model.max_tp=1"]),
                          ("analytic", [])):
        out = folder / source
        subprocess.run([sys.executable, "-m", "orchestrator", "stage=profile_model", "model=tiny",
                        f"profile_model.source={source}", "profile_model.plot=false", *extra,
                        f"profiles_dir={out}"], cwd=REPO, check=True, capture_output=True)
        paths.append(str(out / "local" / "model" / "tiny.json"))
    return paths[0], paths[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measured", nargs="?", help="default: tiny measured here (one CPU rank)")
    ap.add_argument("analytic", nargs="?", help="default: tiny analytic (cluster=local's sheet)")
    ap.add_argument("--peak-TFLOPs", type=float, default=None,
                    help="dense peak for MFU (default: the analytic file's device sheet)")
    args = ap.parse_args()
    if (args.measured is None) != (args.analytic is None):
        ap.error("give both files, or neither")
    if args.measured is None:
        with tempfile.TemporaryDirectory() as tmp:
            print("tiny profiled on cluster=local: measured on one rank, and analytic")
            args.measured, args.analytic = profile_tiny(Path(tmp))
            compare(args)
        return
    compare(args)


def compare(args) -> None:
    """Print both tables for the two files args names."""
    meas_profile, meas = load_points(args.measured)
    ana_profile, ana = load_points(args.analytic)
    keys = sorted(set(meas) & set(ana))
    if not keys:
        raise SystemExit("no (seq_len, tp) point in both files")
    peak = args.peak_TFLOPs or sheet_peak_TFLOPs(ana_profile) or 989.4
    print(f"measured: {meas_profile.get('method', {}).get('device', '?')}, "
          f"torch {meas_profile['provenance']['versions'].get('torch')}; "
          f"model {meas_profile['model']['name']} ({meas_profile['model']['dtype']})")
    time_rows(meas, ana, keys, peak)
    memory_rows(meas, ana, keys)


if __name__ == "__main__":
    main()
