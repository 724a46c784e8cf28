"""Galvatron's hardware files, to and from hardware.json.

Galvatron (PKU-DAIR/Hetu-Galvatron, galvatron/profile_hardware/hardware_configs/) reads:
- allreduce_bandwidth_<tag>.json: "allreduce_size_{n}_consec_{1|0}" = allreduce busbw in GB/s
  (nccl-tests' average bus bandwidth over its size sweep; consec 1 = groups [i*n, (i+1)*n),
  0 = strided range(i, W, W/n); the whole world only as consec_1);
- p2p_bandwidth_<tag>.json: "pp_size_{p}" = send/recv bandwidth in GB/s around the groups
  range(i, W, W/p) (our pipeline with pp outermost); on several nodes every such group spans all
  nodes, so the figure is bounded by the inter-node link;
- sp_time_<tag>.json: "{allreduce|all2all}_size_{n}_{MB}MB_time" = time in ms of one collective
  of MB MiB per rank over consecutive groups of n (Galvatron sweeps 1..1024 MB and fits a line;
  it asserts at least 8 sizes per n);
- overlap_coefficient.json: "overlap_coe" (>= 1).
<tag> is "{nodes}nodes_{gpus_per_node}gpus_per_node"; one directory may hold several shapes.

Export evaluates our fits where Galvatron wants one number (busbw at a reference size, 32 MiB by
default, as Galvatron's own torch profiler uses), and uses measured medians in sp_time where a
point of exactly that size exists (the fit elsewhere). A multi-node profile also gets the one-node
allreduce and p2p files of the same gpus_per_node, from its intra-node fits, so that importing
the export keeps intra- and inter-node links apart.

Import (import_hardware) rebuilds a whole hardware.json body: sp_time series become points and
alpha-beta fits; single bandwidths become fits with alpha 0; reduce-scatter and all-gather fits
come from every all-reduce fit by half_allreduce_line; overlap slowdowns Galvatron does not keep
are None. Whatever does not map, and every assumption made, is listed in the Imported record.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from orchestrator.choices import Dtype
from orchestrator.errors import ConfigError, ProfileError
from orchestrator.interop import Imported
from orchestrator.profiling.hardware.fit import (fit_alpha_beta, half_allreduce_line,
                                                 predict_fit_time_us)
from orchestrator.profiling.hardware.groups import p2p_pairs_by_layout
from orchestrator.profiling.measure import MiB, algbw_from_busbw_GBps, busbw_GBps
from orchestrator.store import write_json
from orchestrator.store.schema import ClusterSummary, FieldError, HardwareBenchmarks

REF_SIZE_BYTES = 32 * MiB
SP_SIZES_MB = tuple(2 ** i for i in range(11))  # 1 .. 1024 MiB, Galvatron's sweep
OVERLAP_FILE = "overlap_coefficient.json"
KINDS = ("allreduce_bandwidth", "p2p_bandwidth", "sp_time")

_FILE_NAME = re.compile(r"^(allreduce_bandwidth|p2p_bandwidth|sp_time)_(\d+)nodes_(\d+)"
                        r"gpus_per_node\.json$")
_ALLREDUCE_KEY = re.compile(r"^allreduce_size_(\d+)_consec_([01])$")
_P2P_KEY = re.compile(r"^pp_size_(\d+)$")
_SP_KEY = re.compile(r"^(allreduce|all2all)_size_(\d+)_(\d+)MB_time$")
_KEY_OF_KIND = {"allreduce_bandwidth": _ALLREDUCE_KEY, "p2p_bandwidth": _P2P_KEY,
                "sp_time": _SP_KEY, "overlap": re.compile(r"^overlap_coe$")}

Files = Dict[str, Dict[str, float]]  # kind ("sp_time", ...) -> {key: value} of one shape


def galvatron_tag(nodes: int, gpus_per_node: int) -> str:
    """Galvatron's file suffix for a cluster shape."""
    return f"{nodes}nodes_{gpus_per_node}gpus_per_node"


# ==================================================================== export
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


