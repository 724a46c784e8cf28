"""search through the CLI: the whole chain here, a 100B model on 8192 GPUs from analytic profiles,
the answer when nothing fits, and a search for another cluster size (the strategy it replaces is
kept, and every command printed runs)."""
from __future__ import annotations

import contextlib
import json

import pytest

from conftest import MEASURED_CHAIN, ledger, run_cli

def test_all_runs_the_chain_then_skips_it(chain):
    """The measured chain (conftest.measured_chain: stage=all once per run), then stage=all
    again on a copy of it, which skips every stage."""
    profiles = chain
    strategy = json.loads((profiles / "local" / "strategy" / "tiny.json").read_text())
    assert strategy["kind"] == "strategy" and strategy["source"] == "measured"
    layout = strategy["layout"]
    assert layout["pp"] * layout["tp"] * layout["dp"] == 4
    assert layout["global_batch_size"] == 8
    assert sum(layout["layers_per_stage"]) == 4
    top_times = [alt["iteration_time_us"] for alt in strategy["top"]]
    assert strategy["top"][0]["layout"] == layout and top_times == sorted(top_times)
    assert len(top_times) == 10 and strategy["considered"] >= len(top_times)
    prediction = strategy["prediction"]
    assert top_times[0] == prediction["iteration_time_us"]
    breakdown = prediction["breakdown_us"]
    assert set(breakdown) == {"compute", "tp_comm", "cp_comm", "pp_comm", "bubble",
                              "dp_sync_exposed", "recompute"}
    assert sum(breakdown.values()) == pytest.approx(prediction["iteration_time_us"], rel=1e-6)
    assert {p.rsplit("/", 1)[-1] for p in strategy["inputs"]} == {"hardware.json", "tiny.json"}
    args = (profiles / "local" / "strategy" / "tiny.megatron.args").read_text()
    assert f"--tensor-model-parallel-size {layout['tp']}" in args
    assert f"--pipeline-model-parallel-size {layout['pp']}" in args
    train_layout = json.loads((profiles / "local" / "strategy" / "tiny.layout.json").read_text())
    assert train_layout["layout"] == layout
    galvatron = json.loads((profiles / "local" / "strategy" / "tiny.galvatron.json").read_text())
    assert galvatron["pp_deg"] == layout["pp"]
    assert (profiles / "local" / "strategy" / "tiny.png").exists()
    assert ledger(profiles)["search/tiny"]["state"] == "done"
    # train of that layout counted every live tensor byte of a step (CPU) and the planner's
    # peak, from the measured profiles, is within 10% of it (docs/workload.md#memory: the
    # pick varies with the measured times, and the search's closed form can sit up to 12%
    # above the exact walk on some schedules; tests/test_train_engine.py holds the walk to 5%).
    (summary,) = (profiles / "local" / "train" / "tiny").glob("*.json")
    trained = json.loads(summary.read_text())
    assert trained["measured"]["peak_memory_source"] == "tensors counted in one step"
    measured = max(trained["measured"]["peak_memory_MiB"])
    assert trained["predicted"]["peak_memory_MiB"] == pytest.approx(measured, rel=0.10)

    before = ledger(profiles)
    strategy_bytes = (profiles / "local" / "strategy" / "tiny.json").read_bytes()
    run_cli("stage=all", *MEASURED_CHAIN, profiles_dir=profiles, check=0)
    after = ledger(profiles)
    for key in ("profile_hardware", "profile_model/tiny", "search/tiny"):
        assert after[key]["ended"] == before[key]["ended"], key  # skipped, not rerun
    assert (profiles / "local" / "strategy" / "tiny.json").read_bytes() == strategy_bytes


