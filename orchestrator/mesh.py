"""One rank's device meshes and process groups of a ParallelLayout, by Group (choices.Group).

Two ways to make them, one result (LayoutMesh), the same members in every group:
- `build_mesh` (ParallelLayout.build_mesh; train): init_device_mesh over the dense grid
  (pp, dp, cp or cp_ring x cp_a2a, tp; a degree-1 cp left out) with cp (a2a+p2p), dp_cp (the
  replicas) and tp_cp (a MoE model's sequence ranks) flattened from it, and the expert grid
  (pp, edp, ep, etp). A real backend needs every rank to make every group, so every rank of the
  world calls it (as torchtitan's ParallelDims.build_mesh, Megatron's HyperCommGrid).
- `rank_mesh` (trace): only one rank's groups (ParallelLayout.rank_groups), each made by
  dist.new_group of its own members, and 1-D DeviceMeshes over those groups alone. Torch's fake
  backend needs no other rank to make a group, so this costs the same at 1,000,000 ranks as at 8
  (init_device_mesh would make world/tp + world/dp + world/pp groups and a mesh that DTensor
  compares rank by rank).
tests/test_layout.py checks that both give every rank the members ParallelLayout.group_ranks
says.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch.distributed as dist

from orchestrator.choices import CpComm, Group

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# The groups a captured trace chunk can hold that are an expert grid's (their own process
# groups even where their ranks are a dense group's: ep = tp, edp = dp).
EXPERT_GROUPS = (Group.etp, Group.ep, Group.edp)


@dataclass
class LayoutMesh:
    """One rank's process groups by Group and the DeviceMeshes its parameters are placed on."""

    layout: object  # the ParallelLayout (not imported: layout.py imports this module)
    device_type: str
    groups: Dict[Group, dist.ProcessGroup]
    # 1-D DeviceMeshes by group: build_mesh's every dimension and flattened one; rank_mesh's TP
    # one, the others made from their group on first use (`mesh`).
    meshes: Dict[Group, "DeviceMesh"] = field(default_factory=dict)
    # The ep x etp block of the expert grid the routed experts are placed on (dims of size 1
    # left out; None when ep = etp = 1 or the model is dense).
    experts: Optional["DeviceMesh"] = None

    def group(self, name: Group) -> dist.ProcessGroup:
        """The process group of Group `name`; KeyError naming the groups this rank has."""
        try:
            return self.groups[name]
        except KeyError:
            raise KeyError(f"no {name} group in this layout's mesh (it has "
                           f"{', '.join(self.groups)})") from None

    def mesh(self, name: Group) -> "DeviceMesh":
        """The 1-D DeviceMesh over Group `name`'s ranks (DTensors, FSDP)."""
        if name not in self.meshes:
            from torch.distributed.device_mesh import DeviceMesh

            self.meshes[name] = DeviceMesh.from_group(self.group(name), self.device_type,
                                                      mesh_dim_names=(name.value,))
        return self.meshes[name]

    def ranks(self, name: Group) -> Tuple[int, ...]:
        """The global ranks of Group `name` (the process group's own list)."""
        return tuple(dist.get_process_group_ranks(self.group(name)))

    def sequence_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks holding the other tokens of this rank's sequences (TP's sequence shards,
        CP's chunks): tp_cp, or tp or cp where only one of them is > 1; None when neither."""
        layout = self.layout
        if layout.tp > 1 and layout.cp > 1:
            return self.group(Group.tp_cp)
        if layout.tp > 1 or layout.cp > 1:
            return self.group(Group.tp if layout.tp > 1 else Group.cp)
        return None


