"""stage=tune: candidates trained for real (4 gloo ranks, and one Slurm job each on the dev
cluster), the calibration fitted to them, the measured fastest picked; and the math it rests on
(contention term, least-squares factors) without launching anything."""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import ledger, run_cli
from planner_fixtures import synthetic_hardware, synthetic_model
from test_slurm import SLURM

from orchestrator.layout import ParallelLayout
from orchestrator.planner import CostOptions, HardwareModel, ModelCost, evaluate
from orchestrator.planner.calibration import (Calibration, Concurrency, Observation, busy_stages,
                                              contention_factor, fit_calibration)
from orchestrator.planner.prediction import run_parts_ms

TUNE = ["stage=tune", "search.max_tp=2", "tune.steps=3", "tune.timing_warmup_steps=1",
        "tune.plot=false"]




def hardware_model():
    return HardwareModel.from_dict(synthetic_hardware(2, 8))


def model_cost():
    return ModelCost.from_dict(synthetic_model(layers=8, hidden=256, ffn=1024, heads=8,
                                               vocab=1000))


# ---------------------------------------------------------------- contention
def test_busy_stages_fill_steady_drain():
    assert busy_stages(1, 3) == [1, 1, 1]
    assert busy_stages(4, 8) == [1, 2, 3, 4, 4, 4, 4, 4, 3, 2, 1]
    assert busy_stages(3, 1) == [1, 1, 1]


def test_contention_factor_by_hand():
    cpu = Concurrency(profiled_busy=4, threads=1, cpus=2)  # 4 ranks on 2 cores, all busy
    assert contention_factor(cpu, 1, 8, 1) == 1.0  # every rank busy all the time, as profiled
    # pp4 m8: stage 0 computes in slots with 1,2,3,4,4,4,4,4 ranks busy -> slowdowns
    # 1,1,1.5,2,2,2,2,2 over the profile's 2; stage 1 in 2,3,4,4,4,4,4,3 -> 1,1.5,2,...,1.5;
    # stages 3 and 2 mirror them
    stage0, stage1 = (1 + 1 + 1.5 + 2 * 5) / 8 / 2, (1 + 1.5 * 2 + 2 * 5) / 8 / 2
    assert contention_factor(cpu, 4, 8, 1) == pytest.approx((stage0 + stage1) / 2)
    assert contention_factor(cpu, 2, 4, 1) < contention_factor(cpu, 2, 4, 2) < 1.0
    assert contention_factor(Concurrency(profiled_busy=8), 4, 8, 1) == 1.0  # GPU: cpus unknown
    assert contention_factor(None, 4, 8, 1) == 1.0
    assert Concurrency.from_method({"concurrency": {"ranks_busy": 4, "threads": 1,
                                                    "cpus": 2}}) == cpu
    assert Concurrency.from_method({"source": "analytic"}) is None


def test_contention_scales_compute_only():
    from orchestrator.planner.cost_model import ConfigKey, StageCosts

    hw, model = hardware_model(), model_cost()
    layout = ParallelLayout.uniform(16, 2, 4, model.layers, num_micro_batches=8)
    key = ConfigKey.of(layout)
    plain = StageCosts(key, model, hw, model.seq_len)
    model.concurrency = Concurrency(profiled_busy=4, threads=1, cpus=2)  # 4 ranks on 2 cores
    contended = StageCosts(key, model, hw, model.seq_len)
    factor = contention_factor(model.concurrency, 4, 8, 1)
    assert factor < 1.0 and contended.contention == factor
    assert contended.compute.block.bwd_us == pytest.approx(factor * plain.compute.block.bwd_us)
    assert contended.compute.other.fwd_us == pytest.approx(factor * plain.compute.other.fwd_us)
    assert contended.tp == plain.tp and list(contended.boundary_us) == list(plain.boundary_us)
    assert contended.block_optim_us == plain.block_optim_us  # every rank steps at once


# ---------------------------------------------------------------- calibration
def _runs(truth: Calibration):
    """Layouts 'measured' as the cost model prices them under `truth`."""
    hw, model = hardware_model(), model_cost()
    layouts = [ParallelLayout.uniform(8, tp, pp, model.layers, num_micro_batches=m,
                                      recompute=rc, zero=zero)
               for tp, pp, m, rc, zero in ((1, 1, 4, "none", 0), (2, 2, 4, "none", 1),
                                           (1, 4, 8, "full", 0), (2, 1, 2, "selective", 0),
                                           (1, 2, 8, "none", 2), (4, 2, 4, "none", 0))]

    def price(layout, cal):
        return run_parts_ms(layout, model, hw, model.seq_len, CostOptions(calibration=cal))
    return [Observation(layout.describe(), layout, price(layout, truth))
            for layout in layouts], price