def test_qwen_100b_on_8192_gpus_from_a_laptop(profiles):
    # How fast is bench/search_speed.py's figure, not a wall-clock bound here (196 s on a loaded
    # machine where 120 s was asked).
    common = ["cluster=dgx_h100", "cluster.nodes=1024", "model=qwen_100b"]
    run_cli("stage=profile_hardware", "profile_hardware.source=analytic", "profile_hardware.plot=false",
            *common, profiles_dir=profiles, check=0)
    run_cli("stage=profile_model", "profile_model.plot=false", *common, profiles_dir=profiles,
            check=0, timeout=300)
    proc = run_cli("stage=search", "search.global_batch_size=1024", "search.memory_GiB=80",
                   *common, profiles_dir=profiles, check=0)
    strategy = json.loads((profiles / "dgx_h100" / "strategy" / "qwen_100b.json").read_text())
    assert strategy["source"] == "analytic" and "(analytic profiles;" in proc.stdout
    assert [i["source"] for i in strategy["inputs"].values()] == ["analytic", "analytic"]
    layout = strategy["layout"]
    # 128K tokens: the default max_cp (seq_len // 4096 = 32) lets the search split sequences
    cp = layout.get("cp", 1)
    assert strategy["space"]["max_cp"] == 32 and cp > 1
    assert layout["world_size"] == 8192 and layout["pp"] * layout["tp"] * cp * layout["dp"] == 8192
    assert strategy["prediction"]["peak_memory_bytes"] <= 80 * 2**30
    # Its speed is bench/search_speed.py's figure: a bound here failed a loaded run (29.3 s).
    assert strategy["elapsed_s"] > 0


def test_no_feasible_layout_says_what_comes_closest(profiles):
    run_cli("stage=profile_hardware", "profile_hardware.source=analytic", "profile_hardware.plot=false",
            "cluster=dgx_h100", profiles_dir=profiles, check=0)
    run_cli("stage=profile_model", "profile_model.plot=false", "cluster=dgx_h100", "model=llama2_7b",
            profiles_dir=profiles, check=0, timeout=300)
    proc = run_cli("stage=search", "cluster=dgx_h100", "model=llama2_7b", "search.memory_GiB=4",
                   profiles_dir=profiles)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "no layout of llama2_7b fits" in proc.stderr
    assert "the closest" in proc.stderr and "GiB" in proc.stderr and "Relax" in proc.stderr
    assert ledger(profiles, "dgx_h100")["search/llama2_7b"]["state"] == "failed"


def test_tp_degrees_the_model_profile_lacks_are_named_with_the_command_that_adds_them(profiles):
    analytic = ["profile_hardware.source=analytic", "profile_model.source=analytic",
                "profile_hardware.plot=false", "profile_model.plot=false", "search.plot=false"]
    run_cli("stage=profile_hardware", *analytic, profiles_dir=profiles, check=0)
    run_cli("stage=profile_model", *analytic, "profile_model.max_tp=1", profiles_dir=profiles,
            check=0)
    proc = run_cli("stage=search", *analytic, profiles_dir=profiles, check=0)
    said = " ".join(proc.stdout.split())
    # tiny (4 heads, 2 KV heads) on 4 ranks: tp 2 needs a profile, tp 4 its shape forbids
    assert "tp_not_profiled 1" in said and "tp_splits_heads 1" in said, proc.stdout
    assert ("tp_not_profiled: the model profile has tp [1]; profile more TP degrees to search "
            "them: python -m orchestrator stage=profile_model") in said
    assert "'profile_model.max_tp=<tp>'" in said


def test_uneven_middle_stages_write_the_strategy_and_an_exact_megatron_export(profiles):
    """A best layout with uneven middle stages ([1, 2, 3, 3]: activations of 1F1B shrink down
    the pipeline) is a valid answer: the strategy is written, the Megatron export says it
    exactly (--pipeline-model-parallel-layout), and the stage succeeds."""
    from planner_fixtures import synthetic_hardware, synthetic_model

    from orchestrator.store import write_json

    write_json(profiles / "local" / "hardware.json", synthetic_hardware(1, 4, name="local"))
    write_json(profiles / "local" / "model" / "tiny.json",
               synthetic_model("tiny", layers=9, hidden=256, ffn=1024, vocab=1000, seq_len=8192))
    # the budget that leaves [1, 2, 3, 3] the fastest fit (Megatron's activations in the search's
    # compute dtype: fp32 on this CPU cluster)
    proc = run_cli("stage=search", "search.seq_len=8192", "search.memory_GiB=1.05",
                   "search.max_cp=1",  # about pipeline stages: no context parallelism at 8K
                   "search.max_tp=1", "search.schedules=[1f1b]", "search.recompute=[none]",
                   "search.zero_stages=[0]", "search.micro_batch_sizes=[1]", "search.reserve_GiB=0",
                   "search.reserve_fraction=0",
                   "search.plot=false", "search.engine=megatron",  # priced as what it exports
                   # the synthetic profile's shape (a profile of another shape is refused)
                   "model.layers=9", "model.hidden=256", "model.ffn=1024", "model.heads=8",
                   "model.kv_heads=8", "model.vocab=1000", "model.dtype=bf16",
                   profiles_dir=profiles, check=0)
    strategy = json.loads((profiles / "local" / "strategy" / "tiny.json").read_text())
    assert strategy["layout"]["layers_per_stage"] == [1, 2, 3, 3]
    exports = strategy["exports"]
    assert exports["megatron_approximations"] == []
    assert "megatron_error" not in exports and "galvatron_error" not in exports
    args = (profiles / "local" / "strategy" / "tiny.megatron.args").read_text().split()
    assert args == exports["megatron"]
    assert args[args.index("--pipeline-model-parallel-layout") + 1] == "Et|tt|t*3|t*3L"
    assert "--decoder-first-pipeline-num-layers" not in args
    assert exports["galvatron"]["pp_division"] == "1,2,3,3"
    assert exports["galvatron_approximations"] == []
    assert "megatron export approximates" not in proc.stdout
    assert ledger(profiles)["search/tiny"]["state"] == "done"


