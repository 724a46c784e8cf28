"""Published H100 BF16 training runs, each layout priced as it ran (search.engine=megatron), beside
its published throughput, with the memory it is predicted to need and what the search picks.

    python bench/published_runs.py            # every run (10-12 minutes on 2 loaded cores)
    python bench/published_runs.py --quick    # no search, no Galvatron: the pricing (4 min)
    python bench/published_runs.py --smoke    # two small runs on the test fixtures' profiles
    python bench/published_runs.py --runs 'Llama 3'   # the runs whose label holds this text
    python bench/published_runs.py --json rows.json   # also each row's figures, to compare
    python bench/published_runs.py --runs 'Llama 3' --quick --guesses   # every guess's terms

Profiles are the project's analytic ones, as a user planning from a laptop gets them: hardware
`analytic_hardware("dgx_h100", world)` (published H100 / NDR figures), each model shape from
`stage=profile_model cluster=dgx_h100` at the run's sequence length (exact memory, FLOP-based
time on the H100 sheet), written once per shape by the CLI into a temporary folder; shapes that
have no config in conf/model are written as model configs into a temporary site conf folder
(ORCHESTRATOR_CONF, orchestrator/conf_folders.py).

Each run (RUNS: its source, paper table or URL, and every layout field it publishes) is priced
with `CostOptions(engine="megatron")` (NeMo AutoModel's Qwen3 30B-A3B, FSDP2 + EP: our engine's
model, `Run.engine`) and the search's default reserve (search.reserve_fraction
0.10 x 80 GiB + search.reserve_GiB 1.0 = 9 GiB). Where a detail is not published (micro-batch
size, recompute, interleaving depth and the partition Megatron runs it with, ZeRO stage), every
guess in `Run.guesses` is priced and the one the planner would take itself is shown: the
fastest that fits 80 GiB with the reserve (the runs' authors tuned what they left out for
speed), else the fastest, with the least memory any guess needs beside it. The guesses favour
the planner (each fits if any does); the published figure plays no part in the choice, so a
guess cannot absorb an error of the cost model. The row says which guess it took.
Throughput is counted as the source counts it (`Run.flops`): Llama 3 with the project's
`orchestrator.device.model_flops` (6 N per token plus causal attention; the paper does not give
its formula), Megatron-LM's README with Megatron's own `num_floating_point_operations`
(megatron/training/training.py; `megatron_flops` below: no embedding lookup, which
model_flops's 6 N counts), NeMo's by its published tokens/s (the ratio is then of tokens/s).

Beside each run, the search at the same world size, global batch and sequence length (80 GiB,
engine megatron, the default reserve; stage=search's defaults otherwise) and its pick's
throughput. Then the summary the issue's "Done when" needs, and Galvatron's own picks on its
shipped llama-7b files priced with stage=train's engine (engine=orchestrator) on its imported
profiles (the sdist bench/galvatron_side_by_side.py downloads; skipped without it).

Targets (issue 41): the median of predicted/published within 0.95-1.05, every run within
0.80-1.20, every published layout fits its 80 GB H100 with the reserve, and Galvatron's picks
fit with our engine. Nothing is fitted to these figures: they are a check.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import yaml  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

from orchestrator.choices import CpComm, Engine, Recompute, Schedule  # noqa: E402
from orchestrator.device import model_flops  # noqa: E402
from orchestrator.layout import LayoutError, ParallelLayout  # noqa: E402
from orchestrator.models.config import ModelConfig, count_params, model_fields  # noqa: E402
from orchestrator.planner import (CostOptions, HardwareModel, InfeasibleError,  # noqa: E402
                                  ModelCost, SearchSpace, evaluate, search)
from orchestrator.planner.options import memory_reserve_GiB  # noqa: E402
from orchestrator.planner.search import auto_max_cp  # noqa: E402
from orchestrator.profiling.hardware.analytic import LinkSheet, analytic_hardware  # noqa: E402
from orchestrator.store import write_json  # noqa: E402

GiB = 2**30
BUDGET_GiB = 80  # an H100's 80 GB
# The search's default reserve (search.reserve_fraction x budget + search.reserve_GiB).
RESERVE_GiB = memory_reserve_GiB(BUDGET_GiB, 0.10, 1.0)
TARGET_MEDIAN = (0.95, 1.05)
TARGET_EACH = (0.80, 1.20)
SMOKE_RUNS = ("Megatron GPT 1.7B", "NeMo Qwen3 30B-A3B")  # a dense and a MoE run, 48 and 8 GPUs


@dataclass(frozen=True)
class Shape:
    """A model shape: an existing conf/model name (`conf`), or the fields of a model config the
    bench writes itself (a Llama-style SwiGLU block; `note` says how it stands for the source's)."""

    name: str
    hidden: int = 0
    ffn: int = 0
    layers: int = 0
    heads: int = 0
    kv_heads: int = 0
    vocab: int = 0
    conf: Optional[str] = None
    note: str = ""


@dataclass(frozen=True)
class Guess:
    """The layout details a source leaves out, one guess of them."""

    micro_batch_size: int = 1
    recompute: Recompute = Recompute.none
    virtual_stages: int = 1
    zero: int = 1
    partition: str = "even"  # "even" | "last" | "first_last": stages_of

    def describe(self, run: "Run") -> str:
        """The guessed details of `run` (those it publishes left out)."""
        parts = [f"mbs{self.micro_batch_size}" if run.mbs_unpublished else "",
                 f"rc {self.recompute}",
                 f"v{self.virtual_stages} {self.partition}" if run.pp > 1 else "",
                 f"zero{self.zero}" if run.zero is None else ""]
        return " ".join(p for p in parts if p)


@dataclass(frozen=True)
class Run:
    """One published run: its figures and layout as its source gives them."""

    label: str
    source: str  # paper + table, or URL
    shape: Shape
    gpus: int
    tp: int
    pp: int
    dp: int
    seq_len: int
    global_batch: int  # sequences
    published_tflops: float  # per GPU, as the source counts its FLOPs
    # "model_flops" (the project's), "megatron" (num_floating_point_operations) or "tokens" (the
    # source publishes tokens/s per GPU: the ratio is of tokens/s, whatever its FLOP count)
    flops: str
    published_tokens_per_s: Optional[float] = None  # per GPU, when the source gives it
    cp: int = 1
    cp_comm: CpComm = CpComm.p2p
    sequence_parallel: bool = True
    ep: int = 1
    zero: Optional[int] = None  # published (FSDP: 3); None: the guess's
    mbs_unpublished: bool = True
    guesses: Tuple[Guess, ...] = (Guess(),)
    unpublished: str = ""  # what the source leaves out
    # the engine model that prices it: Megatron-LM's, or ours (FSDP2 + EP) for NeMo AutoModel
    engine: Engine = Engine.megatron
    moe_imbalance: Optional[float] = None  # None: search.moe_imbalance's default


def guesses(mbs=(1, 2), recompute=(Recompute.none, Recompute.selective), v=(1, 2, 4),
            zero=(1,), partition=("even", "last")) -> Tuple[Guess, ...]:
    """Every combination of the details a source leaves out."""
    return tuple(Guess(m, r, vs, z, u) for m, r, vs, z, u
                 in itertools.product(mbs, recompute, v, zero, partition))


LLAMA3 = "The Llama 3 Herd of Models (arXiv 2407.21783), Table 4"
LLAMA3_UNPUBLISHED = ("micro-batch size, interleaving depth v, ZeRO stage (the paper shards "
                      "optimizer states and gradients); recompute none: section 3.3.2 trains "
                      "without activation checkpointing")
# Llama 3 405B: interleaved 1F1B with the first and the last stage one layer fewer (section
# 3.3.2; "first_last"); the other partitions stand in where the planner cannot interleave it.
# The paper's first chunk of the first stage holds only the embedding and the last chunk of the
# last only the output and loss: with 7 layers on the end stages and 8 on the others, that is
# v = 8, one layer per chunk (16 x 8 - 2 = 126); v 1, 2 and 4 stand beside it.
LLAMA3_GUESSES = guesses(mbs=(1, 2), recompute=(Recompute.none,), v=(1, 2, 4, 8), zero=(1, 2),
                         partition=("first_last", "last", "even"))

MEGATRON = ("NVIDIA/Megatron-LM README.md, 'Training Speed and Scalability' model table "
            "(images/model_table.png, commit f2e5db402c, July 2024)")
MEGATRON_NOTE = ("GPT: GeLU MLP 4h, MHA, vocab 131072, untied embeddings; here a SwiGLU block of "
                 "ffn ~8h/3 (same MLP weights, FLOPs and Megatron's saved MLP bytes)")
MEGATRON_UNPUBLISHED = ("micro-batch size, recompute, interleaving depth v (ZeRO 1: the README "
                        "runs --overlap-param-gather, the distributed optimizer's)")


def _gpt(params: str, heads: int, hidden: int, layers: int) -> Shape:
    """A GPT of the Megatron-LM README's table: GeLU MLP 4h stands as a SwiGLU block of width
    8h/3 (rounded to a multiple of 64), which has the same MLP weights and FLOPs, and Megatron
    saves the same MLP bytes for it (4h in + 4h out vs 2f in + f out)."""
    ffn = round(8 * hidden / 3 / 64) * 64
    return Shape(f"gpt_{params.lower().replace('.', '_')}", hidden=hidden, ffn=ffn, layers=layers,
                 heads=heads, kv_heads=heads, vocab=131072, note=MEGATRON_NOTE)


# (params, heads, hidden, layers, TP, PP, DP, GPUs, batch, TFLOP/s per GPU)
MEGATRON_TABLE = (
    ("1.7B", 16, 2048, 24, 1, 1, 48, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 96, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 48, 384, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 48, 768, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 48, 1536, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 48, 2304, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 48, 3072, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 6144, 3072, 459.9),
)

LLAMA3_405B = Shape("llama3_405b", conf="llama3_405b")

NEMO_AUTOMODEL = ("NVIDIA NeMo AutoModel performance summary, pre-training, DGX-H100 BF16 "
                  "(https://docs.nvidia.com/nemo/automodel/nightly/performance-summary.html)")
NEMO_UNPUBLISHED = ("recompute; the engine is NeMo AutoModel's (PyTorch FSDP2, TE, DeepEP), "
                    "priced as Megatron-LM's with ZeRO 3 for FSDP; the MoE load balance "
                    "(search.moe_imbalance's default)")
# Llama 3 70B (Meta's params.json: dim 8192, 80 layers, 64 heads, 8 KV heads, ffn 28672,
# vocabulary 128256).
LLAMA3_70B = Shape("llama3_70b", hidden=8192, ffn=28672, layers=80, heads=64, kv_heads=8,
                   vocab=128256)
QWEN3_30B_A3B = Shape("qwen3_30b_a3b", conf="qwen3_30b_a3b")
NEMO_QWEN3_RECIPE = ("its recipe NVIDIA-NeMo/Automodel "
                     "examples/llm_benchmark/qwen/qwen3_moe_30b_te_deepep.yaml (strategy fsdp2, "
                     "ep_size 8, activation_checkpointing true, local_batch_size 4, "
                     "fake_balanced_gate true, MaskedCrossEntropy without fp32 upcast, "
                     "torch.optim.Adam)")
# Why our engine's model: NeMo AutoModel shards the dense weights with FSDP2 over the 8 ranks
# and holds the experts by EP alone (ep 8 of 8: no expert FSDP), checkpoints whole blocks and
# computes the loss on bf16 logits: our engine's ZeRO 3 + EP (FSDP2 per block, the experts a
# unit of their own over edp = 1, full recompute, bf16 logits) keeps the same tensors; Megatron-
# Core's model (a distributed optimizer's buffers, its own recompute) is another engine's.
NEMO_QWEN3_UNPUBLISHED = (
    "the parameter and optimizer dtypes (priced as our engine holds them: fp32 shards, fp32 "
    "Adam moments, 16 B per parameter, the experts' 1/edp = whole); the engine is NeMo "
    "AutoModel's (PyTorch FSDP2, TE, DeepEP), priced as stage=train's engine (engine="
    "orchestrator: FSDP2 + EP, the nearest of the planner's engine models)")

RUNS: Tuple[Run, ...] = (
    Run("Llama 3 405B 8K", LLAMA3, LLAMA3_405B, 8192, tp=8, pp=16, dp=64, seq_len=8192,
        global_batch=64 * 32, published_tflops=430, flops="model_flops",
        guesses=LLAMA3_GUESSES, unpublished=LLAMA3_UNPUBLISHED),
    Run("Llama 3 405B 8K", LLAMA3, LLAMA3_405B, 16384, tp=8, pp=16, dp=128, seq_len=8192,
        global_batch=128 * 16, published_tflops=400, flops="model_flops",
        guesses=LLAMA3_GUESSES, unpublished=LLAMA3_UNPUBLISHED),
    # All-gather based context parallelism (the same paper, section 3.3.2).
    Run("Llama 3 405B 128K", LLAMA3, LLAMA3_405B, 16384, tp=8, pp=16, dp=8, cp=16,
        cp_comm=CpComm.allgather, seq_len=131072, global_batch=8 * 16, published_tflops=380,
        flops="model_flops", guesses=LLAMA3_GUESSES, unpublished=LLAMA3_UNPUBLISHED),
) + tuple(
    Run(f"Megatron GPT {params}", MEGATRON, _gpt(params, heads, hidden, layers), gpus, tp=tp,
        pp=pp, dp=dp, seq_len=4096, global_batch=batch, published_tflops=tflops,
        flops="megatron", sequence_parallel=tp > 1, unpublished=MEGATRON_UNPUBLISHED,
        guesses=guesses(v=(1, 2, 4) if pp > 1 else (1,)))
    for params, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops in MEGATRON_TABLE) + (
    # NeMo's long-sequence table (NeMo docs, performance_long_sequence.md) is FP8 and its
    # Megatron-Bridge tables give H100 BF16 only for GPT-OSS 120B (attention sinks, a 64-wide
    # head over a 2880 hidden: not a shape ModelConfig holds); these are its H100 BF16 rows.
    # MBS, GA (micro-batches), TP, PP, CP, EP and FSDP as published; LBS = MBS.
    # As its recipe runs it (NEMO_QWEN3_RECIPE): FSDP2 + EP 8 with DeepEP, every layer
    # checkpointed, local batch 4, routing forced balanced (fake_balanced_gate); priced with
    # our engine's memory and traffic, the same FSDP2 + EP (NEMO_QWEN3_ENGINE).
    Run("NeMo Qwen3 30B-A3B", NEMO_AUTOMODEL + "; " + NEMO_QWEN3_RECIPE, QWEN3_30B_A3B, 8, tp=1,
        pp=1, dp=8, ep=8, zero=3, seq_len=4096, global_batch=512, published_tflops=277,
        published_tokens_per_s=12040, flops="tokens", sequence_parallel=False,
        unpublished=NEMO_QWEN3_UNPUBLISHED, mbs_unpublished=False, engine=Engine.orchestrator,
        moe_imbalance=1.0,
        guesses=guesses(mbs=(4,), v=(1,), recompute=(Recompute.full,))),
    Run("NeMo Llama 3 70B", NEMO_AUTOMODEL, LLAMA3_70B, 64, tp=1, pp=1, dp=32, cp=2, zero=3,
        seq_len=8192, global_batch=128, published_tflops=389, published_tokens_per_s=866.77,
        flops="tokens", sequence_parallel=False, unpublished=NEMO_UNPUBLISHED,
        mbs_unpublished=False, guesses=guesses(mbs=(1,), v=(1,), recompute=tuple(Recompute))),
)


# ------------------------------------------------------------------------------- FLOP counts
def megatron_flops(cfg: ModelConfig, seq_len: int, tokens: int, mlp_weights: int) -> float:
    """Model FLOPs of `tokens` tokens by Megatron-LM's num_floating_point_operations
    (megatron/training/training.py) for a dense model: 6 per weight of the blocks' matmuls
    (`mlp_weights` per layer for the MLP; Q, K, V and the output projection) and of the logits
    (hidden x vocab, not the embedding lookup), plus core attention 6 x hidden x seq per token per
    layer (QK^T and PV, halved for the causal mask). No norms, no embedding."""
    head_dim = cfg.hidden // cfg.heads
    attention = cfg.hidden * head_dim * (2 * cfg.heads + 2 * cfg.kv_heads)
    weights = cfg.layers * (attention + mlp_weights) + cfg.hidden * cfg.vocab
    return 6.0 * tokens * weights + 6.0 * tokens * cfg.layers * cfg.heads * head_dim * seq_len


def run_flops(run: Run, cfg: ModelConfig, tokens: int) -> float:
    """An iteration's FLOPs as the run's source counts them ("tokens": the source's own count,
    published TFLOP/s over published tokens/s per token)."""
    if run.flops == "tokens":
        return tokens * run.published_tflops * 1e12 / run.published_tokens_per_s
    if run.flops == "megatron":  # the README's GPT: a GeLU MLP of 4h, 8 h^2 weights per layer
        return megatron_flops(cfg, run.seq_len, tokens, mlp_weights=8 * cfg.hidden ** 2)
    return model_flops(count_params(cfg), cfg.layers, cfg.hidden, run.seq_len, tokens)


def tflops_per_gpu(run: Run, cfg: ModelConfig, iteration_us: float, world: int,
                   global_batch: int) -> float:
    return (run_flops(run, cfg, global_batch * run.seq_len) / (iteration_us * 1e-6) / world
            / 1e12)


# ---------------------------------------------------------------------------------- profiles
def _cli(args: List[str], env: Optional[dict] = None) -> None:
    done = subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=REPO,
                          capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"orchestrator {' '.join(args)} exited {done.returncode}:\n"
                           f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def shape_config(shape: Shape, seq_len: int) -> ModelConfig:
    """The ModelConfig of `shape` at `seq_len` tokens (bf16)."""
    if shape.conf is not None:
        fields = yaml.safe_load((REPO / "orchestrator" / "conf" / "model"
                                 / f"{shape.conf}.yaml").read_text())
        return ModelConfig(**{**fields, "seq_len": seq_len})
    return ModelConfig(name=shape.name, hidden=shape.hidden, ffn=shape.ffn, layers=shape.layers,
                       heads=shape.heads, kv_heads=shape.kv_heads, vocab=shape.vocab,
                       seq_len=seq_len, dtype="bf16")


def analytic_profile(shape: Shape, seq_len: int, folder: Path) -> ModelCost:
    """The model's analytic dgx_h100 profile at `seq_len` (stage=profile_model via the CLI); a
    shape without a conf/model file gets one in a site conf folder under `folder`."""
    name = f"{shape.name}_s{seq_len}"
    profiles = folder / "profiles"
    site = folder / "conf"
    (site / "model").mkdir(parents=True, exist_ok=True)
    cfg = shape_config(shape, seq_len)
    (site / "model" / f"{name}.yaml").write_text(yaml.safe_dump(
        {**model_fields(cfg), "name": name}))
    _cli(["stage=profile_model", "cluster=dgx_h100", f"model={name}",
          "profile_model.plot=false", f"profiles_dir={profiles}"],
         env={**os.environ, "ORCHESTRATOR_CONF": str(site)})
    path = profiles / "dgx_h100" / "model" / f"{name}.json"
    return ModelCost.from_dict(json.loads(path.read_text())).with_moe(cfg)


def synthetic_profile(shape: Shape, seq_len: int) -> ModelCost:
    """The test fixtures' synthetic profile of the shape (tests/planner_fixtures.py: round
    figures, not an H100's): no CLI, no torch, for --smoke."""
    sys.path.insert(0, str(REPO / "tests"))
    import planner_fixtures

    cfg = shape_config(shape, seq_len)
    return ModelCost.from_dict(planner_fixtures.synthetic_model(
        shape.name, hidden=cfg.hidden, ffn=cfg.ffn, layers=cfg.layers, heads=cfg.heads,
        kv_heads=cfg.kv_heads, vocab=cfg.vocab, seq_len=seq_len)).with_moe(cfg)


def hardware(world: int, synthetic: bool) -> HardwareModel:
    if synthetic:
        sys.path.insert(0, str(REPO / "tests"))
        import planner_fixtures

        return HardwareModel.from_dict(planner_fixtures.synthetic_hardware(world // 8, 8))
    return HardwareModel.from_dict(
        analytic_hardware("dgx_h100", world, LinkSheet(gpus_per_node=8)).to_dict())


# ----------------------------------------------------------------------------------- pricing
def options(run: Optional[Run] = None) -> CostOptions:
    """The run's pricing: its engine model and MoE balance, the search's default reserve."""
    if run is None:
        return CostOptions(engine=Engine.megatron, reserve_bytes=RESERVE_GiB * GiB)
    return CostOptions(engine=run.engine, reserve_bytes=RESERVE_GiB * GiB,
                       moe_imbalance=run.moe_imbalance)


def stages_of(layers: int, pp: int, v: int, partition: str) -> Optional[Tuple[int, ...]]:
    """Layers per stage in a partition Megatron-LM runs, or None when the layers do not split
    so: "even" (layers / pp each, a multiple of v), "last" (the last stage takes the rest:
    --decoder-last-pipeline-num-layers) or "first_last" (the first and the last stage one layer
    fewer than the others, Llama 3's: --decoder-first/last-pipeline-num-layers). Whether a
    stage's count must be a multiple of v is the layout's to say (ParallelLayout refuses what
    the planner cannot run)."""
    if partition == "even":
        return (layers // pp,) * pp if layers % (pp * v) == 0 else None
    if partition == "last":
        per = math.ceil(layers / pp / v) * v
        rest = layers - (pp - 1) * per
        if pp < 2 or rest < 1 or rest == per or layers % (pp * v) == 0:
            return None
        return (per,) * (pp - 1) + (rest,)
    middle, rest = divmod(layers + 2, pp)
    if pp < 3 or rest:
        return None
    return (middle - 1,) + (middle,) * (pp - 2) + (middle - 1,)


def layout_of(run: Run, model: ModelCost, guess: Guess) -> Optional[ParallelLayout]:
    """The run's layout with `guess` for what it leaves out; None when the guess cannot hold it
    (micro-batches that do not divide, a partition the layout refuses)."""
    per_replica = run.global_batch // run.dp
    if per_replica % guess.micro_batch_size:
        return None
    stages = stages_of(model.layers, run.pp, guess.virtual_stages, guess.partition)
    if stages is None or (guess.virtual_stages > 1 and run.pp == 1):
        return None
    m = per_replica // guess.micro_batch_size
    try:
        return ParallelLayout(
            world_size=run.gpus, tp=run.tp, pp=run.pp, dp=run.dp, cp=run.cp,
            cp_comm=run.cp_comm, layers_per_stage=stages,
            recompute=tuple((guess.recompute, 0 if guess.recompute == Recompute.none else n)
                            for n in stages),
            zero=guess.zero if run.zero is None else run.zero, ep=run.ep,
            sequence_parallel=run.sequence_parallel and run.tp > 1,
            micro_batch_size=guess.micro_batch_size, num_micro_batches=m,
            schedule=Schedule.interleaved if guess.virtual_stages > 1 else Schedule["1f1b"],
            virtual_stages=guess.virtual_stages)
    except LayoutError:
        return None


@dataclass
class Priced:
    run: Run
    guess: Optional[Guess]
    prediction: object  # planner Prediction, or None when no guess could be priced
    tflops: float
    ratio: float
    own_GiB: float  # the model's own peak (the reserve left out)
    fits: bool
    tried: int
    least_GiB: float = math.nan  # the least any guess needs (the reserve left out)
    pick: Optional[object] = None  # the search's Prediction
    pick_tflops: Optional[float] = None
    pick_note: str = ""


def priced_guesses(run: Run, model: ModelCost, cfg: ModelConfig, hw: HardwareModel):
    """(guess, planner Prediction, TFLOP/s per GPU) of every guess of `run` the layout can hold
    (80 GiB with the reserve, the run's engine model)."""
    for guess in run.guesses:
        layout = layout_of(run, model, guess)
        if layout is None:
            continue
        try:
            pred = evaluate(layout, model, hw, run.seq_len, BUDGET_GiB * GiB, options(run))
        except LayoutError:
            continue
        yield guess, pred, tflops_per_gpu(run, cfg, pred.iteration_time_us, run.gpus,
                                          run.global_batch)


def price(run: Run, model: ModelCost, cfg: ModelConfig, hw: HardwareModel) -> Priced:
    """The run priced with the guess the planner would take itself: the fastest of those that
    fit 80 GiB with the reserve, else the fastest (and `least_GiB`, the least any guess needs).
    The published figure plays no part in the choice."""
    best = None
    tried = 0
    least = math.inf
    for guess, pred, tflops in priced_guesses(run, model, cfg, hw):
        tried += 1
        least = min(least, pred.peak_memory_bytes)
        ratio = tflops / run.published_tflops
        key = (not pred.feasible, pred.iteration_time_us)
        if best is None or key < best[0]:
            best = (key, guess, pred, tflops, ratio)
    if best is None:
        return Priced(run, None, None, float("nan"), float("nan"), float("nan"), False, 0)
    _, guess, pred, tflops, ratio = best
    return Priced(run, guess, pred, tflops, ratio,
                  (pred.peak_memory_bytes - RESERVE_GiB * GiB) / GiB, pred.feasible, tried,
                  least_GiB=(least - RESERVE_GiB * GiB) / GiB)


def guess_lines(run: Run, model: ModelCost, cfg: ModelConfig, hw: HardwareModel) -> List[str]:
    """Every guess of `run` that the layout can hold, one line each: its predicted iteration
    and ratio, the model's own peak GiB (the reserve left out), whether it fits, and the terms
    of the breakdown over 50 ms (what a guess gains or loses, e.g. ZeRO 2's exposed
    reduce-scatters against ZeRO 1's memory)."""
    lines = [f"{run.label} ({run.gpus:,} GPUs), every guess:"]
    for guess, pred, tflops in priced_guesses(run, model, cfg, hw):
        terms = " ".join(f"{name} {us / 1e6:.2f}" for name, us in pred.breakdown_us.items()
                         if abs(us) > 5e4)
        lines.append(f"  {guess.describe(run):34s} {pred.iteration_time_us / 1e6:6.2f} s "
                     f"ratio {tflops / run.published_tflops:.3f} "
                     f"{(pred.peak_memory_bytes - RESERVE_GiB * GiB) / GiB:6.1f} GiB "
                     f"{'fits' if pred.feasible else 'over'}  s: {terms}")
    return lines


def searched(priced: Priced, model: ModelCost, cfg: ModelConfig, hw: HardwareModel) -> None:
    """Fill in the search's pick at the run's world, batch and sequence length (stage=search's
    defaults, engine megatron, 80 GiB with the reserve)."""
    run = priced.run
    space = SearchSpace(world_size=run.gpus, memory_budget_bytes=BUDGET_GiB * GiB,
                        global_batch_size=run.global_batch, seq_len=run.seq_len,
                        max_cp=auto_max_cp(run.seq_len), options=options(run))
    t0 = time.perf_counter()
    try:
        result = search(model, hw, space)
    except InfeasibleError as e:
        priced.pick_note = f"no layout: {str(e)[:80]}"
        return
    priced.pick = result.prediction
    priced.pick_tflops = tflops_per_gpu(run, cfg, result.prediction.iteration_time_us, run.gpus,
                                        run.global_batch)
    priced.pick_note = f"{time.perf_counter() - t0:.1f} s"


# ----------------------------------------------------------------------------------- output
def table(rows: List[Priced], title: str) -> Table:
    out = Table(title=title, show_lines=True)
    for col, justify in (("run", "left"), ("GPUs", "right"), ("layout as run (guess)", "left"),
                         ("published", "right"), ("predicted", "right"), ("ratio", "right"),
                         ("GiB", "right"), ("fits", "left"), ("search's pick", "left"),
                         ("pick TFLOP/s", "right"), ("pick GiB", "right")):
        out.add_column(col, justify=justify, overflow="fold")
    for p in rows:
        run = p.run
        if p.prediction is None:
            layout = f"tp{run.tp} cp{run.cp} pp{run.pp} dp{run.dp}: no guess could be priced"
            out.add_row(run.label, f"{run.gpus:,}", layout, f"{run.published_tflops:.0f}",
                        "-", "-", "-", "-", "", "", "")
            continue
        engine = "" if run.engine == Engine.megatron else f"; engine {run.engine}"
        layout = escape(f"{p.prediction.layout.describe()}\n(guess: {p.guess.describe(run)}; "
                        f"fastest of {p.tried}{engine})")
        pick = pick_tflops = pick_GiB = ""
        if p.pick is not None:
            pick = ("same" if p.pick.layout == p.prediction.layout
                    else escape(p.pick.layout.describe()))
            pick_tflops = f"{p.pick_tflops:.0f} ({p.pick_tflops / p.tflops:.2f}x)"
            pick_GiB = f"{(p.pick.peak_memory_bytes - RESERVE_GiB * GiB) / GiB:.1f}"
        elif p.pick_note:
            pick = escape(p.pick_note)
        out.add_row(run.label, f"{run.gpus:,}", layout, f"{run.published_tflops:.0f}",
                    f"{p.tflops:.0f}", f"{p.ratio:.2f}", f"{p.own_GiB:.1f}",
                    "yes" if p.fits else f"NO\n(least {p.least_GiB:.1f})", pick, pick_tflops,
                    pick_GiB)
    return out


def summary(rows: List[Priced]) -> List[str]:
    """The lines issue 41's "Done when" reads: median, min and max ratio, runs that fit."""
    ratios = [p.ratio for p in rows if p.prediction is not None]
    if not ratios:
        return ["no run could be priced"]
    median = statistics.median(ratios)
    worst = min(rows, key=lambda p: p.ratio if p.prediction is not None else math.inf)
    best = max(rows, key=lambda p: p.ratio if p.prediction is not None else -math.inf)
    fits = sum(p.fits for p in rows)
    within = sum(TARGET_EACH[0] <= r <= TARGET_EACH[1] for r in ratios)
    picks = [p for p in rows if p.pick is not None and p.prediction is not None]
    differ = [p for p in picks if p.pick.layout != p.prediction.layout]
    gains = [p.pick_tflops / p.tflops for p in differ]
    lines = [] if not picks else [
        f"the search's pick differs from the published layout on {len(differ)} of {len(picks)} "
        f"runs" + (f", predicted {min(gains):.2f}-{max(gains):.2f}x its throughput (it fits by "
                   f"construction)" if gains else "")]
    return [
        f"predicted/published: median {median:.2f} (target {TARGET_MEDIAN[0]}-{TARGET_MEDIAN[1]}),"
        f" min {worst.ratio:.2f} ({worst.run.label}, {worst.run.gpus:,} GPUs), max "
        f"{best.ratio:.2f} ({best.run.label}, {best.run.gpus:,} GPUs); "
        f"{within} of {len(ratios)} within {TARGET_EACH[0]}-{TARGET_EACH[1]}",
        f"fits {BUDGET_GiB} GiB with the search's reserve ({RESERVE_GiB:g} GiB): {fits} of "
        f"{len(rows)} published layouts",
    ] + lines


def record(p: Priced) -> dict:
    """One row's figures as JSON values (None where the run could not be priced or searched)."""
    priced = p.prediction is not None
    return {
        "run": p.run.label, "gpus": p.run.gpus, "source": p.run.source,
        "published_tflops": p.run.published_tflops,
        "layout": p.prediction.layout.to_dict() if priced else None,
        "guess": p.guess.describe(p.run) if priced else None,
        "predicted_tflops": p.tflops if priced else None,
        "ratio": p.ratio if priced else None,
        "own_GiB": p.own_GiB if priced else None, "least_GiB": p.least_GiB if priced else None,
        "fits": p.fits,
        "pick": p.pick.layout.to_dict() if p.pick is not None else None,
        "pick_tflops": p.pick_tflops,
        "pick_GiB": ((p.pick.peak_memory_bytes - RESERVE_GiB * GiB) / GiB
                     if p.pick is not None else None),
    }


# --------------------------------------------------------------------------------- Galvatron
def galvatron_picks(smoke: bool) -> List[str]:
    """Galvatron's shipped llama-7b picks priced with stage=train's engine on its own imported
    profiles (bench/galvatron_side_by_side.py's scenarios and sdist): one line each."""
    from galvatron_engine import CACHE, fetch_sdist
    from galvatron_side_by_side import MODEL, SCENARIOS, orchestrator

    from orchestrator.interop.galvatron.compare import price_galvatron_strategy
    from orchestrator.store.schema import HardwareProfile, ModelProfile

    root, why = fetch_sdist(CACHE, download=not smoke)
    if root is None:
        return [f"Galvatron's picks: skipped: {why}"]
    lines = []
    configs = root / "galvatron" / "models" / "llama_hf" / "configs"
    for label, nodes, memory_GB, batch, shipped in SCENARIOS:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            common = ["cluster=dgx_a100", f"cluster.nodes={nodes}",
                      f"profiles_dir={work / 'profiles'}", *MODEL]
            orchestrator(["stage=import", f"import.path={root / 'galvatron/profile_hardware'}"
                          "/hardware_configs", *common], work)
            orchestrator(["stage=import", f"import.path={configs}", *common], work)
            folder = work / "profiles" / "dgx_a100"
            hw = HardwareModel.from_profile(HardwareProfile.from_dict(
                json.loads((folder / "hardware.json").read_text()), ""))
            model = ModelCost.from_profile(ModelProfile.from_dict(
                json.loads((folder / "model" / "llama2_7b.json").read_text()), ""))
        # Galvatron's "36GB" budgets are its own memory limits (GiB in its cost model).
        reserve = memory_reserve_GiB(memory_GB, 0.10, 1.0)
        opts = CostOptions(engine=Engine.orchestrator, reserve_bytes=reserve * GiB)
        for name in shipped:
            pred, _ = price_galvatron_strategy(configs / name, model, hw,
                                               world_size=nodes * 8, seq_len=2048,
                                               budget_bytes=memory_GB * GiB, options=opts)
            own = (pred.peak_memory_bytes - reserve * GiB) / GiB
            lines.append(f"Galvatron {label}: {name}: {pred.layout.describe()}: {own:.1f} GiB + "
                         f"reserve {reserve:.1f} of {memory_GB} GiB: "
                         + ("fits" if pred.feasible else "DOES NOT FIT") + " (engine=orchestrator)")
    return lines


# -------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="no search beside each run, no Galvatron picks")
    parser.add_argument("--smoke", action="store_true",
                        help="the Megatron GPT 1.7B and NeMo Qwen3 30B-A3B runs on the test "
                             "fixtures' synthetic profiles: seconds")
    parser.add_argument("--runs", default="",
                        help="only the runs whose label holds this text (e.g. 'Llama 3')")
    parser.add_argument("--guesses", action="store_true",
                        help="also print every guess of each run with its time terms and GiB")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write each row's figures to this JSON file (to compare runs)")
    args = parser.parse_args()
    console = Console(width=220)
    runs = [r for r in RUNS if (r.label in SMOKE_RUNS if args.smoke else args.runs in r.label)]
    t0 = time.perf_counter()
    rows, guesses_printed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cache: Dict[Tuple[str, int], ModelCost] = {}
        for run in runs:
            key = (run.shape.name, run.seq_len)
            if key not in cache:
                cache[key] = (synthetic_profile(run.shape, run.seq_len) if args.smoke else
                              analytic_profile(run.shape, run.seq_len, Path(tmp)))
            model = cache[key]
            cfg = shape_config(run.shape, run.seq_len)
            hw = hardware(run.gpus, args.smoke)
            priced = price(run, model, cfg, hw)
            if args.guesses:
                guesses_printed.extend(guess_lines(run, model, cfg, hw))
            if not args.quick:
                searched(priced, model, cfg, hw)
            rows.append(priced)
    source = ("the test fixtures' synthetic profiles" if args.smoke
              else "analytic dgx_h100 profiles")
    console.print(table(rows, f"Published H100 BF16 runs priced as run (engine megatron, "
                              f"{source}); TFLOP/s per GPU; GiB: the model's own peak, fits: "
                              f"with the {RESERVE_GiB:g} GiB reserve in {BUDGET_GiB} GiB"))
    for line in summary(rows):
        print(line)
    for line in guesses_printed:
        print(line)
    if args.json is not None:
        write_json(args.json, [record(p) for p in rows])
    for run in {r.source: r for r in runs}.values():
        print(f"source: {run.source}; not published: {run.unpublished}"
              + (f"; shape: {run.shape.note}" if run.shape.note else ""))
    if not (args.quick or args.smoke):
        for line in galvatron_picks(args.smoke):
            print(line)
    print(f"wall: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
