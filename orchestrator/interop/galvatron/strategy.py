"""Galvatron's strategy files (`galvatron_config_*.json`, from its search) as a ParallelLayout.

What the fields mean (Galvatron 2.4's runtime, core/runtime/hybrid_parallel_config.py):
- pp_deg, pp_division ("16,16": layers per stage; absent: equal stages, the last takes the rest);
- per layer, comma-separated: tp_sizes_enc (TP degree; with use_sp=1 it is the degree of
  Ulysses sequence parallelism and the layer's TP is 1), tp_consecutive_flags (1: TP over
  consecutive ranks, 0: strided), dp_types_enc (0: `default_dp_type`, 1: ZeRO-3), checkpoint
  (1: the layer's activations are recomputed in the backward), use_sp;
- default_dp_type: ddp (ZeRO-0), zero2 or zero3 (absent: ddp); embed_sdp: ZeRO-3 for the
  embedding and LM head (else default_dp_type); vtp / vsp: their TP degree / Ulysses flag;
- global_bsz (sequences per iteration) splits over data parallelism, then each rank's share over
  `chunks` micro-batches (torch.chunk); pipeline_type gpipe (all forwards, then all backwards;
  the default) or pipedream_flush (1F1B).
Megatron-style sequence parallelism is Galvatron's --sequence-parallel training argument
(--sequence_parallel of its search), not a field of the file: the caller says what to assume.
Layers with use_sp = 1 split each sequence over their degree's ranks with Ulysses' all-to-alls,
parameters replicated: our context parallelism of that degree in the a2a flavour (cp = degree,
tp = 1; gradients over dp x cp as Galvatron reduces them over its SP group too).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence, Tuple, Union

from orchestrator.choices import CpComm, Recompute
from orchestrator.errors import ProfileError
from orchestrator.layout import LayoutError, ParallelLayout, StageRecompute

REQUIRED = ("pp_deg", "tp_sizes_enc", "tp_consecutive_flags", "dp_types_enc", "global_bsz",
            "chunks")
OPTIONAL = ("use_sp", "checkpoint", "pp_division", "pipeline_type", "default_dp_type", "vtp",
            "vsp", "embed_sdp")
ZERO_OF_DP_TYPE = {"ddp": 0, "zero2": 2, "zero3": 3}
PIPELINE_TYPES = ("gpipe", "pipedream_flush")


def read_strategy(source: Union[str, Path, Mapping[str, Any]], *, world_size: int,
                  num_layers: int, sequence_parallel: bool = False
                  ) -> Tuple[ParallelLayout, List[str]]:
    """The ParallelLayout of a Galvatron strategy (a path, or the dict already loaded) for
    `world_size` ranks and a model of `num_layers` blocks, and one line per field that does not
    map or is approximated (which layers, what was taken and why) or assumed.

    `sequence_parallel`: whether the strategy trains with Galvatron's --sequence-parallel
    (Megatron-style; not in the file). Raises ProfileError naming the file and the field when
    the file is not a strategy for this world size and layer count."""
    name, raw = _load(source)
    notes = [f"{key}: not a Galvatron strategy field; ignored"
             for key in sorted(set(raw) - set(REQUIRED) - set(OPTIONAL))]
    pp = _positive_int(name, raw, "pp_deg")
    flags = {key: _per_layer(name, raw, key, num_layers, (0, 1), default=0)
             for key in ("tp_consecutive_flags", "dp_types_enc", "use_sp", "checkpoint")}
    degrees = _per_layer(name, raw, "tp_sizes_enc", num_layers, None, default=None)
    for layer, degree in enumerate(degrees):
        if degree < 1 or world_size % (pp * degree):
            raise ProfileError(f"{name}: field 'tp_sizes_enc': layer {layer} has tp {degree}; "
                               f"pp_deg({pp}) * {degree} does not divide world_size({world_size})")
    stages = _pp_division(name, raw, pp, num_layers, notes)
    tp = _most_common(degrees, "tp", "tp_sizes_enc", notes)
    default_zero = ZERO_OF_DP_TYPE[_choice(name, raw, "default_dp_type", ZERO_OF_DP_TYPE, notes)]
    zeros = [3 if t else default_zero for t in flags["dp_types_enc"]]
    zero = _most_common(zeros, "zero", "dp_types_enc", notes)
    ulysses = _most_common([u for d, u in zip(degrees, flags["use_sp"]) if d == tp] or [0],
                           "use_sp", "use_sp", notes) == 1 and tp > 1
    pipeline_type = _choice(name, raw, "pipeline_type", PIPELINE_TYPES, notes if pp > 1 else [])
    notes += _unsupported_notes(raw, flags, tp=tp, zero=zero, default_zero=default_zero,
                                ulysses=ulysses)
    if pp > 1 and pipeline_type == "gpipe":
        notes.append("pipeline_type: gpipe runs all forwards, then all backwards; priced as 1F1B "
                     "(pipedream_flush): the same bubble, but GPipe holds every micro-batch's "
                     "activations, so memory is under-priced")
    sp = bool(sequence_parallel) and tp > 1 and not ulysses
    if tp > 1 and not ulysses:
        notes.append(f"sequence_parallel: Megatron-style sequence parallelism is Galvatron's "
                     f"--sequence-parallel training argument, not in the file; taken as "
                     f"{'on' if sp else 'off'}")
    dp = world_size // (pp * tp)
    mbs, micro_batches = _micro_batches(name, _positive_int(name, raw, "global_bsz"),
                                        _positive_int(name, raw, "chunks"), dp, notes)
    cp = 1
    if ulysses:  # the degree splits sequences (Ulysses), not the layers' weights
        tp, cp = 1, tp
    try:
        layout = ParallelLayout(
            world_size=world_size, pp=pp, tp=tp, dp=dp, cp=cp, cp_comm=CpComm.a2a,
            zero=zero, sequence_parallel=sp,
            micro_batch_size=mbs, num_micro_batches=micro_batches, layers_per_stage=stages,
            recompute=_recompute(flags["checkpoint"], stages, notes))
    except LayoutError as e:
        raise ProfileError(f"{name}: not a layout we can run: {e}") from None
    return layout, notes


# ---------------------------------------------------------------------------- fields
def _load(source) -> Tuple[str, Mapping[str, Any]]:
    """(name for messages, the strategy dict) of a path or a dict."""
    if isinstance(source, Mapping):
        return "Galvatron strategy", source
    path = Path(source)
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise ProfileError(f"{path}: cannot read the Galvatron strategy ({e.strerror}); give "
                           f"the path of a galvatron_config_*.json") from None
    except ValueError as e:
        raise ProfileError(f"{path} is not valid JSON ({e}); rerun Galvatron's search to "
                           f"rewrite it") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"{path}: a Galvatron strategy is a JSON object, got "
                           f"{type(raw).__name__}")
    return str(path), raw


def _missing(name: str, key: str) -> ProfileError:
    return ProfileError(f"{name}: field {key!r} is missing; a Galvatron strategy has "
                        f"{', '.join(REQUIRED)}")


def _positive_int(name: str, raw: Mapping[str, Any], key: str) -> int:
    if key not in raw:
        raise _missing(name, key)
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProfileError(f"{name}: field {key!r} must be an integer >= 1, got {value!r}")
    return value


def _int_list(name: str, key: str, value: Any) -> List[int]:
    """Galvatron's "1,2,3" (or a JSON list) as integers."""
    items = value.split(",") if isinstance(value, str) else value
    try:
        if not isinstance(items, list) or not all(isinstance(x, str) or type(x) is int
                                                  for x in items):
            raise ValueError
        return [int(x) for x in items]
    except ValueError:
        raise ProfileError(f"{name}: field {key!r} must be comma-separated integers, got "
                           f"{value!r}") from None