def _one_node_files(hardware: Mapping, ref_size_bytes: int) -> Dict[str, Dict[str, float]]:
    """The one-node allreduce and p2p files of a multi-node profile, from its intra-node fits:
    consecutive groups up to a node, and each intra-node p2p fit of pp = p * nodes as the
    one-node pp_size_p (the same neighbour distance, W / pp ranks). Inside a node placement does
    not change the links, so the strided figure Galvatron's reader asks for is the consecutive
    one. Empty for a one-node profile."""
    nodes, gpus = hardware["cluster"]["nodes"], hardware["cluster"]["tasks_per_node"]
    if nodes <= 1:
        return {}
    allreduce: Dict[str, float] = {}
    for fit in _fits(hardware, "allreduce"):
        n = fit["group_size"]
        if fit["layout"] == "consec" and n <= gpus:
            allreduce[f"allreduce_size_{n}_consec_1"] = _busbw_at(fit, ref_size_bytes)
            if n < gpus:
                allreduce[f"allreduce_size_{n}_consec_0"] = allreduce[
                    f"allreduce_size_{n}_consec_1"]
    p2p = {f"pp_size_{fit['group_size'] // nodes}": _busbw_at(fit, ref_size_bytes)
           for fit in _fits(hardware, "p2p")
           if fit["layout"] == "intra" and fit["group_size"] % nodes == 0
           and fit["group_size"] // nodes >= 2}
    tag = galvatron_tag(1, gpus)
    named = {f"allreduce_bandwidth_{tag}.json": allreduce, f"p2p_bandwidth_{tag}.json": p2p}
    return {name: body for name, body in named.items() if body}


def to_galvatron(hardware: Mapping, *, ref_size_bytes: int = REF_SIZE_BYTES,
                 sp_sizes_MB: Sequence[int] = SP_SIZES_MB) -> Dict[str, Dict[str, float]]:
    """Galvatron's files as {file name: {key: value}} from a hardware.json body (GB/s, ms); a
    multi-node body also gives the one-node allreduce and p2p files (_one_node_files)."""
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
        **_one_node_files(hardware, ref_size_bytes),
    }
    overlap = hardware.get("benchmarks", {}).get("overlap")
    if overlap is not None:
        files[OVERLAP_FILE] = {"overlap_coe": max(1.0, overlap["overlap_coe"])}
    return files


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


# ==================================================================== import: files
def _load(path: Path) -> Dict[str, float]:
    """{key: value} of one Galvatron file; ProfileError naming the file when it is not a JSON
    object of positive numbers."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"{path} is not readable JSON ({e}); regenerate it with Galvatron's "
                           f"profile_hardware or remove it from the directory") from None
    if not isinstance(body, dict):
        raise ProfileError(f"{path} holds a JSON {type(body).__name__}, not an object of "
                           f"key: number; regenerate it with Galvatron's profile_hardware")
    for key, value in body.items():
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value <= 0):
            raise ProfileError(f"{path}: {key} = {value!r} is not a positive number; regenerate "
                               f"the file with Galvatron's profile_hardware")
    return {key: float(value) for key, value in body.items()}


def _shapes(in_dir: Path) -> Dict[Tuple[int, int], Dict[str, Path]]:
    """{(nodes, gpus_per_node): {kind: path}} of the Galvatron hardware files in `in_dir`."""
    shapes: Dict[Tuple[int, int], Dict[str, Path]] = {}
    for path in sorted(in_dir.glob("*.json")):
        m = _FILE_NAME.match(path.name)
        if m:
            shapes.setdefault((int(m.group(2)), int(m.group(3))), {})[m.group(1)] = path
    return shapes


def _shape_error(in_dir: Path, nodes: int, gpus_per_node: int,
                 shapes: Mapping[Tuple[int, int], Any]) -> ProfileError:
    if not shapes:
        return ProfileError(f"no Galvatron hardware files in {in_dir} (expected "
                            f"allreduce_bandwidth_*.json, p2p_bandwidth_*.json, sp_time_*.json, "
                            f"overlap_coefficient.json); point import.path at Galvatron's "
                            f"hardware_configs/ directory")
    found = ", ".join(f"{galvatron_tag(n, g)} (cluster.nodes={n} cluster.tasks_per_node={g})"
                      for n, g in sorted(shapes))
    return ProfileError(f"{in_dir} has no Galvatron hardware files for "
                        f"{galvatron_tag(nodes, gpus_per_node)}; it has {found}: import one of "
                        f"those with its overrides, or profile this shape with Galvatron")


def _unknown_keys(name: str, kind: str, body: Mapping[str, float]) -> List[str]:
    """One line per key of `body` (file `name`) that matches none of the kind's key patterns."""
    pattern = _KEY_OF_KIND[kind]
    return [f"{name}: {key} (not a Galvatron {kind} key)" for key in body
            if not pattern.match(key)]


