"""Galvatron's hardware files, to and from hardware.json.

Galvatron (PKU-DAIR/Hetu-Galvatron, galvatron/profile_hardware/hardware_configs/) reads:
- allreduce_bandwidth_<tag>.json: "allreduce_size_{n}_consec_{1|0}" = allreduce busbw in GB/s
  (nccl-tests "bus bandwidth"; consec 1 = groups [i*n, (i+1)*n), 0 = strided; the whole world
  only as consec_1);
- p2p_bandwidth_<tag>.json: "pp_size_{p}" = send/recv bandwidth in GB/s between stages of a
  p-stage pipeline (strided pipeline groups, as ours);
- sp_time_<tag>.json: "{allreduce|all2all}_size_{n}_{MB}MB_time" = time in ms of one collective
  of MB MiB per rank over consecutive groups of n (Galvatron sweeps 1..1024 MB and fits a line;
  it asserts at least 8 sizes per n);
- overlap_coefficient.json: "overlap_coe" (>= 1).
<tag> is "{nodes}nodes_{gpus_per_node}gpus_per_node".

Export evaluates our fits where Galvatron wants one number (busbw at a reference size, 32 MiB by
default, as Galvatron's own torch profiler uses), and uses measured medians in sp_time where a
point of exactly that size exists (the fit elsewhere). Import rebuilds fits: sp_time series become
points and alpha-beta fits; single bandwidths become fits with alpha 0 (so they predict the same
busbw at the reference size); overlap slowdowns Galvatron does not keep are None.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from orchestrator.errors import ProfileError
from orchestrator.profiling.hardware.fit import fit_alpha_beta, predict_fit_time_us
from orchestrator.profiling.hardware.groups import p2p_pairs_by_layout
from orchestrator.profiling.measure import MiB, algbw_from_busbw_GBps, busbw_GBps
from orchestrator.store import write_json
from orchestrator.store.schema import FieldError, HardwareBenchmarks

REF_SIZE_BYTES = 32 * MiB
SP_SIZES_MB = tuple(2 ** i for i in range(11))  # 1 .. 1024 MiB, Galvatron's sweep

_ALLREDUCE_KEY = re.compile(r"^allreduce_size_(\d+)_consec_([01])$")
_P2P_KEY = re.compile(r"^pp_size_(\d+)$")
_SP_KEY = re.compile(r"^(allreduce|all2all)_size_(\d+)_(\d+)MB_time$")


def galvatron_tag(nodes: int, gpus_per_node: int) -> str:
    """Galvatron's file suffix for a cluster shape."""
    return f"{nodes}nodes_{gpus_per_node}gpus_per_node"


def _busbw_at(fit: Mapping, size_bytes: float) -> float:
    t = predict_fit_time_us(fit, size_bytes)
    return busbw_GBps(fit["op"], fit["group_size"], size_bytes / t / 1e3)


def _fits(hardware: Mapping, op: str) -> List[Mapping]:
    return list(hardware.get("benchmarks", {}).get(op, {}).get("fits", []))


def _sp_times(hardware: Mapping, op: str, sizes_MB: Sequence[int]) -> Dict[str, float]:
    bench = hardware.get("benchmarks", {}).get(op, {})
    measured = {(p["group_size"], p["size_bytes"]): p["time_us_median"]
                for p in bench.get("points", []) if p["layout"] == "consec"}
    out = {}
    for fit in bench.get("fits", []):
        if fit["layout"] != "consec":
            continue
        n = fit["group_size"]
        for mb in sizes_MB:
            t_us = measured.get((n, mb * MiB))
            if t_us is None:
                t_us = predict_fit_time_us(fit, mb * MiB)
            out[f"{op}_size_{n}_{mb}MB_time"] = t_us / 1e3
    return out


def to_galvatron(hardware: Mapping, *, ref_size_bytes: int = REF_SIZE_BYTES,
                 sp_sizes_MB: Sequence[int] = SP_SIZES_MB) -> Dict[str, Dict[str, float]]:
    """Galvatron's files as {file name: {key: value}} from a hardware.json body (GB/s, ms)."""
    cluster = hardware["cluster"]
    tag = galvatron_tag(cluster["nodes"], cluster["tasks_per_node"])
    allreduce = {}
    for fit in _fits(hardware, "allreduce"):
        consec = 1 if fit["layout"] == "consec" else 0
        allreduce[f"allreduce_size_{fit['group_size']}_consec_{consec}"] = _busbw_at(
            fit, ref_size_bytes)
    p2p: Dict[str, float] = {}
    for fit in _fits(hardware, "p2p"):
        key = f"pp_size_{fit['group_size']}"
        # One number per pp: the slowest kind of link between stages bounds the pipeline.
        p2p[key] = min(p2p.get(key, float("inf")), _busbw_at(fit, ref_size_bytes))
    sp_time = {**_sp_times(hardware, "allreduce", sp_sizes_MB),
               **_sp_times(hardware, "all2all", sp_sizes_MB)}
    files: Dict[str, Dict[str, float]] = {
        f"allreduce_bandwidth_{tag}.json": allreduce,
        f"p2p_bandwidth_{tag}.json": p2p,
        f"sp_time_{tag}.json": sp_time,
    }
    overlap = hardware.get("benchmarks", {}).get("overlap")
    if overlap is not None:
        files["overlap_coefficient.json"] = {"overlap_coe": max(1.0, overlap["overlap_coe"])}
    return files


