"""A dispatch hook that writes down every operation one rank issues, in issue order.

Every aten op that reaches the dispatcher while `OpRecorder` is active is one record: compute
(op, shapes, dtype, FLOPs from torch's FLOP formulas (a causal flash kernel's halved: it skips
the masked tiles), bytes read + written), collectives (from
DTensor's functional collectives and from torch.distributed's c10d ops: op, group, bytes) and
point-to-point messages (peer, bytes, send/recv); an all-to-all also says what it sends to and
receives from each peer (`send_bytes`, `recv_bytes`, group-rank order). Ops that only make
views (reshape, transpose, slicing) launch no kernel and are left out. The tensors are on the
meta device and the process group is fake, so recording costs no memory and no communication.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from orchestrator.device import NO_KERNEL_OPS

# Ops that make views or change metadata only: no kernel, no record (device.NO_KERNEL_OPS).
_NO_KERNEL = NO_KERNEL_OPS
_SKIP_COMM = {"wait_tensor", "barrier", "monitored_barrier_"}

# Collective names as the records spell them (Megatron / NCCL vocabulary).
_FUNCTIONAL = {
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast",
    "all_reduce_coalesced": "all_reduce", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
}
_C10D = {
    "allreduce_": "all_reduce", "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "allgather_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_":
    "reduce_scatter", "reduce_scatter_": "reduce_scatter", "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all", "broadcast_": "broadcast", "allreduce_coalesced_": "all_reduce",
    "send": "send", "recv_": "recv", "recv_any_source_": "recv",
}

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
               torch.float64: "fp64", torch.int64: "int64", torch.int32: "int32",
               torch.bool: "bool", torch.uint8: "uint8"}


def _tensors(tree) -> List[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def as_range(ranks: Sequence[int]) -> Optional[range]:
    """`ranks` as a range when evenly spaced (every group of a (pp, dp, tp) mesh is), else
    None; a range is returned as it is (no walk over its ranks)."""
    if isinstance(ranks, range):
        return ranks
    if len(ranks) == 1:
        return range(ranks[0], ranks[0] + 1)
    if len(ranks) > 1:
        stride = ranks[1] - ranks[0]
        if stride and all(b - a == stride for a, b in zip(ranks, ranks[1:])):
            return range(ranks[0], ranks[-1] + (1 if stride > 0 else -1), stride)
    return None


def describe_group(ranks: Sequence[int]) -> Dict[str, object]:
    """A group as first rank + stride when its ranks are evenly spaced, else the whole list."""
    spaced = as_range(ranks)
    if spaced:
        return {"group_size": len(spaced), "group_first": spaced[0],
                "group_stride": spaced.step if len(spaced) > 1 else 1}
    return {"group_size": len(ranks), "group_ranks": list(ranks)}


class OpRecorder(TorchDispatchMode):
    """Records the ops dispatched while active into `records` (a list of dicts, see module doc).

    `context()` gives the fields stamped on every record (phase, micro-batch, chunk); `module`
    names the innermost module running (torch's ModuleTracker), when one is given;
    `group_names` maps a process group's ranks (a range) to a name ("tp", "dp", "pp", "world");
    `group_ranks` gives the caller's groups' ranks (ranges) by process-group name, so that
    describing a group costs the same at any world size; for any other group torch's list of
    its ranks is asked (world_size long for the default group); `process_group_names` names
    groups by process-group name, before `group_names` (groups whose ranks are another's: the
    expert groups).
    """

    def __init__(self, group_names: Optional[Dict[range, str]] = None,
                 context: Optional[Callable[[], dict]] = None, tracker=None,
                 group_ranks: Optional[Dict[str, range]] = None,
                 process_group_names: Optional[Dict[str, str]] = None):
        super().__init__()
        self.records: List[dict] = []
        self.group_names = group_names or {}
        self.process_group_names = process_group_names or {}
        self.context = context or dict
        self.tracker = tracker
        self._ranks_of: Dict[str, Sequence[int]] = dict(group_ranks or {})
        self._groups: Dict[str, Dict[str, object]] = {}  # group name -> its record fields
        # Storages of the weights and of copies made from them (autocast's casts), by address;
        # held, so that a freed one's address is not reused by an activation (on the meta
        # device a storage costs nothing).
        self._weights: Dict[int, object] = {}

    def watch_weights(self, tensors) -> None:
        """Mark `tensors` (parameters, or their local shards) as weights: a compute record
        that reads one (or a copy of one) then says `reads_weight: True`. That is how an
        input gradient (x' = y' W reads the weight) is told from a weight gradient (W' = y'^T x
        makes one), whatever the shapes: with tokens == hidden both have a weight's shape."""
        for t in tensors:
            storage = t.untyped_storage()
            self._weights[storage._cdata] = storage

    def _reads_weight(self, tensors) -> bool:
        return bool(self._weights) and any(
            t.untyped_storage()._cdata in self._weights for t in tensors)

    # ----------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.tensor import DTensor

        if DTensor in types:
            # Let DTensor run it (mode still active): we record the local ops and collectives
            # it issues on this rank's shards, not the global-shaped op.
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if FakeTensor in types:
            # DTensor's sharding propagation running the op on fake global-shaped tensors to
            # learn its output's shape (once per op and input layout): not the workload.
            return out
        packet = func.overloadpacket
        namespace = func.namespace
        if namespace == "aten":
            name = f"aten.{packet.__name__}"
            if name not in _NO_KERNEL and not func.is_view:
                self._compute(func, name, args, kwargs, out)
        elif namespace == "_c10d_functional":
            op = _FUNCTIONAL.get(packet.__name__)
            if op is not None:
                self._functional(op, func, args, kwargs, out)
        elif namespace == "c10d":
            op = _C10D.get(packet.__name__)
            if op is not None:
                self._c10d(op, func, args, kwargs)
        return out

    def _stamp(self, record: dict) -> dict:
        record.update(self.context())
        if "module" not in record:
            record["module"] = _innermost(self.tracker.parents) if self.tracker else ""
        self.records.append(record)
        return record

    def _compute(self, func, name, args, kwargs, out) -> None:
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        if not any(t.is_meta for t in ins + outs):
            return  # bookkeeping on real CPU tensors (DeviceMesh coordinates), not the workload
        flop_fn = flop_registry.get(func.overloadpacket)
        flops = int(flop_fn(*args, **kwargs, out_val=out)) if flop_fn else 0
        if name in _FLASH_OPS:
            flops = int(flops * _causal_share(func, args, kwargs))
        first = (ins or outs or [None])[0]
        record = {
            "kind": "compute", "op": name,
            "shapes": [list(t.shape) for t in ins],
            "out_shapes": [list(t.shape) for t in outs],
            "dtype": DTYPE_NAMES.get(first.dtype, str(first.dtype)) if first is not None else "",
            "flops": flops,
            "bytes": sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs),
        }
        if self._reads_weight(ins):
            record["reads_weight"] = True
            if name == "aten._to_copy":  # autocast's copy of a weight is a weight too
                self.watch_weights(outs)
        self._stamp(record)

    # ----------------------------------------------------------------- communication
    def _ranks(self, group_name: str) -> Sequence[int]:
        """The global ranks of the group named `group_name`, in group-rank order."""
        ranks = self._ranks_of.get(group_name)
        if ranks is None:
            from torch.distributed.distributed_c10d import _resolve_process_group

            ranks = dist.get_process_group_ranks(_resolve_process_group(group_name))
            ranks = self._ranks_of[group_name] = as_range(ranks) or ranks
        return ranks

    def _group(self, group_name: str) -> Dict[str, object]:
        """A collective's group fields: size, first rank and stride (or the ranks), name."""
        fields = self._groups.get(group_name)
        if fields is None:
            ranks = self._ranks(group_name)
            fields = describe_group(ranks)
            fields["group"] = self.process_group_names.get(group_name) or (
                self.group_names.get(ranks, "other") if isinstance(ranks, range) else "other")
            self._groups[group_name] = fields
        return fields

    def _functional(self, op, func, args, kwargs, out) -> None:
        schema = func._schema
        bound = dict(zip([a.name for a in schema.arguments], args)) | kwargs
        group_name = bound["group_name"]
        tensor = _tensors(args)[0]
        result = _tensors(out)[0]
        # Megatron's convention: all-gather counts the gathered (output) buffer, the others
        # the input buffer.
        size = _nbytes(result) if op == "all_gather" else _nbytes(tensor)
        self._stamp({"kind": "coll", "op": op, **self._group(group_name), "bytes": size,
                     "dtype": DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))})

    def _c10d(self, op, func, args, kwargs) -> None:
        bound = dict(zip([a.name for a in func._schema.arguments], args)) | kwargs
        pg = next(v for v in bound.values() if isinstance(v, torch.ScriptObject))
        pg = dist.ProcessGroup.unbox(pg)  # the c10d op carries it boxed
        tensors = _tensors(args)
        if op in ("send", "recv"):
            keys = ("dst", "dstRank") if op == "send" else ("src", "srcRank")  # torch renamed
            local_peer = int(next((bound[k] for k in keys if k in bound), -1))
            ranks = self._ranks(pg.group_name)
            t = tensors[0]
            self._stamp({"kind": "p2p", "op": op, "group": self._group(pg.group_name)["group"],
                         "peer": ranks[local_peer] if local_peer >= 0 else -1,
                         "bytes": _nbytes(t), "tag": int(bound.get("tag", 0)),
                         "dtype": DTYPE_NAMES.get(t.dtype, str(t.dtype)),
                         "shape": list(t.shape)})
            return
        # c10d ops pass (output, input) for the *_base_ forms; count as the functional ones do
        if op == "all_gather":
            size = _nbytes(tensors[0])
        elif op in ("reduce_scatter", "all_to_all") and len(tensors) > 1:
            size = _nbytes(tensors[1])
        else:
            size = sum(_nbytes(t) for t in tensors)
        record = {"kind": "coll", "op": op, **self._group(pg.group_name), "bytes": size,
                  "dtype": DTYPE_NAMES.get(tensors[0].dtype, str(tensors[0].dtype))}
        if op == "all_to_all" and len(tensors) > 1:
            group_size = int(record["group_size"])
            record["send_bytes"] = _split_bytes(tensors[1], bound.get("input_split_sizes"),
                                                group_size)
            record["recv_bytes"] = _split_bytes(tensors[0], bound.get("output_split_sizes"),
                                                group_size)
        self._stamp(record)


