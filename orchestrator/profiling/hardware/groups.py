"""Which ranks talk to which: collective groups by layout and pipeline send/recv pairs.

Layouts (docs/profile-schema.md):
- "consec": groups [i*s, (i+1)*s), the tensor-parallel-like layout (neighbours on one node first);
- "strided": groups range(i, W, W/s), the data-parallel-like layout (one rank per block of W/s);
- p2p pairs are "intra" (same node) or "inter" (different nodes).
Pipeline stages follow Megatron's rank order (pp outermost): with pp stages, stage = rank // (W/pp)
and a rank's neighbours are rank - W/pp and rank + W/pp.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from orchestrator.errors import ConfigError

LAYOUTS = ("consec", "strided")
P2P_LAYOUTS = ("intra", "inter")


def _check_world(world_size: int) -> None:
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")


def check_group_size(world_size: int, group_size: int) -> None:
    """Raise ConfigError unless `group_size` ranks tile a world of `world_size` ranks."""
    _check_world(world_size)
    if group_size < 1:
        raise ConfigError(f"group size must be >= 1, got {group_size}")
    if group_size > world_size:
        raise ConfigError(f"group size ({group_size}) > world size ({world_size}): "
                          f"ask for group sizes up to {world_size}")
    if world_size % group_size:
        raise ConfigError(f"group size ({group_size}) does not divide world size ({world_size}): "
                          f"groups of {group_size} cannot cover all ranks")


def group_sizes(world_size: int, max_size: Optional[int] = None) -> List[int]:
    """Group sizes to benchmark: 2, 4, 8, ... dividing `world_size`, plus `world_size` itself
    when it is not a power of two; all capped at `max_size` (e.g. the largest TP degree)."""
    _check_world(world_size)
    cap = world_size if max_size is None else min(world_size, max_size)
    sizes = []
    s = 2
    while s <= cap:
        if world_size % s == 0:
            sizes.append(s)
        s *= 2
    if world_size <= cap and world_size >= 2 and world_size not in sizes:
        sizes.append(world_size)
    return sizes


def layouts_for(world_size: int, group_size: int) -> Tuple[str, ...]:
    """The distinct layouts of groups of `group_size`: a group of the whole world (or of one rank)
    is the same set of ranks in both layouts, so it is measured once, as "consec"."""
    check_group_size(world_size, group_size)
    if group_size in (1, world_size):
        return ("consec",)
    return LAYOUTS


def consec_groups(world_size: int, group_size: int) -> List[List[int]]:
    """Groups [i*s, (i+1)*s) for i in range(W/s): global ranks of each group, in rank order."""
    check_group_size(world_size, group_size)
    return [list(range(i * group_size, (i + 1) * group_size))
            for i in range(world_size // group_size)]


def strided_groups(world_size: int, group_size: int) -> List[List[int]]:
    """Groups range(i, W, W/s) for i in range(W/s): global ranks of each group, ascending."""
    check_group_size(world_size, group_size)
    stride = world_size // group_size
    return [list(range(i, world_size, stride)) for i in range(stride)]


def groups_for(layout: str, world_size: int, group_size: int) -> List[List[int]]:
    """All groups of `group_size` in `layout` ("consec" or "strided"); they partition the world."""
    if layout == "consec":
        return consec_groups(world_size, group_size)
    if layout == "strided":
        return strided_groups(world_size, group_size)
    raise ConfigError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")


def check_pp(world_size: int, pp: int) -> None:
    """Raise ConfigError unless `pp` pipeline stages split `world_size` ranks evenly (pp >= 2)."""
    _check_world(world_size)
    if pp < 2:
        raise ConfigError(f"pp must be >= 2 for send/recv between stages, got {pp}")
    if pp > world_size:
        raise ConfigError(f"pp ({pp}) > world size ({world_size}): at most one rank per stage")
    if world_size % pp:
        raise ConfigError(f"pp ({pp}) does not divide world size ({world_size}): "
                          f"stages would hold unequal numbers of ranks")


def pp_sizes(world_size: int, max_pp: Optional[int] = None) -> List[int]:
    """Pipeline degrees to benchmark: 2, 4, 8, ... dividing `world_size`, up to `max_pp`."""
    _check_world(world_size)
    cap = world_size if max_pp is None else min(world_size, max_pp)
    sizes = []
    pp = 2
    while pp <= cap:
        if world_size % pp == 0:
            sizes.append(pp)
        pp *= 2
    return sizes


def stage_of_rank(rank: int, world_size: int, pp: int) -> int:
    """Pipeline stage (0..pp-1) of `rank` when pp is the outermost dimension: rank // (W/pp)."""
    check_pp(world_size, pp)
    return rank // (world_size // pp)


def pp_neighbours(rank: int, world_size: int, pp: int) -> Tuple[Optional[int], Optional[int]]:
    """(previous-stage rank, next-stage rank) of `rank`; None at the first / last stage."""
    stage = stage_of_rank(rank, world_size, pp)
    step = world_size // pp
    prev_rank = rank - step if stage > 0 else None
    next_rank = rank + step if stage < pp - 1 else None
    return prev_rank, next_rank


def p2p_pairs(world_size: int, pp: int) -> List[Tuple[int, int]]:
    """Every (sender stage rank, next stage rank) pair of a pp-stage pipeline, ascending."""
    check_pp(world_size, pp)
    step = world_size // pp
    return [(r, r + step) for r in range(world_size - step)]


def check_node_of_rank(node_of_rank: Sequence[int], world_size: int) -> None:
    """Raise ConfigError unless `node_of_rank` names one node id for each of `world_size` ranks."""
    if len(node_of_rank) != world_size:
        raise ConfigError(f"node_of_rank has {len(node_of_rank)} entries for a world of "
                          f"{world_size} ranks: it needs one node id per rank")


def pair_layout(pair: Tuple[int, int], node_of_rank: Sequence[int]) -> str:
    """"intra" when both ranks of `pair` are on the same node, else "inter"."""
    a, b = pair
    return "intra" if node_of_rank[a] == node_of_rank[b] else "inter"


def p2p_pairs_by_layout(world_size: int, pp: int,
                        node_of_rank: Sequence[int]) -> Dict[str, List[Tuple[int, int]]]:
    """The pairs of a pp-stage pipeline split by layout: {"intra": [...], "inter": [...]}; a layout
    with no pair is absent."""
    check_node_of_rank(node_of_rank, world_size)
    by_layout: Dict[str, List[Tuple[int, int]]] = {}
    for pair in p2p_pairs(world_size, pp):
        by_layout.setdefault(pair_layout(pair, node_of_rank), []).append(pair)
    return {layout: by_layout[layout] for layout in P2P_LAYOUTS if layout in by_layout}


