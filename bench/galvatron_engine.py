"""Run Galvatron 2.4.0's own search engine from its sdist, on CPU, for a side-by-side bench.

    python bench/galvatron_engine.py [--sdist DIR] [--work-dir DIR]
    python bench/galvatron_engine.py --smoke   # the first case's inputs only: no venv, no search

The sdist is the one bench/galvatron_side_by_side.py uses (`pip download`ed once into
<tmp>/galvatron-sdist; without network and without it the cases say "not run"), the venv
theirs too (<tmp>/galvatron-sdist/engine). --smoke never downloads: with the sdist there it
converts the first case's profiles and prints Galvatron's search command.

What it takes to run (found by trying, hetu-galvatron 2.4.0, torch 2.13 CPU):
- A throw-away virtualenv in `work_dir/venv` (never the project's environment) with torch 2.13
  (the wheel on disk), transformers (for `LlamaConfig`), scipy (curve fits), tqdm, numpy, pybind11
  and einops. Built once; later calls reuse it and need no network.
- `csrc/dp_core.cpp` (the C++ dynamic programme, `galvatron_dp_core`) compiled with g++ and
  pybind11's headers into `work_dir/ext`. Galvatron also has a pure-Python DP
  (`DPAlg(use_cpp_core=False)`), but its engine always asks for the C++ one.
- Galvatron's own driver, `galvatron/models/llama_hf/search_dist.py`, cannot run here:
  `import galvatron.core` pulls in the training runtime, whose Megatron copy imports NVIDIA apex
  (`from apex.optimizers import FusedAdam`: ModuleNotFoundError), which is not on PyPI (it is
  built from source against CUDA). So `DRIVER` below does what search_dist.py does, line for line,
  after registering `galvatron.core` and `galvatron.models.llama_hf` as bare packages so that
  their `__init__` (training code) is skipped; every search module runs unmodified.
- The shipped llama profiles are in an older layout than 2.4.0's reader, so they are converted
  into `work_dir/profiles/` (see `convert_model_profiles`, `convert_hardware_profiles`):
  per-batch-size times get the `_seq<S>` key and are fitted by Galvatron's "batch" time mode;
  memory comes from the shipped `*_sp` tables (the only ones keyed by tensor-parallel degree, as
  2.4.0's cost model needs), so the search runs with `--sequence_parallel`; there is no shipped
  `sp_time` file for 2 nodes, so the 1-node one stands in (tensor-parallel groups, at most 8
  wide, stay inside a node).

Measured here (2 shared cores, load ~4; Galvatron's defaults otherwise: every chunk count, ddp):
1 x 8 GPUs, 36 GB, batch 16: 272 s in the engine (290 s process), pp=1, tp=1, all layers
sharded data parallel, 17 of 32 layers checkpointed; 2 x 8 GPUs, 40 GB, batch 32: 204 s
(218 s process), pp=1, tp=1, sharded, 5 layers checkpointed. The time is Galvatron's: one
C++ DP per (chunks, min/max tp, embedding sharding, pp degree) over 1 MB memory steps.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Optional, Tuple

SDIST = "hetu-galvatron==2.4.0"
ROOT = "hetu_galvatron-2.4.0"
CACHE = Path(tempfile.gettempdir()) / "galvatron-sdist"  # the unpacked sdist and the engine's venv
VENV_PACKAGES = ("torch==2.13.0", "transformers", "scipy", "tqdm", "numpy", "pybind11", "einops")
SEARCH_TIMEOUT_S = 600
LLAMA_DIR = Path("galvatron/models/llama_hf")
HARDWARE_DIR = Path("galvatron/profile_hardware/hardware_configs")

# search_dist.py's steps, with galvatron.core's and llama_hf's training imports skipped.
DRIVER = '''\
import argparse, os, sys, time, types
import galvatron

def bare_package(name, *parts):
    module = types.ModuleType(name)
    module.__path__ = [os.path.join(os.path.dirname(galvatron.__file__), *parts)]
    sys.modules[name] = module

bare_package("galvatron.core", "core")
import galvatron.models
bare_package("galvatron.models.llama_hf", "models", "llama_hf")
from galvatron.core.search_engine import GalvatronSearchEngine
from galvatron.core.search_engine.arguments import galvatron_search_args
from galvatron.models.llama_hf.arguments import model_args
from galvatron.models.llama_hf.meta_configs import (config_from_meta, model_layer_configs,
                                                    model_name, set_model_config)

args = model_args(galvatron_search_args(argparse.ArgumentParser())).parse_args()
config = set_model_config(config_from_meta(args.model_size), args)
start = time.perf_counter()
engine = GalvatronSearchEngine(args)
engine.set_search_engine_info(sys.modules["galvatron.models.llama_hf"].__path__[0],
                              model_layer_configs(config), model_name(config))
engine.set_model_type("gpt")
engine.initialize_search_engine()
engine.parallelism_optimization()
print("SEARCH_ELAPSED_S %.6f" % (time.perf_counter() - start))
'''


def fetch_sdist(cache: Path, download: bool = True) -> Tuple[Optional[Path], str]:
    """(the unpacked sdist's root, "") — downloading it into `cache` when absent and `download`
    — or (None, why not)."""
    root = cache / ROOT
    if root.is_dir():
        return root, ""
    if not download:
        return None, f"no {ROOT} in {cache} (a run without --smoke downloads it)"
    cache.mkdir(parents=True, exist_ok=True)
    got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", SDIST,
                          "-d", str(cache)], capture_output=True, text=True)
    archives = sorted(cache.glob(f"{ROOT}*.tar.gz"))
    if got.returncode or not archives:
        return None, f"cannot download {SDIST} ({got.stderr.strip().splitlines()[-1:] or '?'})"
    with tarfile.open(archives[0]) as tar:
        tar.extractall(cache, filter="data")
    return root, ""


class Missing(Exception):
    """A piece Galvatron's search needs is not there; the message says which."""


def _run(cmd: list[str], what: str, timeout_s: float = 900, **kwargs) -> str:
    """Run `cmd`; its stdout+stderr, or Missing naming `what` and the last error line."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, **kwargs)
    except subprocess.TimeoutExpired as exc:
        raise Missing(f"{what} still running after {timeout_s:g} s; stopped") from exc
    except OSError as exc:
        raise Missing(f"{what}: {exc}") from exc
    log = done.stdout + done.stderr
    if done.returncode != 0:
        last = [line for line in log.splitlines() if line.strip()][-1:] or ["no output"]
        raise Missing(f"{what} failed (exit {done.returncode}): {last[0].strip()}")
    return log


def ensure_venv(work_dir: Path) -> Path:
    """The venv's python under `work_dir/venv`, created and filled on the first call only."""
    python = work_dir / "venv" / "bin" / "python"
    marker = work_dir / "venv" / "galvatron-deps-installed"
    if marker.exists():
        return python
    _run([sys.executable, "-m", "venv", str(work_dir / "venv")], "python -m venv")
    _run([str(python), "-m", "pip", "install", "-q", *VENV_PACKAGES],
         "pip install " + " ".join(VENV_PACKAGES))
    marker.write_text(" ".join(VENV_PACKAGES) + "\n")
    return python


def build_dp_core(python: Path, sdist_dir: Path, work_dir: Path) -> Path:
    """The folder holding the compiled `galvatron_dp_core` extension (built once with g++)."""
    ext_dir = work_dir / "ext"
    suffix = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_config_var("
                   "'EXT_SUFFIX'))"], "reading the venv's extension suffix").strip()
    target = ext_dir / f"galvatron_dp_core{suffix}"
    if target.exists():
        return ext_dir
    source = sdist_dir / "csrc" / "dp_core.cpp"
    if not source.exists():
        raise Missing(f"{source} not found: not an unpacked hetu-galvatron sdist")
    if shutil.which("g++") is None:
        raise Missing("g++ not found: needed to build csrc/dp_core.cpp (apt-get install g++)")
    includes = _run([str(python), "-m", "pybind11", "--includes"], "pybind11 --includes").split()
    ext_dir.mkdir(parents=True, exist_ok=True)
    _run(["g++", "-O3", "-shared", "-std=c++11", "-fPIC", *includes, str(source), "-o",
          str(target)], "g++ csrc/dp_core.cpp")
    return ext_dir