# ==================================================================== import: sections
def _point(op: str, n: int, layout: str, size: int, t_us: float, dtype: str) -> Dict[str, Any]:
    algbw = size / t_us / 1e3
    return {"op": op, "group_size": n, "layout": layout, "size_bytes": size, "dtype": dtype,
            "time_us_median": t_us, "time_us_p10": t_us, "time_us_p90": t_us,
            "algbw_GBps": algbw, "busbw_GBps": busbw_GBps(op, n, algbw), "iters": 0}


def _fit_record(op: str, n: int, layout: str, alpha: float, algbw: float,
                max_rel_err: Optional[float]) -> Dict[str, Any]:
    return {"op": op, "group_size": n, "layout": layout, "alpha_us": alpha,
            "algbw_GBps": algbw, "max_rel_err": max_rel_err}


def _sp_series(sp_time: Mapping[str, float]) -> Dict[Tuple[str, int], Dict[int, float]]:
    """{(op, group size): {size_bytes: time_us}} from an sp_time file ("MB" read as MiB)."""
    series: Dict[Tuple[str, int], Dict[int, float]] = {}
    for key, time_ms in sp_time.items():
        m = _SP_KEY.match(key)
        if m:
            op, n, mb = m.group(1), int(m.group(2)), int(m.group(3))
            series.setdefault((op, n), {})[mb * MiB] = time_ms * 1e3
    return series


def _series_section(op: str, series: Mapping[Tuple[str, int], Mapping[int, float]],
                    dtype: str) -> Dict[str, List]:
    """Points and consecutive-group alpha-beta fits of `op` from sp_time series."""
    points, fits = [], []
    for (sop, n), by_size in sorted(series.items()):
        if sop != op:
            continue
        sizes = sorted(by_size)
        points += [_point(op, n, "consec", s, by_size[s], dtype) for s in sizes]
        ab = fit_alpha_beta(sizes, [by_size[s] for s in sizes])
        fits.append(_fit_record(op, n, "consec", ab.alpha_us, ab.algbw_GBps, ab.max_rel_err))
    return {"points": points, "fits": fits}


def _allreduce_figures(allreduce_bw: Mapping[str, float]) -> Dict[Tuple[int, str], float]:
    """{(group size, layout): busbw GB/s} of an allreduce_bandwidth file."""
    figures = {}
    for key, busbw in allreduce_bw.items():
        m = _ALLREDUCE_KEY.match(key)
        if m:
            figures[(int(m.group(1)), "consec" if m.group(2) == "1" else "strided")] = busbw
    return figures


def _collectives(main: Files, one_node: Files, gpus_per_node: int,
                 dtype: str) -> Dict[str, Dict[str, List]]:
    """allreduce and all2all sections. The shape's own sp_time series first, then the one-node
    file's for groups inside a node it lacks; allreduce_bandwidth figures (again the shape's
    own first) become alpha-0 fits for the groups no series covers."""
    series = _sp_series(one_node.get("sp_time", {}))
    series.update(_sp_series(main.get("sp_time", {})))
    sections = {op: _series_section(op, series, dtype) for op in ("allreduce", "all2all")}
    figures = {key: bw for key, bw in _allreduce_figures(one_node.get("allreduce_bandwidth", {})
                                                         ).items()
               if key[1] == "consec" and key[0] <= gpus_per_node}
    figures.update(_allreduce_figures(main.get("allreduce_bandwidth", {})))
    fitted = {(f["group_size"], f["layout"]) for f in sections["allreduce"]["fits"]}
    for (n, layout), busbw in sorted(figures.items()):
        if (n, layout) not in fitted:  # a series gives a full alpha-beta line where it exists
            algbw = algbw_from_busbw_GBps("allreduce", n, busbw)
            sections["allreduce"]["fits"].append(
                _fit_record("allreduce", n, layout, 0.0, algbw, None))
    return sections


