"""Galvatron's model profiles, to and from model/<model>.json.

Galvatron's model profiler (galvatron/core/profiler/model_profiler.py) writes, per model,
computation_profiling_<dtype>_<name>.json and memory_profiling_<dtype>_<name>.json, <name> being
"hidden{h}_head{a}_seqlen{s}" (or without the seqlen, or a model name). What each number is:
- time: "layertype_0_bsz{b}_seq{s}" = forward time in ms of ONE transformer layer for one sample
  (its batch of b divided by b), at tp 1; "layertype_other_bsz{b}_seq{s}" = the same for
  embedding + head + loss. The shipped example files are older: "layertype_0_bsz{b}" and
  "layertype_other_0_bsz{b}" without the length, and a plain "layertype_0". Galvatron's cost
  model prices a layer at tp t as time * bsz / t and its backward as 2 x forward.
- memory (MiB): "layertype_0[_sp]" -> {seq ->} "parameter_size" (one layer's parameters in fp32:
  Galvatron's model states are 4 x that, 16 B per parameter) and "tp_activation_per_bsz_dict"
  ({tp: MiB one rank keeps per sample, "checkpoint": the full-recompute figure at tp 1});
  "other_memory_pp_off[_sp]" -> {seq ->} {"model_states", "activation"} of embedding + head
  ({tp: MiB} in the "_sp" table, one number in the older plain one). "_sp" tables are measured
  with Megatron sequence parallelism, which is what our act_bytes_per_token holds under TP.
Import maps these onto one (seq_len, tp) point per tp and fits in the sequence length; every
choice is one line of `Imported.assumptions`, every field left out one line of `unmapped`.
Export writes 2.4.0's layout (what its search engine reads: run it with --sequence_parallel 1,
the tables are the "_sp" ones).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from orchestrator.choices import Dtype, Recompute, Source
from orchestrator.errors import ProfileError
from orchestrator.interop import Imported
from orchestrator.models.config import ModelConfig, count_block_params, validate_model
from orchestrator.profiling.model.analytic import CAUSAL_ATTENTION_FRACTION
from orchestrator.store import write_json
from orchestrator.store.schema import ModelProfile
from orchestrator.store.schema.identity import model_summary

MiB = 1024 * 1024
GALVATRON_STATE_BYTES_PER_PARAM = 16  # model_states = 4 x parameter_size (fp32 MiB)
BWD_FWD_RATIO = 2.0  # Galvatron's bct_fct_coe
EXPORT_BATCH_SIZES = tuple(range(1, 9))  # 2.4.0's batch mode asks for at least 8

_FILE = re.compile(r"^(computation|memory)_profiling_([a-z0-9]+)_(.+)\.json$")
_SHAPE = re.compile(r"^hidden(\d+)_head(\d+)(?:_seqlen(\d+))?$")
_BLOCK_TIME = re.compile(r"^layertype_0(?:_bsz(\d+))?(?:_seq(\d+))?$")
_OTHER_TIME = re.compile(r"^layertype_other(?:_0)?(?:_bsz(\d+))?(?:_seq(\d+))?$")


# ---------------------------------------------------------------- pure math
def attention_share(model: ModelConfig, seq_len: int) -> float:
    """Share of a block's forward FLOPs in the attention scores and value product at `seq_len`
    (causal: half of 4 s^2 h), against the dense 2 N s; the s^2 part of a block's time."""
    dense = 2.0 * count_block_params(model) * seq_len
    attention = 4.0 * seq_len ** 2 * model.hidden * CAUSAL_ATTENTION_FRACTION
    return attention / (dense + attention)


def split_block_fit(time_us: float, seq_len: int, share_s2: float) -> List[float]:
    """[c0, c1, c2] through one point: `share_s2` of `time_us` quadratic in s, the rest linear."""
    return [0.0, time_us * (1.0 - share_s2) / seq_len, time_us * share_s2 / seq_len ** 2]