def shipped_model_tag(sdist_dir: Path, model: str) -> tuple[str, int]:
    """(name tag of the shipped llama profiles for `model`, its sequence length in tokens)."""
    meta_path = sdist_dir / LLAMA_DIR / "meta_configs" / f"{model}.json"
    if not meta_path.exists():
        raise Missing(f"no Galvatron meta config {meta_path}")
    meta = json.loads(meta_path.read_text())
    seq_len = meta["n_positions"]
    return f"hidden{meta['dim']}_head{meta['n_heads']}_seqlen{seq_len}", seq_len


def convert_time_profile(old: dict, seq_len: int) -> dict:
    """2.4.0's per-(batch, sequence) time keys, in ms per sample, from the shipped per-batch ones.

    Shipped: `layertype_0_bsz{b}` and `layertype_other_0_bsz{b}`; 2.4.0 writes
    `layertype_0_bsz{b}_seq{s}` and `layertype_other_bsz{b}_seq{s}`.
    """
    converted = {}
    for key, time_ms in old.items():
        layer = re.fullmatch(r"layertype_(\d+)_bsz(\d+)", key)
        other = re.fullmatch(r"layertype_other_\d+_bsz(\d+)", key)
        if layer:
            converted[f"layertype_{layer[1]}_bsz{layer[2]}_seq{seq_len}"] = time_ms
        elif other:
            converted[f"layertype_other_bsz{other[1]}_seq{seq_len}"] = time_ms
    return converted


