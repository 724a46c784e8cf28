"""Megatron's memory as the planner prices it (search.engine=megatron,
planner/terms/megatron_memory.py), beside Megatron-LM's own accounting and a Megatron-Core layer.

    python bench/megatron_memory.py --megatron-lm PATH    # a Megatron-LM checkout or bare git dir
    python bench/megatron_memory.py --smoke               # our closed form alone

--megatron-lm loads megatron/training/theoretical_memory_usage.py from PATH (nothing of it is
copied here) and prints, per layer and per first pipeline stage, its figures beside ours:
- "as Megatron assumes": our closed form with Megatron's formula's assumptions (a 2-matrix FFN
  counted at its ffn_hidden_size, as many KV heads as heads, dropout masks), which must equal
  Megatron's 18 + 4 f / h exactly;
- "as run": our closed form for the model as Megatron-Core runs it (SwiGLU, GQA, flash
  attention, no dropout), the planner's figure.
Where megatron-core is importable (pip; a CPU is enough), it builds one TransformerLayer
(local spec: no Transformer Engine, so it runs on CPU) at TP 1 on a one-rank gloo group and
counts the storages autograd saves for each recompute mode, beside our closed form plus what
the local spec keeps that Transformer Engine's layer does not (docs/workload.md, "Megatron's
memory", Checked).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import tempfile
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from orchestrator.choices import Recompute  # noqa: E402
from orchestrator.planner.schedule import in_flight_micro_batches  # noqa: E402
from orchestrator.planner.terms.megatron_memory import (  # noqa: E402
    LSE_BYTES, LayerShape, embedding_activation_bytes_per_token,
    layer_activation_bytes_per_token)

GiB = float(1 << 30)
THEORY = "megatron/training/theoretical_memory_usage.py"

# (label, hidden, heads, kv_heads, ffn, layers, vocab, swiglu)
SHAPES = {
    "llama3_405b": (16384, 128, 8, 53248, 126, 128256, True),
    # GPT shapes of Megatron-LM's scaling table (GELU 4h FFN, multi-head attention)
    "gpt_1.7b": (2304, 24, 24, 4 * 2304, 24, 51200, False),
    "gpt_175b": (12288, 96, 96, 4 * 12288, 96, 51200, False),
}
# (label, shape, tp, pp, dp, cp, v, micro-batches, seq_len)
LAYOUTS = [
    ("Llama 3 405B 8K, 8192 GPUs", "llama3_405b", 8, 16, 64, 1, 2, 32, 8192),
    ("Llama 3 405B 8K, 16384 GPUs", "llama3_405b", 8, 16, 128, 1, 2, 16, 8192),
    ("Llama 3 405B 128K, 16384 GPUs", "llama3_405b", 8, 16, 8, 16, 2, 16, 131072),
    ("GPT 175B, TP8 PP8 DP16", "gpt_175b", 8, 8, 16, 1, 1, 64, 2048),
]


def load_theory(path: Path):
    """Megatron-LM's theoretical_memory_usage module from a checkout or a bare git dir (its one
    relative import, .utils, stubbed: it only prints)."""
    source = path / THEORY
    if not source.exists():
        text = subprocess.run(["git", "-C", str(path), "show", f"HEAD:{THEORY}"], check=True,
                              capture_output=True, text=True).stdout
        source = Path(tempfile.mkdtemp()) / "theoretical_memory_usage.py"
        source.write_text(text)
    package = types.ModuleType("mlm_theory")
    package.__path__ = []
    utils = types.ModuleType("mlm_theory.utils")
    utils.is_hybrid_model = lambda args: False
    utils.print_rank_0 = print
    sys.modules.update({"mlm_theory": package, "mlm_theory.utils": utils})
    spec = importlib.util.spec_from_file_location("mlm_theory.theory", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def megatron_args(shape: str, tp: int, pp: int, dp: int, cp: int, v: int, seq: int,
                  ffn: int | None = None):
    """The argparse namespace Megatron-LM's formulas read, for a dense model trained with SP,
    selective recompute and the distributed optimizer."""
    h, a, g, f, layers, vocab, swiglu = SHAPES[shape]
    pad = 128 * tp
    return types.SimpleNamespace(
        kv_channels=h // a, num_attention_heads=a, hidden_size=h, group_query_attention=g != a,
        num_query_groups=g, num_experts=None, swiglu=swiglu,
        moe_shared_expert_intermediate_size=None, moe_layer_freq=1, num_layers=layers,
        mtp_num_layers=None, normalization="RMSNorm", multi_latent_attention=False,
        padded_vocab_size=int(math.ceil(vocab / pad) * pad),
        untie_embeddings_and_output_weights=True,
        ffn_hidden_size=ffn or f, moe_latent_size=None, moe_router_topk=1, add_bias_linear=False,
        expert_tensor_parallel_size=1, expert_model_parallel_size=1,
        pipeline_model_parallel_size=pp, world_size=tp * pp * dp * cp,
        tensor_model_parallel_size=tp, use_distributed_optimizer=True, data_parallel_size=dp,
        seq_length=seq, micro_batch_size=1,
        virtual_pipeline_model_parallel_size=v if v > 1 else None, sequence_parallel=True,
        recompute_granularity="selective")


def ours_per_layer(shape: str, tp: int, assumptions: bool) -> float:
    """Our bytes per token of one layer beside Megatron's selective figure: with its formula's
    assumptions (ungated FFN, KV heads = heads, dropout masks: our no-recompute count less
    flash attention's statistics, its attention core's s^2 terms being all selective drops
    there), or as Megatron-Core runs it (no recompute: flash attention needs none)."""
    h, a, g, f, *_rest, swiglu = SHAPES[shape]
    if assumptions:
        return layer_activation_bytes_per_token(LayerShape(h, a, a, f), tp, True,
                                                Recompute.none, 2, gated_ffn=False,
                                                dropout=True) - LSE_BYTES * a / tp
    return layer_activation_bytes_per_token(LayerShape(h, a, g, f), tp, True, Recompute.none,
                                            2, gated_ffn=swiglu)


def planner_first_stage(shape: str, tp: int, pp: int, dp: int, cp: int, v: int, m: int,
                        seq: int, cache: dict) -> tuple:
    """(states, activations) bytes the planner prices (search.engine=megatron, no recompute)
    for the first stage holding layers / pp layers, on the analytic dgx_h100 profiles
    bench/search_speed.py builds."""
    from search_speed import analytic_model_profile

    from orchestrator.choices import Schedule
    from orchestrator.planner import CostOptions, HardwareModel, ModelCost
    from orchestrator.planner.cost_model import ConfigKey, StageCosts
    from orchestrator.profiling.hardware.analytic import LinkSheet, analytic_hardware

    if shape not in cache:
        cache[shape] = ModelCost.from_dict(analytic_model_profile(shape, cache["folder"]))
    world = tp * pp * dp * cp
    hardware = HardwareModel.from_dict(
        analytic_hardware("dgx_h100", world, LinkSheet(gpus_per_node=8)).to_dict())
    schedule = Schedule.interleaved if v > 1 else Schedule["1f1b"]
    key = ConfigKey(world, tp, pp, dp, 1, True, 1, m, schedule, v, cp)
    costs = StageCosts(key, cache[shape], hardware, seq, CostOptions(engine="megatron"))
    layers = SHAPES[shape][4] / pp
    states = sum(float(x) for x in costs.static_bytes(0, layers))
    return states, float(costs.activation_bytes(0, layers, 0, 0))


def theory_report(path: Path, cache: dict) -> None:
    theory = load_theory(path)
    print("Per layer, selective recompute + SP, bytes per token of a rank (Megatron-LM: "
          "s b h (18 + 4 f / h) / t)")
    print(f"{'shape':12} {'tp':>3} {'Megatron':>10} {'ours, its assumptions':>22} "
          f"{'ours as run':>12} {'as run / Megatron':>18}")
    for shape in SHAPES:
        for tp in (1, 2, 4, 8):
            # one layer's share: the difference of two layer counts (pp 2, no schedule factor)
            one, two = (megatron_args(shape, tp, 2, 1, 1, 1, 2048) for _ in range(2))
            one.num_layers, two.num_layers = 1, 2
            mega = (theory.compute_activation_memory(two, None)
                    - theory.compute_activation_memory(one, None)) / 2048
            same = ours_per_layer(shape, tp, True)
            run = ours_per_layer(shape, tp, False)
            print(f"{shape:12} {tp:3d} {mega:10.1f} {same:22.1f} {run:12.1f} {run / mega:18.3f}")
    print()
    print("First pipeline stage (Megatron's most loaded shard: layers / pp and the embedding), "
          "GiB")
    print(f"{'layout':32} {'weights+optim: Megatron':>24} {'ours':>7} "
          f"{'activations: Megatron':>22} {'at s/cp':>8} {'ours, its assumptions':>22} "
          f"{'ours as run':>12}")
    for label, shape, tp, pp, dp, cp, v, m, seq in LAYOUTS:
        args = megatron_args(shape, tp, pp, dp, cp, v, seq)
        weights = theory.compute_weight_and_optimizer_memory(args)
        acts = theory.compute_activation_memory(args, m)
        at_cp = theory.compute_activation_memory(megatron_args(shape, tp, pp, dp, cp, v,
                                                               seq // cp), m)
        tokens = seq // cp
        in_flight = float(in_flight_micro_batches(
            "interleaved" if v > 1 else "1f1b", pp, m, v)[0])
        layers = SHAPES[shape][4] / pp
        assumed = tokens * in_flight * (layers * ours_per_layer(shape, tp, True)
                                        + embedding_activation_bytes_per_token())
        if SHAPES[shape][-1]:  # our models are SwiGLU: a GELU model is not ours to price
            states, acts_ours = planner_first_stage(shape, tp, pp, dp, cp, v, m, seq, cache)
            states, run = f"{states / GiB:7.2f}", f"{acts_ours / GiB:12.2f}"
        else:
            states, run = f"{'-':>7}", f"{'-':>12}"
        print(f"{label:32} {weights / GiB:24.2f} {states} {acts / GiB:22.2f} "
              f"{at_cp / GiB:8.2f} {assumed / GiB:22.2f} {run}")


def smoke_report(smoke: bool) -> None:
    """Our per-layer figures alone (no Megatron-LM checkout given, or the smoke case)."""
    print("Per layer, bytes per token of a rank (ours: with Megatron-LM's assumptions / as run)")
    for shape in SHAPES:
        row = "  ".join(f"tp{tp} {ours_per_layer(shape, tp, True):.1f} / "
                        f"{ours_per_layer(shape, tp, False):.1f}" for tp in (1, 2, 4, 8))
        print(f"{shape:12} {row}")
    print(f"Megatron-LM: not run ({'--smoke' if smoke else 'no --megatron-lm PATH'})")


# ------------------------------------------------------------------ a Megatron-Core layer on CPU
def count_layer(seq: int = 256, batch: int = 2, hidden: int = 512, heads: int = 8,
                kv_heads: int = 2, ffn: int = 1408) -> dict:
    """Bytes of the storages autograd saves in one forward of a megatron-core TransformerLayer
    (local spec, bf16, TP 1, SwiGLU, RMSNorm, GQA, RoPE, no dropout) per recompute mode, per token,
    and the same counted by our closed form plus the local spec's extras."""
    import contextlib
    import os

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    # the local spec's scratch buffer (the attention scores' baddbmm input) asks CUDA for
    # its device; on a CPU-only torch, it is the CPU
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")
        # no dropout here: the CUDA RNG tracker's forks (and recompute's RNG restores) do
        # nothing a CPU run needs
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
        tracker.get_states = lambda: {}
        tracker.set_states = lambda states: None
        random = sys.modules["megatron.core.tensor_parallel.random"]
        random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
        random._set_cuda_rng_state = lambda *args, **kwargs: None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0) if torch.cuda.is_available() else None
    out = {}
    tokens = seq * batch
    for mode in Recompute:
        extra = {}
        if mode == Recompute.selective:
            extra = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
        elif mode == Recompute.full:
            extra = dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1)
        config = TransformerConfig(
            num_layers=1, hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=kv_heads, ffn_hidden_size=ffn, gated_linear_unit=True,
            activation_func=torch.nn.functional.silu, normalization="RMSNorm",
            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
            bias_activation_fusion=True, masked_softmax_fusion=False, bias_dropout_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False, bf16=True,
            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, use_cpu_initialization=True,
            perform_initialization=False, **extra)
        block = TransformerBlock(config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                                 post_layer_norm=False).to(torch.bfloat16)  # norms too
        # Megatron's rotary table, [s, 1, 1, d] fp32 angles (its RotaryEmbedding asks for CUDA)
        d = hidden // heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
        rope = torch.cat((angles, angles), dim=-1)[:, None, None, :]
        x = torch.randn(seq, batch, hidden, dtype=torch.bfloat16, requires_grad=True)
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        # the causal mask given (Megatron's default one is built on CUDA); made once, not
        # per layer: not counted, like the parameters and the rotary table
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
        params.update({rope.untyped_storage().data_ptr(), mask.untyped_storage().data_ptr()})
        seen: dict = {}

        def pack(t):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.data_ptr() not in params:
                    seen[storage.data_ptr()] = (storage.nbytes(), tuple(t.shape), str(t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block(x, attention_mask=mask, rotary_pos_emb=rope)
        y.float().sum().backward()
        out[mode.value] = {"bytes_per_token": sum(b for b, *_ in seen.values()) / tokens,
                           "saved": sorted(((b, s, d) for b, s, d in seen.values()),
                                           reverse=True)}
    shape = LayerShape(hidden, heads, kv_heads, ffn)
    d = hidden // heads
    # What the local spec keeps beyond Transformer Engine's layer, per token (bf16 = 2 B):
    # K and V repeated to every query head; the unfused attention's softmax, fp32 and its bf16
    # cast (a x s each); torch's RMSNorm keeps two fp32 rows (its upcast input and the
    # normalised one) and a 4-byte rstd where TE's keeps the bf16 input; RoPE's cos and sin
    # tables for Q and K (per position: / batch); no flash log-sum-exp.
    norms = 2 * (2 * 4 * hidden + 4) - 2 * 2 * hidden
    rope = 4 * 2 * d / batch
    local = {Recompute.none: {"kv_repeat": 2 * 2 * (heads - kv_heads) * d,
                              "softmax": (4 + 2) * heads * seq, "norms": norms, "rope": rope,
                              "no_lse": -LSE_BYTES * heads},
             Recompute.selective: {"norms": norms, "rope": rope},
             Recompute.full: {}}
    for mode in Recompute:
        ours = layer_activation_bytes_per_token(shape, 1, True, mode, 2)
        out[mode.value].update(ours=ours, local_extras=local[mode],
                               ours_local_spec=ours + sum(local[mode].values()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout or bare git dir")
    parser.add_argument("--json", action="store_true", help="the layer count's figures as JSON")
    parser.add_argument("--smoke", action="store_true",
                        help="our closed form alone (no Megatron-LM, no megatron-core)")
    args = parser.parse_args()
    if args.smoke or not args.megatron_lm:
        smoke_report(args.smoke)
    else:
        with tempfile.TemporaryDirectory() as folder:
            theory_report(args.megatron_lm, {"folder": folder})
    if args.smoke:
        print("megatron-core layer: not run (--smoke)")
        return
    if importlib.util.find_spec("megatron") is None:
        print("megatron-core layer: not run (megatron-core is not importable: pip install "
              "megatron-core in a venv, docs/workload.md)")
        return
    result = count_layer()
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    print("megatron-core TransformerLayer (local spec, bf16, TP 1, s 256, b 2, h 512, 8 heads,"
          " 2 KV heads, SwiGLU 1408): saved bytes per token")
    for mode, row in result.items():
        print(f"  {mode:9} counted {row['bytes_per_token']:9.1f}  ours (TE layer) "
              f"{row['ours']:9.1f}  ours + local-spec extras {row['ours_local_spec']:9.1f}"
              f"  ({row['bytes_per_token'] / row['ours_local_spec']:.3f})")


if __name__ == "__main__":
    main()