def per_sample_ms(times_by_bsz: Mapping[int, float]) -> Tuple[float, Optional[float]]:
    """(ms per sample, intercept ms per micro-batch or None) from per-sample times by batch size:
    the slope of the least-squares line through (b, b * t_b) with two sizes or more (the mean
    when noise makes it non-positive), else the single time."""
    if len(times_by_bsz) < 2:
        return next(iter(times_by_bsz.values())), None
    xs = sorted(times_by_bsz)
    ys = [b * times_by_bsz[b] for b in xs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
             / sum((x - mx) ** 2 for x in xs))
    if slope <= 0:
        return sum(times_by_bsz.values()) / len(times_by_bsz), None
    return slope, my - slope * mx


# ---------------------------------------------------------------- finding the files
def _read(path: Path) -> Dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ProfileError(f"Galvatron profile {path} cannot be read ({e}); rerun Galvatron's "
                           "model profiler or import another directory") from None
    if not isinstance(data, dict):
        raise ProfileError(f"Galvatron profile {path}: expected a JSON object; rerun "
                           "Galvatron's model profiler")
    return data


def _matches(name: str, model: ModelConfig) -> bool:
    shape = _SHAPE.match(name)
    if shape is None:
        return name == model.name
    h, a, s = shape.groups()
    return int(h) == model.hidden and int(a) == model.heads and (s is None
                                                                 or int(s) == model.seq_len)


def _overrides(name: str, dtype: str) -> str:
    shape = _SHAPE.match(name)
    if shape is None:
        return f"model.name={name} model.dtype={dtype}"
    h, a, s = shape.groups()
    seq = f" model.seq_len={s}" if s else ""
    return f"model.hidden={h} model.heads={a}{seq} model.dtype={dtype}"


def find_model_files(in_dir, model: ModelConfig) -> Tuple[Path, Path]:
    """(computation, memory) file of `in_dir` for `model`: same dtype, same hidden and heads and
    seq_len when the name has them (else the same model name); a name with the length wins.
    ProfileError listing what was found and the overrides that would match."""
    in_dir = Path(in_dir)
    found: Dict[Tuple[str, str], Dict[str, Path]] = {}
    for path in sorted(in_dir.glob("*_profiling_*.json")):
        m = _FILE.match(path.name)
        if m and m.group(2) in Dtype.__members__:
            found.setdefault((Dtype.parse(m.group(2)).value, m.group(3)), {})[m.group(1)] = path
    dtype = Dtype.parse(model.dtype).value
    hits = sorted((k for k in found if k[0] == dtype and _matches(k[1], model)),
                  key=lambda k: _SHAPE.match(k[1]) is None or "seqlen" not in k[1])
    if not hits:
        seen = "; ".join(f"{n} ({d}): {_overrides(n, d)}" for d, n in sorted(found)) or "none"
        raise ProfileError(
            f"no Galvatron model profile in {in_dir} matches model {model.name} ({dtype}, "
            f"hidden {model.hidden}, heads {model.heads}, seq_len {model.seq_len}); found "
            f"{seen}: pass those overrides, or profile this model with Galvatron")
    pair = found[hits[0]]
    for kind in ("computation", "memory"):
        if kind not in pair:
            raise ProfileError(f"{in_dir}: {kind}_profiling_{hits[0][0]}_{hits[0][1]}.json is "
                               "missing next to its pair; copy it from Galvatron's configs/")
    return pair["computation"], pair["memory"]


# ---------------------------------------------------------------- reading the figures
def _times_at(time_config: Mapping[str, Any], pattern: re.Pattern, seq_len: int):
    """{bsz: ms per sample} of the keys matching `pattern` at `seq_len` (keys without a length
    count as at it), and the plain no-bsz figure (or None)."""
    by_bsz, plain = {}, None
    for key, value in time_config.items():
        m = pattern.match(key)
        if not m or not isinstance(value, (int, float)):
            continue
        bsz, seq = m.groups()
        if seq is not None and int(seq) != seq_len:
            continue
        if bsz is None:
            plain = float(value)
        else:
            by_bsz[int(bsz)] = float(value)
    return by_bsz, plain


def _profiled_seqs(time_config: Mapping[str, Any]) -> List[int]:
    return sorted({int(m.group(2)) for k in time_config
                   if (m := _BLOCK_TIME.match(k)) and m.group(2)})


def _at_seq(table: Mapping[str, Any], seq_len: int, marker: str):
    """A memory table's entry at `seq_len` (2.4.0: keyed by length; older: the entry itself,
    recognised by `marker`), with the length it was taken at (None for older tables)."""
    if marker in table:
        return table, None
    seqs = sorted(int(k) for k in table if str(k).isdigit())
    if not seqs:
        return None, None
    seq = seq_len if seq_len in seqs else seqs[-1]
    return table[str(seq)], seq


