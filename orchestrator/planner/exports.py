"""A ParallelLayout in the words of other trainers: Megatron-LM arguments, a Galvatron strategy.

Both raise ExportError (strict, the default) when the layout uses something the trainer cannot
express, naming it; with strict=False they approximate it on the memory-safe side and warn.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional

from orchestrator.choices import CpComm, Recompute, Schedule
from orchestrator.errors import ConfigError
from orchestrator.layout import ParallelLayout, chunk_recompute
from orchestrator.models.config import ModelConfig, expert_width, is_moe
from orchestrator.planner.options import CostOptions, Overlap


class ExportError(ConfigError, ValueError):
    """The layout cannot be written for this trainer; the message says what and why."""


def _problem(strict: bool, message: str) -> None:
    if strict:
        raise ExportError(message)
    warnings.warn(message, stacklevel=3)


def megatron_args(layout: ParallelLayout, strict: bool = True,
                  overlap: Optional[Overlap] = None) -> List[str]:
    """Megatron-LM command-line arguments for `layout` (parallel sizes, batch, schedule,
    recompute, the pipeline partition, the overlap priced), as a list of strings ready for
    subprocess.

    `overlap` (None: CostOptions' defaults, all on): --overlap-grad-reduce for the DDP's
    gradient sync, --overlap-param-gather with the distributed optimizer (ZeRO 1/2; Megatron
    wants --overlap-grad-reduce with it), --tp-comm-overlap with sequence parallelism (Megatron
    refuses it without); none of them for ZeRO 3 (torch FSDP2 has its own prefetch).

    Megatron expresses every partition a ParallelLayout holds, uneven and interleaved with
    short end chunks included (megatron_partition); one recompute setting for every stage
    (block method: the first r layers of each model chunk, all of a shorter one); ZeRO 1 as
    --use-distributed-optimizer and ZeRO 3 as --use-torch-fsdp2 (pp 1 and ep 1 only: an
    ExportError otherwise, strict or not). Anything else is an
    ExportError (strict) or, with strict=False, approximated on the memory-safe side (ZeRO 2 ->
    distributed optimizer, differing recompute -> the most recompute any stage has) with a
    warning."""
    v = layout.virtual_stages
    args = ["--tensor-model-parallel-size", str(layout.tp),
            "--pipeline-model-parallel-size", str(layout.pp),
            "--num-layers", str(layout.num_layers),
            "--micro-batch-size", str(layout.micro_batch_size),
            "--global-batch-size", str(layout.global_batch_size)]
    if layout.cp > 1:
        args += ["--context-parallel-size", str(layout.cp), "--cp-comm-type", layout.cp_comm]
    if layout.cp_comm == CpComm["a2a+p2p"]:  # the all-to-all inside, the ring across
        args += ["--hierarchical-context-parallel-sizes", str(layout.cp_a2a),
                 str(layout.cp // layout.cp_a2a)]
    if layout.ep * layout.etp > 1:
        args += ["--expert-model-parallel-size", str(layout.ep),
                 "--expert-tensor-parallel-size", str(layout.etp)]
    if layout.sequence_parallel:
        args.append("--sequence-parallel")
    if layout.zero == 1:
        args.append("--use-distributed-optimizer")
    elif layout.zero == 2:
        _problem(strict, "Megatron-LM's ZeRO-2 is Megatron-FSDP (--use-megatron-fsdp "
                         "--data-parallel-sharding-strategy optim_grads), which is not priced "
                         "here; written as its distributed optimizer (ZeRO-1), which shards "
                         "less")
        args.append("--use-distributed-optimizer")
    elif layout.zero == 3:
        # Megatron's torch FSDP2 runs without pipeline and expert parallelism only, and refuses
        # its default gradient-accumulation fusion (arguments.py, validate_args); no other
        # Megatron option holds a ZeRO-3 layout's memory, so it is not written, strict or not
        if layout.pp > 1 or layout.ep > 1:
            raise ExportError(f"ZeRO 3 with pp({layout.pp}), ep({layout.ep}): Megatron-LM's "
                              f"--use-torch-fsdp2 runs only with pp 1 and ep 1")
        args += ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]

    args += megatron_partition(layout)
    if v > 1 and layout.pp == 2:
        # Megatron refuses interleaving over 2 stages unless the sends overlap (arguments.py:
        # two sends between the same ranks in one batch otherwise)
        args.append("--overlap-p2p-comm")
    args += megatron_overlap_args(layout, CostOptions().megatron_overlap() if overlap is None
                                  else overlap)

    # Recompute: one setting for all stages, the first r layers of each chunk (block method).
    modes = {mode for mode, _ in layout.recompute}
    per_chunk = [chunk_recompute(k, chunks) if mode == Recompute.full else 0
                 for (mode, k), chunks in zip(layout.recompute, layout.layers_per_chunk)]
    full_r = max(per_chunk)
    if full_r:
        same = all(sum(min(full_r, c) for c in chunks) == k
                   for (_, k), chunks in zip(layout.recompute, layout.layers_per_chunk))
        if not same or modes != {Recompute.full}:
            _problem(strict, f"Megatron-LM applies one recompute setting to every stage, got "
                             f"{list(layout.recompute)}")
        args += ["--recompute-granularity", "full", "--recompute-method", "block",
                 "--recompute-num-layers", str(full_r)]
    elif Recompute.selective in modes:
        if modes != {Recompute.selective}:
            _problem(strict, f"Megatron-LM applies one recompute setting to every stage, got "
                             f"{list(layout.recompute)}")
        args += ["--recompute-granularity", "selective"]
    return args


def megatron_overlap_args(layout: ParallelLayout, overlap: Overlap) -> List[str]:
    """The overlap flags that make Megatron-LM run what the cost model priced for `layout`
    (megatron_args' docstring says which apply where)."""
    args = []
    if layout.zero < 3 and overlap.grad_reduce:
        args.append("--overlap-grad-reduce")
        if layout.zero in (1, 2) and overlap.param_gather:
            args.append("--overlap-param-gather")
    if overlap.tp_comm and layout.sequence_parallel and layout.tp > 1:
        args.append("--tp-comm-overlap")
    return args


def moe_layer_freq(model: ModelConfig) -> str:
    """Megatron's --moe-layer-freq list for `model`: "([0]*d+[1]*m)" with d dense blocks first
    ("([1]*m)" without)."""
    moe = model.layers - model.dense_layers
    return f"([0]*{model.dense_layers}+[1]*{moe})" if model.dense_layers else f"([1]*{moe})"


def megatron_model_args(model: ModelConfig) -> List[str]:
    """The arguments of `model` the layout's (megatron_args) leave out: its shape and
    architecture (Llama-style: RMSNorm, GQA, RoPE, SwiGLU, no linear biases, and an untied head,
    which Megatron ties by default: for llama2_7b 131M parameters fewer than priced), the
    vocabulary's padding, always written (Megatron's own default, 128, would pad further than
    what was priced and trained: models/config.vocab_rows), and the experts'
    (megatron_moe_args). The sequence length and the tokenizer are the run's."""
    divisor = getattr(model, "make_vocab_size_divisible_by", None) or 1
    args = ["--hidden-size", str(model.hidden), "--ffn-hidden-size", str(model.ffn),
            "--num-attention-heads", str(model.heads)]
    if model.kv_heads != model.heads:
        args += ["--group-query-attention", "--num-query-groups", str(model.kv_heads)]
    args += ["--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", f"{model.norm_eps:g}",
             "--position-embedding-type", "rope", "--rotary-base", _rotary_base(model.rope_theta),
             "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--make-vocab-size-divisible-by", str(divisor)]
    return args + megatron_moe_args(model)


def _rotary_base(theta: float) -> str:
    """Megatron-LM parses --rotary-base as an int (arguments.py): 1000000, never 1e+06."""
    return str(int(theta)) if float(theta).is_integer() else repr(float(theta))


def megatron_moe_args(model: ModelConfig) -> List[str]:
    """The mixture-of-experts arguments of `model` (empty for a dense one); the expert grid's
    sizes are the layout's (megatron_args).

    Names and meanings are Megatron-LM's (megatron/training/arguments.py, _add_moe_args).
    models/moe.py's router is Megatron's default (top-k of the logits, softmax over the k: the
    weights of a softmax over all renormalised over the k), so no --moe-router-pre-softmax; its
    experts are a loop of GEMMs, so no --moe-grouped-gemm (a flag: off when absent)."""
    if not is_moe(model):
        return []
    args = ["--num-experts", str(model.experts),
            "--moe-router-topk", str(model.top_k),
            "--moe-ffn-hidden-size", str(expert_width(model)),
            "--moe-layer-freq", moe_layer_freq(model),
            "--moe-token-dispatcher-type", "alltoall",
            "--moe-router-load-balancing-type", "seq_aux_loss",
            "--moe-aux-loss-coeff", f"{model.aux_loss_coef:g}"]
    if model.shared_expert_ffn:
        args += ["--moe-shared-expert-intermediate-size", str(model.shared_expert_ffn)]
    if model.capacity_factor is not None:
        # models/moe.py keeps each expert's first tokens (Megatron's "position" policy), and
        # pads nothing (no --moe-pad-expert-input-to-capacity)
        args += ["--moe-expert-capacity-factor", f"{model.capacity_factor:g}",
                 "--moe-token-drop-policy", "position"]
    return args


def megatron_partition(layout: ParallelLayout) -> List[str]:
    """Megatron's arguments for the layout's layers per stage and model chunk, exact: equal
    stages by --num-layers-per-virtual-pipeline-stage; equal middle stages with other first
    and last ones (each a multiple of v) by --decoder-first/last-pipeline-num-layers (and
    --num-virtual-stages-per-pipeline-rank, the only virtual size Megatron takes with them);
    anything else, uneven middle stages or a short end chunk (layout.stage_chunks), by
    --pipeline-model-parallel-layout (pipeline_layout_string)."""
    p, v = layout.pp, layout.virtual_stages
    layers = list(layout.layers_per_stage)
    if p == 1:
        return []
    first, middle, last = layers[0], layers[1:-1], layers[-1]
    if len(set(middle)) > 1 or layout.short_chunks:
        return ["--pipeline-model-parallel-layout", pipeline_layout_string(layout)]
    if len(set(layers)) == 1:
        return ["--num-layers-per-virtual-pipeline-stage", str(first // v)] if v > 1 else []
    q = middle[0] if middle else None
    args = []
    if first != q:
        args += ["--decoder-first-pipeline-num-layers", str(first)]
    if last != q:
        args += ["--decoder-last-pipeline-num-layers", str(last)]
    if v > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(v)]
    return args


def pipeline_layout_string(layout: ParallelLayout) -> str:
    """Megatron's --pipeline-model-parallel-layout for `layout`: one entry per virtual stage
    (chunk c of stage s is entry c * pp + s), separated by "|", each its decoder layers ("t",
    "t*k" for k > 2), the embedding "E" first and the loss "L" last; runs of equal entries as
    "(entry|)*n" (the syntax of megatron/core/transformer/pipeline_parallel_layer_layout.py).
    Llama 3 405B's 126 layers over 16 stages with v = 8: "E|(t|)*126L"."""
    p, v = layout.pp, layout.virtual_stages
    chunks = layout.layers_per_chunk
    entries = []
    for c in range(v):
        for s in range(p):
            k = chunks[s][c]
            entries.append("t" * k if k <= 2 else f"t*{k}")
    entries[0] = "E" + entries[0]
    entries[-1] += "L"
    runs: List[List] = []  # [entry, repeats]
    for entry in entries:
        if runs and runs[-1][0] == entry:
            runs[-1][1] += 1
        else:
            runs.append([entry, 1])
    parts = []
    for i, (entry, n) in enumerate(runs):
        end = i == len(runs) - 1
        repeated, single = (n - 1, True) if end else (n, False)
        if repeated > 1:
            parts.append(f"({entry}|)*{repeated}")
        elif repeated == 1:
            parts.append(f"{entry}|")
        parts.append(entry if single else "")
    return "".join(parts)


def galvatron_strategy(layout: ParallelLayout, strict: bool = True) -> Dict[str, Any]:
    """A Galvatron (PKU-DAIR/Hetu-Galvatron) strategy JSON dict for `layout`: per-layer encodings
    as comma-separated strings (tp_sizes_enc, tp_consecutive_flags, dp_types_enc, use_sp,
    checkpoint), pp_deg / pp_division / chunks / pipeline_type / global_bsz, default_dp_type and
    the vocabulary's vtp / vsp / embed_sdp.

    Megatron-style sequence parallelism is Galvatron's global `--sequence-parallel` training
    argument (`--sequence_parallel` of its search), not a JSON field; its per-layer `use_sp` is
    Ulysses, written for context parallelism in the a2a flavour without TP (cp as the layers'
    degree; other CP: ExportError). Galvatron has no interleaved schedule, no selective
    recompute and no ZeRO-1: ExportError (strict) or, with strict=False, 1F1B (pipedream_flush), full
    checkpointing of those layers and zero2, with a warning. Everything else comes back
    unchanged through orchestrator.interop.galvatron.strategy.read_strategy."""
    L = layout.num_layers
    # Galvatron's per-layer use_sp is Ulysses in place of TP: our a2a flavour without TP. The
    # others are not approximated: a layout without CP needs cp times the activations.
    ulysses = layout.cp > 1 and layout.cp_comm == CpComm.a2a and layout.tp == 1
    if layout.cp > 1 and not ulysses:
        why = ("Galvatron has no ring, all-gather or hierarchical context parallelism"
               if layout.cp_comm != CpComm.a2a
               else f"Galvatron's Ulysses (use_sp) replaces TP, it does not combine with "
                    f"tp({layout.tp})")
        raise ExportError(f"cp({layout.cp}) with cp_comm {layout.cp_comm}: not written for "
                          f"Galvatron: {why}")
    degree = layout.cp if ulysses else layout.tp
    if layout.schedule != Schedule["1f1b"]:
        _problem(strict, "Galvatron has no interleaved pipeline schedule; it would run "
                         "pipedream_flush (1F1B)")
    checkpoint: List[int] = []
    for (mode, k), n, chunks in zip(layout.recompute, layout.layers_per_stage,
                                    layout.layers_per_chunk):
        if mode == Recompute.selective:
            _problem(strict, "Galvatron has no selective recompute; those layers would be "
                             "fully checkpointed")
            checkpoint += [1] * n
        elif mode == Recompute.full:
            # Megatron's block method recomputes the first r layers of each chunk; Galvatron
            # flags layers one by one, so mark the same layers.
            r = chunk_recompute(k, chunks)
            for c in chunks:
                checkpoint += [1] * min(r, c) + [0] * (c - min(r, c))
        else:
            checkpoint += [0] * n
    if layout.zero == 1:
        _problem(strict, "Galvatron has no ZeRO-1 (its default_dp_type is ddp, zero2 or zero3); "
                         "written as zero2, which also shards gradients")
    zero3 = layout.zero == 3

    def enc(values) -> str:
        return ",".join(str(x) for x in values)

    return {
        "pp_deg": layout.pp,
        "tp_sizes_enc": enc([degree] * L),
        "tp_consecutive_flags": enc([1] * L),
        "dp_types_enc": enc([1 if zero3 else 0] * L),
        "use_sp": enc([int(ulysses)] * L),
        "checkpoint": enc(checkpoint),
        "global_bsz": layout.global_batch_size,
        "chunks": layout.num_micro_batches,
        "pp_division": enc(layout.layers_per_stage),
        "pipeline_type": "pipedream_flush",
        "default_dp_type": "ddp" if layout.zero == 0 else "zero2",
        "vtp": degree,
        "vsp": int(ulysses),
        "embed_sdp": 1 if zero3 else 0,
    }
