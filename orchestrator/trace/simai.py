"""The SimAI / ASTRA-sim training workload text file of one traced rank (`trace.export=simai`).

Format (learned from the public AICB and SimAI sources, not copied):
- Line 1: `HYBRID_TRANSFORMER_FWD_IN_BCKWD model_parallel_NPU_group: <tp> ep: <ep> pp: <pp>
  vpp: <n> ga: <micro-batches> all_gpus: <ws> checkpoints: 0 checkpoint_initiates: 0
  pp_comm: <bytes>` (aliyun/aicb workload_generator/SimAI_training_workload_generator.py,
  SIMAI_workload.dump_file). SimAI reads the tokens after each `key:` (aliyun/SimAI
  astra-sim-alibabacloud/astra-sim/workload/Workload.cc, Workload::initialize_workload) and warns
  when pp > 1 and pp_comm is 0. It walks the item list once: AICB writes every micro-batch's
  items (a loop over ga), and SimAI's analytical report adds a pipeline bubble of
  (pp - 1) / (ga * vpp) times the items' summed time (Layer.cc, pre_bubble_time), so `vpp:` is
  the number of model chunks per stage (1 for 1F1B, v interleaved); AICB writes the layers per
  stage there, which shrinks the bubble by that factor.
- Line 2: the number of item lines.
- One tab-separated line per item: name, -1 (dependency placeholder), forward compute, forward
  comm type, forward comm bytes, input-gradient compute, ig comm type, ig bytes, weight-gradient
  compute, wg comm type, wg bytes, wg update time (AICB's Work_Item field order). The
  analytical build ignores the last column (it only delays a callback of the packet-level
  simulation), so the optimizer step's time goes in its item's forward compute column.
- Comm types: ALLREDUCE, ALLGATHER, REDUCESCATTER, ALLTOALL, NONE (+ _EP / _DP_EP suffixes for
  the EP and DP_EP groups). Workload.cc maps an un-suffixed type to the TP group in the forward
  and ig columns and to the DP group in the wg column, so the DP gradient collectives go in the
  wg column of their own items, as AICB's `grad_param_comm` / `grad_gather` items do.
- One group per line (AICB's convention: its MoE layer is an EP dispatch line, TP lines and an
  EP combine line): Layer.cc files a line's forward and ig communication under EP only when the
  forward type is EP's, so an item with collectives of several groups gets one line per
  collective and group (`_lines`). A line whose forward is NONE (a group with more ig than
  forward collectives: the all-gather flavour's K/V re-gather under recompute) is filed under
  TP by that report whatever its ig type; AICB writes no such line.
- TIME UNIT: integer nanoseconds. AICB's AIOB times kernels with CUDA events in us
  (utils/utils.py, cuda_timing_decorator: `elapsed_time(...) * 1000`) and extract_averages
  multiplies those by 1000 again before rounding to int (`avg_value = float(...) * 1000`); SimAI
  reads the columns as `Tick`s, and its clock reports `Sys::boostedTick() / FREQ` with FREQ 1000
  as microseconds, i.e. one tick is 1 ns.

Context parallelism (cp > 1): SimAI's workload knows no CP group (its groups are TP, DP, EP and
DP_EP; a maintainer's word in aliyun/SimAI#45: "We are recently planning to adapt to CP"), so
the header says `ep: <cp>` (SimAI's EP group of rank r is the ranks of stride tp in its block of
tp x ep: the CP group in the order tp-cp-dp-pp) and the CP collectives take the `_EP` suffix
(ALLGATHER_EP, REDUCESCATTER_EP, ALLTOALL_EP). The ring's sends, which SimAI cannot express
(no point-to-point item), are written as the ring all-gather that moves the same bytes over the
same links: a pass's n sends of one K/V block become ALLGATHER_EP of n x cp / (cp - 1) blocks
(each rank of a ring all-gather sends (cp - 1) / cp of it). SimAI then exposes them; the real
ring runs beside the attention's compute. The gradient collectives over dp x cp go in the wg
columns as before (SimAI's DP group).

Mixture of experts (followed: aliyun/aicb workload_generator/SimAI_training_workload_generator.py,
its "moelayer" items and `moe_grad_norm` items, Megatron-Core 0.13's all-to-all dispatcher; and
SimAI's MockNcclGroup.cc for the groups). SimAI's expert grid is Megatron's default: expert
tensor parallelism = TP (its EP group of a rank is the ranks of stride tp in its block of
tp x ep, its DP_EP group the ep-th ones of its DP group, stride tp x ep), which is the layout's
ETP, EP and EDP groups when etp == tp and cp == 1; other MoE layouts are refused
(`unexportable`). The header says `ep: <ep>`; per MoE layer and micro-batch an item
`layer<N>_moelayer` holds the router, the dispatcher and the experts, one line per collective
as AICB writes them: the counts exchange and the tokens' all-to-alls over EP as ALLTOALL_EP
(dispatch and combine; backward the same two), the ETP all-gathers and reduce-scatters
un-suffixed (the TP group), and the shared expert's items are the MLP's column / row items. The
routed experts' gradient buckets (over EDP) go in the wg column of `grad_param_comm` as
ALLREDUCE_DP_EP / REDUCESCATTER_DP_EP, their ZeRO parameter all-gather in `grad_gather` as
ALLGATHER_DP_EP (AICB's moe_grad_norm items). SimAI builds its EP groups from its TP groups, so
at tp = 1 (no TP group) it has none in the version read.

Items follow AICB's split with sequence parallelism: per block an attention "column" item
(norm, QKV, attention core: forward all-gather; backward Megatron-LM's second all-gather of the
sharded input for the weight gradient, then the input gradient's reduce-scatter, one line each:
AICB computes that all-gather, `backward_comm_2`, but leaves it out of its file) and a "row"
item (output projection: forward reduce-scatter, backward all-gather), the same for the MLP,
plus the embedding and the final norm + lm_head + loss, for every micro-batch. Compute times are sums of
the records' time_us; a backward op is weight-gradient compute when it makes a weight's gradient
(an mm that reads no weight and gives a weight's shape, the embedding's dense backward) and
input-gradient compute otherwise (the recorder marks the ops that read a weight).
"""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from orchestrator.choices import CpComm

