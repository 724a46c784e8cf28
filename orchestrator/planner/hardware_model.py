"""HardwareModel: a hardware profile (orchestrator.store.schema) as the cost model asks it, "how
long does this collective take on a group of n ranks laid out like this", from the profile's
fitted lines per op and rank layout (consecutive or strided, within or across nodes). Built from
the validated profile dataclass (`from_profile`; `from_dict` validates a loaded JSON dict first);
holds no file handles.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Tuple

import numpy as np

from orchestrator.bandwidth import busbw_factor, half_allreduce_line
from orchestrator.choices import Op
from orchestrator.commands import rerun_command
from orchestrator.errors import ProfileError
from orchestrator.store import parse_profile
from orchestrator.store.schema import HardwareProfile

COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather", "all2all")
OPS = COLLECTIVES + ("p2p",)


@dataclass(frozen=True)
class LinkFit:
    """One alpha-beta fit: time_us(size) = alpha_us + size_bytes / (algbw_GBps * 1e3)."""

    group_size: int
    alpha_us: float
    algbw_GBps: float


def group_span(group_size: int, stride: int, tasks_per_node: int) -> Tuple[int, int]:
    """(nodes, members_per_node) of a group of `group_size` ranks `stride` apart in Megatron rank
    order (ranks r, r + stride, ...) on nodes of `tasks_per_node` consecutive ranks."""
    per_node = min(group_size, max(1, tasks_per_node // stride))
    return -(-group_size // per_node), per_node


def _fit_line(fit: LinkFit) -> Tuple[float, float]:
    return fit.alpha_us, 1.0 / (fit.algbw_GBps * 1e3)


def _half_fit(fit: LinkFit) -> LinkFit:
    """A reduce-scatter / all-gather fit from an all-reduce's (the stated half rule)."""
    return LinkFit(fit.group_size, *half_allreduce_line(fit.alpha_us, fit.algbw_GBps))


def _none_moves(size_bytes) -> bool:
    """True when no buffer of `size_bytes` (a float, or a numpy array of sizes: the dynamic
    planner's micro-batches) has a byte to move (the search's scalars take the cheap test)."""
    if isinstance(size_bytes, np.ndarray):
        return not (size_bytes > 0).any()
    return size_bytes <= 0


def _linear_us(line: Tuple[float, float], size_bytes):
    """alpha + size x us_per_byte of a (alpha_us, us_per_byte) line, 0 for an empty buffer (a
    float, or a numpy array of sizes)."""
    alpha_us, us_per_byte = line
    if isinstance(size_bytes, np.ndarray):
        return np.where(size_bytes > 0, alpha_us + size_bytes * us_per_byte, 0.0)
    return alpha_us + size_bytes * us_per_byte if size_bytes > 0 else 0.0


def _pick_line(op: str, fits: Tuple[LinkFit, ...], group_size: int) -> Tuple[float, float]:
    """(alpha_us, us_per_byte) from fits sorted by group size: the exact size, else the nearest
    larger, else ring extrapolation from the largest (p2p: the largest as is)."""
    i = bisect_left([f.group_size for f in fits], group_size)
    if i < len(fits):
        return _fit_line(fits[i])
    fit = fits[-1]
    if op == "p2p":
        return _fit_line(fit)
    n0, n = fit.group_size, group_size
    busbw = fit.algbw_GBps * busbw_factor(op, n0) if n0 > 1 else fit.algbw_GBps
    algbw = busbw / busbw_factor(op, n)
    alpha = fit.alpha_us * (n - 1) / (n0 - 1) if n0 > 1 else fit.alpha_us * (n - 1)
    return alpha, 1.0 / (algbw * 1e3)


