"""The engine matrices: the layouts tests/test_train_engine.py and tests/test_moe_train.py run
on 4 gloo ranks (every message and byte checked against orchestrator/workload/), and that
tests/workload/test_priced_messages.py holds the planner's priced messages equal to, term by
term. One list, so a layout added to the engine's tests is priced-checked too."""
from __future__ import annotations

WORLD_SIZE = 4
GBS = 4
MODEL = dict(hidden=64, ffn=128, layers=4, heads=4, kv_heads=2, vocab=128, seq_len=32)
# (pp, tp, extra ParallelLayout fields): dp4, tp2*dp2, pp2*dp2, pp2*tp2, pp4 1F1B, pp2 v2
# interleaved, ZeRO 1/2/3 (FSDP2, also under a pipeline and with TP), each recompute mode,
# an uneven split, TP without SP, full recompute of k < n layers with TP, selective with ZeRO-2.
LAYOUTS = [
    (1, 1, {}),
    (1, 2, {}),
    (2, 1, {}),
    (2, 2, {}),
    (4, 1, {}),
    (2, 1, {"schedule": "interleaved", "virtual_stages": 2}),
    (1, 1, {"zero": 1}),
    (1, 1, {"zero": 2}),
    (1, 1, {"zero": 3}),
    (2, 1, {"zero": 3}),
    (1, 2, {"zero": 3}),
    (1, 1, {"recompute": "selective"}),
    (2, 1, {"recompute": "full"}),
    (2, 1, {"layers_per_stage": (3, 1)}),
    (1, 2, {"sequence_parallel": False}),
    (2, 2, {"recompute": ("full", 1)}),
    (1, 2, {"zero": 2, "recompute": "selective"}),
    # context parallelism (each sequence split over cp ranks): the ring (p2p) over 4 ranks,
    # with TP+SP, a pipeline (1F1B and interleaved), ZeRO-3 and each recompute; K/V all-gathered with ZeRO-1 and with
    # TP and selective recompute; Ulysses with ZeRO-2 and with a pipeline and full recompute;
    # the hierarchical flavour with ZeRO-1
    (1, 1, {"cp": 4}),
    (1, 2, {"cp": 2}),
    (2, 1, {"cp": 2}),
    (1, 1, {"cp": 2, "zero": 3}),
    (1, 1, {"cp": 2, "recompute": "selective"}),
    (2, 1, {"cp": 2, "recompute": "full"}),
    (2, 1, {"cp": 2, "schedule": "interleaved", "virtual_stages": 2}),
    (1, 1, {"cp": 2, "cp_comm": "allgather", "zero": 1}),
    (1, 2, {"cp": 2, "cp_comm": "allgather", "recompute": "selective"}),
    # Ulysses (a2a): tp x cp must divide the 2 KV heads
    (1, 1, {"cp": 2, "cp_comm": "a2a", "zero": 2}),
    (2, 1, {"cp": 2, "cp_comm": "a2a", "recompute": "full"}),
    # hierarchical: Ulysses over pairs of CP ranks, the ring over the two pairs
    (1, 1, {"cp": 4, "cp_comm": "a2a+p2p", "cp_a2a": 2, "zero": 1}),
]
# Traced once each under bf16 (not trained): the dtype of every message (bf16 weights, fp32
# masters and gradient buckets; ZeRO 2 with TP + SP and ZeRO 3's FSDP2 gather bf16).
BF16_LAYOUTS = [
    (2, 2, {}),
    (1, 2, {"zero": 2}),
    (1, 1, {"zero": 3}),
    (1, 2, {"sequence_parallel": False, "zero": 1}),
    (2, 2, {"sequence_parallel": False, "recompute": ("full", 1)}),
    (1, 2, {"cp": 2}),
    (1, 1, {"cp": 2, "cp_comm": "allgather"}),
    (1, 1, {"cp": 2, "cp_comm": "a2a", "recompute": "selective"}),
    (1, 1, {"cp": 4, "cp_comm": "a2a+p2p", "cp_a2a": 2, "recompute": "selective"}),
]


def layout(pp, tp, extra):
    """The engine matrix's layout (pp, tp, extra) on WORLD_SIZE ranks, GBS sequences of 1."""
    from orchestrator.layout import ParallelLayout

    extra = dict(extra)
    recompute = extra.pop("recompute", "none")
    dp = WORLD_SIZE // (pp * tp * extra.get("cp", 1))
    common = dict(micro_batch_size=1, num_micro_batches=GBS // dp,
                  sequence_parallel=extra.pop("sequence_parallel", tp > 1))
    stages = extra.pop("layers_per_stage", None)
    if stages:
        return ParallelLayout(world_size=WORLD_SIZE, pp=pp, tp=tp, dp=dp, layers_per_stage=stages,
                              **common, **extra)
    return ParallelLayout.uniform(WORLD_SIZE, tp, pp, 4, recompute=recompute, **common, **extra)


# Mixture of experts (tests/test_moe_train.py): every EP layout family.
MOE_MODEL = dict(hidden=64, ffn=128, layers=4, heads=4, kv_heads=2, vocab=128, seq_len=32,
                 experts=4, top_k=2, expert_ffn=64, shared_expert_ffn=64, dense_layers=1,
                 aux_loss_coef=0.01)
# (pp, tp, extra ParallelLayout fields)
MOE_LAYOUTS = [
    (1, 1, {}),  # experts replicated, reduced over dp
    (1, 1, {"ep": 2}),
    (1, 1, {"ep": 4, "zero": 1}),
    (1, 1, {"ep": 2, "etp": 2, "zero": 2}),
    (1, 1, {"ep": 2, "zero": 3}),  # FSDP2: experts their own unit over edp
    (1, 2, {"ep": 4, "zero": 3}),
    (2, 1, {"ep": 2, "zero": 3}),
    (1, 2, {"ep": 2}),  # the EP group is the TP pair (folding)
    (1, 2, {"ep": 4, "recompute": "selective"}),  # EP over TP and DP ranks
    (1, 2, {}),  # experts replicated over TP x DP: reduced over all four
    (1, 2, {"ep": 2, "etp": 2, "zero": 1}),
    (2, 1, {"ep": 2, "recompute": "full"}),
    (2, 2, {"ep": 2}),
    (4, 1, {}),  # stage 0 holds the dense block only: no experts there
    (2, 1, {"ep": 2, "schedule": "interleaved", "virtual_stages": 2}),
    # context parallelism: a sequence's tokens over cp (x tp) ranks, EP folded over them
    (1, 1, {"cp": 2, "ep": 2}),
    (1, 2, {"cp": 2, "ep": 4}),
    (1, 1, {"cp": 4, "ep": 2, "cp_comm": "a2a+p2p", "cp_a2a": 2, "zero": 1}),
    (1, 1, {"cp": 2, "ep": 4, "cp_comm": "allgather", "recompute": "full"}),
]


def moe_layout(world, pp, tp, extra, mbs=1):
    """The MoE matrix's layout (pp, tp, extra) on `world` ranks, micro-batches of `mbs`."""
    from orchestrator.layout import ParallelLayout

    extra = dict(extra)
    recompute = extra.pop("recompute", "none")
    dp = world // (pp * tp * extra.get("cp", 1))
    return ParallelLayout.uniform(world, tp, pp, MOE_MODEL["layers"], recompute=recompute,
                                  micro_batch_size=mbs, num_micro_batches=GBS // (dp * mbs),
                                  sequence_parallel=tp > 1, **extra)