COMM_TYPES = ("NONE", "ALLREDUCE", "ALLGATHER", "REDUCESCATTER", "ALLTOALL")
# Context parallelism's collectives: SimAI has no CP group; its EP group is (MockNcclGroup.cc)
# ep ranks of stride tp inside blocks of tp x ep, which in Megatron's rank order tp-cp-dp-pp is
# the CP group when the header says `ep: <cp>`.
CP_COMM_TYPES = tuple(f"{t}_EP" for t in COMM_TYPES[1:])
# Mixture of experts: the EP group's (as CP's) and the expert-data-parallel group's (DP_EP).
MOE_COMM_TYPES = CP_COMM_TYPES + tuple(f"{t}_DP_EP" for t in COMM_TYPES[1:])
# The suffix of a record's group in SimAI's types (un-suffixed: TP in the forward and ig
# columns, DP in wg; "etp" is the TP group where the export is allowed, etp == tp).
_GROUP_SUFFIX = {"cp": "_EP", "ep": "_EP", "edp": "_DP_EP"}
# Collectives written one line each (AICB's MoE items), not summed by type.
_SEPARATE_GROUPS = ("ep", "etp")
_COMM_OF_OP = {"all_reduce": "ALLREDUCE", "all_gather": "ALLGATHER",
               "reduce_scatter": "REDUCESCATTER", "all_to_all": "ALLTOALL"}
HEADER_KIND = "HYBRID_TRANSFORMER_FWD_IN_BCKWD"
_BLOCK = re.compile(r"^blocks\.(\d+)(?:\.(attn|mlp)(_norm)?(?:\.([\w.]+))?)?$")
# Ops that compute a weight's gradient without being a matmul.
_WEIGHT_GRAD_OPS = {"aten.embedding_dense_backward"}