def _split_bytes(t: torch.Tensor, splits, group_size: int) -> List[int]:
    """Bytes per peer (group-rank order) of an all-to-all's buffer `t` cut in `splits` rows
    (empty: equal parts)."""
    if not splits:
        return [_nbytes(t) // group_size] * group_size
    row = _nbytes(t) // t.shape[0] if t.dim() and t.shape[0] else 0
    return [int(n) * row for n in splits]


_FLASH_OPS = {"aten._scaled_dot_product_flash_attention",
              "aten._scaled_dot_product_flash_attention_backward"}


def _causal_share(func, args, kwargs) -> float:
    """The share of a flash kernel's score tiles a causal mask leaves to compute (torch's FLOP
    formula counts them all): 1 - s_q / (2 s_k) with the mask aligned to the last key
    (flash-attention's rule for s_q <= s_k; 1/2 for self-attention); 1 without a mask."""
    bound = dict(zip([a.name for a in func._schema.arguments], args)) | kwargs
    if not bound.get("is_causal"):
        return 1.0
    q_len, k_len = bound["query"].shape[-2], bound["key"].shape[-2]
    return 1.0 - min(q_len, k_len) / (2.0 * k_len)


def _innermost(parents) -> str:
    """The innermost module's name from ModuleTracker's set of running modules ("Global" and the
    root's class name dropped: "blocks.5.attn.wq").

    In backward the set can hold siblings (wq, wk, wv's hooks overlap): the deepest wins, ties
    broken by name and then block number, so the choice does not depend on set order and is the
    same for every chunk of one shape (tracer.Captured renames block numbers)."""
    names = [p for p in parents if p != "Global"]
    if not names:
        return ""
    name = max(names, key=_depth_key)
    name = name.split(".", 1)[1] if "." in name else ""
    if name == "chunk" or name.startswith("chunk."):  # tracer.LiveChunk holds the chunk
        name = name[len("chunk."):]
    return name


def _depth_key(name: str):
    parts = name.split(".")
    numbers = [int(p) for p in parts if p.isdigit()]
    return len(parts), [p for p in parts if not p.isdigit()], numbers