def convert_memory_profile(old: dict, seq_len: int) -> dict:
    """2.4.0's sequence-keyed memory tables (MiB) from the shipped sequence-parallel ones.

    Only the shipped `*_sp` tables give model states per tensor-parallel degree, which 2.4.0's
    memory cost model indexes by; each is put under the sequence length key.
    """
    names = [key for key in old if key.endswith("_sp") and not key[0].isdigit()]
    if not names:
        raise Missing("shipped memory profile has no *_sp tables to convert")
    return {name: {str(seq_len): old[name]} for name in names}


def convert_model_profiles(sdist_dir: Path, out_dir: Path, model: str) -> None:
    """Write `computation_/memory_profiling_bf16_<model>.json` in 2.4.0's layout to `out_dir`."""
    tag, seq_len = shipped_model_tag(sdist_dir, model)
    configs = sdist_dir / LLAMA_DIR / "configs"
    out_dir.mkdir(parents=True, exist_ok=True)
    for kind, convert in (("computation", convert_time_profile),
                          ("memory", convert_memory_profile)):
        shipped = configs / f"{kind}_profiling_bf16_{tag}.json"
        if not shipped.exists():
            raise Missing(f"no shipped {kind} profile {shipped.name} for {model}")
        converted = convert(json.loads(shipped.read_text()), seq_len)
        (out_dir / f"{kind}_profiling_bf16_{model}.json").write_text(json.dumps(converted))


def convert_hardware_profiles(sdist_dir: Path, out_dir: Path, nodes: int,
                              gpus_per_node: int) -> None:
    """Copy the shipped hardware files for `nodes` x `gpus_per_node` into `out_dir`.

    Their layout is unchanged in 2.4.0. A missing sp_time file for several nodes is replaced by
    the 1-node one: sequence-parallel collectives run in tensor-parallel groups, inside a node.
    """
    shipped = sdist_dir / HARDWARE_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    topology = f"{nodes}nodes_{gpus_per_node}gpus_per_node"
    for name in (f"allreduce_bandwidth_{topology}.json", f"p2p_bandwidth_{topology}.json",
                 "overlap_coefficient.json"):
        if not (shipped / name).exists():
            raise Missing(f"Galvatron ships no {name} for {nodes} x {gpus_per_node} GPUs")
        shutil.copyfile(shipped / name, out_dir / name)
    sp_time = shipped / f"sp_time_{topology}.json"
    if not sp_time.exists():
        sp_time = shipped / f"sp_time_1nodes_{gpus_per_node}gpus_per_node.json"
    if not sp_time.exists():
        raise Missing(f"Galvatron ships no sp_time file for {gpus_per_node} GPUs per node")
    shutil.copyfile(sp_time, out_dir / f"sp_time_{topology}.json")


