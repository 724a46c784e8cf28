"""Tracing only the representative ranks is enough: every rank's trace is its stage
representative's with the ranks of its groups and peers renamed (issue 13, "Symmetry").

Every rank of three small worlds is traced (WS 16 PP 2 TP 2 with 1F1B; WS 32 PP 4 TP 2
interleaved; WS 16 PP 2 TP 2 CP 2, the ring). A record is normalised by checking its group's
first rank / its peer against the rank order tp, cp, dp, pp (computed here, not asked of the
layout) and then dropping the rank numbers; the normalised streams must be equal within a stage
and CP rank. CP ranks of a stage issue the same attention kernels and messages in a different order (the
ring's half blocks, trace/cp.py), and as many FLOPs.
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache
from typing import Dict, List, Tuple

import pytest

from orchestrator.models.config import ModelConfig
from orchestrator.trace.configs import TraceSettings, TraceSpec, plan_configs
from orchestrator.trace.tracer import trace_rank

TINY = ModelConfig(name="tiny", hidden=128, ffn=384, layers=8, heads=4, kv_heads=2, vocab=512,
                   seq_len=256, dtype="bf16")
# [ws, pp, tp], schedule; GBS 16 with DP 4 gives 4 micro-batches (>= pp for interleaved).
WORLDS = {
    "ws16_pp2_tp2_1f1b": ([16, 2, 2], "1f1b"),
    "ws32_pp4_tp2_interleaved": ([32, 4, 2], "interleaved"),
    "ws16_pp2_tp2_cp2_1f1b": ([16, 2, 2, 2], "1f1b"),
}


def _spec(config, schedule: str, zero: int = 1) -> TraceSpec:
    settings = TraceSettings(global_batch_size=16, micro_batch_size=1, seq_len=256,
                             sequence_parallel=True, schedule=schedule, zero=zero)
    specs, skipped = plan_configs([config], settings, TINY)
    assert not skipped, skipped
    return specs[0]


@lru_cache(maxsize=None)
def _all_traces(world: str) -> Tuple[TraceSpec, Dict[int, List[dict]]]:
    """Every rank's records of one world (traced once per test session)."""
    config, schedule = WORLDS[world]
    spec = _spec(config, schedule)
    return spec, {r: trace_rank(spec, TINY, r).records for r in spec.all_ranks()}


