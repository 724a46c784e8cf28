"""DynaPipe's plans against ours, both priced by OUR cost model (issue 24). Prints; asserts nothing.

DynaPipe (awslabs/optimizing-multitask-training-through-dynamic-pipelines, unmodified) makes its
own plan of each batch: DataAssignmentOptimizer.generate_microbatches (its C++ dynamic programme
over splits, no packing, lengths rounded to 8) and ExecutionPlanner.generate_execution_plan
(schedule_method="dynamic": every recompute type x {1F1B, wait-free cyclic}, k-means group
orders). Every time and byte it sees is read from a table filled by our MicroBatchCosts (one
DynaPipe "layer" per pipeline stage; its links set so that a send costs our boundary time), so
both planners price a micro-batch identically. Its plan (micro-batches, order, recompute,
schedule: 1F1B = our extra_warmup 0, wait-free cyclic = pp - 1) is then priced by our
simulation and compared with plan_iteration's (normal mode), on the bench's batches: llama2_7b
pp4 tp8 sp on 4 analytic dgx_h100 nodes, lognormal lengths (mean 1024, cap 4096 by default).

Setup, once (DynaPipe's C++ extension builds itself on first import):

    # fetch the repository (e.g. the tool library's fetch), then
    git --git-dir=<mirror>/repo archive HEAD | tar -x -C /tmp/dynapipe_src
    pip install --target /tmp/dynapipe_lib --no-deps pybind11 scikit-learn joblib threadpoolctl narwhals
    PYTHONPATH=/tmp/dynapipe_src:/tmp/dynapipe_lib python bench/dynapipe_side_by_side.py 8 16 64 [256]
    ... python bench/dynapipe_side_by_side.py --smoke    # 8 sequences, one batch

Without DynaPipe importable it says so and exits 0. elkai and prtpy (DynaPipe's encoder-decoder ordering and dp > 1 paths, unused here) are stubbed.
"""
import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
for _unused in ("elkai", "prtpy"):
    sys.modules.setdefault(_unused, types.ModuleType(_unused))

import dynamic_microbatching as B  # noqa: E402

from orchestrator.layout import ParallelLayout  # noqa: E402
from orchestrator.planner import HardwareModel, ModelCost  # noqa: E402
from orchestrator.planner.terms import MODE_NAMES  # noqa: E402
from orchestrator.planner.terms.pipeline import boundary_intra_node  # noqa: E402
from orchestrator.planner.dynamic import (MicroBatch, MicroBatchCosts, plan_iteration,  # noqa
                                          price_plan)
from orchestrator.planner.execution_plan import _price_micro_batches  # noqa: E402

try:
    import dynapipe.schedule_opt.execution_planner as EP  # noqa: E402
    from dynapipe.data_opt.optimizer import DataAssignmentOptimizer  # noqa: E402
    from dynapipe.model import DynaPipeCluster, DynaPipeMinibatch, DynaPipeMicrobatch  # noqa
    from dynapipe.model import TransformerModelSpec  # noqa: E402
except ImportError as e:  # not set up (this file's docstring): main() says so
    DYNAPIPE_MISSING = f"{type(e).__name__}: {e}"
else:
    DYNAPIPE_MISSING = ""

MB = 1e6
RC = MODE_NAMES  # the planner's recompute codes: RC[code]
ROUND = 8