def _half_allreduce_sections(allreduce_fits: Sequence[Mapping]) -> Dict[str, Dict[str, List]]:
    """reduce_scatter and all_gather sections: one fit per all-reduce fit, by
    half_allreduce_line (no points: nothing was measured)."""
    sections = {}
    for op in ("reduce_scatter", "all_gather"):
        fits = []
        for f in allreduce_fits:
            alpha, algbw = half_allreduce_line(f["alpha_us"], f["algbw_GBps"])
            fits.append(_fit_record(op, f["group_size"], f["layout"], alpha, algbw, None))
        sections[op] = {"points": [], "fits": fits}
    return sections


def _pp_figures(p2p_bw: Mapping[str, float]) -> Dict[int, float]:
    """{pp: bandwidth GB/s} of a p2p_bandwidth file."""
    return {int(m.group(1)): bw for key, bw in p2p_bw.items() if (m := _P2P_KEY.match(key))}


def _p2p_fits(main: Files, one_node: Files, nodes: int,
              gpus_per_node: int) -> Tuple[List[Dict[str, Any]], List[int]]:
    """(p2p fits, the pps whose intra-node hops got the multi-node figure). Each pp's pairs are
    split by node as our pipeline places them (pp outermost, as Galvatron's groups): inter-node
    pairs take the shape's figure; intra-node pairs on one node take it too, on several nodes
    the one-node file's figure at the same neighbour distance (pp / nodes), else the multi-node
    figure (pessimistic: bounded by the inter-node link)."""
    world = nodes * gpus_per_node
    node_of_rank = [r // gpus_per_node for r in range(world)]
    own = _pp_figures(main.get("p2p_bandwidth", {}))
    intra = own if nodes == 1 else {pp * nodes: bw for pp, bw in
                                    _pp_figures(one_node.get("p2p_bandwidth", {})).items()}
    fits, pessimistic = [], []
    for pp in sorted(set(own) | set(intra)):
        if pp < 2 or pp > world or world % pp:
            continue
        for layout in p2p_pairs_by_layout(world, pp, node_of_rank):
            bw = (intra if layout == "intra" else own).get(pp)
            if bw is None and layout == "intra" and pp in own:
                bw = own[pp]
                pessimistic.append(pp)
            if bw is not None:
                fits.append(_fit_record("p2p", pp, layout, 0.0, bw, None))
    return fits, pessimistic


# ==================================================================== import: the profile
def _load_shape(paths: Mapping[str, Path]) -> Files:
    return {kind: _load(path) for kind, path in paths.items()}


def _unmapped(main: Files, one_node: Files, overlap: Mapping[str, float], nodes: int,
              gpus_per_node: int) -> List[str]:
    """Keys with no place in hardware.json: unknown keys of every file used, and the one-node
    file's strided groups (inside one node) when importing a multi-node shape, where our
    strided groups cross nodes."""
    lines = []
    for files, shape_nodes in ((main, nodes), (one_node, 1)):
        for kind, body in files.items():
            lines += _unknown_keys(f"{kind}_{galvatron_tag(shape_nodes, gpus_per_node)}.json",
                                   kind, body)
    lines += _unknown_keys(OVERLAP_FILE, "overlap", overlap)
    one_node_name = f"allreduce_bandwidth_{galvatron_tag(1, gpus_per_node)}.json"
    lines += [f"{one_node_name}: allreduce_size_{n}_consec_0 (a strided group inside one node; "
              f"groups inside a node are priced from the consecutive fits)"
              for (n, layout) in sorted(_allreduce_figures(one_node.get("allreduce_bandwidth",
                                                                        {})))
              if layout == "strided"]
    return lines


def _assumptions(dtype: str, nodes: int, gpus_per_node: int, one_node: Files,
                 pessimistic_pps: Sequence[int]) -> List[str]:
    """One line per assumption import_hardware makes."""
    lines = [
        f"dtype {dtype} for every point (Galvatron's files do not say)",
        "sp_time sizes read as MiB per rank (nccl-tests' size // 2**20), times as ms",
        "allreduce_bandwidth and p2p_bandwidth figures (nccl-tests' average bus bandwidth over "
        "a size sweep) become fits with alpha 0: the same bus bandwidth at every size",
        "reduce-scatter and all-gather take half an all-reduce's time on the same buffer and "
        "group (alpha / 2, 2 x algbw; Galvatron's own rule for sp_time)",
        "overlap: only overlap_coe is known; compute and communication slowdowns are null",
    ]
    if nodes > 1:
        lines.append("p2p: Galvatron's pipeline groups range(i, W, W/pp) span every node, so each "
                     "pp_size figure is the inter-node link's; intra-node hops of pp come from "
                     "the one-node file's pp_size_{pp / nodes} (same neighbour distance)")
        if one_node:
            lines.append(f"consecutive groups inside a node take the "
                         f"{galvatron_tag(1, gpus_per_node)} sp_time series where the "
                         f"{nodes}-node files have none (a series gives latency and bandwidth, "
                         f"a figure bandwidth only), and its allreduce figures where they have "
                         f"neither")
    if pessimistic_pps:
        lines.append(f"p2p intra-node hops of pp={list(pessimistic_pps)} priced at the "
                     f"multi-node (inter-node) figure: no one-node p2p figure for them "
                     f"(pessimistic)")
    return lines


def import_hardware(in_dir: os.PathLike, *, cluster_name: str, nodes: int, gpus_per_node: int,
                    dtype: str = "bf16") -> Imported:
    """A hardware.json body ({"cluster", "benchmarks"}, without the header) from the Galvatron
    files of the shape `nodes` x `gpus_per_node` in `in_dir` (a directory may hold several
    shapes; on several nodes the one-node files of the same gpus_per_node, when present, give
    the intra-node links). Times in us, bandwidths in GB/s; the Imported record lists the files
    read, the keys that do not map and the assumptions made. ProfileError when the shape is
    missing (naming the shapes found) or a file is corrupt."""
    try:
        dtype = Dtype.parse(dtype).value
    except ValueError as e:
        raise ConfigError(f"import dtype: {e}") from None
    root = Path(in_dir)
    shapes = _shapes(root)
    if (nodes, gpus_per_node) not in shapes:
        raise _shape_error(root, nodes, gpus_per_node, shapes)
    used = shapes[(nodes, gpus_per_node)]
    main = _load_shape(used)
    one_node_paths = shapes.get((1, gpus_per_node), {}) if nodes > 1 else {}
    one_node = _load_shape(one_node_paths)
    overlap_path = root / OVERLAP_FILE
    overlap = _load(overlap_path) if overlap_path.exists() else {}

    benchmarks: Dict[str, Any] = _collectives(main, one_node, gpus_per_node, dtype)
    benchmarks.update(_half_allreduce_sections(benchmarks["allreduce"]["fits"]))
    p2p, pessimistic = _p2p_fits(main, one_node, nodes, gpus_per_node)
    benchmarks["p2p"] = {"points": [], "fits": p2p}
    if "overlap_coe" in overlap:
        benchmarks["overlap"] = {"compute_slowdown": None, "comm_slowdown": None,
                                 "overlap_coe": overlap["overlap_coe"]}
    try:
        checked = HardwareBenchmarks.from_dict(benchmarks, "benchmarks")
    except FieldError as e:
        raise ProfileError(f"Galvatron files in {root} do not make a hardware profile: "
                           f"{e}") from None
    cluster = ClusterSummary(name=cluster_name, nodes=nodes, tasks_per_node=gpus_per_node,
                             backend="nccl", gpus_per_node=gpus_per_node)
    files = (list(used.values()) + list(one_node_paths.values())
             + ([overlap_path] if overlap else []))
    return Imported(body={"cluster": cluster.to_dict(), "benchmarks": checked.to_dict()},
                    files=files,
                    unmapped=_unmapped(main, one_node, overlap, nodes, gpus_per_node),
                    assumptions=_assumptions(dtype, nodes, gpus_per_node, one_node, pessimistic))
