"""trace's compute times are the planner's (issue 40): with a model profile, each stage's compute
in the SimAI export adds up to what the cost model charges that stage (its blocks, with experts
MoE blocks on the busiest EP rank; "other" split 5% / 95% over the first and last stage;
recompute by its mode and k; the optimizer step), and no op or exported item runs above the
device's peak FLOP/s. Profiles: tiny and tiny_moe in bf16, analytic on the dgx_h100 cluster's
H100 sheet (what a user plans from a laptop), made once for the module."""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest
import yaml

import planner_fixtures as pf
from conftest import REPO, run_cli
from orchestrator.choices import Recompute, Schedule
from orchestrator.device import dense_peak_flops, load_device_sheet
from orchestrator.models.config import ModelConfig
from orchestrator.planner import CostOptions, HardwareModel
from orchestrator.planner.cost_model import ConfigKey, StageCosts
from orchestrator.trace.configs import TraceSettings, plan_configs
from orchestrator.trace.simai import simai_workload, workload_items
from orchestrator.trace.timing import fit_to_total, make_pricer
from orchestrator.trace.tracer import trace_rank

SEQ = 256
SHEET = load_device_sheet("h100")
# (name, model, config, settings beyond the defaults, recompute (mode, k) per stage or None)
CASES = [
    ("1f1b", "tiny", [16, 2, 2], {}, None),
    ("full_recompute_k1_of_2", "tiny", [16, 2, 2], {"recompute": Recompute.full},
     ((Recompute.full, 1), (Recompute.full, 1))),
    ("interleaved", "tiny", [8, 2, 1], {"schedule": Schedule.interleaved}, None),
    ("cp2_ring_selective", "tiny", [16, 2, 2, 2], {"recompute": Recompute.selective}, None),
    ("moe_ep2_etp2_full_recompute_k1", "tiny_moe", [16, 2, 2, 1, 2, 2],
     {"recompute": Recompute.full}, ((Recompute.full, 1), (Recompute.full, 1))),
]
IDS = [case[0] for case in CASES]


def _model(name: str) -> ModelConfig:
    raw = yaml.safe_load((REPO / "orchestrator" / "conf" / "model" / f"{name}.yaml").read_text())
    return ModelConfig(**{**raw, "dtype": "bf16"})


@pytest.fixture(scope="module")
def profiles_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trace_timing") / "profiles"
    run_cli("-m", "stage=profile_model", "profile_model.source=analytic",
            "profile_model.plot=false", "cluster=dgx_h100", "model=tiny,tiny_moe",
            "model.dtype=bf16", "profile_model.max_tp=2", "profile_model.seq_lens=[128,256]",
            profiles_dir=folder, check=0)
    return folder


def _cfg(profiles_dir, model: str):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from orchestrator.config import CONF_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=[
            "stage=trace", "cluster=dgx_h100", f"model={model}", "model.dtype=bf16",
            f"profiles_dir={profiles_dir}"]))


@lru_cache(maxsize=None)
def _priced(profiles_dir, name: str):
    """(spec, pricer, {stage: priced records of its representative}) of case `name`."""
    _, model_name, config, extra, recompute = CASES[IDS.index(name)]
    model = _model(model_name)
    settings = TraceSettings(**{"global_batch_size": 16, "micro_batch_size": 1, "seq_len": SEQ,
                                "sequence_parallel": True, **extra})
    (spec,), skipped = plan_configs([config], settings, model)
    assert not skipped, skipped
    if recompute is not None:  # k of a stage's layers (the search's partial full recompute)
        spec = dataclasses.replace(spec, layout=dataclasses.replace(spec.layout,
                                                                    recompute=recompute))
    pricer = make_pricer(_cfg(profiles_dir, model_name), {spec.layout.tp})
    assert pricer.model_cost is not None, pricer.note
    traces = {}
    for rank in spec.representative_ranks():
        records = trace_rank(spec, model, rank).records
        pricer.price(records, spec, spec.stage_of(rank))
        traces[spec.stage_of(rank)] = records
    return spec, pricer, traces


def _planner_cost(profiles_dir, model_name: str):
    """The model profile as the search reads it (stages/search.model_cost: with its experts)."""
    from orchestrator.stages.search import model_cost
    from orchestrator.store import read_profile
    from orchestrator.store.schema import ModelProfile

    path = profiles_dir / "dgx_h100" / "model" / f"{model_name}.json"
    return model_cost(_cfg(profiles_dir, model_name), read_profile(path, ModelProfile, ""))