class HardwareModel:
    """Collective and point-to-point times from a hardware profile's alpha-beta fits.

    A group of n ranks `stride` apart (Megatron rank order: tp groups stride 1, dp groups stride
    tp) spans k nodes with m = n / k members on each (group_span). Its collective is priced
    (collective_line / collective_time_us) by the first rule that applies:
    1. k == 1 (inside a node): the intra-node "consec" fits by the size rule below.
    2. a measured fit with the same (k, m): a "consec" fit of size n' spans ceil(n' / tpn) nodes
       with min(n', tpn) on each; a "strided" fit of size n' was measured on the profiled world W
       as range(i, W, W / n'), i.e. stride W / n'.
    3. the profile has fits spanning nodes: the hierarchical composition of a ring inside each
       node and one across nodes, for a per-rank buffer of S bytes:
         all-reduce(k, m, S) = all-reduce(1, m, S) + all-reduce(k, 1, S / m)
       (reduce-scatter inside the node, all-reduce of each 1/m shard across nodes, all-gather
       inside the node, priced as the intra all-reduce), and likewise reduce-scatter (intra
       reduce-scatter, then across nodes on S / m) and all-gather (across nodes on S / m, then
       inside). The across-nodes part comes from the fits with one member per node, by the size
       rule over k; a profile without such fits prices the group by the size rule over its
       fits spanning nodes instead (a pessimistic stand-in).
    4. no fit spans nodes (a one-node profile planned on more nodes): the layout group_layout
       names, by the size rule (what the search's note about extrapolation warns of).
    Across nodes, a reduce-scatter / all-gather signature measured only as an all-reduce is
    derived from it by half_allreduce_line (profile_hardware measures them inside a node only;
    Galvatron not at all).

    Size rule, `time_us(op, group_size, layout, size_bytes)`: the fit measured for exactly that
    (op, layout, group_size); else the nearest larger group measured with that layout (a
    pessimistic stand-in); beyond the largest measured group, ring extrapolation from the
    largest: bus bandwidth stays constant (algbw = busbw / factor(n)) and latency grows with the
    ring's steps (alpha * (n - 1) / (n0 - 1)). A layout that was never measured falls back to
    the other layout. p2p fits are looked up by "intra"/"inter" with the group size exact, else
    nearest larger, else largest (p2p does not grow with the pipeline).
    """

    def __init__(self, tasks_per_node: int, world_size: int, overlap_coe: float,
                 fits: Mapping[Tuple[str, str], Tuple[LinkFit, ...]], name: str = "cluster"):
        if tasks_per_node < 1:
            raise ProfileError(f"hardware profile of {name}: tasks_per_node must be >= 1, got "
                               f"{tasks_per_node}")
        self.name = name
        self.tasks_per_node = int(tasks_per_node)
        self.world_size = int(world_size)
        # A slowdown below 1 would make overlapping faster than running alone: treat as 1.
        self.overlap_coe = max(1.0, float(overlap_coe))
        self._fits = {key: tuple(sorted(v, key=lambda f: f.group_size)) for key, v in fits.items()}
        self._cache: Dict[Tuple[str, int, str], Tuple[float, float]] = {}
        self._group_cache: Dict[Tuple[str, int, int], Tuple[float, float]] = {}
        self._spanning = {op: self._spanning_fits(op) for op in COLLECTIVES}

    def _fit_span(self, layout: str, group_size: int) -> Tuple[int, int]:
        """(nodes, members_per_node) of a measured group (rule 2 of the class docstring)."""
        stride = 1 if layout == "consec" else max(1, self.world_size // group_size)
        return group_span(group_size, stride, self.tasks_per_node)

    def _spanning_fits(self, op: str) -> Dict[Tuple[int, int], LinkFit]:
        """{(nodes, members_per_node): fit} of `op`'s measured groups spanning nodes ("consec"
        first), completed from the all-reduce's by the half rule for reduce-scatter/all-gather."""
        def spanning(of: str) -> Dict[Tuple[int, int], LinkFit]:
            found: Dict[Tuple[int, int], LinkFit] = {}
            for layout in ("consec", "strided"):
                for fit in self._fits.get((of, layout), ()):
                    span = self._fit_span(layout, fit.group_size)
                    if span[0] > 1:
                        found.setdefault(span, fit)
            return found

        own = spanning(op)
        if op not in ("reduce_scatter", "all_gather"):
            return own
        derived = {span: _half_fit(fit) for span, fit in spanning("allreduce").items()}
        return {**derived, **own}

    @classmethod
    def from_profile(cls, hardware: HardwareProfile) -> "HardwareModel":
        """Build from a validated hardware profile."""
        cluster = hardware.cluster
        fits: Dict[Tuple[str, str], list] = {}
        for fit in hardware.benchmarks.fits():
            fits.setdefault((fit.op.value, fit.layout.value), []).append(
                LinkFit(fit.group_size, fit.alpha_us, fit.algbw_GBps))
        overlap = hardware.benchmarks.overlap
        return cls(tasks_per_node=cluster.tasks_per_node, world_size=cluster.world_size,
                   overlap_coe=overlap.overlap_coe if overlap else 1.0,
                   fits={k: tuple(v) for k, v in fits.items()}, name=cluster.name)

    @classmethod
    def from_dict(cls, hardware: Mapping[str, Any]) -> "HardwareModel":
        """Build from a loaded hardware.json dict (validated as a HardwareProfile)."""
        return cls.from_profile(parse_profile(hardware, HardwareProfile, "hardware profile"))

    # ---------------------------------------------------------------- lookup
    def _line(self, op: str, group_size: int, layout: str) -> Tuple[float, float]:
        """(alpha_us, us_per_byte) for the group, by the size rule in the class docstring."""
        key = (op, group_size, layout)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        fits = self._fits.get((op, layout))
        if not fits:
            other = {"consec": "strided", "strided": "consec",
                     "intra": "inter", "inter": "intra"}.get(layout)
            fits = self._fits.get((op, other))
        if not fits:  # every benchmark it lacks in one command, not one per search
            measured = {o for o, _ in self._fits}
            missing = [o.value for o in Op if o.value not in measured] or [op]
            needs = "" if missing == [op] else f" (this one needs {op})"
            fix = rerun_command("profile_hardware",
                                f"profile_hardware.benchmarks=[{','.join(missing)}]")
            raise ProfileError(f"hardware profile of {self.name} has no fits for "
                               f"{', '.join(missing)}{needs}; rerun `{fix}`")
        line = _pick_line(op, fits, group_size)
        self._cache[key] = line
        return line

    def time_us(self, op: str, group_size: int, layout: str, size_bytes: float) -> float:
        """Time in us of one `op` on a group of `group_size` ranks in `layout` ("consec" |
        "strided" for collectives, "intra" | "inter" for p2p) with a per-rank buffer of
        `size_bytes` (nccl-tests convention; a float or a numpy array of sizes). A group of one
        rank costs nothing."""
        if group_size <= 1 and op != "p2p":
            return 0.0
        if _none_moves(size_bytes):
            return 0.0
        return _linear_us(self._line(op, int(group_size), layout), size_bytes)

    def group_layout(self, group_size: int, stride: int) -> str:
        """Measured layout standing for a group of `group_size` ranks `stride` apart when the
        profile has no fit spanning nodes (rule 4 of the class docstring): "consec" inside a
        node or several members per node, "strided" when every member is on its own node."""
        if group_size * stride <= self.tasks_per_node:
            return "consec"
        if stride >= self.tasks_per_node:
            return "strided"
        return "consec"

    def collective_line(self, op: str, group_size: int, stride: int) -> Tuple[float, float]:
        """(alpha_us, us_per_byte) of `op` on a group of `group_size` ranks `stride` apart, by
        the topology rules of the class docstring, so a caller can price many sizes at once;
        (0, 0) for a group of one rank."""
        if group_size <= 1:
            return 0.0, 0.0
        key = (op, int(group_size), int(stride))
        hit = self._group_cache.get(key)
        if hit is None:
            hit = self._group_cache[key] = self._topology_line(op, *key[1:])
        return hit

    def _topology_line(self, op: str, group_size: int, stride: int) -> Tuple[float, float]:
        nodes, per_node = group_span(group_size, stride, self.tasks_per_node)
        spanning = self._spanning.get(op, {})
        if nodes == 1:
            return self._line(op, group_size, "consec")
        if not spanning:
            return self._line(op, group_size, self.group_layout(group_size, stride))
        fit = spanning.get((nodes, per_node))
        if fit is not None:
            return _fit_line(fit)
        across = tuple(sorted((f for (_, m), f in spanning.items() if m == 1),
                              key=lambda f: f.group_size))
        if not across:  # no one-per-node group measured: the spanning fits by the size rule
            return _pick_line(op, tuple(sorted(spanning.values(), key=lambda f: f.group_size)),
                              group_size)
        inter_alpha, inter_per_byte = _pick_line(op, across, nodes)
        intra_alpha, intra_per_byte = (self._line(op, per_node, "consec") if per_node > 1
                                       else (0.0, 0.0))
        return intra_alpha + inter_alpha, intra_per_byte + inter_per_byte / per_node

    def collective_time_us(self, op: str, group_size: int, stride: int,
                           size_bytes: float) -> float:
        """Time in us of `op` on a group of `group_size` ranks `stride` apart (tp groups: stride 1;
        Megatron dp groups: stride tp) for a per-rank buffer of `size_bytes` (a float or a numpy
        array of sizes)."""
        if group_size <= 1 or _none_moves(size_bytes):
            return 0.0
        return _linear_us(self.collective_line(op, group_size, stride), size_bytes)

    def all2all_line(self, group_size: int, stride: int) -> Tuple[float, float]:
        """(alpha_us, us_per_byte) of an all-to-all on `group_size` ranks `stride` apart for a
        per-rank buffer (its whole send buffer), by topology: inside a node, or a measured fit
        of the same nodes x members (rules 1 and 2 of the class docstring); across nodes
        otherwise as two parts that run at once, the slower setting the time: the (m - 1) / n
        of the buffer for the node's other members over the intra-node all-to-all fit of m
        ranks, and the (n - m) / n leaving the node through the rank's own NIC at the bus
        bandwidth of an all-reduce with one rank per node over those nodes (profile_hardware
        measures all-to-all over consecutive groups only, up to its max_tp; an all-to-all's
        off-node bytes do not shrink with m as a ring's do). A profile without fits spanning
        nodes falls back to collective_line (rule 4)."""
        if group_size <= 1:
            return 0.0, 0.0
        nodes, per_node = group_span(group_size, stride, self.tasks_per_node)
        measured = self._spanning.get("all2all", {}).get((nodes, per_node))
        if nodes == 1 or measured is not None:
            return self.collective_line("all2all", group_size, stride)
        across = tuple(sorted((f for (_, m), f in self._spanning.get("allreduce", {}).items()
                               if m == 1), key=lambda f: f.group_size))
        if not across:
            return self.collective_line("all2all", group_size, stride)
        inter_alpha, inter_per_byte = _pick_line("allreduce", across, nodes)
        # all-reduce's algbw = busbw / (2 (k - 1) / k): back to the NIC's bus bandwidth
        nic_us_per_byte = inter_per_byte / busbw_factor("allreduce", nodes)
        off_node = nic_us_per_byte * (group_size - per_node) / group_size
        if per_node > 1:
            intra_alpha, intra_per_byte = self._line("all2all", per_node, "consec")
            on_node = intra_per_byte * per_node / group_size  # its buffer's share for the node
        else:
            intra_alpha, on_node = 0.0, 0.0
        return intra_alpha + inter_alpha / 2.0, max(on_node, off_node)

    def p2p_time_us(self, size_bytes: float, intra: bool, pp: int) -> float:
        """Time in us of one send/recv of `size_bytes` (a float or a numpy array) between
        pipeline neighbours."""
        return self.time_us("p2p", max(pp, 2), "intra" if intra else "inter", size_bytes)

    @property
    def measured(self) -> Tuple[Tuple[str, str], ...]:
        """(op, layout) pairs the profile has fits for."""
        return tuple(sorted(self._fits))
