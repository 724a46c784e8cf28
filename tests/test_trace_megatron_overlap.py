"""The trace's Megatron-LM arguments say what the search.* overlap knobs ask for, as search's
own export (<model>.megatron.args) does."""
from __future__ import annotations

import json

from conftest import run_cli


def test_trace_megatron_args_follow_the_overlap_knobs(profiles):
    knobs = ["search.engine=megatron", "search.tp_comm_overlap=false",
             "search.overlap_grad_reduce=false"]
    run_cli("stage=trace", "model=tiny", "trace.world_size=8", "trace.pp=2", "trace.tp=2",
            "trace.global_batch_size=4", *knobs, profiles_dir=profiles)
    (summary,) = (profiles / "local" / "trace").glob("SIM_*/summary.json")
    args = json.loads(summary.read_text())["megatron_args"]
    assert "--sequence-parallel" in args
    assert "--tp-comm-overlap" not in args and "--overlap-grad-reduce" not in args