def test_fit_recovers_the_factors_it_was_made_with():
    truth = Calibration(compute=1.3, recompute=1.0, tp_latency=0.8, p2p=2.0, dp_sync=1.5,
                        optimizer=0.7)
    runs, price = _runs(truth)
    exact = fit_calibration(runs, price, min_runs=3, prior_weight=0.0)
    assert not exact.why_not and exact.calibration.runs == len(runs)
    assert max(abs(e) for e in exact.before.values()) > 0.05  # it was off before
    assert max(abs(e) for e in exact.after.values()) < 0.005
    assert exact.calibration.compute == pytest.approx(1.3, rel=0.02)
    assert "calibrated from 6 runs" in exact.calibration.describe()
    assert exact.calibration.at_bound() == []
    # The default prior pulls the factors the runs pin only weakly towards 1: still most of it.
    fit = fit_calibration(runs, price, min_runs=3)
    assert max(map(abs, fit.after.values())) < max(map(abs, fit.before.values())) / 3


def test_a_factor_the_fit_pushes_to_its_bound_names_the_profile_to_measure_again():
    # Runs 30x slower in compute than the profile says (a profile of a loaded host): the fit
    # stops at compute x10, which tune reports with the stage that measures compute again.
    from orchestrator.cli.tune import bound_warning

    runs, price = _runs(Calibration(compute=30.0))
    fit = fit_calibration(runs, price, min_runs=3)
    assert fit.calibration.compute == pytest.approx(10.0, rel=0.01)
    assert "compute" in fit.calibration.at_bound()
    text = bound_warning(fit.calibration)
    assert "compute x10.00 at the fit's bound" in text
    assert "stage=profile_model force=true" in text
    assert "profile_hardware" not in text  # the communication factors were not pushed
    assert Calibration(compute=1.3, p2p=0.1).at_bound() == ["p2p"]
    # what search and train print beside their calibrated predictions
    assert "compute at the bound: profiles to measure again" in fit.calibration.describe()


def test_too_few_runs_keep_the_model_uncalibrated():
    runs, price = _runs(Calibration(compute=2.0))
    fit = fit_calibration(runs[:2], price, min_runs=3)
    assert fit.calibration == Calibration() and "2 successful run(s)" in fit.why_not
    assert Calibration().describe() == "not calibrated"


def test_calibration_scales_each_term():
    hw, model = hardware_model(), model_cost()
    layout = ParallelLayout.uniform(8, 2, 2, model.layers, num_micro_batches=4)
    base = evaluate(layout, model, hw).breakdown_us
    scaled = Calibration(compute=2.0, tp_latency=3.0, tp_bandwidth=3.0, p2p=4.0)
    doubled = evaluate(layout, model, hw, options=CostOptions(calibration=scaled)).breakdown_us
    assert doubled["compute"] == pytest.approx(2 * base["compute"])
    assert doubled["tp_comm"] == pytest.approx(3 * base["tp_comm"])
    assert doubled["pp_comm"] == pytest.approx(4 * base["pp_comm"])


# ---------------------------------------------------------------- stage=tune, 4 local ranks
def _record(profiles, cluster="local"):
    return json.loads((profiles / cluster / "calibration" / "tiny.json").read_text())