@contextlib.contextmanager
def _as_the_cli(stage, *overrides):
    """The config of `python -m orchestrator stage=<stage> <overrides>`, composed in this
    process, with the overrides recorded as the CLI records them (the fix commands printed
    keep them); recorded until the `with` block ends."""
    from omegaconf import OmegaConf

    from orchestrator.commands import set_user_overrides
    from test_cli import _compose

    set_user_overrides(overrides)
    try:
        yield OmegaConf.to_object(_compose([f"stage={stage}", *overrides]))
    finally:
        set_user_overrides([])


def _plan_train(*overrides):
    """stage=train planned in this process, as the CLI plans it."""
    from orchestrator.pipeline import plan_stage

    with _as_the_cli("train", *overrides) as cfg:
        return plan_stage("train", cfg)


def test_advice_for_another_node_count_works_and_never_costs_the_strategy(chain):
    """Issue 39: the local launcher with cluster.nodes=2 was told to search again for 2 nodes;
    that search overwrote the 4-rank strategy, and train (one node here) refused the 8-rank one.
    Now the launcher is named first with two commands that run; a search for another size keeps
    the strategy it replaces, and train points at it."""
    from orchestrator.commands import commands_that_launch
    from orchestrator.errors import ConfigError

    folder = chain / "local" / "strategy"
    four = (folder / "tiny.layout.json").read_text()
    where = f"profiles_dir={chain}"
    with pytest.raises(ConfigError) as refused:
        _plan_train("cluster.nodes=2", where)
    line = str(refused.value)
    assert line.startswith("launcher=local runs train on this machine only: cluster.nodes(2) "
                           "must be 1."), line
    assert (f"On 2 nodes: python -m orchestrator stage=train cluster.nodes=2 {where} "
            f"launcher=slurm; here: python -m orchestrator stage=train {where} cluster.nodes=1"
            in line), line
    assert "stage=search" not in line
    # a profile with a form priced from published figures names that command too, which plans
    from orchestrator.pipeline import check_launchable, plan_stage
    analytic = "profile_hardware.source=analytic"
    with _as_the_cli("profile_hardware", "cluster.nodes=2", where) as cfg:
        with pytest.raises(ConfigError) as refused:
            check_launchable(plan_stage("profile_hardware", cfg), cfg)
    assert str(refused.value).endswith(
        f"; or from published figures, on no ranks: python -m orchestrator "
        f"stage=profile_hardware cluster.nodes=2 {where} {analytic}"), str(refused.value)
    with _as_the_cli("profile_hardware", "cluster.nodes=2", where, analytic) as cfg:
        check_launchable(plan_stage("profile_hardware", cfg), cfg)
    # stage=status of an empty folder prints the first command to run: the same two.
    with _as_the_cli("status", "cluster.nodes=2", where) as cfg:
        first = commands_that_launch("all", cfg)
    assert first == [f"python -m orchestrator stage=all cluster.nodes=2 {where} launcher=slurm",
                     f"python -m orchestrator stage=all {where} cluster.nodes=1"]

    # A search for 2 nodes (a what-if from here) keeps the 4-rank strategy and says how to train it.
    proc = run_cli("stage=search", "cluster.nodes=2", "search.plot=false", profiles_dir=chain,
                   check=0)
    kept = folder / "tiny@4-ranks.layout.json"
    assert kept.read_text() == four
    assert {p.name for p in folder.glob("tiny@4-ranks.*")} == {
        "tiny@4-ranks.json", "tiny@4-ranks.layout.json", "tiny@4-ranks.megatron.args",
        "tiny@4-ranks.galvatron.json", "tiny@4-ranks.png"}
    assert json.loads((folder / "tiny.layout.json").read_text())["layout"]["world_size"] == 8
    assert (f"kept as tiny@4-ranks.json and its files (train it: python -m orchestrator "
            f"stage=train {where} cluster.nodes=1 train.layout={kept})"
            in " ".join(proc.stdout.split())), proc.stdout

    # train on one node: the kept strategy, or a search for 4 ranks (which keeps the 8-rank one).
    with pytest.raises(ConfigError) as refused:
        _plan_train(where)
    line = str(refused.value)
    train_kept = f"python -m orchestrator stage=train {where} train.layout={kept}"
    assert (f"the layout is for 8 ranks but cluster local has 4 (nodes x tasks_per_node); "
            f"train the 4-rank strategy an earlier search kept: {train_kept}; or search for 4 "
            f"ranks: python -m orchestrator stage=search {where} (it keeps the 8-rank strategy "
            f"as tiny@8-ranks.layout.json)" in line), line
    plan = _plan_train(where, f"train.layout={kept}")  # the printed command plans
    assert plan.world_size == 4