class Table:
    """Our prices of every (b rows, s = 8k tokens, rc) for b <= n: per-stage arrays, so that
    DynaPipe's cost-model calls are O(1) lookups (as its interpolated profiles are)."""

    def __init__(self, costs, n, max_len):
        self.costs = costs
        self.S = np.arange(ROUND, max_len + 1, ROUND)
        bb, ss = np.meshgrid(np.arange(1, n + 1), self.S, indexing="ij")
        self.t = {}
        for code, rc in enumerate(RC):
            p = costs.price(bb.ravel(), ss.ravel(), np.full(bb.size, code))
            shp = (costs.layout.pp, n, len(self.S))
            self.t[rc] = {f: getattr(p, f).reshape(shp) for f in
                          ("fwd_us", "bwd_us", "boundary_us", "stage_time_us", "stored_bytes",
                           "extra_bytes")}

    def get(self, rc, field, b, s):
        return self.t[rc][field][:, b - 1, s // ROUND - 1]


class RawCM:
    """DynaPipe's ProfileBasedCostModel interface for the C++ DP (times ms, memory MB).
    n_layers_per_stage = 1: "Encoder FW" = the bottleneck stage's fwd+bwd+sends (our
    candidates' t), BW and postprocess 0; stored = max over stages of one micro-batch's stored
    activations; peak = max over stages of stored + transient extra."""

    def __init__(self, table, rc):
        self.table, self.rc = table, rc

    def get_cost(self, stage, seqlen, mbs):
        if stage == "Encoder FW":
            return float(self.table.get(self.rc, "stage_time_us", mbs, seqlen).max()) / 1e3
        return 0.0

    def get_stored_activation(self, stage, seqlen, mbs):
        return float(self.table.get(self.rc, "stored_bytes", mbs, seqlen).max()) / MB

    def get_peak_activation(self, stage, seqlen, mbs):
        t = self.table
        return float((t.get(self.rc, "stored_bytes", mbs, seqlen)
                      + t.get(self.rc, "extra_bytes", mbs, seqlen)).max()) / MB


class CMWithRC:
    def __init__(self, table, static_bytes):
        self.table, self.static_mb = table, float(np.max(static_bytes)) / MB

    def get_raw_cost_model(self, tp_size, rc_type):
        return RawCM(self.table, rc_type)

    def get_model_state(self, tp_size, rc_type, stage, n_shards=1, zero_stage=0):
        return self.static_mb if stage == "Embedding" else 0.0


def p2p_lines(costs) -> np.ndarray:
    """[pp - 1, 2]: (alpha us, us per byte) of one send across each pipeline boundary, as the
    cost model prices it (HardwareModel.p2p_time_us: a line in the bytes), read at two sizes."""
    key, hw = costs.whole.key, costs.hardware
    intra = boundary_intra_node(key.pp, key.stage_ranks, hw.tasks_per_node)[:-1]
    small, large = 1 << 20, 1 << 21
    t_small, t_large = (np.array([hw.p2p_time_us(size, x, key.pp) for x in intra])
                        for size in (small, large))
    per_byte = (t_large - t_small) / (large - small)
    return np.stack([t_small - per_byte * small, per_byte], axis=1)


def make_spec_builder(table, costs, hidden, lines):
    """Replacement of execution_planner.construct_minibatch_spec: one DynaPipe 'layer' per
    pipeline stage, carrying our per-stage fwd/bwd (us), boundary sizes, stored/peak MB and
    static MB; `lines` the boundaries' p2p_lines."""
    per_byte = lines[0, 1]

    def build(model_spec, cost_model, minibatch, rc_type, dp_size=1, tp_size=1, zero_stage=0,
              minibatch_idx=None, name="microbatch"):
        mbs = []
        for i, (b, s, _) in enumerate(minibatch):
            g = lambda f: table.get(rc_type, f, b, s)  # noqa: E731
            mb = DynaPipeMicrobatch(str(i))
            mb.set_fw_exec_times(list(map(float, g("fwd_us"))))
            mb.set_bw_exec_times(list(map(float, g("bwd_us")[::-1])))
            # comm time = lat + MB*8e3/bw; lat = alpha, bw chosen so that MB -> our per-byte
            comm_mb = [float((g("boundary_us")[j] - lines[j, 0]) / per_byte) / MB
                       for j in range(costs.layout.pp - 1)]
            mb.set_fw_comm_size(comm_mb)
            mb.set_bw_comm_size(comm_mb[::-1])
            mb.set_model_state_memory(list(map(float, costs.static_bytes / MB)))
            stored = g("stored_bytes")
            mb.set_model_stored_activation_memory(list(map(float, stored / MB)))
            mb.set_model_peak_activation_memory(list(map(float, (stored + g("extra_bytes"))
                                                         / MB)))
            mb.set_activation_shapes([[(b, s, hidden)]] * costs.layout.pp)
            mb.check_all_set()
            mbs.append(mb)
        return DynaPipeMinibatch(name, mbs)
    return build


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sizes", nargs="*", type=int, default=[8, 16, 64])
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--mean", type=float, default=1024)
    ap.add_argument("--cap", type=int, default=4096)
    ap.add_argument("--smoke", action="store_true", help="8 sequences, one batch")
    args = ap.parse_args()
    if args.smoke:
        args.sizes, args.batches = [8], 1
    if DYNAPIPE_MISSING:
        print(f"skipped: DynaPipe is not importable ({DYNAPIPE_MISSING}); set it up as this "
              f"file's docstring says")
        return

    cfg = B.compose_cfg(["stage=profile_model", "cluster=dgx_h100", "cluster.nodes=4",
                         "model=llama2_7b", "model.seq_len=8192",
                         "profile_model.source=analytic"])
    hw = HardwareModel.from_dict(B.analytic_hardware_profile(cfg))
    model = ModelCost.from_dict(B.analytic_model_profile(cfg))
    layout = ParallelLayout.uniform(32, 8, 4, model.layers, sequence_parallel=True,
                                    micro_batch_size=1)
    budget = B.budget_bytes(cfg)
    costs = MicroBatchCosts(layout, model, hw)
    lines = p2p_lines(costs)
    pp = layout.pp
    print(f"budget {budget / 2**30:.2f} GiB, static per stage GiB "
          f"{np.round(costs.static_bytes / 2**30, 2)}, p2p lines {lines.tolist()}")

    alpha, per_byte = lines[0]
    assert np.allclose(lines, lines[0]), "boundaries differ"
    bw_gbps = 8e-3 / per_byte
    cluster = DynaPipeCluster({j: j for j in range(pp)}, [budget / MB] * pp, bw_gbps, bw_gbps,
                              alpha, alpha)
    spec = TransformerModelSpec(n_encoder_layers=pp, n_decoder_layers=0,
                                hidden_dim=model.hidden, num_attn_heads=32)

    rows = []
    for n in args.sizes:
        table = Table(costs, n, args.cap)
        cm = CMWithRC(table, costs.static_bytes)
        EP.construct_minibatch_spec = make_spec_builder(table, costs, model.hidden, lines)
        dataopt = DataAssignmentOptimizer(cm, spec, n_executors=pp, n_layers_per_stage=1,
                                          dp_size=1, tp_size=layout.tp,
                                          device_memory_limit=budget / MB,
                                          round_seqlen_multiple=ROUND)
        planner = EP.ExecutionPlanner(cluster, spec, list(range(pp)), budget / MB, cm,
                                      dp_size=1, tp_size=layout.tp)
        rng = np.random.default_rng(n)
        for it in range(args.batches):
            lengths = B.lognormal_lengths(rng, n, args.mean, args.cap)
            np.random.seed(1000 * n + it)  # DynaPipe's in-group shuffles
            t0 = time.perf_counter()
            _, idx, memtype, split_rc, _ = dataopt.generate_microbatches(lengths)
            groups = idx[0]
            shapes = [(len(mb), -(-max(lengths[i] for smp in mb for i in smp) // ROUND) * ROUND,
                       0) for mb in groups]
            t1 = time.perf_counter()
            _, dp_ms, stats, rc, sch = planner.generate_execution_plan(shapes)
            t2 = time.perf_counter()
            perm = list(stats[0])
            mbs = [MicroBatch(tuple(i for smp in groups[k] for i in smp), shapes[k][1], rc)
                   for k in perm]
            extra = 0 if sch == "1F1B" else pp - 1
            theirs = price_plan([mbs], costs, budget, extra_warmup=[extra])
            # our simulated makespan without the optimizer tail, vs DynaPipe's own makespan
            priced = _price_micro_batches(costs, mbs, [()] * len(mbs))
            tail = float(np.max(costs.tail_us(priced.sync_window_us[:, -1])))
            t3 = time.perf_counter()
            ours = plan_iteration([lengths], layout, model, hw, budget, max_seq_len=args.cap,
                                  costs=costs, fast_mode=False)
            t4 = time.perf_counter()
            r = dict(n=n, it=it, ours=ours.iteration_time_us, theirs=theirs.iteration_time_us,
                     theirs_ok=theirs.feasible, ours_ok=ours.feasible, sch=sch, rc=rc,
                     split_rc=split_rc, memtype=memtype, m=len(mbs),
                     m_ours=len(ours.micro_batches[0]), dp_make_ms=dp_ms,
                     our_make_ms=(theirs.iteration_time_us - tail) / 1e3,
                     t_dp_ms=(t2 - t0) * 1e3, t_split_ms=(t1 - t0) * 1e3,
                     t_ours_ms=(t4 - t3) * 1e3,
                     peak_gib=max(theirs.stage_peak_memory_bytes) / 2**30,
                     ours_extra=ours.extra_warmup_of(0))
            rows.append(r)
            print(f"n={n} it={it}: ours {r['ours']/1e3:.1f} ms ({r['m_ours']} mbs, e"
                  f"{r['ours_extra']}) | DynaPipe {r['theirs']/1e3:.1f} ms ({r['m']} mbs, {sch}, "
                  f"rc {rc}, split rc {split_rc}/{memtype}, ok={theirs.feasible}, peak "
                  f"{r['peak_gib']:.1f} GiB) | DP makespan own {dp_ms:.1f} vs our sim "
                  f"{r['our_make_ms']:.1f} ms | plan ms DP {r['t_dp_ms']:.0f} "
                  f"(split {r['t_split_ms']:.0f}) ours {r['t_ours_ms']:.0f}", flush=True)
        rs = [r for r in rows if r["n"] == n]
        d = [r["ours"] / r["theirs"] - 1 for r in rs]
        print(f"== n={n}: ours/DynaPipe-1 median {100*statistics.median(d):+.2f}% max "
              f"{100*max(d):+.2f}% min {100*min(d):+.2f}%; DynaPipe over budget "
              f"{sum(not r['theirs_ok'] for r in rs)}/{len(rs)}; ours over "
              f"{sum(not r['ours_ok'] for r in rs)}; plan ms median DP "
              f"{statistics.median(r['t_dp_ms'] for r in rs):.0f} ours "
              f"{statistics.median(r['t_ours_ms'] for r in rs):.1f}; DP own/our-sim makespan "
              f"median {statistics.median(r['dp_make_ms'] / r['our_make_ms'] for r in rs):.3f}"
              f"; schedules {[r['sch'] for r in rs]}", flush=True)


if __name__ == "__main__":
    main()
