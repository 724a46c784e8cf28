"""Synthetic hardware and model profiles, shaped like docs/profile-schema.md, for planner tests
and bench/search_speed.py. Numbers are analytic-looking (A100/H100-class GPUs, NVLink inside a
node, InfiniBand between nodes); they are test inputs, not measurements. `hand_hardware` and
`hand_model` build the planner's adapters directly with round numbers a test can work by hand."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, Mapping, Optional, Tuple

from orchestrator.planner.hardware_model import HardwareModel, LinkFit

from orchestrator.planner.model_cost import ModelCost, PartMemory, TpFit
GiB = 1 << 30
CONF_MODEL = Path(__file__).resolve().parent.parent / "orchestrator" / "conf" / "model"


def _factor(op: str, n: int) -> float:
    if op == "allreduce":
        return 2.0 * (n - 1) / n
    if op == "p2p":
        return 1.0
    return (n - 1) / n


def synthetic_hardware(nodes: int = 2, tasks_per_node: int = 8, *, intra_busbw_GBps: float = 150.0,
                       inter_busbw_GBps: float = 20.0, intra_alpha_us: float = 8.0,
                       inter_alpha_us: float = 25.0, overlap_coe: float = 1.2,
                       max_group: Optional[int] = None, name: str = "synthetic") -> Dict:
    """A hardware.json dict: alpha-beta fits for every collective at group sizes 2, 4, ... (up to
    `max_group`, default the world) in both layouts, and intra/inter p2p fits."""
    world = nodes * tasks_per_node
    top = min(world, max_group or world)
    benchmarks: Dict[str, Dict] = {}
    for op in ("allreduce", "reduce_scatter", "all_gather", "all2all"):
        fits = []
        n = 2
        while n <= top:
            if world % n == 0:
                for layout in ("consec", "strided"):
                    if layout == "strided" and n == world:
                        continue
                    stride = 1 if layout == "consec" else world // n
                    intra = (n * stride <= tasks_per_node)
                    busbw = intra_busbw_GBps if intra else inter_busbw_GBps
                    alpha = (intra_alpha_us if intra else inter_alpha_us) * (1 + 0.1 * (n - 2))
                    fits.append({"op": op, "group_size": n, "layout": layout, "alpha_us": alpha,
                                 "algbw_GBps": busbw / _factor(op, n), "max_rel_err": 0.02})
            n *= 2
        benchmarks[op] = {"points": [], "fits": fits}
    p2p_fits = []
    for layout, bw, alpha in (("intra", intra_busbw_GBps / 2, intra_alpha_us),
                              ("inter", inter_busbw_GBps, inter_alpha_us)):
        p2p_fits.append({"op": "p2p", "group_size": 2, "layout": layout, "alpha_us": alpha,
                         "algbw_GBps": bw, "max_rel_err": 0.02})
    benchmarks["p2p"] = {"points": [], "fits": p2p_fits}
    benchmarks["overlap"] = {"compute_slowdown": overlap_coe, "comm_slowdown": overlap_coe,
                             "overlap_coe": overlap_coe}
    return {
        "schema_version": 1, "kind": "hardware", "source": "analytic", "provenance": {},
        "cluster": {"name": name, "nodes": nodes, "tasks_per_node": tasks_per_node,
                    "world_size": world, "backend": "nccl"},
        "inventory": {"ranks": []},
        "benchmarks": benchmarks,
    }


def synthetic_model(name: str = "tiny", *, hidden: int = 256, ffn: int = 1024, layers: int = 6,
                    heads: int = 8, kv_heads: Optional[int] = None, vocab: int = 1000,
                    seq_len: int = 512, tps: Iterable[int] = (1, 2, 4, 8),
                    tflops: float = 400.0, efficiency: float = 0.5,
                    overhead_us: float = 20.0) -> Dict:
    """A model.json dict for a GPT-like decoder: compute from FLOPs at `tflops` x `efficiency`
    (TP divides the work; a fixed per-kernel overhead does not shrink), memory of mixed-precision
    Adam (2 + 4 + 12 bytes per parameter) and Megatron-style activations per token."""
    kv_heads = kv_heads or heads
    head_dim = hidden // heads
    block_params = (hidden * hidden * 2 + 2 * hidden * kv_heads * head_dim  # q, o, k, v
                    + 3 * hidden * ffn + 2 * hidden)  # gated MLP + norms
    other_params = 2 * vocab * hidden + hidden  # untied embedding + LM head + final norm
    rate = tflops * 1e6 * efficiency  # FLOP per us
    fits, memory, points = {}, {}, []
    for tp in tps:
        c1 = 2.0 * block_params / tp / rate  # matmuls: 2 FLOP per param per token
        c2 = 2.0 * hidden / tp / rate  # causal attention: QK^T + AV, half of 4 s^2 h
        o1 = 2.0 * vocab * hidden / tp / rate
        fits[str(tp)] = {"block_fwd_us": [overhead_us, c1, c2],
                         "block_bwd_us": [2 * overhead_us, 2 * c1, 2.5 * c2],
                         "other_fwd_us": [overhead_us, o1],
                         "other_bwd_us": [2 * overhead_us, 2 * o1],
                         "max_rel_err": 0.03}
        sel = (18.0 * hidden + 4.0 * ffn) / tp
        memory[str(tp)] = {
            "block": {"param_bytes": 2.0 * block_params / tp, "grad_bytes": 4.0 * block_params / tp,
                      "optim_bytes": 12.0 * block_params / tp,
                      "act_bytes_per_token": {"none": sel + 6.0 * hidden / tp, "selective": sel,
                                              "full": 2.0 * hidden / tp}},
            "other": {"param_bytes": 2.0 * other_params / tp, "grad_bytes": 4.0 * other_params / tp,
                      "optim_bytes": 12.0 * other_params / tp,
                      "act_bytes_per_token": {"none": 6.0 * vocab / tp + 2.0 * hidden,
                                              "selective": 6.0 * vocab / tp + 2.0 * hidden,
                                              "full": 6.0 * vocab / tp + 2.0 * hidden}},
        }
    return {
        "schema_version": 1, "kind": "model", "source": "analytic", "provenance": {},
        "model": {"name": name, "hidden": hidden, "ffn": ffn, "layers": layers, "heads": heads,
                  "kv_heads": kv_heads, "vocab": vocab, "seq_len": seq_len, "dtype": "bf16"},
        "points": points, "fits": fits, "memory": memory,
    }


def shaped_like(name: str, **kw) -> Dict:
    """synthetic_model with the shape of orchestrator/conf/model/<name>.yaml (the bench's
    --smoke runs; a MoE model's experts are ModelCost.with_moe's to add)."""
    import yaml

    cfg = yaml.safe_load((CONF_MODEL / f"{name}.yaml").read_text())
    return synthetic_model(name, **{k: cfg[k] for k in ("hidden", "ffn", "layers", "heads",
                                                         "kv_heads", "vocab", "seq_len")}, **kw)


# Named models of the bench (GPT-like shapes).
def llama2_7b(**kw) -> Dict:
    return synthetic_model("llama2_7b", hidden=4096, ffn=11008, layers=32, heads=32, kv_heads=32,
                           vocab=32000, seq_len=4096, **kw)


def qwen_30b(**kw) -> Dict:
    return synthetic_model("qwen_30b", hidden=5120, ffn=25600, layers=72, heads=64, kv_heads=8,
                           vocab=32000, seq_len=32768, **kw)


def qwen_100b(**kw) -> Dict:
    return synthetic_model("qwen_100b", hidden=8192, ffn=49152, layers=74, heads=64, kv_heads=8,
                           vocab=32000, seq_len=131072, **kw)


def hand_hardware(fits: Mapping[Tuple[str, str], Tuple[int, float, float]], *,
                  tasks_per_node: int = 8, world_size: int = 16,
                  overlap_coe: float = 1.0) -> HardwareModel:
    """A HardwareModel with one fit per (op, layout): (group_size, alpha_us, algbw_GBps), so a
    collective of B bytes takes alpha_us + B / (algbw_GBps * 1e3) us."""
    return HardwareModel(tasks_per_node=tasks_per_node, world_size=world_size,
                         overlap_coe=overlap_coe,
                         fits={key: (LinkFit(n, alpha, bw),) for key, (n, alpha, bw) in
                               fits.items()}, name="hand")


def hand_model(*, tp: int = 1, hidden: int = 1024, heads: int = 8, layers: int = 4,
               seq_len: int = 512, block_fwd_us=(10.0, 0.5, 0.001),
               block_bwd_us=(20.0, 1.0, 0.0025), other_fwd_us=(5.0, 0.1),
               other_bwd_us=(10.0, 0.2), block: Optional[PartMemory] = None,
               other: Optional[PartMemory] = None) -> ModelCost:
    """A bf16 ModelCost profiled at one tp, with the given per-sequence time fits and memory
    (defaults: 1 MB of parameters per block, 4 MB for "other", Megatron's sequence-parallel
    activations sbh(34/t + 5as/(ht)), 34sbh/t selective, 2sbh/t full, per token)."""
    acts = {"none": hidden * 34.0 / tp + 5.0 * heads * seq_len / tp,
            "selective": hidden * 34.0 / tp, "full": hidden * 2.0 / tp}
    block = block or PartMemory(2e6, 4e6, 12e6, acts, seq_len)
    other = other or PartMemory(8e6, 16e6, 48e6, {mode: 100.0 for mode in acts}, seq_len)
    return ModelCost(name="hand", hidden=hidden, ffn=4 * hidden, layers=layers, heads=heads,
                     kv_heads=heads, vocab=1000, seq_len=seq_len, dtype="bfloat16",
                     fits={tp: TpFit(tuple(block_fwd_us), tuple(block_bwd_us),
                                     tuple(other_fwd_us), tuple(other_bwd_us))},
                     memory={tp: (block, other)})