def _tp_table(value: Any) -> Dict[int, float]:
    """{tp: MiB} from a {tp: MiB} table or one number (at tp 1)."""
    if isinstance(value, (int, float)):
        return {1: float(value)}
    return {int(k): float(v) for k, v in value.items() if str(k).isdigit()}


def _memory_tables(memory_config: Mapping[str, Any], seq_len: int, path: Path):
    """{sequence parallel?: (layer entry, other entry, seq taken at)} for each of the "_sp" and
    plain table pairs the memory profile has (at least one)."""
    found = {}
    for suffix, sp in (("_sp", True), ("", False)):
        layer = memory_config.get(f"layertype_0{suffix}")
        other = memory_config.get(f"other_memory_pp_off{suffix}")
        if isinstance(layer, dict) and isinstance(other, dict):
            layer, seq = _at_seq(layer, seq_len, "parameter_size")
            other, _ = _at_seq(other, seq if seq is not None else seq_len, "model_states")
            if layer is not None and other is not None:
                found[sp] = (layer, other, seq)
    if not found:
        raise ProfileError(f"Galvatron profile {path} has no layertype_0[_sp] and "
                           "other_memory_pp_off[_sp] tables; rerun Galvatron's memory profiler")
    return found


def _tables_at(found: Mapping[bool, tuple], tp: int) -> Tuple[Mapping, Mapping, bool, Any]:
    """(layer, other, sequence parallel?, seq) standing for our engine's layer at `tp`: the
    "_sp" tables (Megatron sequence parallelism, ours under TP) where there are any, but at tp 1
    the plain ones where there are: no engine runs sequence parallelism on one rank, and
    Galvatron's own search prices a tp-1 layer without use_sp from them (its shipped llama-7b
    "_sp" figure at tp 1 is 430 MiB a sample, the plain one 301)."""
    sp = True in found and (tp > 1 or False not in found)
    return (*found[sp][:2], sp, found[sp][2])


# ---------------------------------------------------------------- import
def _state_bytes(params: float, dtype: Dtype, tp: int) -> Dict[str, float]:
    """Our Adam mixed-precision states of `params` split over `tp` ranks (memory.state_bytes)."""
    optim = 8 if dtype is Dtype.fp32 else 12
    return {"param_bytes": params * dtype.bytes / tp, "grad_bytes": 4.0 * params / tp,
            "optim_bytes": optim * params / tp}


def _block_memory(layer: Mapping, sp: bool, tp: int, seq: int, model: ModelConfig) -> Dict:
    acts = _tp_table(layer["tp_activation_per_bsz_dict"])
    none = acts[tp] * MiB / seq
    full = float(layer["tp_activation_per_bsz_dict"]["checkpoint"]) * MiB / seq / (tp if sp else 1)
    # Flash attention keeps no s x s scores: selective recompute drops only the logsumexp.
    selective = max(full, none - 4.0 * model.heads / tp)
    params = float(layer["parameter_size"]) * MiB / 4
    return {**_state_bytes(params, Dtype.parse(model.dtype), tp), "params": params / tp,
            "act_seq_len": seq,
            "act_bytes_per_token": {Recompute.none: none, Recompute.selective: selective,
                                    Recompute.full: full}}


def _other_memory(other: Mapping, tp: int, seq: int, dtype: Dtype) -> Dict:
    states, acts = _tp_table(other["model_states"]), _tp_table(other["activation"])
    # The older plain table has tp 1 only: a vocab-parallel embedding and head split it by tp.
    at = tp if tp in states else 1
    params = states[at] * MiB / GALVATRON_STATE_BYTES_PER_PARAM * at / tp
    act = acts[tp] if tp in acts else acts[1] / tp
    return {**_state_bytes(params, dtype, 1), "params": params, "act_seq_len": seq,
            "act_bytes_per_token": {m.value: act * MiB / seq for m in Recompute}}


