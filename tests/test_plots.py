"""The PNGs say what a user needs: the model's own memory (not the reserve), legends that hide no
points, the overlap panel and log axes for message sizes, and a warning where a fit misses."""
from __future__ import annotations

import copy
import io

import matplotlib
import pytest
from rich.console import Console

from orchestrator.planner.report import build_strategy_figure
from orchestrator.profiling.hardware.report import build_busbw_figure
from orchestrator.profiling.model.fit import predict_poly
from orchestrator.profiling.model.report import (
    FIT_WARN_REL_ERR, block_fit_errors, build_profile_figure, print_report)
from orchestrator.store import read_json, read_profile
from orchestrator.store.schema import StrategyProfile
from tests.conftest import run_cli

matplotlib.use("Agg")
MiB = 2**20


@pytest.fixture(scope="module")
def local_profiles(tmp_path_factory):
    """Every profile of the tiny model on this machine, analytic (seconds, no measuring)."""
    profiles_dir = tmp_path_factory.mktemp("plots") / "profiles"
    for stage in ("profile_hardware", "profile_model", "search"):  # what the figures read
        run_cli(f"stage={stage}", "profile_hardware.source=analytic",
                "profile_model.source=analytic", profiles_dir=profiles_dir, check=0)
    return profiles_dir / "local"


def _axes(fig, label):
    found = [ax for ax in fig.axes if ax.get_label() == label]
    assert len(found) == 1, [ax.get_label() for ax in fig.axes]
    return found[0]


def _legend_outside(fig, ax) -> bool:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    return not ax.get_legend().get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))


def test_strategy_memory_panel_shows_the_models_own_memory_not_the_reserve(local_profiles):
    strategy = read_profile(local_profiles / "strategy" / "tiny.json", StrategyProfile, "rebuild")
    fig = build_strategy_figure(strategy)
    ax = _axes(fig, "memory")
    assert "MiB" in ax.get_ylabel()  # tiny: tens of MiB, so not GiB
    stage_mem = strategy.prediction.memory_bytes[0]
    heights = {c.get_label(): c.patches[0].get_height() for c in ax.containers}
    assert "reserve" not in heights
    for kind in ("params", "grads", "optim", "activations"):
        assert heights[kind] == pytest.approx(stage_mem[kind] / MiB)
    assert sum(heights.values()) < 100  # MiB; the 2 GiB reserve would be 2048
    # The reserve and the budget are drawn apart, in their own panel.
    budget = _axes(fig, "budget")
    texts = " ".join(t.get_text() for t in budget.texts) + budget.get_title()
    assert "reserve" in texts and "budget" in texts


def test_strategy_candidates_are_placed_by_model_memory_and_legends_hide_no_points(local_profiles):
    strategy = read_profile(local_profiles / "strategy" / "tiny.json", StrategyProfile, "rebuild")
    fig = build_strategy_figure(strategy)
    ax = _axes(fig, "candidates")
    reserve = strategy.prediction.memory_bytes[0]["reserve"]
    xs = sorted(x for coll in ax.collections for x in coll.get_offsets()[:, 0])
    want = sorted([(a.peak_memory_bytes - reserve) / MiB for a in strategy.top]
                  + [(strategy.prediction.peak_memory_bytes - reserve) / MiB])
    assert xs == pytest.approx(want)
    for label in ("candidates", "stage time", "memory"):
        assert _legend_outside(fig, _axes(fig, label)), label


def test_hardware_figure_has_an_overlap_panel_and_log_message_sizes(local_profiles):
    hardware = read_json(local_profiles / "hardware.json")
    fig = build_busbw_figure(hardware)
    overlap = _axes(fig, "overlap")
    coe = hardware["benchmarks"]["overlap"]
    heights = sorted(p.get_height() for p in overlap.patches)
    assert heights == pytest.approx(sorted([1.0, coe["compute_slowdown"], 1.0,
                                            coe["comm_slowdown"]]))
    assert f"{coe['overlap_coe']:.2f}" in overlap.get_title()
    for op in ("allreduce", "p2p", "all2all"):
        ax = _axes(fig, op)
        assert ax.get_xscale() == "log"
        ys = [y for line in ax.get_lines() for y in line.get_ydata()]
        assert ax.get_yscale() == ("log" if max(ys) > 20 * min(ys) else "linear")
        assert _legend_outside(fig, ax), op


def _bad_point_profile(local_profiles):
    """The analytic tiny profile with the tp=2, second-shortest point's forward time tripled (the
    fits kept): returns the profile and the fit error of that point, computed by hand."""
    profile = copy.deepcopy(read_json(local_profiles / "model" / "tiny.json"))
    pts = sorted((p for p in profile["points"] if p["tp"] == 2), key=lambda p: p["seq_len"])
    bad = pts[1]
    bad["block_fwd_us"] *= 3
    fit = profile["fits"]["2"]
    pred = (predict_poly(fit["block_fwd_us"], bad["seq_len"])
            + predict_poly(fit["block_bwd_us"], bad["seq_len"]))
    measured = bad["block_fwd_us"] + bad["block_bwd_us"]
    return profile, abs(pred - measured) / measured


def test_model_fit_that_misses_a_point_is_flagged_with_its_error(local_profiles):
    profile, err = _bad_point_profile(local_profiles)
    assert err > FIT_WARN_REL_ERR
    errors = block_fit_errors(profile)
    assert errors[2] == pytest.approx(err)
    assert errors[1] < 1e-9  # the analytic fit is exact
    fig = build_profile_figure(profile)
    ax = _axes(fig, "time")
    texts = {t.get_text(): t for t in ax.get_legend().get_texts()}
    flagged = [t for s, t in texts.items() if f"fit misses by {err:.0%}" in s]
    assert len(flagged) == 1 and flagged[0].get_text().startswith("tp=2")
    assert matplotlib.colors.same_color(flagged[0].get_color(), "red")
    assert not any("misses" in s for s in texts if s.startswith("tp=1"))
    assert "fit misses" in ax.get_title()


def test_model_report_prints_one_line_per_fit_that_misses(local_profiles):
    profile, err = _bad_point_profile(local_profiles)
    out = io.StringIO()
    print_report(profile, Console(file=out, width=200, highlight=False))
    lines = [line for line in out.getvalue().splitlines() if "fit misses" in line]
    assert len(lines) == 1
    assert "tp=2" in lines[0] and f"{err:.0%}" in lines[0]
    good = read_json(local_profiles / "model" / "tiny.json")
    out = io.StringIO()
    print_report(good, Console(file=out, width=200, highlight=False))
    assert "fit misses" not in out.getvalue()
