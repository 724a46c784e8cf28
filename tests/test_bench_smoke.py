"""Every script in bench/ runs its smoke case to the end and prints its figures (docs/testing.md,
Benchmarks): one process per script, as `make bench` runs them. The figures themselves are
never asserted (timing belongs in bench/): the header of what a script prints and one number
in it are.

Each smoke case takes seconds: the smallest case of the script, on the test fixtures' synthetic
profiles where the full run profiles analytically through the CLI, on 1-2 ranks where it
launches 4. A bench that needs an outside tool (DynaPipe, SimAI, Galvatron's sdist) runs what it
can without it and says what it skipped; one that needs measured runs (cost_model_accuracy)
re-scores the suite's measured chain.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
N = r"[\d,]+(?:\.\d+)?"  # a printed figure
B = r"[\u2502|]"  # a table's column rule (rich draws "|" where the output cannot take UTF-8)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _launch_bound() -> list:
    if _cuda():
        return [r"tiny one block on .*; ms, fastest of 10", rf"\n\s+256\s+{N}\s+{N}"]
    return [r"skipped: needs a GPU"]


def _dynapipe() -> list:
    if importlib.util.find_spec("dynapipe") is None:
        return [r"skipped: DynaPipe is not importable"]
    return [rf"n=8 it=0: ours {N} ms", rf"== n=8: ours/DynaPipe-1 median [+-]{N}%"]


# script -> (arguments; "{chain}" is a copy of the suite's measured chain), patterns its output
# must hold (a callable: decided when the test runs)
SMOKES = {
    "cost_model_accuracy": (["--rescore", "{chain}/.."], [
        r"local: re-predicted by this code",
        rf"iteration, as profiled \(all\): mean \|error\| {N}%, max {N}% over 1"]),
    "dynamic_microbatching": (["--smoke"], [
        r"tiny: pp2 tp1 dp2, budget", rf"{B}\s+8 {B}\s+{N} {B}\s+{N} {B}\s+{N} {B}"]),
    "dynapipe_side_by_side": (["--smoke"], _dynapipe),
    "galvatron_engine": (["--smoke"], [
        r"smoke, llama-7b 1x8 36 GB bsz 16: not run: no hetu_galvatron-2.4.0 in "]),
    "galvatron_side_by_side": (["--smoke"], [r"skipped: no hetu_galvatron-2.4.0 in "]),
    "long_context": (["--smoke"], [
        r"llama2_7b, 128K, 128 H100s, global batch 32",
        rf"NeMo TP4 CP4 DP8\s+tp4 cp4 pp1 dp8 .*\n\s+{N} s/iter\s+{N} tok/s",
        rf"CP / no CP: {N}x", r"pick, max_cp 16\s+tp\d"]),
    "megatron_memory": (["--smoke"], [
        rf"llama3_405b\s+tp1 {N} / {N}", r"Megatron-LM: not run \(--smoke"]),
    "moe": (["--smoke"], [
        r"256 H100s, global batch 1024 x 4096 tokens",
        rf"mixtral_8x7b Megatron-LM example\s+{B} tp2 pp4 dp32 ep8 .*{B}\s+{N} {B}\s+{N} {B}"]),
    "overhead": (["--smoke"], [
        rf"local, 4 ranks: orchestrator {N} s, bare {N} s, overhead [+-]{N} s"]),
    "plain_loop": (["--smoke", "--keep-summaries", "{tmp}/kept"], [
        r"tiny x2 layers, seq 64, global batch 2 on one CPU",
        r"mbs 1: stage=train summary kept: .*/kept/local/train/tiny/pp1-tp1-dp1-zero0-mbs1x2-1f1b\.json",
        rf"mbs1 x2 {B}\s+{N} \({N}\) {B}\s+{N} \({N}\) {B}\s+{N} \({N}\) {B}\s+{N}x"]),
    "profile_hardware_agreement": (["--smoke"], [
        r"allreduce over 2 ranks, 0.0625 MiB fp32:",
        rf"torch loop busbw {N} GB/s\s+ratio profiler/torch {N}"]),
    "compile_tp_torch": (["--smoke"], [
        # what train relies on: a waited input keeps its gradient; uncheckpointed TP compiles
        r"async collective input / compiled, plain input: input AsyncCollectiveTensor: "
        r"w\.grad sum 64\.0", rf"checkpointed attention / no checkpoint: ok, x\.grad norm {N}",
        r"checkpointed attention / checkpoint: "]),
    "profile_hardware_speed": (["--smoke"], [
        rf"smoke profile \(.*\): {N} s", rf"allreduce n=2\s+consec\s+held-out error\s+{N}%"]),
    "profile_model_extrapolation": (["--smoke"], [
        r"tiny on 1 CPU rank\(s\), fit on seq \[32, 64\]",
        rf"block_fwd_us\s+seq 128: predicted\s+{N} us, measured\s+{N} us"]),
    "profile_model_gpu_launch_bound": (["--smoke"], _launch_bound),
    "profile_model_gpu_vs_analytic": (["{chain}/local/model/tiny.json"] * 2, [
        r"block times, ms: measured / analytic",
        rf"\n\s+64\s+1\s+{N} / {N} \(x1.00\)"]),
    "profile_model_memory": (["--smoke"], [
        r"tiny fp32 \(cpu\) seq 256 tp 1:", rf"none: live\s+{N} MiB"]),
    "profile_model_speed": (["--smoke"], [
        rf"tiny, 1 CPU rank, 1 points \(tp \[1\], seq \[64\]\): {N} s wall"]),
    "published_runs": (["--smoke", "--guesses"], [
        r"Published H100 BF16 runs priced as run",
        rf"Megatron GPT 1.7B\s+{B}\s+48 {B} tp1 pp1 dp48 .*{B}\s+409 {B}\s+{N} {B}\s+{N} {B}",
        rf"predicted/published: median {N} \(target 0.95-1.05\), min {N}",
        rf"Megatron GPT 1.7B \(48 GPUs\), every guess:\n  mbs1 rc none zero1\s+{N} s ratio {N}\s+{N} GiB (fits|over)  s: compute {N}"]),
    "search_speed": (["--smoke"], [rf"llama2_7b\s+16 dev: exact\s+{N} s\s+fast\s+{N} s"]),
    "simai_iteration": (["--smoke"], [
        r"tiny tp2 pp2 dp2 .*SimAI \(analytical\) vs the trace and the planner",
        rf"{B}\s+1 {B}\s+- {B}\s+{N} {B}", r"SimAI: not run \(--smoke\)"]),
    "trace_speed": (["--smoke"], [
        rf"tiny small world \(GBS 64, seq 256, SP\): wall {N} s",
        rf"{B}\s+64 {B}\s+4 {B}\s+4 {B}\s+4 {B}\s+16 {B}\s+4 {B}"]),
    "train_memory": (["--smoke"], [
        rf"model tiny x1 layers, {N} M params, seq 32", rf"peak counted: {N} MiB"]),
    "train_overhead": (["--smoke"], [
        rf"round 1: dp1 tiny, 512 tokens/step, .*: stage=train {N} ms .* bare DDP loop {N} ms"]),
}


def _one_cpu() -> None:
    """In the child: run on one CPU. A stage of one rank takes every CPU it may use for torch's
    threads, and two threads spin on a loaded 2-core machine (a tiny step took 2 s, not 60 ms)."""
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})


def test_every_bench_has_a_smoke_case():
    assert {p.stem for p in BENCH.glob("*.py")} == set(SMOKES)


@pytest.mark.parametrize("script", sorted(SMOKES))
def test_bench_smoke_case_runs_to_its_end(script, request, tmp_path):
    args, patterns = SMOKES[script]
    if any("{chain}" in a for a in args):
        chain = request.getfixturevalue("chain")
        args = [a.format(chain=chain) for a in args]
    args = [a.format(tmp=tmp_path) if "{tmp}" in a else a for a in args]
    patterns = patterns() if callable(patterns) else patterns
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "TMPDIR": str(tmp_path)}  # no Galvatron sdist cached from an earlier bench run
    env.pop("SIMAI_ROOT", None)
    proc = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=_one_cpu)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for pattern in patterns:
        assert re.search(pattern, proc.stdout), f"{pattern!r} not in:\n{out}"
