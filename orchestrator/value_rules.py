"""The numbers a config may hold: one table of key -> allowed range, checked before anything runs.

The schema (orchestrator/config.py) says a key is an integer or a number; `RULES` says which of
them make sense (a learning rate above 0, a fraction in [0, 1], a count of at least 1, ...), and
`CROSS_RULES` the few that depend on another key. `check_values` checks a composed config (what
the group files, the site folder and the command line made of it, every point of a sweep too);
`check_override_values` checks the command line's own values before Hydra composes, so a bad
value in any point of a `-m` sweep is refused before the first point runs. A value out of its
range is refused in one line naming the key (ConfigError, exit 2).

What a stage knows beyond one key (a layout that does not divide the world, a length above the
model's) stays with the stage's own checks; `NOT_RULED` names the numeric keys left to them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Tuple

from orchestrator.errors import ConfigError


@dataclass(frozen=True)
class Bound:
    """A number's allowed range: lo..hi (None: no end), each end included unless open; `note`
    says what a special value means or why the range."""

    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""

    def allows(self, x: float) -> bool:
        """Whether `x` lies in the range (nan and inf never do: every comparison with nan is
        false, so `train.lr=nan` passed `> 0` and trained to a nan loss)."""
        if not math.isfinite(x):
            return False
        if self.lo is not None and (x <= self.lo if self.lo_open else x < self.lo):
            return False
        return self.hi is None or (x < self.hi if self.hi_open else x <= self.hi)

    def text(self) -> str:
        """The range as a message says it: '>= 1', '> 0', 'in [0, 1)'."""
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return (f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                f"{')' if self.hi_open else ']'}")


COUNT = Bound(lo=1)  # sizes, degrees, lengths, steps, iterations
NON_NEGATIVE = Bound(lo=0)
POSITIVE = Bound(lo=0, lo_open=True)
FRACTION = Bound(lo=0, hi=1)
ZERO_STAGE = Bound(lo=0, hi=3, note="a ZeRO stage")


def _note(bound: Bound, note: str) -> Bound:
    return Bound(bound.lo, bound.hi, bound.lo_open, bound.hi_open, note)


# Every numeric key of the schema (an unset optional, null, always passes; a list: each item).
RULES: Dict[str, Bound] = {
    "launcher.poll_s": POSITIVE,
    "cluster.nodes": COUNT, "cluster.tasks_per_node": COUNT,
    "cluster.gpus_per_node": _note(NON_NEGATIVE, "0: CPU nodes"),
    "cluster.device_mem_GiB": _note(NON_NEGATIVE, "0: not known"),
    "cluster.time_min": COUNT, "cluster.cpus_per_task": COUNT, "cluster.mem_GiB": POSITIVE,
    "cluster.signal_delay_s": NON_NEGATIVE,
    "cluster.links.intra_busbw_GBps": POSITIVE, "cluster.links.intra_p2p_GBps": POSITIVE,
    "cluster.links.nics_per_node": COUNT, "cluster.links.nic_Gbps": POSITIVE,
    "cluster.links.inter_efficiency": Bound(lo=0, hi=1, lo_open=True),
    "cluster.links.intra_latency_us": NON_NEGATIVE, "cluster.links.inter_latency_us": NON_NEGATIVE,
    "cluster.links.overlap_coe": _note(Bound(lo=1), "a slowdown: 1 is none"),
    "model.hidden": COUNT, "model.ffn": COUNT, "model.layers": COUNT, "model.heads": COUNT,
    "model.kv_heads": COUNT, "model.vocab": COUNT, "model.seq_len": COUNT,
    "model.rope_theta": POSITIVE, "model.norm_eps": POSITIVE,
    "model.experts": _note(NON_NEGATIVE, "0: a dense model"), "model.top_k": COUNT,
    "model.expert_ffn": _note(NON_NEGATIVE, "0: model.ffn"),
    "model.shared_expert_ffn": _note(NON_NEGATIVE, "0: none"),
    "model.dense_layers": NON_NEGATIVE,
    "model.capacity_factor": _note(POSITIVE, "null: dropless"),
    "model.aux_loss_coef": NON_NEGATIVE,
    "model.make_vocab_size_divisible_by": _note(COUNT, "1: pad only what TP needs"),
    "profile_hardware.min_size_bytes": COUNT, "profile_hardware.max_size_bytes": COUNT,
    "profile_hardware.size_step": _note(Bound(lo=2), "the factor between two sizes"),
    "profile_hardware.max_tp": COUNT, "profile_hardware.max_group": COUNT,
    "profile_hardware.max_pp": COUNT, "profile_hardware.warmup_iters": NON_NEGATIVE,
    "profile_hardware.min_iters": COUNT, "profile_hardware.max_iters": COUNT,
    "profile_hardware.max_time_s": POSITIVE,
    "profile_hardware.rel_spread": _note(NON_NEGATIVE, "0: never stop early"),
    "profile_model.seq_lens": COUNT, "profile_model.min_seq_len": COUNT,
    "profile_model.max_seq_len": COUNT, "profile_model.seq_len_step": COUNT,
    "profile_model.max_tp": COUNT, "profile_model.micro_batch_size": COUNT,
    "profile_model.micro_batch_sizes": COUNT,
    "profile_model.warmup_iters": NON_NEGATIVE, "profile_model.iters": COUNT,
    "search.memory_GiB": POSITIVE, "search.world_size": COUNT,
    "search.global_batch_size": COUNT, "search.seq_len": COUNT, "search.pp": COUNT,
    "search.tp": COUNT, "search.max_tp": COUNT, "search.max_pp": COUNT, "search.max_cp": COUNT,
    "search.max_ep": COUNT, "search.max_etp": COUNT, "search.ep": COUNT, "search.etp": COUNT,
    "search.moe_imbalance": _note(Bound(lo=1), "the busiest EP rank's load over the mean"),
    "search.zero_stages": ZERO_STAGE, "search.micro_batch_sizes": COUNT,
    "search.virtual_stages": _note(Bound(lo=2), "model chunks per stage of an interleaved "
                                                "schedule"),
    "search.reserve_fraction": Bound(lo=0, hi=1, hi_open=True, note="the share of the budget "
                                                                    "kept free"),
    "search.reserve_GiB": NON_NEGATIVE, "search.top_k": COUNT,
    "train.steps": COUNT, "train.pp": COUNT, "train.tp": COUNT, "train.cp": COUNT,
    "train.cp_a2a": COUNT, "train.ep": COUNT, "train.etp": COUNT, "train.zero": ZERO_STAGE,
    "train.micro_batch_size": COUNT, "train.num_micro_batches": COUNT,
    "train.global_batch_size": COUNT, "train.virtual_stages": COUNT,
    "train.layers_per_stage": COUNT, "train.seq_len": COUNT, "train.length_mean": COUNT,
    "train.seed": NON_NEGATIVE, "train.lr": POSITIVE, "train.min_lr_ratio": FRACTION,
    "train.warmup_steps": _note(NON_NEGATIVE, "0: no warm-up"),
    "train.weight_decay": NON_NEGATIVE, "train.grad_clip": _note(NON_NEGATIVE, "0: no clipping"),
    "train.log_every": COUNT, "train.timing_warmup_steps": NON_NEGATIVE,
    "train.checkpoint_every": _note(NON_NEGATIVE, "0: at the last step and a signal only"),
    "train.keep_checkpoints": _note(NON_NEGATIVE, "0: none written"),
    "train.memory_interval_s": _note(NON_NEGATIVE, "0: no memory sampler"),
    "train.memory_GiB": POSITIVE,
    "noop.sleep_s": NON_NEGATIVE,
    "tune.top_k": COUNT, "tune.steps": COUNT, "tune.timing_warmup_steps": NON_NEGATIVE,
    "tune.min_runs": _note(Bound(lo=2), "a fit needs two runs"),
    "init.nodes": COUNT, "init.tasks_per_node": COUNT, "init.max_time_min": COUNT,
    "init.preflight_nodes": COUNT, "init.preflight_time_min": COUNT,
    "trace.world_size": COUNT, "trace.pp": COUNT, "trace.tp": COUNT,
    "trace.global_batch_size": COUNT, "trace.micro_batch_size": COUNT, "trace.seq_len": COUNT,
    "trace.cp": COUNT, "trace.cp_a2a": COUNT, "trace.ep": COUNT, "trace.etp": COUNT,
    "trace.virtual_stages": COUNT, "trace.zero": ZERO_STAGE, "trace.layers_per_stage": COUNT,
    "trace.bucket_MiB": POSITIVE,
    "limits.max_micro_batches": COUNT, "limits.max_dynamic_samples": COUNT,
    "limits.max_traced_ranks": COUNT, "limits.max_trace_GiB": POSITIVE,
    "limits.max_profile_points": COUNT, "limits.max_message_GiB": POSITIVE,
    "limits.max_sweep_points": COUNT, "limits.max_local_ranks": COUNT,
}

# Numeric keys with no range here, and who checks them.
NOT_RULED: Dict[str, str] = {
    "trace.configs": "stage=trace: a configuration with an entry below 1 is skipped with its "
                     "reason, the others traced",
}


def _warmup_within_steps(get: Callable[[str], Any]) -> Optional[str]:
    """train.warmup_steps <= train.steps (null: the default, min(5, steps), always is)."""
    warmup, steps = get("train.warmup_steps"), get("train.steps")
    if warmup is None or steps is None or warmup <= steps:
        return None
    return (f"train.warmup_steps({warmup}) must be <= train.steps({steps}): the learning rate "
            f"would never reach train.lr (null: 5, or train.steps if fewer)")


# Rules over several keys: each gets a getter of the composed values (by dotted key) and says
# what is wrong, or None. Checked on the composed config only (the other key may come from a
# file or its default).
CROSS_RULES: Tuple[Callable[[Callable[[str], Any]], Optional[str]], ...] = (
    _warmup_within_steps,
)


def _items(value: Any) -> Iterable[Any]:
    """A value's numbers: itself, or a list's items (nested lists flattened)."""
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _items(item)
    else:
        yield value


def value_error(key: str, value: Any) -> Optional[str]:
    """One line naming `key` when `value` (or an item of it) is out of RULES[key]'s range;
    None when it is in range, unset (None), not a number (the type check says so), or the key
    has no rule."""
    from orchestrator.config_keys import user_spelling

    bound = RULES.get(key)
    if bound is None:
        return None
    for item in _items(value):
        if isinstance(item, bool) or not isinstance(item, (int, float)):
            continue
        if not bound.allows(item):
            note = f" ({bound.note})" if bound.note else ""
            if not math.isfinite(item):
                note += " and finite"
            if item is value:
                return user_spelling(f"{key}({item}) must be {bound.text()}{note}")
            return user_spelling(f"{key}({value}): every item must be {bound.text()}{note}, "
                                 f"not {item}")
    return None


def _select(cfg, key: str) -> Any:
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def check_values(cfg) -> None:
    """ConfigError naming the first key of the composed `cfg` whose value is out of its range
    (RULES), or the first CROSS_RULES rule it breaks."""
    for key in RULES:
        error = value_error(key, _select(cfg, key))
        if error:
            raise ConfigError(error)
    for rule in CROSS_RULES:
        error = rule(lambda key: _select(cfg, key))
        if error:
            raise ConfigError(error)


def _as_typed(key: str, value: Any) -> Any:
    """A command-line number as the schema holds it (`train.lr=-1` is -1.0), so a message
    reads the same before and after Hydra composes; lists item by item."""
    import typing

    from orchestrator.config_keys import _schema_hint

    hint = _schema_hint(key)
    while True:  # Optional[X] -> X, List[X] -> X
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if not args:
            break
        hint = args[0]

    def typed(item):
        if isinstance(item, (list, tuple)):
            return [typed(i) for i in item]
        if hint is float and isinstance(item, int) and not isinstance(item, bool):
            return float(item)
        return item

    return typed(value)


def check_override_values(argv: Sequence[str]) -> None:
    """ConfigError naming the key when a value the command line gives (every value of a
    sweep) is out of its range: before Hydra composes, so no point of a sweep runs first."""
    from orchestrator.commands import parse_overrides

    for o in parse_overrides(tuple(argv)) or ():
        key = o.key_or_group.lstrip("+")
        if o.is_delete() or key not in RULES:
            continue
        values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
        for value in values:
            if isinstance(value, str) and "${" in value:
                continue  # an interpolation: checked once composed
            error = value_error(key, _as_typed(key, value))
            if error:
                raise ConfigError(error)