def dense_dims(layout) -> Tuple[Tuple[Group, int], ...]:
    """The dense grid's (Group, size) dimensions, slowest first: pp, dp, the CP dimension (as
    cp_ring x cp_a2a for a2a+p2p; none when cp is 1), tp."""
    if layout.cp_comm == CpComm["a2a+p2p"]:
        cp = ((Group.cp_ring, layout.cp // layout.cp_a2a), (Group.cp_a2a, layout.cp_a2a))
    else:
        cp = ((Group.cp, layout.cp),) if layout.cp > 1 else ()
    return ((Group.pp, layout.pp), (Group.dp, layout.dp), *cp, (Group.tp, layout.tp))


def expert_dims(layout) -> Tuple[Tuple[Group, int], ...]:
    """The expert grid's (Group, size) dimensions, slowest first: pp, edp, ep, etp."""
    return ((Group.pp, layout.pp), (Group.edp, layout.edp), (Group.ep, layout.ep),
            (Group.etp, layout.etp))


def mesh_dims(layout, experts: bool = False) -> Dict[Group, Tuple[bool, Tuple[Group, ...]]]:
    """Each group build_mesh makes but world, as (on the expert grid?, the grid dimensions it
    spans, slowest first): a dimension of its own, or several flattened into one (cp over
    cp_ring x cp_a2a, dp_cp over dp and the CP dimensions, tp_cp over those and tp). Pure: the
    tests hold it to ParallelLayout.group_ranks at any world size."""
    dense = tuple(name for name, _ in dense_dims(layout))
    cp = dense[2:-1]  # between dp and tp: none, cp, or cp_ring x cp_a2a
    out = {name: (False, (name,)) for name in dense}
    if len(cp) > 1:
        out[Group.cp] = (False, cp)
    if cp:
        out[Group.dp_cp] = (False, (Group.dp,) + cp)
    if experts:
        out.update({name: (True, (name,)) for name in EXPERT_GROUPS})
        if Group.tp_cp in layout.groups(experts=True):
            out[Group.tp_cp] = (False, cp + (Group.tp,))
    return out


def build_mesh(layout, device_type: str, experts: bool = False) -> LayoutMesh:
    """Every group of the layout (ParallelLayout.groups) on every rank, from init_device_mesh
    over the dense grid and the expert grid (mesh_dims); collective: every rank of the world
    calls it, in the same order."""
    from torch.distributed.device_mesh import init_device_mesh

    def grid(dims):
        return init_device_mesh(device_type, tuple(n for _, n in dims),
                                mesh_dim_names=tuple(g.value for g, _ in dims))

    grids = {False: grid(dense_dims(layout))}
    if experts:
        grids[True] = grid(expert_dims(layout))
    meshes = {}
    for name, (on_experts, dims) in mesh_dims(layout, experts).items():
        sub = grids[on_experts][tuple(d.value for d in dims)]
        meshes[name] = sub if len(dims) == 1 else sub._flatten(name.value)
    expert_mesh = None
    if experts:
        placed = tuple(g.value for g, n in expert_dims(layout)[2:] if n > 1)
        expert_mesh = grids[True][placed] if placed else None
    groups = {Group.world: dist.group.WORLD,
              **{name: mesh.get_group() for name, mesh in meshes.items()}}
    return LayoutMesh(layout, device_type, groups, meshes, expert_mesh)


def rank_mesh(layout, rank: int, device_type: str = "cpu", experts: bool = False) -> LayoutMesh:
    """`rank`'s own groups only (module doc: for torch's fake backend, where dist.new_group
    needs only the group's members): the default group where a group spans the world (as
    init_device_mesh does), none for an expert dimension of size 1 (nothing is sent over it),
    and the DeviceMeshes over its TP group and its ep x etp block of the expert grid."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.group.WORLD
    groups: Dict[Group, dist.ProcessGroup] = {}
    for name, ranks in layout.rank_groups(rank, experts).items():
        if name in (Group.ep, Group.etp) and len(ranks) == 1:
            continue
        groups[name] = world if len(ranks) == layout.world_size else dist.new_group(list(ranks))
    out = LayoutMesh(layout, device_type, groups)
    out.mesh(Group.tp)
    dims = tuple(name for name in (Group.ep, Group.etp) if name in groups)
    if dims:
        import torch

        # this rank's ep x etp block of the expert grid (etp fastest): its ranks only
        first = layout.group_ranks(Group.ep, rank)[0] - layout.coordinate(rank, Group.etp)
        block = torch.arange(layout.ep * layout.etp).view(layout.ep, layout.etp) + first
        out.experts = DeviceMesh.from_group(
            [groups[d] for d in dims] if len(dims) == 2 else groups[dims[0]], device_type,
            mesh=(block if len(dims) == 2 else block.flatten()).tolist(),
            mesh_dim_names=tuple(d.value for d in dims))
    return out