def _tps(layer: Mapping, model: ModelConfig, max_tp: Optional[int]) -> List[int]:
    out = []
    for tp in sorted(_tp_table(layer["tp_activation_per_bsz_dict"])):
        try:
            validate_model(model, tp)
        except ValueError:
            continue  # heads or ffn do not split over tp
        if max_tp is None or tp <= max_tp:
            out.append(tp)
    return out


def _forward_ms(time_config: Mapping, pattern: re.Pattern, seq: int, path: Path, what: str):
    by_bsz, plain = _times_at(time_config, pattern, seq)
    if by_bsz:
        ms, intercept = per_sample_ms(by_bsz)
        return ms, {"ms_per_sample_by_bsz": by_bsz, "intercept_ms": intercept}
    if plain is not None:
        return plain, {}
    raise ProfileError(f"Galvatron profile {path} has no {what} time at seq {seq}; rerun "
                       "Galvatron's computation profiler")


def _seq_of(time_config: Mapping, time_path: Path, model: ModelConfig) -> int:
    seqs = _profiled_seqs(time_config)
    if seqs:
        return model.seq_len if model.seq_len in seqs else seqs[-1]
    shape = _SHAPE.match(_FILE.match(time_path.name).group(3))
    return int(shape.group(3)) if shape and shape.group(3) else model.seq_len


def _unmapped(time_config: Mapping, memory_config: Mapping, sp: bool, timing: Dict) -> List[str]:
    out = []
    raw = [k for k in time_config if k.startswith("layernum")]
    if raw:
        out.append(f"computation: {len(raw)} raw layernum[...] totals (whole-model times the "
                   "per-layer figures were derived from)")
    if timing.get("block", {}).get("ms_per_sample_by_bsz") and "layertype_0" in time_config:
        out.append("computation: plain layertype_0 (an older per-sample forward time; the "
                   "per-batch-size times were used)")
    if any(re.match(r"^layertype_[1-9]", k) for k in list(time_config) + list(memory_config)):
        out.append("layertype_1.. (more than one kind of layer, e.g. T5's decoder)")
    strategies = [k for k in memory_config if re.match(r"^\d+_\d+_\d+", k)]
    if strategies:
        out.append(f"memory: {len(strategies)} raw per-strategy tables (pp_tp_dp[_c][_vtp][_sp]:"
                   " per-rank ms/act/act_peak of whole runs; per-layer mixed TP figures)")
    if any("vtp" in k for k in strategies):
        out.append("memory: *_vtp_* tables (vocab-TP / vsp: the embedding and head split apart "
                   "from the layers' TP; ours splits them with the layers)")
    for key in ("other_memory_pp_on_first", "other_memory_pp_on_last"):
        if any(k.startswith(key) for k in memory_config):
            out.append(f"memory: {key}[_sp] (Galvatron's first/last-stage memory; our planner "
                       "puts half of 'other' on each)")
    if sp and "layertype_0" in memory_config:
        out.append("memory: layertype_0 / other_memory_pp_off without _sp at tp > 1 "
                   "(activations without sequence parallelism; the planner derives those from "
                   "the _sp figures)")
    out.append("embedding ZeRO-3 (embed_sdp) and Galvatron's zero2/zero3 memory ratios (our "
               "planner prices ZeRO itself)")
    return out