def test_a_tp_degree_the_models_ffn_cannot_take_is_not_sent_to_profile_model_and_a_vocab_is_padded(
        profiles, tmp_path):
    """Before: a vocabulary of 511 made tp 2 `tp_not_profiled`, with the advice to profile it
    (profile_model.max_tp=<tp>), which profile_model refuses ("lower profile_model.max_tp"): the
    planner split only heads and KV heads, train and profile_model split FFN and vocab too. Now
    the vocabulary is padded for tp (model.make_vocab_size_divisible_by, Megatron's rule):
    profile_model profiles tp 2 of the 511-token model and search takes it; an FFN of 383
    still refuses it."""
    site = tmp_path / "site"
    (site / "model").mkdir(parents=True)
    shape = "hidden: 128\nffn: {ffn}\nlayers: 4\nheads: 4\nkv_heads: 2\nvocab: {vocab}\nseq_len: 256\n"
    (site / "model" / "v511.yaml").write_text("name: v511\n" + shape.format(ffn=384, vocab=511))
    (site / "model" / "f383.yaml").write_text("name: f383\n" + shape.format(ffn=383, vocab=512))
    env = {"ORCHESTRATOR_CONF": str(site)}
    analytic = ["profile_hardware.source=analytic", "profile_model.source=analytic",
                "profile_hardware.plot=false", "profile_model.plot=false", "search.plot=false"]
    run_cli("stage=profile_hardware", *analytic, profiles_dir=profiles, env=env, check=0)
    for model, refused in (("v511", 1), ("f383", 2)):  # tp 4 of 4 ranks: the 2 KV heads
        run_cli("stage=profile_model", *analytic, f"model={model}", profiles_dir=profiles,
                env=env, check=0)
        proc = run_cli("stage=search", *analytic, f"model={model}", profiles_dir=profiles,
                       env=env, check=0)
        said = " ".join(proc.stdout.split())
        assert f"tp_splits_heads {refused}" in said, proc.stdout
        assert "tp_not_profiled" not in said and "profile_model.max_tp" not in said
    profile = json.loads((profiles / "local" / "model" / "v511.json").read_text())
    assert sorted(int(tp) for tp in profile["fits"]) == [1, 2]
    # its embedding and head: 512 rows at tp 2 (256 a rank), 511 at tp 1 (fp32: 4 B each)
    other = {int(tp): m["other"]["param_bytes"] for tp, m in profile["memory"].items()}
    assert other == {1: 4 * (2 * 511 * 128 + 128), 2: 4 * (2 * 256 * 128 + 128)}, other
    # When nothing is left, the one line says why each layout went, and what TP must divide
    # (before: only "Relax: ... search.max_tp raise", which cannot help such a model).
    proc = run_cli("stage=search", *analytic, "model=f383", "search.global_batch_size=2",
                   profiles_dir=profiles, env=env)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "(rejected: " in proc.stderr and "tp_splits_heads 2" in proc.stderr, proc.stderr
    assert "a TP degree must divide model.heads(4), model.kv_heads(2) and model.ffn(383)" \
        in proc.stderr