def test_tune_measures_candidates_calibrates_and_picks_the_fastest(chain):
    proc = run_cli(*TUNE, "tune.top_k=1", profiles_dir=chain, check=0, timeout=600)
    rec = _record(chain)
    roles = [c["role"] for c in rec["candidates"]]
    assert roles[0] == "top 1" and set(roles[1:]) <= {"pure dp", "tp-heavy", "pp-heavy"}
    assert len(roles) >= 3  # top 1 and at least two families it is not
    done = [c for c in rec["candidates"] if c["state"] == "measured"]
    assert rec["runs"] == len(done) == len(roles)
    for c in done:
        assert c["measured_ms"]["iteration"] > 0 and c["predicted_ms"]["iteration"] > 0
        assert set(c["measured_ms"]) == set(c["predicted_ms"])
        key = f"train/tiny@tune={c['summary'].split('/')[-1].split('@')[0]}"
        assert ledger(chain)[key]["state"] == "done"
        # a candidate is only timed: no checkpoint (train.keep_checkpoints=0)
        summary = chain / "local" / c["summary"]
        assert summary.exists() and not summary.with_suffix(".ckpt").exists()
    fastest = min(done, key=lambda c: c["measured_ms"]["iteration"])
    assert rec["pick_describe"] == fastest["describe"]
    assert rec["pick"] == fastest["layout"]
    trained = json.loads((chain / "local" / "strategy" / "tiny.layout.json").read_text())
    assert trained["layout"] == fastest["layout"]  # what stage=train trains next
    assert rec.get("why_not") is None and rec["mean_error_before"] >= 0
    assert rec["mean_error_after"] >= 0 and set(rec["factors"]) >= {"compute", "p2p"}
    assert all(0.1 <= f <= 10 for f in rec["factors"].values())
    assert rec["at_bound"] == Calibration.of(rec["factors"], rec["runs"]).at_bound()
    assert set(rec["inputs"]) == {"hardware.json", "model/tiny.json"}
    assert "pick (measured fastest)" in proc.stdout

    # A rerun measures nothing again; the next search prices with the calibration and keeps
    # the measured pick as the layout to train.
    calibration = (chain / "local" / "calibration" / "tiny.json").read_bytes()
    again = run_cli(*TUNE, "tune.top_k=1", profiles_dir=chain, check=0, timeout=300)
    assert again.stdout.count("skipping (force=true redoes it)") == len(roles)
    # ... and leaves the calibration as it was: a rewrite made search and trace run again
    assert (chain / "local" / "calibration" / "tiny.json").read_bytes() == calibration
    search = run_cli("stage=search", "search.max_tp=2", profiles_dir=chain, check=0)
    assert f"calibrated from {len(done)} runs" in search.stdout
    strategy = json.loads((chain / "local" / "strategy" / "tiny.json").read_text())
    assert "calibration/tiny.json" in strategy["inputs"]
    trained = json.loads((chain / "local" / "strategy" / "tiny.layout.json").read_text())
    assert trained["layout"] == fastest["layout"]
    status = run_cli("stage=status", profiles_dir=chain, check=0)
    assert "calibration" in status.stdout and f"{len(done)} runs" in status.stdout
    # each candidate's row in the train table says tune wrote it
    rows = [line for line in status.stdout.splitlines() if "│ tiny" in line]
    assert sum("│ stage=tune" in line for line in rows) == len(done), status.stdout
    # A factor the fit pushed to its bound: status says to measure the profiles again.
    path = chain / "local" / "calibration" / "tiny.json"
    path.write_text(json.dumps({**rec, "at_bound": ["compute"]}))
    status = run_cli("stage=status", profiles_dir=chain, check=0)
    said = " ".join(status.stdout.split())  # rich wraps lines at 200 columns
    assert "compute at the fit's bound: measure the profiles again" in said

    # Profiles measured again make the calibration stale: search says so and goes uncalibrated.
    hw = chain / "local" / "hardware.json"
    hw.write_text(hw.read_text().replace('"schema_version"', '"schema_version" ', 1))
    stale = run_cli("stage=search", "search.max_tp=2", profiles_dir=chain, check=0)
    assert "calibrated from" not in stale.stdout
    said = " ".join(stale.stdout.split())
    assert "search: cost model uncalibrated: calibration" in said and "is stale" in said
    assert "rerun python -m orchestrator stage=tune" in said
    status = run_cli("stage=status", profiles_dir=chain, check=0)
    assert "stale" in status.stdout


def test_failed_candidates_are_recorded_and_excluded(chain):
    """Every candidate refused (train's memory check, before any rank starts): each recorded
    with its reason, no pick, exit 3, nothing of the profiles touched."""
    before = (chain / "local" / "strategy" / "tiny.layout.json").read_text()
    proc = run_cli(*TUNE, "tune.top_k=1", "train.memory_GiB=0.0001", profiles_dir=chain,
                   check=3, timeout=300)
    rec = _record(chain)
    assert rec["runs"] == 0 and rec.get("pick") is None
    assert all(c["state"] == "failed" and "GiB" in c["reason"] for c in rec["candidates"])
    assert "every candidate failed" in proc.stderr
    # each reason whole, below the table (cut at 60 characters there, the cause was lost)
    for c in rec["candidates"]:
        assert " ".join(f"tune: {c['role']} failed: {c['reason']}".split()) in " ".join(
            proc.stdout.split())
    assert (chain / "local" / "strategy" / "tiny.layout.json").read_text() == before
    # status does not call a calibration fitted from no run plainly "current"
    status = " ".join(run_cli("stage=status", profiles_dir=chain, check=0).stdout.split())
    assert "calibration tiny: 0 runs" in status and "current, not fitted" in status


