"""The event simulation with micro-batches of different sizes, against hand-worked timelines."""
from __future__ import annotations

import random

import pytest

from orchestrator.planner.schedule import in_flight_micro_batches, simulate


def test_two_stages_three_micro_batches_of_different_sizes():
    # 1F1B, p=2, m=3. Stage 0 runs F0 F1 B0 F2 B1 B2, stage 1 F0 B0 F1 B1 F2 B2.
    # f = 1, 2, 1 and b = 2, 4, 2 (micro-batches 0, 1, 2) on both stages.
    # s0: F0 0-1, F1 1-3          s1: F0 1-2, B0 2-4, F1 4-6 (busy until 4), B1 6-10
    # s0: B0 4-6 (waits s1's B0), F2 6-7, B1 10-14 (waits s1's B1)
    # s1: F2 10-11, B2 11-13      s0: B2 14-16 -> makespan 16; each stage busy 12.
    f = [[1, 2, 1], [1, 2, 1]]
    b = [[2, 4, 2], [2, 4, 2]]
    # Stored bytes: s0 after F0 10, F1 30, B0 20, F2 50, B1 30, B2 0 -> peak 50;
    # s1 holds one micro-batch at a time -> the largest, 3.
    r = simulate(f, b, 3, act_bytes=[[10, 20, 30], [1, 2, 3]])
    assert r.iteration_time_us == 16.0
    assert r.stage_finish_us == (16.0, 13.0)
    assert r.stage_busy_us == (12.0, 12.0)
    assert r.stage_peak_act_bytes == (50.0, 3.0)


def test_three_stages_with_one_long_micro_batch():
    # p=3, m=3, f=1 b=2 except micro-batch 1: f=3 b=6, on every stage.
    # s0: F0 0-1, F1 1-4, F2 4-5
    # s1: F0 1-2, F1 4-7             s2: F0 2-3, B0 3-5, F1 7-10, B1 10-16
    # s1: B0 7-9, F2 9-10, B1 16-22  s2: F2 16-17, B2 17-19;  s1: B2 22-24
    # s0: B0 9-11, B1 22-28, B2 28-30 -> makespan 30.
    f = [[1, 3, 1]] * 3
    b = [[2, 6, 2]] * 3
    r = simulate(f, b, 3)
    assert r.stage_finish_us == (30.0, 24.0, 19.0)
    assert r.iteration_time_us == 30.0
    assert r.stage_peak_act_bytes is None


def test_p2p_per_micro_batch_occupies_the_sender():
    # p=2, m=2; f = 1, 2 and b = 2, 3; a send takes 0.5 (micro-batch 0) and 1 (micro-batch 1).
    # s0's forwards send forward, s1's backwards send back.
    # s0: F0 0-1.5, F1 1.5-4         s1: F0 1.5-2.5, B0 2.5-5, F1 5-7, B1 7-11
    # s0: B0 5-7, B1 11-14 -> makespan 14.
    r = simulate([[1, 2], [1, 2]], [[2, 3], [2, 3]], 2, p2p_us=[[0.5, 1.0]])
    assert r.stage_finish_us == (14.0, 11.0)


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1),
                                            ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3)])
def test_equal_micro_batches_give_todays_result(schedule, p, m, v):
    rng = random.Random(p * 100 + m)
    f = [rng.uniform(1, 3) for _ in range(p)]
    b = [x * 2 for x in f]
    p2p = [rng.uniform(0, 0.5) for _ in range(p - 1)]
    today = simulate(f, b, m, schedule, v, p2p)
    grid = simulate([[x] * m for x in f], [[x] * m for x in b], m, schedule, v,
                    [[x] * m for x in p2p], act_bytes=[[7.0] * m for _ in range(p)])
    assert grid.stage_finish_us == today.stage_finish_us
    assert grid.stage_busy_us == today.stage_busy_us
    # Equal micro-batches: the in-flight peak is the cost model's count (chunks hold 1/v).
    expected = in_flight_micro_batches(schedule, p, m, v) * 7.0
    assert grid.stage_peak_act_bytes == pytest.approx(tuple(expected), rel=1e-12)


def test_no_micro_batches_take_no_time():
    r = simulate([[], []], [[], []], 0, act_bytes=[[], []])
    assert r.iteration_time_us == 0.0 and r.stage_peak_act_bytes == (0.0, 0.0)


def test_a_grid_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="one per micro-batch"):
        simulate([[1.0, 2.0]], [[1.0, 2.0, 3.0]], 2)
