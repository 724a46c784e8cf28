"""trace.export=simai: the SimAI/AICB workload text of a traced rank, parsed back and checked
against hand-computed sizes and times (tiny model, WS 16 PP 2 TP 2 DP 4, bf16, SP on): every
micro-batch's items (SimAI walks the list once), the model chunks per stage after `vpp:`, the
input- and weight-gradient split from what each op reads, the optimizer in a compute column."""
import dataclasses

import pytest

from orchestrator.models.config import ModelConfig
from orchestrator.trace.configs import TraceSettings, plan_configs
from orchestrator.trace.simai import (COMM_TYPES, CP_COMM_TYPES, simai_file_name,
                                      simai_workload, write_simai)
from orchestrator.trace.tracer import trace_rank

MODEL = ModelConfig(name="tiny", hidden=128, ffn=384, layers=4, heads=4, kv_heads=2, vocab=512,
                    seq_len=256, dtype="bf16")
SEQ, MBS, HIDDEN, BF16_BYTES = 256, 1, 128, 2


@pytest.fixture(scope="module")
def spec():
    settings = TraceSettings(global_batch_size=16, micro_batch_size=MBS, seq_len=SEQ,
                             sequence_parallel=True)
    specs, skipped = plan_configs([[16, 2, 2]], settings, MODEL)
    assert not skipped
    return specs[0]


def _priced(spec, model, rank):
    records = trace_rank(spec, model, rank).records
    for r in records:
        if r["kind"] == "compute":
            r["time_us"] = r["flops"] / 1e6 + 1.0  # 1 us per op + 1 us per MFLOP
    return records


@pytest.fixture(scope="module")
def traces(spec):
    return {rank: _priced(spec, MODEL, rank) for rank in (0, 8)}


def parse(text):
    lines = text.rstrip("\n").split("\n")
    tokens = lines[0].split()
    header = {tokens[k][:-1]: tokens[k + 1] for k in range(1, len(tokens) - 1)
              if tokens[k].endswith(":")}
    items = [line.split("\t") for line in lines[2:]]
    return tokens[0], header, int(lines[1]), items


def by_name(items):
    """Each item's first line (its compute times; a pass with several collectives adds
    comm-only lines of the same name, as AICB writes them)."""
    rows = {}
    for row in items:
        rows.setdefault(row[0], row)
    return rows


def comms_of(items, name, column):
    """{comm type: bytes} of item `name`'s pass at `column` (3 fwd, 6 ig, 9 wg), every line."""
    return {row[column]: int(row[column + 1]) for row in items
            if row[0] == name and row[column] != "NONE"}


def item_names(items):
    """The items' names in order, one per item (its comm-only lines folded in)."""
    out = []
    for row in items:
        if not out or out[-1] != row[0]:
            out.append(row[0])
    return out