@dataclass
class _Pass:
    """One pass (forward, input-gradient or weight-gradient) of an item."""

    time_us: float = 0.0
    flops: float = 0.0  # of its compute (not written: SimAI reads times)
    # [SimAI type, bytes, whether later ones of its type add to it], issue order
    comm: List[list] = field(default_factory=list)

    def add_comm(self, comm_type: str, n_bytes: float, merge: bool = True) -> None:
        """Add a collective: to the bytes of the pass's mergeable entry of its type (`merge`),
        or as an entry of its own."""
        if merge:
            for entry in self.comm:
                if entry[0] == comm_type and entry[2]:
                    entry[1] += n_bytes
                    return
        self.comm.append([comm_type, n_bytes, merge])


@dataclass
class _Item:
    name: str
    fwd: _Pass = field(default_factory=_Pass)
    ig: _Pass = field(default_factory=_Pass)
    wg: _Pass = field(default_factory=_Pass)


def _item_name(module: str, moe_layers=frozenset()) -> Optional[str]:
    """The AICB-style item a module's ops belong to, or None (ops outside any item);
    `moe_layers`: the blocks whose FFN is a mixture of experts (their router, dispatcher and
    experts make the `moelayer` item, their shared expert the MLP's column / row items)."""
    if module == "tok_emb":
        return "embedding_layer"
    if module in ("norm", "lm_head"):
        return "final_norm_lm_head"
    m = _BLOCK.match(module)
    if m is None or m.group(2) is None:
        return None
    layer, part, child = m.group(1), m.group(2), m.group(4)
    if part == "mlp" and not m.group(3) and int(layer) in moe_layers:
        # The shared expert's projections are the MLP's items; everything else of the MoE FFN
        # (router, dispatcher, experts, and the shared expert's SP messages and elementwise ops:
        # torch's module tracker cannot tell them apart from the experts' in backward) is its
        # moelayer item.
        if child not in ("shared.w_gate", "shared.w_up", "shared.w_down"):
            return f"layer{layer}_moelayer"
        child = child[len("shared."):]
    row = (part == "attn" and child == "wo") or (part == "mlp" and child == "w_down")
    kind = "attention" if part == "attn" else "mlp"
    return f"layer{layer}_{kind}_{'row' if row else 'column'}"


def _moe_layers(records: List[dict]) -> frozenset:
    """The blocks with a router among `records`' modules."""
    return frozenset(int(m.group(1)) for m in (
        _BLOCK.match(r.get("module") or "") for r in records if r["kind"] == "compute")
        if m is not None and (m.group(4) or "").startswith("router"))


def _is_part_module(module: str, moe_layers=frozenset()) -> bool:
    """True for "blocks.N.attn" / "blocks.N.mlp" themselves (not a projection or a norm; not
    a MoE FFN, whose own ops are its item's)."""
    m = _BLOCK.match(module)
    return (m is not None and m.group(2) is not None and not m.group(3) and not m.group(4)
            and not (m.group(2) == "mlp" and int(m.group(1)) in moe_layers))


def _comm_type(record: dict) -> str:
    op = record["op"]
    if op not in _COMM_OF_OP:
        raise ValueError(f"collective {op!r} (record {record.get('i')}) has no SimAI workload "
                         f"type; SimAI knows {sorted(_COMM_OF_OP)}")
    return _COMM_OF_OP[op] + _GROUP_SUFFIX.get(record.get("group"), "")


def _weight_shapes(forward: List[dict], moe_layers=frozenset()) -> Dict[str, set]:
    """item -> the local weight shapes its forward matmuls use, both orientations (by item, not
    module: the backward's module labels of sibling projections are not reliable)."""
    shapes: Dict[str, set] = {}
    for r in forward:
        if r["kind"] == "compute" and r["op"] == "aten.mm" and len(r["shapes"]) == 2:
            w = tuple(r["shapes"][1])
            shapes.setdefault(_item_name(r["module"], moe_layers), set()).update({w, w[::-1]})
    return shapes