def _assumptions(model: ModelConfig, seq: int, share: float, sp: bool, timing: Dict) -> List[str]:
    dtype = Dtype.parse(model.dtype)
    ours = dtype.bytes + 4 + (8 if dtype is Dtype.fp32 else 12)
    fit = "slope of the least-squares line of batch time over batch size (Galvatron 2.4.0's " \
          "batch mode fits the same line; its intercept, a per-micro-batch constant our cost " \
          "model has no place for, is kept in extras)"
    how = fit if timing["block"].get("ms_per_sample_by_bsz") else "the one per-sample figure"
    return [
        f"block and other forward time per sequence = Galvatron's forward ms per sample at seq "
        f"{seq}, tp 1: {how}",
        f"backward = {BWD_FWD_RATIO:g} x forward (Galvatron times the forward only; its cost "
        "model's bct_fct_coe)",
        "time at tp t = time at tp 1 / t, for blocks and for the vocab-parallel embedding + head "
        "(Galvatron's cost model: fct = time * bsz / tp)",
        f"sequence-length fits from one length (seq {seq}): block c1 s + c2 s^2 with "
        f"{share:.1%} in s^2, the analytic share of causal attention-score FLOPs (2 s^2 h) "
        "against the dense 2 N s at that length; other c1 s (linear, through 0)",
        f"states: parameters = parameter_size MiB / 4 B (Galvatron counts fp32 parameters; its "
        f"model states are 4 x parameter_size = {GALVATRON_STATE_BYTES_PER_PARAM} B/param); "
        f"ours for {dtype.value}: {dtype.bytes} B params + 4 B fp32 grads + "
        f"{ours - dtype.bytes - 4} B optimizer = {ours} B/param, as profile_model writes; "
        f"'other' parameters = model_states MiB / {GALVATRON_STATE_BYTES_PER_PARAM} B",
        "activations per token = tp_activation_per_bsz_dict[tp] MiB per sample / seq "
        + ("(the _sp table: sequence parallel, as ours; at tp 1 the plain table where there "
           "is one: no sequence parallelism on one rank, Galvatron's search takes it there too)"
           if sp else
           "(no _sp table: figures without sequence parallelism, an over-estimate under SP)"),
        "full recompute = the 'checkpoint' figure (the layer input at tp 1)"
        + (" / tp (sequence parallel)" if sp else ""),
        "selective recompute = none minus the flash-attention logsumexp (4 B x heads / tp per "
        "token): Galvatron has no selective figure and its none figures keep no s x s scores",
        "activations per token constant in seq (no s^2 term: flash attention), as Galvatron's "
        "sequence mode scales them linearly",
        "other activations per token = other_memory_pp_off activation MiB per sample / seq, "
        "the same in every recompute mode",
    ]


def import_model(in_dir, model: ModelConfig, *, max_tp: Optional[int] = None) -> Imported:
    """Galvatron's model profile files in `in_dir` for `model` as a ModelProfile body (times in
    us per sequence, memory in bytes per rank), with the files read, what does not map and what
    was assumed. ProfileError when no file matches, a file is corrupt or a table is missing."""
    time_path, memory_path = find_model_files(in_dir, model)
    time_config, memory_config = _read(time_path), _read(memory_path)
    dtype = Dtype.parse(model.dtype)
    seq = _seq_of(time_config, time_path, model)
    block_ms, block_t = _forward_ms(time_config, _BLOCK_TIME, seq, time_path, "layertype_0")
    other_ms, other_t = _forward_ms(time_config, _OTHER_TIME, seq, time_path, "layertype_other")
    tables = _memory_tables(memory_config, seq, memory_path)
    layer, other, sp, mem_seq = _tables_at(tables, 2)  # what tp > 1 takes
    mem_seq = mem_seq or seq
    share = attention_share(model, seq)
    points, fits, memory = [], {}, {}
    for tp in _tps(layer, model, max_tp):
        block_us, other_us = block_ms * 1e3 / tp, other_ms * 1e3 / tp
        points.append({"seq_len": seq, "tp": tp, "block_fwd_us": block_us,
                       "block_bwd_us": BWD_FWD_RATIO * block_us, "other_fwd_us": other_us,
                       "other_bwd_us": BWD_FWD_RATIO * other_us, "source": Source.galvatron.value})
        fwd = split_block_fit(block_us, seq, share)
        fits[str(tp)] = {"block_fwd_us": fwd, "block_bwd_us": [BWD_FWD_RATIO * c for c in fwd],
                         "other_fwd_us": [0.0, other_us / seq],
                         "other_bwd_us": [0.0, BWD_FWD_RATIO * other_us / seq],
                         "seq_lens": [seq], "source": Source.galvatron.value}
        tp_layer, tp_other, tp_sp, tp_seq = _tables_at(tables, tp)
        tp_seq = tp_seq or seq
        memory[str(tp)] = {"block": _block_memory(tp_layer, tp_sp, tp, tp_seq, model),
                           "other": _other_memory(tp_other, tp, tp_seq, dtype),
                           "source": Source.galvatron.value}
    if not fits:
        raise ProfileError(f"Galvatron profile {memory_path}: no tp in its activation table "
                           f"splits model {model.name} (max_tp={max_tp})")
    timing = {"block": block_t, "other": other_t}
    body = {
        "model": model_summary(model),
        "points": points, "fits": fits, "memory": memory, "micro_batch_size": 1,
        "method": {"source": Source.galvatron.value,
                   "why": f"imported from Galvatron's {time_path.name} and {memory_path.name}",
                   "timing": "Galvatron's forward ms per sample, backward 2 x, tp t = 1/t",
                   "memory": "Galvatron's MiB per sample and parameter MiB, in our bytes"},
        "galvatron": {"seq_len": seq, "memory_seq_len": mem_seq, "sequence_parallel": sp,
                      "tp1_sequence_parallel": _tables_at(tables, 1)[2],
                      "layer_forward_ms": block_ms, "other_forward_ms": other_ms,
                      "timing": timing, "attention_share": share,
                      "parameter_size_MiB": float(layer["parameter_size"]),
                      "tp_activation_per_bsz_MiB": dict(layer["tp_activation_per_bsz_dict"]),
                      "other_memory_pp_off": other},
    }
    return Imported(body=body, files=[time_path, memory_path],
                    unmapped=_unmapped(time_config, memory_config, sp, timing),
                    assumptions=_assumptions(model, seq, share, sp, timing))