def _sp_series(sp_time: Mapping[str, float]) -> Dict[tuple, Dict[int, float]]:
    series: Dict[tuple, Dict[int, float]] = {}
    for key, time_ms in sp_time.items():
        m = _SP_KEY.match(key)
        if m:
            op, n, mb = m.group(1), int(m.group(2)), int(m.group(3))
            series.setdefault((op, n), {})[mb * MiB] = float(time_ms) * 1e3
    return series


def _point(op: str, n: int, layout: str, size: int, t_us: float, dtype: str) -> Dict[str, Any]:
    algbw = size / t_us / 1e3
    return {"op": op, "group_size": n, "layout": layout, "size_bytes": size, "dtype": dtype,
            "time_us_median": t_us, "time_us_p10": t_us, "time_us_p90": t_us,
            "algbw_GBps": algbw, "busbw_GBps": busbw_GBps(op, n, algbw), "iters": 0}


def _fit_record(op: str, n: int, layout: str, alpha: float, algbw: float,
                max_rel_err: Optional[float]) -> Dict[str, Any]:
    return {"op": op, "group_size": n, "layout": layout, "alpha_us": alpha,
            "algbw_GBps": algbw, "max_rel_err": max_rel_err}


def _file(files: Mapping[str, Mapping], prefix: str) -> Mapping[str, float]:
    matches = [name for name in files if name.startswith(prefix)]
    if len(matches) > 1:
        raise ProfileError(f"several Galvatron files start with {prefix!r}: {sorted(matches)}; "
                           f"keep one cluster shape per directory")
    return files[matches[0]] if matches else {}


def from_galvatron(files: Mapping[str, Mapping[str, float]], world_size: int, gpus_per_node: int,
                   *, dtype: str = "bf16",
                   ref_size_bytes: int = REF_SIZE_BYTES) -> HardwareBenchmarks:
    """hardware.json "benchmarks" rebuilt from Galvatron's files ({file name: {key: value}}) for
    the fields Galvatron keeps. Unknown error bounds and overlap slowdowns are None."""
    series = _sp_series(_file(files, "sp_time_"))
    benchmarks: Dict[str, Any] = {}
    for op in ("allreduce", "all2all"):
        points, fits = [], []
        for (sop, n), by_size in sorted(series.items()):
            if sop != op:
                continue
            sizes = sorted(by_size)
            points += [_point(op, n, "consec", s, by_size[s], dtype) for s in sizes]
            ab = fit_alpha_beta(sizes, [by_size[s] for s in sizes])
            fits.append(_fit_record(op, n, "consec", ab.alpha_us, ab.algbw_GBps, ab.max_rel_err))
        benchmarks[op] = {"points": points, "fits": fits}
    fitted = {(f["group_size"], f["layout"]) for f in benchmarks["allreduce"]["fits"]}
    for key, busbw in sorted(_file(files, "allreduce_bandwidth_").items()):
        m = _ALLREDUCE_KEY.match(key)
        if not m:
            continue
        n, layout = int(m.group(1)), "consec" if m.group(2) == "1" else "strided"
        if (n, layout) in fitted:
            continue  # the sp_time series gave a full alpha-beta line for this shape
        algbw = algbw_from_busbw_GBps("allreduce", n, float(busbw))
        benchmarks["allreduce"]["fits"].append(
            _fit_record("allreduce", n, layout, 0.0, algbw, None))
    node_of_rank = [r // gpus_per_node for r in range(world_size)]
    p2p_fits = []
    for key, bw in sorted(_file(files, "p2p_bandwidth_").items(),
                          key=lambda kv: (len(kv[0]), kv[0])):
        m = _P2P_KEY.match(key)
        if not m:
            continue
        pp = int(m.group(1))
        for layout in p2p_pairs_by_layout(world_size, pp, node_of_rank):
            p2p_fits.append(_fit_record("p2p", pp, layout, 0.0, float(bw), None))
    benchmarks["p2p"] = {"points": [], "fits": p2p_fits}
    overlap = _file(files, "overlap_coefficient")
    if "overlap_coe" in overlap:
        benchmarks["overlap"] = {"compute_slowdown": None, "comm_slowdown": None,
                                 "overlap_coe": float(overlap["overlap_coe"])}
    try:
        return HardwareBenchmarks.from_dict(benchmarks, "benchmarks")
    except FieldError as e:
        raise ProfileError(f"Galvatron files do not make a hardware profile: {e}") from None


def write_galvatron_dir(hardware: Mapping, out_dir: os.PathLike, **kwargs) -> List[Path]:
    """Write Galvatron's files for `hardware` into `out_dir` (atomically, one by one); returns
    their paths. Point Galvatron's --allreduce_bandwidth_config_path etc. (or its
    hardware_configs/ directory) at them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, body in to_galvatron(hardware, **kwargs).items():
        write_json(out / name, body)
        paths.append(out / name)
    return paths


def read_galvatron_dir(in_dir: os.PathLike, world_size: int, gpus_per_node: int,
                       **kwargs) -> HardwareBenchmarks:
    """from_galvatron over the Galvatron JSON files found in `in_dir`."""
    files = {}
    for path in sorted(Path(in_dir).glob("*.json")):
        if path.name.startswith(("allreduce_bandwidth_", "p2p_bandwidth_", "sp_time_",
                                 "overlap_coefficient")):
            try:
                files[path.name] = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ProfileError(f"{path} is not valid JSON ({e}); regenerate it") from e
    if not files:
        raise ProfileError(f"no Galvatron hardware files in {in_dir} (expected "
                           f"allreduce_bandwidth_*.json, p2p_bandwidth_*.json, sp_time_*.json, "
                           f"overlap_coefficient.json)")
    return from_galvatron(files, world_size, gpus_per_node, **kwargs)
