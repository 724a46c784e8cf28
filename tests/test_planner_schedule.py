"""The event-driven pipeline simulation agrees with the textbook closed forms."""
from __future__ import annotations

import random

import pytest

from orchestrator.planner.schedule import (in_flight_micro_batches, schedule_coefficients,
                                          simulate, stage_order)


def closed_form_time_us(fwd_us, bwd_us, pp, num_micro_batches, virtual_stages=1):
    """Makespan (us) of equal stages with no p2p, from the cost model's coefficients."""
    schedule = "interleaved" if virtual_stages > 1 else "1f1b"
    alpha, beta = schedule_coefficients(schedule, num_micro_batches, virtual_stages)
    return (alpha * pp + beta) * (fwd_us + bwd_us)


def bubble_fraction(result):
    """Idle over busy on the busiest stage: (p - 1) / m for equal 1F1B stages."""
    j = max(range(len(result.stage_busy_us)), key=lambda s: result.stage_busy_us[s])
    return result.stage_idle_us[j] / result.stage_busy_us[j]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
def test_1f1b_equal_stages_match_closed_form(p, m):
    f, b = 3.0, 5.5
    result = simulate([f] * p, [b] * p, m)
    assert result.iteration_time_us == pytest.approx((m + p - 1) * (f + b), rel=1e-12)
    assert result.iteration_time_us == pytest.approx(closed_form_time_us(f, b, p, m), rel=1e-12)
    if m >= p:
        assert bubble_fraction(result) == pytest.approx((p - 1) / m, rel=1e-12)


@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 3), (4, 4, 2), (4, 8, 4), (8, 16, 2),
                                   (3, 6, 3)])
def test_interleaved_equal_stages_match_closed_form(p, m, v):
    f, b = 2.0, 4.0
    result = simulate([f] * p, [b] * p, m, "interleaved", v)
    assert result.iteration_time_us == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v,
                                                     rel=1e-12)
    assert bubble_fraction(result) == pytest.approx((p - 1) / (v * m), rel=1e-12)


def test_busy_plus_idle_is_the_iteration_on_every_stage():
    result = simulate([1.0, 2.0, 1.5], [2.0, 4.5, 3.0], 6, p2p_us=[0.2, 0.3])
    for busy, idle in zip(result.stage_busy_us, result.stage_idle_us):
        assert busy + idle == pytest.approx(result.iteration_time_us)
    assert max(result.stage_finish_us) == result.iteration_time_us
    # Stage 0 runs the very last backward.
    assert result.stage_finish_us[0] == result.iteration_time_us


def test_p2p_sends_lengthen_the_iteration():
    base = simulate([2.0] * 4, [4.0] * 4, 8).iteration_time_us
    with_p2p = simulate([2.0] * 4, [4.0] * 4, 8, p2p_us=0.5).iteration_time_us
    assert with_p2p > base == (8 + 4 - 1) * 6.0
    # The cost model's bound with each send on its sender: t = 6.5, 7, 7, 6.5.
    t = [6.5, 7.0, 7.0, 6.5]
    assert base + 4 * 0.5 < with_p2p <= sum(t) + 7 * max(t)


def test_unequal_1f1b_never_exceeds_the_cost_model_closed_form():
    """The cost model's S + (m - 1) max t is an upper bound of the 1F1B simulation."""
    rng = random.Random(7)
    for _ in range(200):
        p, m = rng.choice([2, 3, 4, 6]), rng.choice([1, 2, 5, 8, 16])
        f = [rng.uniform(1, 3) for _ in range(p)]
        b = [x * rng.uniform(1.5, 2.5) for x in f]
        t = [x + y for x, y in zip(f, b)]
        sim = simulate(f, b, m).iteration_time_us
        assert sim <= sum(t) + (m - 1) * max(t) + 1e-9


def test_slowest_last_stage_makes_the_closed_form_exact():
    f, b = [1.0, 1.0, 1.0, 2.0], [2.0, 2.0, 2.0, 3.0]
    t = [x + y for x, y in zip(f, b)]
    assert simulate(f, b, 8).iteration_time_us == pytest.approx(sum(t) + 7 * max(t))


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1),
                                            ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3)])
def test_in_flight_micro_batches_match_the_memory_model(schedule, p, m, v):
    """Peak outstanding forwards per stage: 1F1B min(p - j, m); interleaved (in chunks)
    min((p - j - 1) * 2 + (v - 1) * p + 1, m v), the counts the cost model charges."""
    for j in range(p):
        order = stage_order(p, j, m, schedule, v)
        assert sum(op == "F" for op, _, _ in order) == m * v
        assert sum(op == "B" for op, _, _ in order) == m * v
        live = peak = 0
        for op, _, _ in order:
            live += 1 if op == "F" else -1
            peak = max(peak, live)
        expected = (min(p - j, m) if schedule == "1f1b"
                    else min((p - j - 1) * 2 + (v - 1) * p + 1, m * v))
        assert peak == expected
        assert peak == in_flight_micro_batches(schedule, p, m, v)[j] * v


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="num_micro_batches"):
        simulate([1.0] * 4, [2.0] * 4, 6, "interleaved", 2)
    with pytest.raises(ValueError, match="one forward and one backward"):
        simulate([1.0] * 2, [2.0] * 3, 4)