# ---------------------------------------------------------------- export
def _halves(table: Mapping[str, Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    return {kind: {tp: v / 2 for tp, v in by_tp.items()} for kind, by_tp in table.items()}


def galvatron_model_files(profile: ModelProfile,
                          seq_len: Optional[int] = None) -> Dict[str, Dict[str, Any]]:
    """Galvatron 2.4.0's two files as {file name: content} from our profile at `seq_len` (the
    model's by default): forward ms per sample at tp 1 (our tp t time x t), MiB tables of the
    sequence-parallel kind. Backward times and per-tp times other than time / tp have no place
    there; the first/last-stage tables get half of 'other' each, as our planner places it."""
    from orchestrator.planner.model_cost import ModelCost
    cost = ModelCost.from_profile(profile)
    m, seq = profile.model, int(seq_len or profile.model.seq_len)
    dtype = Dtype.parse(m.dtype)
    tp0 = min(cost.tps)
    block_ms = cost.block_fwd_us(seq, tp0) * tp0 / 1e3
    other_ms = cost.other_fwd_us(seq, tp0) * tp0 / 1e3
    times = {}
    for b in EXPORT_BATCH_SIZES:
        times[f"layertype_0_bsz{b}_seq{seq}"] = block_ms
        times[f"layertype_other_bsz{b}_seq{seq}"] = other_ms
    acts, states, other_acts = {}, {}, {}
    for tp in cost.tps:
        block, other = cost.memory(tp)
        acts[str(tp)] = block.act_bytes_per_token_at(Recompute.none, seq) * seq / MiB
        states[str(tp)] = (other.param_bytes / dtype.bytes * GALVATRON_STATE_BYTES_PER_PARAM
                           / MiB)
        other_acts[str(tp)] = other.act_bytes_per_token_at(Recompute.none, seq) * seq / MiB
    block0, _ = cost.memory(tp0)
    acts["checkpoint"] = block0.act_bytes_per_token_at(Recompute.full, seq) * seq * tp0 / MiB
    other_off = {"model_states": states, "activation": other_acts}
    memory = {
        "layertype_0_sp": {str(seq): {
            "parameter_size": block0.param_bytes * tp0 / dtype.bytes * 4 / MiB,
            "tp_activation_per_bsz_dict": acts}},
        "other_memory_pp_off_sp": {str(seq): other_off},
        "other_memory_pp_on_first_sp": {str(seq): _halves(other_off)},
        "other_memory_pp_on_last_sp": {str(seq): _halves(other_off)},
    }
    name = f"hidden{m.hidden}_head{m.heads}_seqlen{seq}"
    return {f"computation_profiling_{dtype.value}_{name}.json": times,
            f"memory_profiling_{dtype.value}_{name}.json": memory}


def write_galvatron_model(profile: ModelProfile, out_dir, *,
                          seq_len: Optional[int] = None) -> List[Path]:
    """Write Galvatron 2.4.0's computation_profiling_* and memory_profiling_* files for
    `profile` into `out_dir` (atomically); returns their paths."""
    out_dir = Path(out_dir)
    return [write_json(out_dir / name, content)
            for name, content in galvatron_model_files(profile, seq_len).items()]