def _is_weight_grad(record: dict, item: str, weights: Dict[str, set]) -> bool:
    """A backward op producing a weight's gradient: an mm that reads no weight (an input
    gradient reads one) and gives one of the item's weight shapes, or the embedding's dense
    backward; everything else is input gradient."""
    if record["op"] in _WEIGHT_GRAD_OPS:
        return True
    if record["op"] != "aten.mm" or not record.get("out_shapes") or record.get("reads_weight"):
        return False
    return tuple(record["out_shapes"][0]) in weights.get(item, ())


def _stream_items(stream: List[dict], backward: bool,
                  moe_layers=frozenset()) -> List[Tuple[str, dict]]:
    """(item name, record) for one chunk's ordered records. Compute records go by their module;
    collectives and records outside any item (residual adds, casts, p2p, loss) go with the item
    whose compute they follow in the forward (a row projection's reduce-scatter comes after its
    matmul) and precede in the backward (its all-gather comes before the matmul's gradient)."""
    named = [_item_name(r.get("module", ""), moe_layers) if r["kind"] == "compute" else None
             for r in stream]
    order = range(len(stream) - 1, -1, -1) if backward else range(len(stream))
    owner: List[Optional[str]] = [None] * len(stream)
    current = None
    for k in order:
        name = named[k]
        # Ops of the attention / MLP module itself (rope, the reduce-scatter's concat) stay in
        # the row item once its projection has run: they belong to its communication.
        weak = name is not None and _is_part_module(stream[k]["module"], moe_layers)
        if weak and current is not None and current.rsplit("_", 1)[0] == name.rsplit("_", 1)[0]:
            name = None
        current = name or current
        owner[k] = current
    first = next((n for n in (owner[k] for k in order) if n), None)
    return [(name or first, r) for name, r in zip(owner, stream)]


def _chunk_items(mine: List[dict], cp: int) -> List[_Item]:
    """The items of one model chunk for one micro-batch (its records, in issue order), in
    forward order; `cp` is the layout's (the ring's sends as its all-gather)."""
    forward = [r for r in mine if r["phase"] in ("F", "loss")]
    backward = [r for r in mine if r["phase"] == "B"]
    moe_layers = _moe_layers(forward)
    weights = _weight_shapes(forward, moe_layers)
    items: Dict[str, _Item] = {}
    for name, r in _stream_items(forward, backward=False, moe_layers=moe_layers):
        item = items.setdefault(name, _Item(name))
        _add(item.fwd, r, cp)
    for name, r in _stream_items(backward, backward=True, moe_layers=moe_layers):
        item = items.setdefault(name, _Item(name))
        wg = r["kind"] == "compute" and _is_weight_grad(r, name, weights)
        _add(item.wg if wg else item.ig, r, cp)
    return list(items.values())


def _add(target: _Pass, record: dict, cp: int = 1) -> None:
    if record["kind"] == "compute":
        target.time_us += _time_us(record)
        target.flops += record["flops"]
    elif record["kind"] == "coll":
        target.add_comm(_comm_type(record), int(record["bytes"]),
                        merge=record.get("group") not in _SEPARATE_GROUPS)
    elif record["kind"] == "p2p" and record.get("group") == "cp" and record["op"] == "send":
        # one ring step's send: its share of the ring all-gather moving the same bytes
        target.add_comm("ALLGATHER_EP", int(record["bytes"]) * cp / (cp - 1))


def _time_us(record: dict) -> float:
    if "time_us" not in record:
        raise ValueError(f"compute record {record.get('i')} ({record['op']}) has no time_us: "
                         f"price the trace with a model profile or device sheet first")
    return float(record["time_us"])


