"""Tracing a rank costs the same at any world size: the rank makes only its own TP, DP and PP
groups, and DTensor's mesh holds its TP group, not the world.

Counted, not timed: every process group made while tracing a rank (torch's new_group, which
init_device_mesh also calls once per group of each mesh dimension, member or not), the ranks
each lists, and the ranks each DeviceMesh maps. Before, init_device_mesh made world/tp +
world/dp + world/pp groups and a mesh of world_size ranks per rank traced (62 s for the 8
representatives at 1,000,000 ranks).
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch.distributed as dist
from test_trace_symmetry import normalise
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from orchestrator.layout import ParallelLayout
from orchestrator.models.config import ModelConfig
from orchestrator.trace.configs import TraceSettings, TraceSpec, plan_configs
from orchestrator.trace.tracer import fake_world, trace_rank

TINY = ModelConfig(name="tiny", hidden=128, ffn=384, layers=8, heads=4, kv_heads=4, vocab=512,
                   seq_len=256, dtype="bf16")
PP, TP = 4, 4
SMALL_WORLD, HUGE_WORLD = 64, 1 << 20  # DP 4 and DP 65536


def _spec(world_size: int) -> TraceSpec:
    dp = world_size // (PP * TP)
    settings = TraceSettings(global_batch_size=dp * PP, micro_batch_size=1, seq_len=256,
                             sequence_parallel=True, zero=1)
    specs, skipped = plan_configs([[world_size, PP, TP]], settings, TINY)
    assert not skipped, skipped
    return specs[0]


def traced_with_counts(spec: TraceSpec, rank: int, monkeypatch,
                       model: ModelConfig = TINY) -> Dict[str, object]:
    """Trace `rank` of `model`; the size of every process group made meanwhile and of every
    DeviceMesh's rank map (test_trace_moe.py's MoE ranks too)."""
    groups: List[int] = []
    mesh_ranks: List[int] = []
    new_group = distributed_c10d._new_group_with_tag
    mesh_init = DeviceMesh.__init__

    def new_group_counting(ranks=None, *args, **kwargs):
        groups.append(spec.world_size if ranks is None else len(ranks))
        return new_group(ranks, *args, **kwargs)

    def mesh_init_counting(self, *args, **kwargs):
        mesh_init(self, *args, **kwargs)
        # What DTensor hashes and compares mesh by mesh (every submesh keeps its root's).
        mesh_ranks.append(self._rank_map.numel())

    # Every new_group, dist.new_group's and init_device_mesh's, goes through this one.
    monkeypatch.setattr(distributed_c10d, "_new_group_with_tag", new_group_counting)
    monkeypatch.setattr(DeviceMesh, "__init__", mesh_init_counting)
    records = trace_rank(spec, model, rank).records
    monkeypatch.undo()
    return {"records": records, "groups": sorted(groups), "mesh_ranks": mesh_ranks}


def test_a_rank_makes_only_its_own_groups_at_any_world_size(monkeypatch):
    small, huge = _spec(SMALL_WORLD), _spec(HUGE_WORLD)
    counts = {}
    for spec in (small, huge):
        rank = spec.representative_ranks()[1]
        counts[spec.world_size] = traced = traced_with_counts(spec, rank, monkeypatch)
        lay = spec.layout
        # Its PP, DP and TP groups, nothing else: as many groups and mesh ranks at 1,048,576
        # ranks as at 64; only the DP group itself grows (it has DP members).
        assert traced["groups"] == sorted([lay.pp, lay.dp, lay.tp]), spec.world_size
        assert traced["mesh_ranks"] and max(traced["mesh_ranks"]) == lay.tp, spec.world_size
        # The groups in the records are the ones this rank's position implies, "world" and "dp"
        # included (checked against rank arithmetic of its own, test_trace_symmetry.normalise).
        for record in traced["records"]:
            normalise(record, rank, spec)
        assert {r["group"] for r in traced["records"] if r["kind"] == "coll"} \
            == {"tp", "dp", "world"}
    assert len(counts[SMALL_WORLD]["groups"]) == len(counts[HUGE_WORLD]["groups"])
    assert len(counts[SMALL_WORLD]["records"]) == len(counts[HUGE_WORLD]["records"])


@pytest.mark.parametrize("world_size,pp,tp", [(24, 2, 3), (16, 1, 16), (8, 8, 1), (12, 3, 1)])
def test_layout_groups_are_the_ones_train_s_device_mesh_gives(world_size, pp, tp):
    """ParallelLayout.group_ranks (what trace builds its groups from) equals the groups of the
    (pp, dp, tp) DeviceMesh train builds, rank by rank."""
    dp = world_size // (pp * tp)
    layout = ParallelLayout(world_size=world_size, pp=pp, tp=tp, dp=dp,
                            layers_per_stage=(1,) * pp)
    for rank in range(world_size):
        with fake_world(rank, world_size):
            mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
            for dim in ("pp", "dp", "tp"):
                assert list(layout.group_ranks(dim, rank)) \
                    == dist.get_process_group_ranks(mesh[dim].get_group()), (rank, dim)
                assert layout.coordinate(rank, dim) == mesh.get_local_rank(dim), (rank, dim)
        assert list(layout.group_ranks("world", rank)) == list(range(world_size))