def _planner_compute_us(spec, cost) -> list:
    """Each stage's compute per iteration as the cost model charges it: per micro-batch its
    blocks, its "other" and the compute its recompute reruns; the optimizer step once."""
    layout = spec.layout
    costs = StageCosts(ConfigKey.of(layout), cost, HardwareModel.from_dict(
        pf.synthetic_hardware()), spec.seq_len, CostOptions())
    block = costs.compute
    out = []
    for j, n in enumerate(layout.layers_per_stage):
        mode, k = layout.recompute[j]
        rerun = {Recompute.none: 0.0, Recompute.selective: n * block.selective_recompute_us,
                 Recompute.full: k * block.block.fwd_us}[mode]
        per_mb = (n * block.block.total_us + costs.other_compute.fwd_us[j]
                  + costs.other_compute.bwd_us[j] + rerun)
        out.append(layout.num_micro_batches * per_mb + float(costs.optimizer_us(j, n)))
    return out


def _simai_compute_us(text: str) -> float:
    """Every compute column of a SimAI workload (ns) summed, in us."""
    rows = [line.split("\t") for line in text.splitlines()[2:]]
    return sum(int(row[k]) for row in rows for k in (2, 5, 8)) / 1e3


@pytest.mark.parametrize("name", IDS)
def test_simai_compute_per_stage_is_the_planners(profiles_dir, name):
    spec, pricer, traces = _priced(profiles_dir, name)
    want = _planner_compute_us(spec, _planner_cost(profiles_dir, CASES[IDS.index(name)][1]))
    for stage, records in traces.items():
        got = _simai_compute_us(simai_workload(records, spec, "m"))
        assert got == pytest.approx(want[stage], rel=0.01), (stage, got, want)
    if name.startswith("moe"):
        assert "busiest EP rank at 1.1x" in pricer.note  # tiny_moe's aux loss 1e-2


def test_other_is_five_percent_on_the_first_stage_the_rest_on_the_last(profiles_dir):
    """The embedding's item carries the planner's first-stage share of "other", the final
    norm + LM head + loss the last stage's."""
    spec, pricer, traces = _priced(profiles_dir, "1f1b")
    sc = pricer.stage_compute(spec)
    m = spec.layout.num_micro_batches
    for stage, item, share in ((0, "embedding_layer", sc.other_first),
                               (1, "final_norm_lm_head", sc.other_last)):
        got = sum(p.time_us for i in workload_items(traces[stage], spec) if i.name == item
                  for p in (i.fwd, i.ig, i.wg))
        assert got == pytest.approx(m * share.total_us, rel=0.01), (item, got)
    assert sc.other_first.total_us == pytest.approx(
        0.05 / 0.95 * sc.other_last.total_us)


@pytest.mark.parametrize("name", IDS)
def test_no_op_or_exported_item_is_above_the_device_peak(profiles_dir, name):
    spec, _, traces = _priced(profiles_dir, name)
    top = max(dense_peak_flops(SHEET, dtype) for dtype in ("bf16", "fp32"))
    for records in traces.values():
        for r in records:
            if r["kind"] == "compute" and r["flops"]:
                peak = dense_peak_flops(SHEET, r["dtype"])
                assert r["flops"] / (r["time_us"] * 1e-6) <= peak * (1 + 1e-9), r
        for item in workload_items(records, spec):
            for p in (item.fwd, item.ig, item.wg):
                if p.flops:
                    assert p.flops / (p.time_us * 1e-6) <= top * (1 + 1e-9), item.name


def test_fit_to_total_keeps_proportions_above_the_floors():
    # one factor for all: 2 and 4 scaled to 3 in total
    assert fit_to_total([2.0, 4.0], [0.0, 0.0], 3.0) == pytest.approx([1.0, 2.0])
    # the second would be 2.0 < its floor 2.5: held there, the first takes the rest
    assert fit_to_total([2.0, 4.0], [0.0, 2.5], 3.0) == pytest.approx([0.5, 2.5])
    # floors above the total: every op at its floor (the sum is then above the total)
    assert fit_to_total([2.0, 4.0], [1.5, 2.5], 3.0) == pytest.approx([1.5, 2.5])
    # nothing priced: shared equally
    assert fit_to_total([0.0, 0.0], [0.0, 0.0], 3.0) == pytest.approx([1.5, 1.5])