def test_interleaved_short_end_chunks_by_hand():
    """p = 2, v = 2, m = 2, 1 us forward and 2 us backward per layer, chunks (1, 2) on stage 0
    and (2, 1) on stage 1 (short first and last chunks, layout.stage_chunks). Counted by hand
    along stage_order: stage 0 F 0-1, 1-2, 3-5, 5-7 and B 8-12, 12-16, 16-18, 20-22; stage 1
    F 1-3, 3-5, 5-6, B 6-8, F 8-9, B 9-11, 12-16, 16-20: 22 us, 4 us idle on each stage
    (equal chunks of the same stages: 22.5 us). Stage 1's peak in flight is 5 layers' bytes
    (2, 4, 5, 4, 5 over its first five ops), not 4.5."""
    f, b = [3.0, 3.0], [6.0, 6.0]
    shares = [[1 / 3, 2 / 3], [2 / 3, 1 / 3]]
    result = simulate(f, b, 2, "interleaved", 2, act_bytes=[3.0, 3.0], chunk_shares=shares)
    assert result.iteration_time_us == pytest.approx(22.0)
    assert result.stage_idle_us == pytest.approx((4.0, 4.0))
    assert result.stage_peak_act_bytes[1] == pytest.approx(5.0)
    equal = simulate(f, b, 2, "interleaved", 2, act_bytes=[3.0, 3.0])
    assert equal.iteration_time_us == pytest.approx(22.5)
    assert equal.stage_peak_act_bytes[1] == pytest.approx(4.5)


# Megatron-LM's interleaved schedule with --microbatch-group-size-per-vp-stage N
# (megatron/core/pipeline_parallel/schedules.py): rank r runs 2 (p - r - 1) + (v - 1) N warm-up
# chunk forwards (get_pp_rank_microbatches), all m v when that is more, so 1 more than that is in
# flight once the steady 1F1B starts; micro-batches go through each chunk in groups of N, the
# last group taking what is left (get_schedule_table). N defaults to p.
def megatron_in_flight_chunks(p, r, m, v, n):
    return min(2 * (p - r - 1) + (v - 1) * n + 1, m * v)


@pytest.mark.parametrize("p,v,m,n", [(4, 2, 8, 4), (4, 2, 8, 8), (4, 3, 12, 6), (4, 2, 10, 5),
                                     (4, 2, 10, 6), (2, 2, 5, 3), (16, 2, 32, 16),
                                     (16, 8, 32, 16), (16, 2, 32, 32), (16, 4, 16, 16)])
def test_interleaved_in_flight_with_a_group_size_is_megatrons(p, v, m, n):
    """m > p (and m = p): every stage's walked peak and in_flight_micro_batches equal Megatron's
    warm-up + 1 for group size n, and each stage runs every chunk of every micro-batch once."""
    expected = [megatron_in_flight_chunks(p, r, m, v, n) for r in range(p)]
    assert (in_flight_micro_batches("interleaved", p, m, v, group=n) * v).tolist() == expected
    for r in range(p):
        order = stage_order(p, r, m, "interleaved", v, group=n)
        assert sorted(op for op in order if op[0] == "F") == [
            ("F", c, i) for c in range(v) for i in range(m)]
        live = peak = 0
        for op, _, _ in order:
            live += 1 if op == "F" else -1
            peak = max(peak, live)
        assert peak == expected[r]
    if n == p:  # the default group is p
        assert (in_flight_micro_batches("interleaved", p, m, v).tolist()
                == in_flight_micro_batches("interleaved", p, m, v, group=n).tolist())


def test_interleaved_group_order_is_megatrons_table():
    """Megatron's own example (schedules.py, PP2 N3 M5 with VP2): forwards take micro-batches
    0 1 2 0 1 2 3 4 3 4 through chunks 0 0 0 1 1 1 0 0 1 1, backwards the same micro-batches
    through the chunks in reverse; the schedule simulates without deadlock."""
    order = stage_order(2, 0, 5, "interleaved", 2, group=3)
    fwd = [(c, i) for op, c, i in order if op == "F"]
    bwd = [(c, i) for op, c, i in order if op == "B"]
    assert [i for _, i in fwd] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for c, _ in fwd] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert bwd == [(1 - c, i) for c, i in fwd]
    result = simulate([2.0, 2.0], [4.0, 4.0], 5, "interleaved", 2, group=3)
    assert result.iteration_time_us > 0


@pytest.mark.parametrize("p,m,n,match", [(4, 8, 3, "group"), (4, 8, 9, "group"),
                                         (4, 10, 4, "remainder")])
def test_interleaved_group_size_outside_megatrons_range_is_refused(p, m, n, match):
    """Megatron refuses N outside [p, m] and a last group of 1..p-1 micro-batches."""
    with pytest.raises(ValueError, match=match):
        stage_order(p, 0, m, "interleaved", 2, group=n)
    with pytest.raises(ValueError, match=match):
        in_flight_micro_batches("interleaved", p, m, 2, group=n)