def _end_items(records: List[dict]) -> Tuple[List[_Item], List[_Item]]:
    """(items before the layers, after them): the SP norm gradients' TP all-reduce in an ig
    column (the TP group's), the DP gradient collectives in wg columns (AICB's grad_param_comm
    / grad_gather) and the optimizer step with its grad-norm all-reduce."""
    norm_item = _Item("norm_grads_allreduce")
    reduce_item, gather_item = _Item("grad_param_comm"), _Item("grad_gather")
    optimizer = _Item("optimizer")
    for r in records:
        if r["phase"] == "dp" and r["kind"] == "coll" and r.get("group") == "tp":
            norm_item.ig.add_comm(_comm_type(r), int(r["bytes"]))
        elif r["phase"] == "dp":
            _add(reduce_item.wg, r)
        elif r["phase"] == "optimizer" and r["kind"] == "coll" \
                and r.get("group") in ("dp", "dp_cp", "edp"):
            gather_item.wg.add_comm(_comm_type(r), int(r["bytes"]))
        elif r["phase"] == "optimizer" and r["kind"] == "coll":
            # AICB writes the grad-norm all-reduce as a forward ALLREDUCE (optimizer1..4 items).
            optimizer.fwd.add_comm(_comm_type(r), int(r["bytes"]))
        elif r["phase"] == "optimizer" and r["kind"] == "compute":
            _add(optimizer.fwd, r)  # a compute column: SimAI's analytical mode reads no update
    before = [i for i in (norm_item, reduce_item, gather_item)
              if i.ig.comm or i.wg.comm or i.wg.time_us]
    return before, [optimizer]


def _ns(time_us: float) -> int:
    return int(round(time_us * 1000.0))


def _simai_group(comm_type: str, column: int) -> str:
    """The group SimAI runs a collective of `comm_type` on in pass `column` (0 forward, 1 input
    gradient, 2 weight gradient; Workload.cc): its suffix's, else TP's in the forward and
    input-gradient columns and DP's in the weight-gradient one."""
    for suffix in ("_DP_EP", "_EP"):
        if comm_type.endswith(suffix):
            return suffix[1:]
    return "DP" if column == 2 else "TP"


def _lines(item: _Item) -> List[str]:
    """The item's lines: per SimAI group, in the order the item first issues it, one line per
    collective of a pass of that group (its forward, input-gradient and weight-gradient
    columns side by side); the compute times on the first. One group per line, as AICB writes
    a layer (its MoE layer: EP dispatch, TP, EP combine lines): SimAI files a line's forward and
    input-gradient time under EP only when its forward type is EP's (Layer.cc), so a TP
    collective beside an EP one would be counted under the other group."""
    passes = (item.fwd, item.ig, item.wg)
    by_group: Dict[str, List[List[tuple]]] = {}
    for column, p in enumerate(passes):
        for comm_type, n_bytes, _ in p.comm:
            group = by_group.setdefault(_simai_group(comm_type, column), [[], [], []])
            group[column].append((comm_type, n_bytes))
    rows = []
    for comms in list(by_group.values()) or [[[], [], []]]:
        for k in range(max(1, *(len(c) for c in comms))):
            cols = [item.name, "-1"]
            for p, c in zip(passes, comms):
                comm_type, n_bytes = c[k] if k < len(c) else ("NONE", 0)
                cols += [str(_ns(p.time_us) if not rows and k == 0 else 0), comm_type,
                         str(int(round(n_bytes)) if comm_type != "NONE" else 0)]
            cols.append("0")  # the update-time column: the optimizer's time is compute
            rows.append("\t".join(cols))
    return rows


def _pp_comm_bytes(records: List[dict]) -> int:
    """The activation message a stage sends or receives (0 with one stage)."""
    return max((int(r["bytes"]) for r in records
                if r["kind"] == "p2p" and r.get("group") != "cp"), default=0)