def _coords(rank: int, tp: int, dp: int, cp: int = 1) -> Dict[str, int]:
    """Coordinates of a rank in the rank order tp-cp-dp-pp ("dp_cp": dp x cp, stride tp)."""
    return {"tp": rank % tp, "cp": rank // tp % cp, "dp": rank // (tp * cp) % dp,
            "dp_cp": rank // tp % (cp * dp), "pp": rank // (tp * cp * dp)}


def _expected_group(group: str, tp: int, dp: int, pp: int, cp: int = 1) -> Tuple[int, int]:
    """(size, stride) of a named group in the rank order tp-cp-dp-pp."""
    return {"tp": (tp, 1), "cp": (cp, tp), "dp": (dp, tp * cp), "dp_cp": (dp * cp, tp),
            "pp": (pp, tp * cp * dp), "world": (tp * cp * dp * pp, 1)}[group]


def normalise(record: dict, rank: int, spec: TraceSpec) -> dict:
    """The record without rank numbers, after checking they are the ones this rank's position
    implies: a group by (name, size, stride), a peer by its stage and its offset in ranks."""
    lay = spec.layout
    out = dict(record)
    if record["kind"] == "coll":
        group = record["group"]
        assert "group_ranks" not in record, record  # every mesh group is evenly spaced
        size, stride = _expected_group(group, lay.tp, lay.dp, lay.pp, lay.cp)
        assert (record["group_size"], record["group_stride"]) == (size, stride), record
        position = rank if group == "world" else _coords(rank, lay.tp, lay.dp, lay.cp)[group]
        assert rank - record["group_first"] == position * stride, (rank, record)
        del out["group_first"]
    elif record["kind"] == "p2p" and record["group"] == "cp":
        # the ring: the next CP rank (send) or the previous one (recv), wrapping around
        cp_rank = _coords(rank, lay.tp, lay.dp, lay.cp)["cp"]
        step = 1 if record["op"] == "send" else -1
        assert record["peer"] == rank + ((cp_rank + step) % lay.cp - cp_rank) * lay.tp, record
        out["peer"] = ("cp", step)
    elif record["kind"] == "p2p":
        peer = record["peer"]
        stage, peer_stage = spec.stage_of(rank), spec.stage_of(peer)
        offset = peer - rank
        # Neighbouring stages, or the wrap-around between the last and the first stage of the
        # interleaved schedule (virtual stage pp-1 -> pp).
        assert abs(peer_stage - stage) in (1, lay.pp - 1), (rank, record)
        assert offset == (peer_stage - stage) * lay.tp * lay.cp * lay.dp, (rank, record)
        out["peer"] = ("stage", peer_stage, offset)
    return out


def _as_multiset(records: List[dict]) -> Counter:
    """The messages and the attention kernels (op, FLOPs, phase, micro-batch), without order;
    and the FLOPs of everything. A ring step's half block is the queries' second half against
    the whole block on one CP rank, all queries against the block's first half on another (the
    same FLOPs); the merging and accumulating around it differs in shape, not in FLOPs."""
    def kept_fields(r):
        if r["kind"] == "compute":
            return repr([r["op"], r["flops"], r["phase"], r["mb"], r["chunk"]])
        return repr(sorted((k, v) for k, v in r.items() if k not in ("i", "module")))

    kept = Counter(kept_fields(r) for r in records
                   if r["kind"] != "compute" or "flash_attention" in r["op"])
    kept["flops"] = sum(r.get("flops", 0) for r in records)
    return kept


@pytest.mark.parametrize("world", list(WORLDS))
def test_every_rank_equals_its_stage_representative_up_to_renaming(world):
    spec, traces = _all_traces(world)
    lay = spec.layout
    representative = {spec.stage_of(r): r for r in spec.representative_ranks()}
    assert sorted(representative) == list(range(lay.pp))
    for rank, records in traces.items():
        rep = representative[spec.stage_of(rank)]
        # the rank of its stage with its CP coordinate (tp rank 0, dp rank 0): the same stream
        cp_rank = _coords(rank, lay.tp, lay.dp, lay.cp)["cp"]
        twin = rep + cp_rank * lay.tp
        mine = [normalise(r, rank, spec) for r in records]
        theirs = [normalise(r, twin, spec) for r in traces[twin]]
        assert len(mine) == len(theirs), (rank, twin)
        for a, b in zip(mine, theirs):
            assert a == b, (rank, twin, a, b)
        # and the representative's ops, in another order where the ring's half blocks differ
        if twin != rep:
            assert mine != [normalise(r, rep, spec) for r in traces[rep]]
            assert _as_multiset(mine) == _as_multiset(
                [normalise(r, rep, spec) for r in traces[rep]]), (rank, rep)


@pytest.mark.parametrize("world", list(WORLDS))
def test_raw_streams_differ_by_the_rank_offset(world):
    """Not faked: a non-representative rank's raw records name other ranks, shifted by exactly
    its offset from the representative (peers) or by its offset outside the group (groups)."""
    spec, traces = _all_traces(world)
    lay = spec.layout
    groups = ("tp", "dp_cp") if lay.cp > 1 else ("tp", "dp")  # the ring: p2p, no cp collective
    for rep in spec.representative_ranks():
        # The last rank of the stage: tp rank tp-1, cp rank cp - 1, dp rank dp-1; a group's
        # first rank moves by the rank's move less its move inside the group.
        rank = rep + lay.tp * lay.cp * lay.dp - 1
        shifts = {"pp": rank - rep, "world": 0}
        for group in ("tp", "cp", "dp", "dp_cp"):
            _, stride = _expected_group(group, lay.tp, lay.dp, lay.pp, lay.cp)
            inside = (_coords(rank, lay.tp, lay.dp, lay.cp)[group]
                      - _coords(rep, lay.tp, lay.dp, lay.cp)[group]) * stride
            shifts[group] = rank - rep - inside
        assert traces[rank] != traces[rep]
        compared = dict.fromkeys(("p2p",) + groups, 0)
        for a, b in zip(traces[rank], traces[rep]):
            if a["kind"] == "p2p" and a["group"] == "cp":  # ring neighbours in the CP group
                step = 1 if a["op"] == "send" else -1
                at = [(_coords(r, lay.tp, lay.dp, lay.cp)["cp"] + step) % lay.cp
                      for r in (rank, rep)]
                assert a["peer"] - b["peer"] == shifts["cp"] + (at[0] - at[1]) * lay.tp, (a, b)
                compared["p2p"] += 1
            elif a["kind"] == "p2p":
                assert a["peer"] - b["peer"] == rank - rep, (a, b)
                compared["p2p"] += 1
            elif a["kind"] == "coll":
                assert a["group_first"] - b["group_first"] == shifts[a["group"]], (a, b)
                compared[a["group"]] = compared.get(a["group"], 0) + 1
        assert min(compared.values()) > 0, compared


def _cut_modules(records: List[dict]) -> List[dict]:
    """ModuleTracker's backward attribution is approximate below the block: compare
    "blocks.5.attn" rather than "blocks.5.attn.wq"."""
    return [{**r, "module": ".".join(r["module"].split(".")[:3])} for r in records]


@pytest.mark.parametrize("world", list(WORLDS))
def test_replayed_trace_equals_running_every_micro_batch(world):
    config, schedule = WORLDS[world]
    spec = _spec(config, schedule)
    for rank in spec.representative_ranks()[:2]:
        replayed = trace_rank(spec, TINY, rank, replay=True).records
        live = trace_rank(spec, TINY, rank, replay=False).records
        assert len(replayed) == len(live), rank
        for a, b in zip(_cut_modules(replayed), _cut_modules(live)):
            assert a == b, (rank, a, b)


@pytest.mark.parametrize("world", list(WORLDS))
def test_shared_chunk_captures_give_the_same_traces(world):
    """The stage traces each chunk shape once per run and hands it to every rank with the same
    shape (block numbers and TP group renamed): raw streams equal tracing each rank alone."""
    spec, alone = _all_traces(world)
    captures: dict = {}
    for rank in spec.all_ranks():
        shared = trace_rank(spec, TINY, rank, captures=captures)
        assert shared.records == alone[rank], rank
        assert shared.seconds_alone >= shared.seconds
    # Chunk shapes: the first (embedding) and the last (head) virtual stage, and, in WS 32 PP 4
    # interleaved, virtual stages 1..6 (blocks only).
    # With CP 2 each of the two per CP rank (the order of the ring's half blocks).
    assert len(captures) == {"ws16_pp2_tp2_1f1b": 2, "ws32_pp4_tp2_interleaved": 3,
                             "ws16_pp2_tp2_cp2_1f1b": 4}[world]


def test_first_micro_batch_records_no_sharding_propagation():
    """DTensor runs an op on fake global-shaped tensors the first time it meets it (to learn
    the output's shape); that is not the workload, so the first micro-batch's forward is the
    same op stream as the second's."""
    config, schedule = WORLDS["ws16_pp2_tp2_1f1b"]
    spec = _spec(config, schedule)
    records = trace_rank(spec, TINY, spec.representative_ranks()[1], replay=False).records

    def forward(mb):
        return [(r["op"], r.get("shapes"), r.get("bytes")) for r in records
                if r["phase"] == "F" and r["mb"] == mb and r["kind"] != "p2p"]
    assert forward(0) and forward(0) == forward(1)