def _per_layer(name: str, raw: Mapping[str, Any], key: str, num_layers: int,
               allowed: Sequence[int] | None, default: int | None) -> List[int]:
    """One integer per layer; an absent optional field is `default` on every layer."""
    if key not in raw:
        if default is None:
            raise _missing(name, key)
        return [default] * num_layers
    values = _int_list(name, key, raw[key])
    if len(values) != num_layers:
        raise ProfileError(f"{name}: field {key!r} has {len(values)} layers, the model has "
                           f"{num_layers}: the strategy is for another model")
    bad = [v for v in values if allowed is not None and v not in allowed]
    if bad:
        raise ProfileError(f"{name}: field {key!r} holds {bad[0]}; allowed: {list(allowed)}")
    return values


def _pp_division(name: str, raw: Mapping[str, Any], pp: int, num_layers: int,
                 notes: List[str]) -> Tuple[int, ...]:
    """Layers per stage; absent, Galvatron's own split (equal, the last stage takes the rest)."""
    if "pp_division" not in raw:
        base = num_layers // pp
        stages = [base] * (pp - 1) + [num_layers - base * (pp - 1)]
        notes.append(f"pp_division: absent; Galvatron's default split {stages} assumed")
    else:
        stages = _int_list(name, "pp_division", raw["pp_division"])
    if len(stages) != pp or sum(stages) != num_layers or min(stages) < 1:
        raise ProfileError(f"{name}: field 'pp_division' {stages} must give pp_deg({pp}) stages "
                           f"of >= 1 layer summing to the model's {num_layers} layers")
    return tuple(stages)