def workload_items(records: List[dict], spec) -> List[_Item]:
    """The items of one representative rank's records, in file order: the end items before
    the layers, every micro-batch's chunk items, the optimizer (compute records need time_us).
    ValueError when the layout has no SimAI workload or micro-batches are missing."""
    lay = spec.layout
    reason = unexportable(lay, moe=bool(_moe_layers(records)) or lay.ep * lay.etp > 1)
    if reason is not None:
        raise ValueError(reason)
    # One pass over the records (a large world's trace holds millions, over hundreds of
    # micro-batches): each chunk's records per micro-batch, in issue order.
    parts: Dict[Tuple[int, int], List[dict]] = {}
    for r in records:
        if r.get("chunk") is not None and r.get("mb") is not None:
            parts.setdefault((r["mb"], r["chunk"]), []).append(r)
    micro_batches = sorted({mb for mb, _ in parts})
    if len(micro_batches) != lay.num_micro_batches:
        raise ValueError(f"the records hold micro-batches {micro_batches}, the layout "
                         f"{lay.num_micro_batches}: SimAI needs every micro-batch's items")
    before, after = _end_items(records)
    return before + [i for key in sorted(parts) for i in _chunk_items(parts[key], lay.cp)] \
        + after


def simai_workload(records: List[dict], spec, model_name: str) -> str:
    """The SimAI workload text of one representative rank's records (compute records need
    time_us; compute columns in integer ns, comm sizes in bytes). `model_name` is only used for
    the file name, kept here for a uniform signature."""
    del model_name
    lay = spec.layout
    rows = [row for item in workload_items(records, spec) for row in _lines(item)]
    # SimAI's EP group: the experts' (MoE) or the CP group (a dense model, see the module doc)
    ep = lay.ep if lay.ep > 1 else lay.cp
    header = (f"{HEADER_KIND} model_parallel_NPU_group: {lay.tp} ep: {ep} pp: {lay.pp} "
              f"vpp: {lay.virtual_stages} ga: {lay.num_micro_batches} "
              f"all_gpus: {lay.world_size} checkpoints: 0 checkpoint_initiates: 0 "
              f"pp_comm: {_pp_comm_bytes(records) if lay.pp > 1 else 0}")
    return "\n".join([header, str(len(rows))] + rows) + "\n"


def unexportable(layout, moe: bool = False) -> Optional[str]:
    """Why SimAI's workload cannot express `layout` (of a mixture-of-experts model when `moe`),
    or None: SimAI has one group beside TP and DP for CP or experts (EP, with DP_EP), and its
    expert grid has expert tensor parallelism = TP (MockNcclGroup.cc builds EP from the TP
    groups)."""
    if layout.cp > 1 and layout.cp_comm == CpComm["a2a+p2p"]:
        return ("cp_comm a2a+p2p has no SimAI workload: SimAI has one group that can stand for "
                "CP (EP), the hierarchical flavour needs two")
    if not moe:
        return None
    if layout.cp > 1:
        return (f"SimAI's workload has one EP group, for the experts or for CP, not both "
                f"(cp({layout.cp}) with a mixture-of-experts model)")
    if layout.etp != layout.tp:
        return (f"SimAI's expert grid has expert tensor parallelism = TP; etp({layout.etp}) != "
                f"tp({layout.tp}) (its EP group would not be the layout's)")
    return None


def simai_file_name(spec, model_name: str, stage: Optional[int] = None,
                    moe: bool = False) -> str:
    """AICB's workload file name (without its GPU-type prefix, which a trace does not know),
    plus `-stage<s>` when one file per pipeline stage is written; `moe`: a mixture-of-experts
    model (AICB's MOE-True, its ep)."""
    lay = spec.layout
    suffix = "" if stage is None else f"-stage{stage}"
    cp = f"-cp{lay.cp}" if lay.cp > 1 else ""
    return (f"{model_name}-world_size{lay.world_size}-tp{lay.tp}{cp}-pp{lay.pp}-ep{lay.ep}"
            f"-gbs{lay.global_batch_size}-mbs{lay.micro_batch_size}-seq{spec.seq_len}"
            f"-MOE-{moe}-GEMM-False-flash_attn-True{suffix}.txt")


def write_simai(path, records: List[dict], spec, model_name: str) -> Path:
    """Write the workload to `path` atomically (temp file in the same folder, then rename);
    returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = simai_workload(records, spec, model_name)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
