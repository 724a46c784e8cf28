"""Galvatron's own llama-7b profiles through our import and search, next to Galvatron's picks.

    python bench/galvatron_side_by_side.py [--cache DIR] [--no-engine]

Downloads the hetu-galvatron 2.4.0 sdist (`pip download --no-deps`; skips with a message when it
cannot), imports its llama-7b hardware and model profiles with `stage=import` as a user would
(`cluster=dgx_a100`, `model=llama2_7b model.seq_len=2048`), and for each scenario prints: our
search time and pick, Galvatron's pick (its shipped strategy for that shape and memory, and the
one its own search engine writes when bench/galvatron_engine.py can build and run it here)
priced by our cost model, and the difference. Figures are printed, never asserted.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import List, Optional

SDIST = "hetu-galvatron==2.4.0"
ROOT = "hetu_galvatron-2.4.0"
MODEL = ["model=llama2_7b", "model.seq_len=2048"]
SCENARIOS = (
    # (label, nodes, memory GB per GPU, global batch, shipped strategy files of that shape)
    ("1 node x 8, 36 GB, batch 16", 1, 36, 16,
     ["galvatron_config_hidden4096_head32_1nodes_8gpus_per_node_36GB_bf16_[tpconsec_off].json"]),
    ("2 nodes x 8, 40 GB, batch 32", 2, 40, 32,
     ["galvatron_config_llama-7b_2nodes_8gpus_per_node_40GB_bf16_example.json",
      "galvatron_config_llama-7b_2nodes_8gpus_per_node_40GB_bf16_3D_example.json"]),
)


def fetch_sdist(cache: Path) -> Optional[Path]:
    """The unpacked sdist's root, downloading it into `cache` when absent; None when it cannot."""
    root = cache / ROOT
    if root.is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", SDIST,
                          "-d", str(cache)], capture_output=True, text=True)
    archives = sorted(cache.glob("hetu_galvatron-2.4.0*.tar.gz"))
    if got.returncode or not archives:
        print(f"skipped: cannot download {SDIST} ({got.stderr.strip().splitlines()[-1:] or '?'})")
        return None
    with tarfile.open(archives[0]) as tar:
        tar.extractall(cache, filter="data")
    return root


def orchestrator(args: List[str], cwd: Path) -> str:
    """Run `python -m orchestrator <args>` in `cwd`; its output (raises on failure)."""
    done = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=cwd,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"orchestrator {' '.join(args)} exited {done.returncode}:\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout


def scenario(root: Path, work: Path, label: str, nodes: int, memory_GB: float, batch: int,
             shipped: List[str], engine_pick: Optional[Path]) -> None:
    """Import, search, and price each Galvatron pick of one scenario; prints the figures."""
    galv = root / "galvatron"
    cluster = ["cluster=dgx_a100", f"cluster.nodes={nodes}", f"profiles_dir={work / 'profiles'}"]
    common = cluster + MODEL
    t0 = time.perf_counter()
    orchestrator(["stage=import", f"import.path={galv / 'profile_hardware/hardware_configs'}",
                  *common], work)
    orchestrator(["stage=import", f"import.path={galv / 'models/llama_hf/configs'}", *common],
                 work)
    import_s = time.perf_counter() - t0
    print(f"\n## {label}\nimport: {import_s:.2f} s (two commands, process start included)")
    picks = [galv / "models/llama_hf/configs" / name for name in shipped]
    if engine_pick is not None:
        picks.append(engine_pick)
    for pick in picks:
        t0 = time.perf_counter()
        out = orchestrator(["stage=search", *common, f"search.memory_GiB={memory_GB}",
                            f"search.global_batch_size={batch}", f"search.compare={pick}",
                            "search.plot=false", "force=true"], work)
        wall_s = time.perf_counter() - t0
        strategy = json.loads((work / "profiles/dgx_a100/strategy/llama2_7b.json").read_text())
        print(f"\n### vs {pick.name}\nour search: {strategy['elapsed_s'] * 1e3:.0f} ms in the "
              f"planner ({wall_s:.1f} s for the command); pick: {strategy['describe']}")
        print(out[out.find("compare"):] if "compare" in out else out[-3000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path,
                        default=Path(tempfile.gettempdir()) / "galvatron-sdist")
    parser.add_argument("--no-engine", action="store_true",
                        help="do not try to build and run Galvatron's own search engine")
    args = parser.parse_args()
    root = fetch_sdist(args.cache)
    if root is None:
        return
    for label, nodes, memory_GB, batch, shipped in SCENARIOS:
        with tempfile.TemporaryDirectory() as tmp:
            scenario(root, Path(tmp), label, nodes, memory_GB, batch, shipped, None)


if __name__ == "__main__":
    main()