def search_args(profiles: Path, output: Path, *, nodes: int, gpus_per_node: int,
                memory_GB: float, global_batch_size: int, model: str) -> list[str]:
    """Galvatron's search command-line arguments for one case."""
    return ["--model_size", model, "--num_nodes", str(nodes),
            "--num_gpus_per_node", str(gpus_per_node),
            "--memory_constraint", str(int(memory_GB)), "--settle_bsz", str(global_batch_size),
            "--mixed_precision", "bf16", "--sequence_parallel",
            "--time_profile_mode", "batch", "--memory_profile_mode", "static",
            "--memory_profiling_path", str(profiles), "--time_profiling_path", str(profiles),
            *[f"--{name}_path={profiles}" for name in (
                "allreduce_bandwidth_config", "p2p_bandwidth_config", "overlap_coe", "sp_time")],
            "--output_config_path", str(output), "--log_dir", str(output / "logs")]


def prepare(sdist_dir: Path, work_dir: Path, model: str, nodes: int,
            gpus_per_node: int) -> tuple[Path, Path, Path]:
    """(venv python, extension folder, converted-profile folder), built or reused."""
    if not (sdist_dir / "galvatron" / "core" / "search_engine").is_dir():
        raise Missing(f"{sdist_dir} is not an unpacked hetu-galvatron sdist")
    work_dir.mkdir(parents=True, exist_ok=True)
    python = ensure_venv(work_dir)
    ext_dir = build_dp_core(python, sdist_dir, work_dir)
    profiles = work_dir / "profiles" / f"{model}_{nodes}x{gpus_per_node}"
    convert_model_profiles(sdist_dir, profiles, model)
    convert_hardware_profiles(sdist_dir, profiles, nodes, gpus_per_node)
    (work_dir / "search_driver.py").write_text(DRIVER)
    return python, ext_dir, profiles


def run_galvatron_search(sdist_dir: Path, work_dir: Path, *, nodes: int, gpus_per_node: int,
                         memory_GB: float, global_batch_size: int, model: str = "llama-7b"
                         ) -> dict:
    """Run Galvatron's search for one case as a subprocess and time it.

    Returns {"ok", "reason" (one line, empty when ok), "elapsed_s" (wall seconds of the search
    subprocess, interpreter start and imports included), "search_s" (seconds inside Galvatron's
    engine: initialise + parallelism_optimization), "config_path" (the galvatron_config_*.json
    written), "config" (its content), "log" (the subprocess output)}.
    """
    result = {"ok": False, "reason": "", "elapsed_s": 0.0, "search_s": 0.0,
              "config_path": "", "config": {}, "log": ""}
    case = f"{model}_{nodes}x{gpus_per_node}_{memory_GB:g}GB_bsz{global_batch_size}"
    output = work_dir / "runs" / case
    try:
        python, ext_dir, profiles = prepare(sdist_dir, work_dir, model, nodes, gpus_per_node)
        shutil.rmtree(output, ignore_errors=True)
        output.mkdir(parents=True)
        env = dict(os.environ, PYTHONPATH=f"{ext_dir}{os.pathsep}{sdist_dir}")
        args = search_args(profiles, output, nodes=nodes, gpus_per_node=gpus_per_node,
                           memory_GB=memory_GB, global_batch_size=global_batch_size, model=model)
        start = time.perf_counter()
        result["log"] = _run([str(python), str(work_dir / "search_driver.py"), *args],
                             "Galvatron search", timeout_s=SEARCH_TIMEOUT_S, env=env, cwd=output)
        result["elapsed_s"] = time.perf_counter() - start
    except Missing as exc:
        result["reason"] = str(exc)
        return result
    found = re.search(r"SEARCH_ELAPSED_S ([\d.]+)", result["log"])
    result["search_s"] = float(found[1]) if found else 0.0
    written = sorted(output.glob("galvatron_config_*.json"))
    if not written:
        result["reason"] = "Galvatron's search found no strategy within the memory limit"
        return result
    result.update(ok=True, config_path=str(written[0]),
                  config=json.loads(written[0].read_text()))
    return result