def test_header_carries_the_degrees_and_accumulation(spec, traces):
    kind, header, count, items = parse(simai_workload(traces[8], spec, "tiny"))
    assert kind == "HYBRID_TRANSFORMER_FWD_IN_BCKWD"
    assert header["model_parallel_NPU_group"] == "2" and header["pp"] == "2"
    assert header["all_gpus"] == "16" and header["ep"] == "1"
    assert header["ga"] == str(16 // (4 * MBS))  # GBS / (DP * MBS)
    assert header["vpp"] == "1"  # model chunks per stage: SimAI's bubble is (pp-1)/(ga*vpp)
    # p2p activation with SP: s*b*h*bytes / TP
    assert header["pp_comm"] == str(SEQ * MBS * HIDDEN * BF16_BYTES // 2)
    assert count == len(items) and all(len(row) == 12 for row in items)


def test_items_cover_only_the_ranks_layers(spec, traces):
    names0 = item_names(parse(simai_workload(traces[0], spec, "tiny"))[3])
    names8 = item_names(parse(simai_workload(traces[8], spec, "tiny"))[3])
    parts = ("attention_column", "attention_row", "mlp_column", "mlp_row")
    ga = 16 // (4 * MBS)
    assert [n for n in names0 if n.startswith("layer")] == [
        f"layer{n}_{p}" for _ in range(ga) for n in (0, 1) for p in parts]
    assert [n for n in names8 if n.startswith("layer")] == [
        f"layer{n}_{p}" for _ in range(ga) for n in (2, 3) for p in parts]
    assert "embedding_layer" not in names8 and "final_norm_lm_head" not in names0
    for names, end in ((names0, "embedding_layer"), (names8, "final_norm_lm_head")):
        per_mb = [n for n in names if n.startswith("layer") or n == end]
        assert per_mb == per_mb[:len(per_mb) // ga] * ga and end in per_mb  # ga equal blocks


def test_sequence_parallel_comm_sizes_are_sbh_bytes(spec, traces):
    sbh_bytes = SEQ * MBS * HIDDEN * BF16_BYTES
    items = parse(simai_workload(traces[8], spec, "tiny"))[3]
    for part in ("attention", "mlp"):
        col, row = f"layer2_{part}_column", f"layer2_{part}_row"
        assert comms_of(items, col, 3) == {"ALLGATHER": sbh_bytes}  # forward
        # input gradient: Megatron-LM gathers the sharded input again (for the weight
        # gradient), then reduce-scatters the input's gradient
        assert comms_of(items, col, 6) == {"ALLGATHER": sbh_bytes, "REDUCESCATTER": sbh_bytes}
        assert [r[6] for r in items if r[0] == col][:2] == ["ALLGATHER", "REDUCESCATTER"]
        assert comms_of(items, row, 3) == {"REDUCESCATTER": sbh_bytes}
        assert comms_of(items, row, 6) == {"ALLGATHER": sbh_bytes}
        assert comms_of(items, col, 9) == comms_of(items, row, 9) == {}  # DP: own items
    head = comms_of(items, "final_norm_lm_head", 6)
    assert head == {"ALLGATHER": sbh_bytes, "REDUCESCATTER": sbh_bytes}


def test_weight_gradient_time_is_the_projections_matmuls(spec, traces):
    # TP 2 local shards: wq 128x64 (4 heads / 2 * 32), wk and wv 128x32 (2 kv heads / 2);
    # each weight-gradient mm is 2*tokens*in*out FLOPs, priced flops/1e6 + 1 us.
    tokens = SEQ * MBS
    wg_us = sum(2 * tokens * 128 * out / 1e6 + 1.0 for out in (64, 32, 32))
    items = by_name(parse(simai_workload(traces[0], spec, "tiny"))[3])
    assert int(items["layer0_attention_column"][8]) == round(wg_us * 1000)  # ns
    # w_down local shard 192x128 (ffn 384 / TP 2): one weight-gradient mm
    down_us = 2 * tokens * 192 * 128 / 1e6 + 1.0
    assert int(items["layer1_mlp_row"][8]) == round(down_us * 1000)


def test_compute_time_adds_up_to_every_micro_batch(spec, traces):
    records = traces[8]
    expected_us = sum(r["time_us"] for r in records if r["kind"] == "compute"
                      and r["phase"] in ("F", "B", "loss"))
    items = parse(simai_workload(records, spec, "tiny"))[3]
    layer_ns = sum(int(row[k]) for row in items if row[0] not in ("grad_param_comm",
                   "grad_gather", "optimizer") for k in (2, 5, 8))
    assert abs(layer_ns - expected_us * 1000) <= len(items) * 3  # per-column rounding
    optimizer_us = sum(r["time_us"] for r in records
                       if r["kind"] == "compute" and r["phase"] == "optimizer")
    # In a compute column: SimAI's analytical mode ignores the update-time column.
    optimizer = by_name(items)["optimizer"]
    assert int(optimizer[2]) == round(optimizer_us * 1000) > 0 and optimizer[11] == "0"
    assert {row[11] for row in items} == {"0"}


def test_tokens_equal_to_hidden_split_the_gradients_by_what_each_matmul_reads(spec):
    """seq * mbs == hidden: an input-gradient matmul gives a weight's shape too (the shape
    guess swapped them); the one that reads the weight is the input gradient."""
    model = dataclasses.replace(MODEL, seq_len=HIDDEN)
    settings = TraceSettings(global_batch_size=16, micro_batch_size=1, seq_len=HIDDEN,
                             sequence_parallel=True)
    (square,), _ = plan_configs([[16, 2, 2]], settings, model)
    items = by_name(parse(simai_workload(_priced(square, model, 0), square, "tiny"))[3])
    wg_us = sum(2 * HIDDEN * 128 * out / 1e6 + 1.0 for out in (64, 32, 32))  # wq, wk, wv
    assert int(items["layer0_attention_column"][8]) == round(wg_us * 1000)
    down_us = 2 * HIDDEN * 192 * 128 / 1e6 + 1.0  # w_down's local 192 x 128
    assert int(items["layer1_mlp_row"][8]) == round(down_us * 1000)


def test_interleaved_writes_its_chunks_per_stage_after_vpp():
    settings = TraceSettings(global_batch_size=16, micro_batch_size=MBS, seq_len=SEQ,
                             sequence_parallel=True, schedule="interleaved", virtual_stages=2)
    (interleaved,), _ = plan_configs([[16, 2, 2]], settings, MODEL)
    text = simai_workload(_priced(interleaved, MODEL, 0), interleaved, "tiny")
    _, header, _, items = parse(text)
    assert header["vpp"] == "2"
    # Stage 0 holds layers 0 and 2 (one per chunk), every micro-batch, chunk by chunk.
    layers = [name.split("_")[0] for name in item_names(items) if name.startswith("layer")]
    assert layers == ["layer0"] * 4 + ["layer2"] * 4 + (["layer0"] * 4 + ["layer2"] * 4) * 3


def test_dp_gradient_reduce_is_the_stage_gradient_bytes(spec, traces):
    records = traces[8]
    comm = [r for r in records if r["phase"] == "dp" and r["kind"] == "coll"]
    dp_bytes = sum(r["bytes"] for r in comm if r["group"] == "dp")
    tp_bytes = sum(r["bytes"] for r in comm if r["group"] == "tp")
    items = by_name(parse(simai_workload(records, spec, "tiny"))[3])
    assert items["grad_param_comm"][10] == str(dp_bytes) and dp_bytes > 0
    # SP norm gradients, reduced over TP: in an input-gradient column (SimAI's TP group).
    assert items["norm_grads_allreduce"][6:8] == ["ALLREDUCE", str(tp_bytes)] and tp_bytes > 0
    assert items["norm_grads_allreduce"][9] == "NONE"


def test_every_comm_type_is_in_simai_vocabulary(spec, traces):
    for rank in (0, 8):
        for row in parse(simai_workload(traces[rank], spec, "tiny"))[3]:
            assert {row[3], row[6], row[9]} <= set(COMM_TYPES)
            for k in (3, 6, 9):
                assert (row[k] == "NONE") == (row[k + 1] == "0")


def test_compute_without_time_is_refused(spec, traces):
    records = [dict(r) for r in traces[8]]
    next(r for r in records if r["kind"] == "compute").pop("time_us")
    with pytest.raises(ValueError, match="time_us"):
        simai_workload(records, spec, "tiny")


def test_write_simai_writes_the_text_under_aicb_name(spec, traces, tmp_path):
    name = simai_file_name(spec, "tiny", stage=1)
    assert name == ("tiny-world_size16-tp2-pp2-ep1-gbs16-mbs1-seq256-MOE-False-GEMM-False"
                    "-flash_attn-True-stage1.txt")
    path = write_simai(tmp_path / name, traces[8], spec, "tiny")
    assert path.read_text() == simai_workload(traces[8], spec, "tiny")
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no temp file left


# ------------------------------------------------------------------ context parallelism
def _cp_export(cp_comm: str):
    settings = TraceSettings(global_batch_size=16, micro_batch_size=MBS, seq_len=SEQ,
                             sequence_parallel=True, cp_comm=cp_comm)
    (cp_spec,), skipped = plan_configs([[16, 2, 2, 2]], settings, MODEL)
    assert not skipped
    return cp_spec, parse(simai_workload(_priced(cp_spec, MODEL, 8), cp_spec, "tiny"))


def test_cp_ring_is_written_as_the_all_gather_moving_its_bytes_over_the_ep_group():
    """SimAI has no CP group: `ep: <cp>` makes its EP group the CP group (ranks of stride tp),
    and each layer's ring sends become ALLGATHER_EP of sends x cp / (cp - 1) K/V blocks: cp
    blocks forward (cp - 1 sends), (2 cp - 1) x cp / (cp - 1) backward (K/V again, and their
    gradients)."""
    cp_spec, (_, header, _, items) = _cp_export("p2p")
    lay = cp_spec.layout
    cp = lay.cp
    assert (header["ep"], header["model_parallel_NPU_group"], header["all_gpus"]) == (
        "2", "2", "16")
    # tokens per rank s / cp; the p2p activation message is the pipeline's, not the ring's
    assert header["pp_comm"] == str(SEQ // cp * MBS * HIDDEN * BF16_BYTES // 2)
    kv = 2 * MBS * SEQ // cp * (MODEL.kv_heads // lay.tp) * (HIDDEN // MODEL.heads) * BF16_BYTES
    col = "layer2_attention_column"
    assert comms_of(items, col, 3)["ALLGATHER_EP"] == (cp - 1) * kv * cp // (cp - 1)
    assert comms_of(items, col, 6)["ALLGATHER_EP"] == (2 * cp - 1) * kv * cp // (cp - 1)
    # the rest of the layer is the TP layer's, at s / cp tokens
    assert comms_of(items, col, 3)["ALLGATHER"] == SEQ // cp * MBS * HIDDEN * BF16_BYTES
    assert all(comms_of(items, f"layer2_{p}", 3).keys() <= {"ALLGATHER", "REDUCESCATTER"}
               for p in ("attention_row", "mlp_column", "mlp_row"))
    # gradients over the dp x cp replicas: SimAI's DP group (wg column), ZeRO 1's reduce-scatter
    assert by_name(items)["grad_param_comm"][9] == "REDUCESCATTER"
    assert by_name(items)["grad_gather"][9] == "ALLGATHER"


def test_cp_all_gather_and_a2a_flavours_keep_their_collectives_on_the_ep_group():
    lay_spec, (_, header, _, items) = _cp_export("allgather")
    lay = lay_spec.layout
    whole = MBS * SEQ * (MODEL.kv_heads // lay.tp) * (HIDDEN // MODEL.heads) * BF16_BYTES
    col = "layer2_attention_column"
    assert comms_of(items, col, 3)["ALLGATHER_EP"] == 2 * whole  # K and V
    assert comms_of(items, col, 6)["REDUCESCATTER_EP"] == 2 * whole
    for row in items:
        assert {row[3], row[6], row[9]} <= set(COMM_TYPES) | set(CP_COMM_TYPES)
    # Ulysses needs tp x cp to divide the KV heads: TP 1 here
    settings = TraceSettings(global_batch_size=16, micro_batch_size=MBS, seq_len=SEQ,
                             sequence_parallel=False, cp_comm="a2a")
    (a2a,), skipped = plan_configs([[8, 2, 1, 2]], settings, MODEL)
    assert not skipped
    a2a_items = parse(simai_workload(_priced(a2a, MODEL, 4), a2a, "tiny"))[3]
    q = MBS * SEQ // 2 * HIDDEN * BF16_BYTES
    assert comms_of(a2a_items, col, 3) == {"ALLTOALL_EP": 2 * q + 2 * (q // 2)}  # Q, out; K, V
    assert comms_of(a2a_items, col, 6) == {"ALLTOALL_EP": 2 * q + 2 * (q // 2)}


# SimAI's group of a collective by its column (Workload.cc): the suffix, else TP in the forward
# and input-gradient columns and DP in the weight-gradient one.
def _simai_group(comm_type: str, column: int) -> str:
    for suffix in ("_DP_EP", "_EP"):
        if comm_type.endswith(suffix):
            return suffix[1:]
    return "DP" if column == 9 else "TP"


# The SimAI group each of the trace's groups is exported to: CP and EP on SimAI's EP group, the
# expert replicas on DP_EP, the dp (x cp) replicas on DP; the grad-norm all-reduce over the
# world goes in a forward column as AICB writes it (optimizer items), TP's.
TRACE_TO_SIMAI = {"tp": "TP", "etp": "TP", "world": "TP", "cp": "EP", "ep": "EP",
                  "edp": "DP_EP", "dp": "DP", "dp_cp": "DP"}


def check_one_group_per_line(items, records, cp: int) -> None:
    """Every line of an export carries the collectives of one SimAI group (SimAI files a
    line's forward and input-gradient time under EP only when its forward type is EP's, so a
    line mixing TP and EP misfiles one of them), and each group's bytes over the lines are
    the trace's records of that group (the CP ring's sends as the all-gather moving them)."""
    exported = {}
    for row in items:
        groups = {_simai_group(row[c], c) for c in (3, 6, 9) if row[c] != "NONE"}
        assert len(groups) <= 1, row
        for c in (3, 6, 9):
            if row[c] != "NONE":
                group = _simai_group(row[c], c)
                exported[group] = exported.get(group, 0) + int(row[c + 1])
    traced = {}
    for r in records:
        n_bytes = (r["bytes"] if r["kind"] == "coll" else r["bytes"] * cp // (cp - 1)
                   if r["kind"] == "p2p" and r.get("group") == "cp" and r["op"] == "send"
                   else 0)
        if n_bytes:
            group = TRACE_TO_SIMAI[r["group"]]
            traced[group] = traced.get(group, 0) + n_bytes
    assert exported == traced
    assert "EP" in exported


@pytest.mark.parametrize("cp_comm,config,recompute", [
    ("p2p", [16, 2, 2, 2], "selective"), ("allgather", [16, 2, 2, 2], "selective"),
    ("a2a", [8, 2, 1, 2], "none")])
def test_cp_export_writes_one_group_per_line(cp_comm, config, recompute):
    settings = TraceSettings(global_batch_size=16, micro_batch_size=MBS, seq_len=SEQ,
                             sequence_parallel=config[2] > 1, cp_comm=cp_comm,
                             recompute=recompute)
    (cp_spec,), skipped = plan_configs([config], settings, MODEL)
    assert not skipped
    records = _priced(cp_spec, MODEL, cp_spec.layout.world_size // 2)
    items = parse(simai_workload(records, cp_spec, "tiny"))[3]
    check_one_group_per_line(items, records, cp_spec.layout.cp)


def test_cp_heads_that_do_not_split_are_skipped_with_the_reason():
    settings = TraceSettings(global_batch_size=16, micro_batch_size=MBS, seq_len=SEQ,
                             sequence_parallel=True, cp_comm="a2a")
    specs, skipped = plan_configs([[16, 2, 2, 2], [16, 2, 1, 3]], settings, MODEL)
    assert specs == [] and [s.index for s in skipped] == [0, 1]
    assert "tp(2) * cp(2) (cp_comm a2a) must divide heads(4) and kv_heads(2)" in skipped[0].reason
    assert "WORLD_SIZE(16) % (PP(2) * TP(1) * CP(3)) != 0" in skipped[1].reason
