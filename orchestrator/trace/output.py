"""What a trace writes: per configuration folder, per traced rank `fake_rank_<r>.jsonl` (a record
per line) and `fake_rank_<r>.log` (the same, one readable line each), `summary.json`; one
`trace/index.json` over every configuration. Every file is written atomically."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable, List

from orchestrator.store import atomic_write, read_json, write_json


def _group_text(r: dict) -> str:
    if "group_ranks" in r:
        return f"{r['group']}{r['group_ranks']}"
    return f"{r['group']}(n={r['group_size']} first={r['group_first']} " \
           f"stride={r['group_stride']})"


def log_line(r: dict) -> str:
    """One record as a line: index, phase, micro-batch, chunk, op and its details."""
    mb = "-" if r.get("mb") is None else r["mb"]
    chunk = "-" if r.get("chunk") is None else r["chunk"]
    head = f"{r['i']:>7} {r['phase']:<9} mb={mb:<4} c={chunk:<2} "
    if r["kind"] == "compute":
        shapes = "x".join(str(s) for s in r["shapes"]) or "()"
        return (head + f"COMP {r['op']:<40} {r.get('module') or '-':<24} {shapes} -> "
                f"{r['out_shapes'][0] if r['out_shapes'] else '()'} {r['dtype']} "
                f"flops={r['flops']} bytes={r['bytes']} "
                f"time_us={r.get('time_us', 0.0):.3f} [{r.get('time_source', '')}]")
    if r["kind"] == "coll":
        return (head + f"COLL {r['op']:<15} {_group_text(r)} bytes={r['bytes']} {r['dtype']} "
                f"{r.get('module') or '-'}")
    return (head + f"P2P  {r['op']:<5} peer={r['peer']} bytes={r['bytes']} {r['dtype']} "
            f"shape={r['shape']} tag={r['tag']}")


def write_rank(folder: Path, rank: int, records: List[dict]) -> List[Path]:
    """fake_rank_<rank>.jsonl and .log in `folder`."""
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    jsonl = atomic_write(folder / f"fake_rank_{rank}.jsonl",
                         lambda f: f.write("".join(dumps(r) + "\n" for r in records)))
    log = atomic_write(folder / f"fake_rank_{rank}.log",
                       lambda f: f.write("".join(log_line(r) + "\n" for r in records)))
    return [jsonl, log]


def rank_totals(records: Iterable[dict]) -> Dict[str, Dict[str, float]]:
    """Counts and bytes per collective type (op/group) and per p2p direction, and the compute
    totals (ops, FLOPs, time_us) of one rank."""
    out: Dict[str, Dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    compute = {"count": 0, "flops": 0, "time_us": 0.0}
    for r in records:
        if r["kind"] == "compute":
            compute["count"] += 1
            compute["flops"] += r["flops"]
            compute["time_us"] += r.get("time_us", 0.0)
        else:
            key = f"{r['op']}/{r['group']}" if r["kind"] == "coll" else f"p2p_{r['op']}"
            out[key]["count"] += 1
            out[key]["bytes"] += r["bytes"]
    return {"compute": compute, **dict(sorted(out.items()))}


def read_index(index_path: Path) -> dict:
    """trace/index.json: `configurations` (folder name -> state and details) and `parts` (ledger
    sub-part -> what it was made under); a new one when missing or corrupt."""
    index = {"configurations": {}, "parts": {}}
    if index_path.exists():
        try:
            index = read_json(index_path)
        except ValueError:
            pass  # corrupt: rebuilt from this run (the ledger then retraces every part)
    index.setdefault("configurations", {})
    index.setdefault("parts", {})
    return index


def write_index(index_path: Path, index: dict) -> Path:
    return write_json(index_path, index)
