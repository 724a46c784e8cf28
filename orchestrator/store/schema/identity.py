"""What a profile claims to be: the one definition every reader checks it against.

A file under profiles/<cluster>/ is named for the cluster and model it was made for, but a name
is not proof (a copied file, a model file edited since, a profile of another shape). Each
profile records, from the config it was made under, every field that changes what it measures
or what a reader takes from it; `read_profile(..., config=cfg)` compares them with the config of
the command reading it (`differences`), and a profile that is not what it claims is stale
(ProfileError, exit 4, naming the file, each field's two values and the command that rebuilds
it). Every reader passes its config: search, train's prediction and its variable-length planner,
tune, trace's pricer, export.

Model profiles (`ModelSummary`), field by field:
- recorded and compared: name (the file is the model's; a copy of another's is refused), hidden,
  ffn, heads, kv_heads, vocab, make_vocab_size_divisible_by (the embedding's and head's rows
  at each tp: 1 when absent), dtype (the shapes and bytes timed and counted), layers (the
  planner takes the block count from the profile, and profile_model times the optimizer step
  against the whole model's parameters), and for a mixture-of-experts model experts, top_k,
  expert_ffn, shared_expert_ffn, dense_layers (what its MoE parts time), capacity_factor (routing
  drops and permutes only the tokens within capacity) and aux_loss_coef (routing runs the balance
  loss only when it is not 0);
- `experts` is 0 for a dense model: a dense profile has no MoE fields, so a MoE model never
  reads a dense model's profile as its own, nor the reverse;
- not compared: seq_len (how long the sequences of a run are: profile_model times a list of
  lengths and the fits carry the time and memory to any other; search and train choose theirs),
  rope_theta and norm_eps (constants inside the same ops: no time or memory changes).

Hardware profiles (`ClusterSummary`):
- recorded and compared: name (the cluster's folder; a copy of another cluster's is refused),
  tasks_per_node (which groups stay inside a node), and for a measured profile the backend (gloo
  ranks compute and talk on CPUs, nccl ranks on GPUs: what the links were timed with);
- not compared: nodes and world_size (a search over more ranks than profiled prices them from
  the fits and says so in a note), gpus_per_node (with nccl it equals tasks_per_node, with gloo
  the ranks run on CPUs whatever it is), and the backend of analytic and imported profiles (they
  price a link sheet or Galvatron's GPU measurements, not this cluster's backend).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

from orchestrator.choices import Source

MODEL_IDENTITY = ("name", "hidden", "ffn", "layers", "heads", "kv_heads", "vocab", "dtype")
# A mixture-of-experts model's (models/config.ModelConfig); `experts` 0 (a dense model) has none
# of the others.
MOE_IDENTITY = ("experts", "top_k", "expert_ffn", "shared_expert_ffn", "dense_layers",
                "capacity_factor", "aux_loss_coef")
# The vocabulary's padding (Megatron's --make-vocab-size-divisible-by): compared, and written
# only when it is not 1.
PADDING = "make_vocab_size_divisible_by"
CLUSTER_IDENTITY = ("name", "tasks_per_node")
MEASURED_CLUSTER_IDENTITY = CLUSTER_IDENTITY + ("backend",)

# (dotted key, the profile's value, the config's value)
Difference = Tuple[str, Any, Any]


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)  # an Enum as its JSON string


def model_identity(model) -> Dict[str, Any]:
    """{field: JSON value} that a model profile of `model` records and must match:
    MODEL_IDENTITY, `experts` (0: dense) and a MoE model's other MOE_IDENTITY fields. `model`
    is a ModelConfig, its DictConfig or a profile's ModelSummary."""
    identity = {f: _plain(getattr(model, f)) for f in MODEL_IDENTITY}
    identity["kv_heads"] = identity["kv_heads"] or identity["heads"]  # absent: no GQA
    # the vocabulary's padding (models/config.vocab_rows); absent (profiles before it): 1
    identity[PADDING] = getattr(model, PADDING, None) or 1
    identity["experts"] = getattr(model, "experts", None) or 0
    if identity["experts"]:
        identity.update({f: _plain(getattr(model, f)) for f in MOE_IDENTITY[1:]})
    return identity


def model_summary(model) -> Dict[str, Any]:
    """A model profile's `model` section for `model`: its identity and the sequence length it
    was profiled for (a dense model's written without `experts`)."""
    summary = {**model_identity(model), "seq_len": int(model.seq_len)}
    if not summary["experts"]:
        del summary["experts"]
    if summary[PADDING] == 1:  # a profile written before the key reads the same
        del summary[PADDING]
    return summary


def cluster_identity(cluster, measured: bool) -> Dict[str, Any]:
    """{field: JSON value} that a hardware profile of `cluster` (a ClusterConfig, its
    DictConfig or a profile's ClusterSummary) records and must match; `measured`: the
    profile's source is measured (its backend counts)."""
    fields = MEASURED_CLUSTER_IDENTITY if measured else CLUSTER_IDENTITY
    return {f: _plain(getattr(cluster, f)) for f in fields}


def differences(profile, config) -> List[Difference]:
    """Where `profile` (a ModelProfile or HardwareProfile; other kinds claim nothing) is not
    what `config` (the composed Config, or anything with its `model` and `cluster` sections)
    asks for: (dotted key, the profile's value, the config's), in identity order; [] when it
    is the model or cluster it claims."""
    kind = getattr(profile, "KIND", "")
    if kind == "model":
        have, want, section = model_identity(profile.model), model_identity(config.model), "model"
    elif kind == "hardware":
        measured = profile.source == Source.measured
        have = cluster_identity(profile.cluster, measured)
        want = cluster_identity(config.cluster, measured)
        section = "cluster"
    else:
        return []
    # A side without a MoE field is a dense model: `experts` alone says so.
    return [(f"{section}.{key}", have[key], want[key]) for key in have
            if key in want and have[key] != want[key]]


def show_value(value: Any) -> str:
    """A value as a user types it after `key=` (null for None, strings bare)."""
    return value if isinstance(value, str) else json.dumps(value)


def mismatch_message(path, found: List[Difference], rebuild: str) -> str:
    """The one line for a profile that is not what it claims: the file, each differing field's
    value in the profile and in the command, and the command that rebuilds it."""
    made = ", ".join(f"{key}={show_value(have)}" for key, have, _ in found)
    asked = ", ".join(f"{key}={show_value(want)}" for key, _, want in found)
    return f"{path} was profiled for {made}; this command asks for {asked}: stale. " \
           f"Rerun: {rebuild} force=true"