def _choice(name: str, raw: Mapping[str, Any], key: str, allowed, notes: List[str]) -> str:
    """raw[key], one of `allowed`; absent, the first allowed (Galvatron's default), noted."""
    allowed = list(allowed)
    if key not in raw:
        notes.append(f"{key}: absent; Galvatron's default {allowed[0]} assumed")
        return allowed[0]
    if raw[key] not in allowed:
        raise ProfileError(f"{name}: field {key!r} is {raw[key]!r}; allowed: {allowed}")
    return raw[key]


def _most_common(values: List[int], what: str, key: str, notes: List[str]) -> int:
    """The value most layers have (ties: the smallest, which prices more memory per device),
    with a line naming the layers that differ: we have one value for every layer."""
    counts = Counter(values)
    chosen = min(counts, key=lambda v: (-counts[v], v))
    if len(counts) > 1:
        others = ", ".join(f"{what}{v} on layers {_ranges(values, v)}"
                           for v in sorted(counts) if v != chosen)
        notes.append(f"{key}: mixed per layer ({others}); we have one {what} for every layer "
                     f"and take {what}{chosen}, the most common (ties: the smaller, which "
                     f"prices more memory)")
    return chosen


def _ranges(values: Sequence[int], value: int) -> str:
    """Indices where values == value as "0-25,29" (layer numbers from 0)."""
    spans: List[List[int]] = []
    for i, v in enumerate(values):
        if v != value:
            continue
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _recompute(checkpoint: List[int], stages: Sequence[int],
               notes: List[str]) -> Tuple[StageRecompute, ...]:
    """Full recompute of k layers per stage, k = the stage's flagged layers; our full recompute
    reruns a stage's first k layers, so other flagged layers are priced as the first ones."""
    out: List[StageRecompute] = []
    start = 0
    for stage, n in enumerate(stages):
        flags = checkpoint[start:start + n]
        k = sum(flags)
        out.append((Recompute.full, k) if k else (Recompute.none, 0))
        if k and flags != [1] * k + [0] * (n - k):
            flagged = [start + i for i, f in enumerate(flags) if f]
            notes.append(f"checkpoint: stage {stage} recomputes layers {flagged}, not its first "
                         f"{k}; priced as full recompute of its first {k} layers "
                         f"({start}-{start + k - 1}): same count, our recompute is by block")
        start += n
    return tuple(out)


def _micro_batches(name: str, global_bsz: int, chunks: int, dp: int,
                   notes: List[str]) -> Tuple[int, int]:
    """(micro_batch_size, num_micro_batches): each data-parallel rank's global_bsz / dp
    sequences in `chunks` micro-batches, as torch.chunk splits them (ceil-sized, so fewer
    chunks when they do not divide)."""
    if global_bsz % dp:
        raise ProfileError(f"{name}: field 'global_bsz' {global_bsz} does not split over "
                           f"dp({dp}) data-parallel ranks")
    local = global_bsz // dp
    mbs = -(-local // chunks)
    micro_batches = -(-local // mbs)
    if mbs * micro_batches != local or micro_batches != chunks:
        notes.append(f"chunks: {local} sequences per rank do not split into {chunks} equal "
                     f"micro-batches; Galvatron's torch.chunk makes {micro_batches} of up to "
                     f"{mbs}, priced as {micro_batches} x {mbs} = {micro_batches * mbs} per rank")
    return mbs, micro_batches


def _unsupported_notes(raw: Mapping[str, Any], flags: Dict[str, List[int]], *, tp: int,
                       zero: int, default_zero: int, ulysses: bool) -> List[str]:
    """One line per setting we have no way to express, with what is priced instead."""
    notes = []
    if ulysses:
        notes.append(f"use_sp: Ulysses sequence parallelism of degree {tp} (all-to-alls, "
                     f"parameters replicated): priced as context parallelism cp{tp} in the a2a "
                     f"flavour, tp 1")
    if not all(flags["tp_consecutive_flags"]):
        notes.append(f"tp_consecutive_flags: layers {_ranges(flags['tp_consecutive_flags'], 0)}"
                     f" put TP over strided ranks; we price TP over consecutive ranks and DP "
                     f"strided")
    vtp = raw.get("vtp", 1)
    if vtp != tp:
        notes.append(f"vtp: Galvatron splits the embedding and LM head {vtp!r} ways; we "
                     f"split them over tp({tp}) like the layers")
    if bool(raw.get("vsp", 0)) != ulysses:
        uses = "use" if raw.get("vsp", 0) else "do not use"
        notes.append(f"vsp: the embedding and LM head {uses} Ulysses sequence parallelism; "
                     f"priced like the layers")
    embed_zero = 3 if raw.get("embed_sdp", 0) else default_zero
    if embed_zero != zero:
        notes.append(f"embed_sdp: the embedding and LM head are ZeRO-{embed_zero} in Galvatron; "
                     f"priced at the layers' ZeRO-{zero} (we have one ZeRO stage)")
    return notes
