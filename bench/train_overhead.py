"""What `stage=train` costs over a bare torch training loop of the same model, layout and batch.

  python bench/train_overhead.py            # dp4 on 4 local gloo ranks, twice, alternating
  python bench/train_overhead.py --rounds 3 --steps 20
  python bench/train_overhead.py --smoke    # one rank, one round, one timed step

The bare loop: 4 processes (torch.multiprocessing), gloo, the same GPT (`tiny`, fp32, seed 0),
DDP with no_sync over the micro-batches, gradient clipping, AdamW (foreach), 1 thread per rank
as the runtime sets; the same global batch (8 sequences of 256 tokens: 2 micro-batches of 1 per
rank) and step count. Both skip the same warm-up steps and take the median iteration; the
overhead is train's median over the bare loop's, minus 1 (target <= 5%). Also prints each one's
RSS growth over the run (MiB, the most of any rank), the figure train's summary calls peak
memory on CPU. pp2*tp2 has no bare loop here: a torch-only pipeline + TP loop is the engine
itself. Prints figures; asserts nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORLD, MICRO_BATCHES, SEQ, WARMUP = 4, 2, 256, 3


def rss_MiB() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def bare_rank(rank: int, port: int, steps: int, out: str, world: int = WORLD) -> None:
    """One rank of the bare loop; rank 0 writes {"step_s": [...], "rss_growth_MiB": [...]}."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from orchestrator.models.config import ModelConfig
    from orchestrator.models.gpt import GPT

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    base_MiB = rss_MiB()
    model = DDP(GPT(ModelConfig(seq_len=SEQ), seed=0))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(rank)
    peak_MiB, step_s = 0.0, []
    for _ in range(steps):
        tokens = torch.randint(0, 512, (MICRO_BATCHES, 1, SEQ + 1), generator=gen)
        start = time.perf_counter()
        for i in range(MICRO_BATCHES):
            x, y = tokens[i, :, :-1], tokens[i, :, 1:]
            if i < MICRO_BATCHES - 1:
                with model.no_sync():
                    (model(x, y) / MICRO_BATCHES).backward()
            else:
                (model(x, y) / MICRO_BATCHES).backward()  # DDP's bucketed all-reduce
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        step_s.append(time.perf_counter() - start)
        peak_MiB = max(peak_MiB, rss_MiB())
    growth = [None] * world
    dist.all_gather_object(growth, peak_MiB - base_MiB)
    times = [None] * world
    dist.all_gather_object(times, step_s)
    if rank == 0:
        # an iteration ends when its slowest rank does
        Path(out).write_text(json.dumps({"step_s": [max(t) for t in zip(*times)],
                                         "rss_growth_MiB": growth}))
    dist.destroy_process_group()


def run_bare(steps: int, work: Path, world: int = WORLD, warmup: int = WARMUP) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = work / "bare.json"
    os.environ["OMP_NUM_THREADS"] = "1"
    if world == 1:  # --smoke: this process is the rank
        bare_rank(0, port, steps, str(out), world)
    else:
        mp.spawn(bare_rank, args=(port, steps, str(out), world), nprocs=world, join=True)
    result = json.loads(out.read_text())
    timed = result["step_s"][warmup:]
    return {"iteration_ms": statistics.median(timed) * 1e3,
            "rss_MiB": max(result["rss_growth_MiB"])}


def run_train(steps: int, work: Path, world: int = WORLD, warmup: int = WARMUP) -> dict:
    # force=true still resumes from the last checkpoint (no step left to time): start afresh
    for ckpt in (work / "profiles").glob("local/train/*/*.ckpt"):
        shutil.rmtree(ckpt)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    args = ["stage=train", "train.pp=1", "train.tp=1", "train.micro_batch_size=1",
            f"train.num_micro_batches={MICRO_BATCHES}", f"train.steps={steps}",
            f"train.timing_warmup_steps={warmup}", "train.keep_checkpoints=0", "train.plot=false",
            "train.allow_oom_risk=true", "force=true", f"profiles_dir={work / 'profiles'}",
            f"cluster.tasks_per_node={world}"]
    subprocess.run([sys.executable, "-m", "orchestrator", *args], cwd=work, env=env, check=True,
                   capture_output=True)
    summary = next((work / "profiles" / "local" / "train" / "tiny").glob("*.json"))
    m = json.loads(summary.read_text())["measured"]
    return {"iteration_ms": m["iteration_ms"], "rss_MiB": max(m["peak_memory_MiB"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="train then bare, this many times")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--smoke", action="store_true",
                    help="dp1 on one rank, one round of 2 steps (1 timed)")
    args = ap.parse_args()
    world, warmup = (1, 1) if args.smoke else (WORLD, WARMUP)
    if args.smoke:
        args.rounds, args.steps = 1, 2
    tokens = world * MICRO_BATCHES * SEQ
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            train = run_train(args.steps, work, world, warmup)
            bare = run_bare(args.steps, work, world, warmup)
            overhead = train["iteration_ms"] / bare["iteration_ms"] - 1
            print(f"round {r + 1}: dp{world} tiny, {tokens} tokens/step, median of steps "
                  f"{warmup + 1}..{args.steps}: stage=train {train['iteration_ms']:.1f} ms "
                  f"({tokens / train['iteration_ms'] * 1e3:,.0f} tok/s), bare DDP loop "
                  f"{bare['iteration_ms']:.1f} ms ({tokens / bare['iteration_ms'] * 1e3:,.0f} "
                  f"tok/s): overhead {overhead:+.1%} (target <= 5%); RSS growth train "
                  f"{train['rss_MiB']:.0f} MiB, bare {bare['rss_MiB']:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