def test_a_candidate_another_command_runs_stops_tune_instead_of_being_left_out(tmp_path,
                                                                              monkeypatch):
    """A second tune on the same profiles folder meets the first one's candidate running: it
    must stop (exit 5, the first's pid and how to stop it), as a second run of a stage does,
    not leave the candidate out and go on. Left out, the two tunes each timed part of the
    candidates while the other's ranks shared the CPUs, and each wrote its own pick."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from orchestrator.cli import tune as tune_cli
    from orchestrator.config import CONF_DIR, register_configs
    from orchestrator.errors import LaunchError, ProfileError
    from orchestrator.choices import Ranks
    from orchestrator.stages import StagePlan
    from orchestrator.store.ledger import LedgerBusy, RunInProgress

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        composed = compose(config_name="config",
                           overrides=["stage=tune", f"profiles_dir={tmp_path}"])
    cfg = OmegaConf.to_object(composed)
    layout = ParallelLayout(world_size=4, pp=2, tp=1, dp=2, micro_batch_size=1,
                            num_micro_batches=4, layers_per_stage=(2, 2))
    cand = tune_cli.Candidate("top 1", layout, 1.0)

    class Decision:
        done = False

    monkeypatch.setattr(tune_cli, "plan_stage", lambda stage, c, produced: StagePlan(
        stage="train", key="train/tiny", ranks=Ranks.cluster, world_size=4,
        outputs=(tmp_path / "t.json",)))
    monkeypatch.setattr(tune_cli, "decide", lambda plan, ledger, force: Decision())
    monkeypatch.setattr(tune_cli, "ledger_for", lambda c: None)

    class Console:
        def print(self, *args, **kwargs):
            pass

    for refusal in (RunInProgress("train/tiny@tune=x is already running (pid 1 on host h)"),
                    LedgerBusy("the ledger is locked by pid 1 on host h")):
        def running_elsewhere(c, plans, refusal=refusal):
            raise refusal

        with pytest.raises(RunInProgress) as raised:
            tune_cli._run_candidate(cfg, cand, 256, tmp_path, running_elsewhere, Console())
        assert raised.value is refusal and raised.value.exit_code == 5

    # A candidate that fails on its own (a crash, a stale profile) is still left out.
    for failure in (LaunchError("rank 1 was killed by signal 9"), ProfileError("stale")):
        def failing(c, plans, failure=failure):
            raise failure

        assert tune_cli._run_candidate(cfg, cand, 256, tmp_path, failing, Console()) == \
            (None, str(failure))


def test_tune_refuses_bad_settings(profiles):
    proc = run_cli("stage=tune", "tune.steps=2", "tune.timing_warmup_steps=3",
                   profiles_dir=profiles, check=2)
    assert "tune.steps(2) must be more than tune.timing_warmup_steps(3)" in proc.stderr
    # fewer candidates than the fit needs, by the settings alone: refused before any run
    # (too few runs that succeed keep the model uncalibrated: test_too_few_runs_...)
    proc = run_cli("stage=tune", "tune.top_k=1", "tune.controls=false", profiles_dir=profiles,
                   check=2)
    assert ("tune.top_k(1) candidates with tune.controls=false: fewer than the "
            "tune.min_runs(3) runs the fit needs; raise tune.top_k or set tune.controls=true"
            in proc.stderr), proc.stderr
    assert not (profiles / "local" / "runs").exists()


# ---------------------------------------------------------------- the dev Slurm cluster
def test_tune_on_slurm_runs_a_job_per_candidate(slurm_cluster, measured_chain, tmp_path):
    """The same path under launcher=slurm: each candidate its own Slurm job, then the fit."""
    profiles = tmp_path / "profiles"
    (profiles / "dev" / "model").mkdir(parents=True)
    # dev's own hardware profile (local's is another cluster's: refused), from its links
    run_cli("stage=profile_hardware", "cluster=dev", "profile_hardware.source=analytic",
            "profile_hardware.plot=false", profiles_dir=profiles, check=0)
    shutil.copy(measured_chain / "local" / "model" / "tiny.json",
                profiles / "dev" / "model" / "tiny.json")
    run_cli(*TUNE, *SLURM, "tune.top_k=2", "tune.controls=false", "tune.min_runs=2",
            profiles_dir=profiles, check=0, timeout=600)
    rec = _record(profiles, "dev")
    assert rec["runs"] == 2 and rec.get("why_not") is None
    entries = ledger(profiles, "dev")
    jobs = {entries[k]["job_id"] for k in entries if k.startswith("train/tiny@tune=")}
    assert len(jobs) == 2 and None not in jobs  # a Slurm job per candidate
    for c in rec["candidates"]:
        summary = json.loads((profiles / "dev" / c["summary"]).read_text())
        assert summary["provenance"]["job_id"] in jobs


def test_train_layout_file_missing_is_one_clear_error(profiles, tmp_path):
    proc = run_cli("stage=train", f"train.layout={tmp_path / 'nope.layout.json'}",
                   profiles_dir=profiles, check=2)
    assert "no such file" in proc.stderr and "nope.layout.json" in proc.stderr