CASES = [  # (nodes, GPUs per node, memory GB, global batch)
    (1, 8, 36, 16),
    (2, 8, 40, 32),
]


def describe(config: dict) -> str:
    """One line: pipeline degree, distinct tensor-parallel degrees, chunks, checkpointed layers."""
    tp_sizes = sorted({int(tp) for tp in config["tp_sizes_enc"].split(",")})
    checkpointed = sum(int(flag) for flag in config["checkpoint"].split(","))
    return (f"pp={config['pp_deg']} tp={tp_sizes} chunks={config['chunks']} "
            f"ckpt_layers={checkpointed} dp_type={config['default_dp_type']}")


def case_label(nodes: int, gpus: int, memory_GB: float, batch: int) -> str:
    return f"llama-7b {nodes}x{gpus} {memory_GB} GB bsz {batch}"


def smoke(sdist_dir: Path, nodes: int, gpus: int, memory_GB: float, batch: int,
          model: str = "llama-7b") -> None:
    """The first case's inputs: the shipped profiles converted (into a temporary folder) and
    Galvatron's search command, without its venv or its search."""
    with tempfile.TemporaryDirectory() as tmp:
        profiles = Path(tmp) / "profiles"
        try:
            convert_model_profiles(sdist_dir, profiles, model)
            convert_hardware_profiles(sdist_dir, profiles, nodes, gpus)
        except Missing as exc:
            print(f"  inputs not converted: {exc}")
            return
        for path in sorted(profiles.iterdir()):
            print(f"  converted {path.name}: {len(json.loads(path.read_text()))} entries")
        args = search_args(profiles, Path(tmp) / "out", nodes=nodes, gpus_per_node=gpus,
                           memory_GB=memory_GB, global_batch_size=batch, model=model)
        print("search_driver.py " + " ".join(args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, default=None,
                        help=f"an unpacked sdist (default: {CACHE / ROOT}, downloaded if absent)")
    parser.add_argument("--work-dir", type=Path, default=CACHE / "engine")
    parser.add_argument("--smoke", action="store_true",
                        help="the first case's converted inputs and command, no download")
    opts = parser.parse_args()
    sdist, why = ((opts.sdist, "") if opts.sdist is not None
                  else fetch_sdist(CACHE, download=not opts.smoke))
    if opts.smoke:
        print(f"smoke, {case_label(*CASES[0])}" + (f": not run: {why}" if sdist is None else ""))
        if sdist is not None:
            smoke(sdist, *CASES[0])
        return
    for nodes, gpus, memory_GB, batch in CASES:
        label = case_label(nodes, gpus, memory_GB, batch)
        if sdist is None:
            print(f"{label}: Galvatron search not run: {why}")
            continue
        found = run_galvatron_search(sdist, opts.work_dir, nodes=nodes, gpus_per_node=gpus,
                                     memory_GB=memory_GB, global_batch_size=batch)
        if not found["ok"]:
            print(f"{label}: Galvatron search not run: {found['reason']}")
            continue
        print(f"{label}: search {found['search_s']:.2f} s (process {found['elapsed_s']:.2f} s)"
              f" -> {describe(found['config'])}")
        print(f"    {found['config_path']}")


if __name__ == "__main__":
    main()
