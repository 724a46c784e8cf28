"""stage=train's tokens/s beside a plain PyTorch loop of the same model, eager and compiled.

  python bench/plain_loop.py                  # llama2_7b cut to 4 layers, seq 2048, global
                                              # batch 8, mbs 2 and 8 (issue 42's case)
  python bench/plain_loop.py --mbs 1 2 4 8 --steps 12 --json out.json
  python bench/plain_loop.py --train-arg train.compile=true --train-arg train.recompute=full
  python bench/plain_loop.py --profiles-dir profiles   # train predicts from these profiles
  python bench/plain_loop.py --smoke          # tiny, 2 layers, on CPU: seconds

The plain loop is written here, without the engine: a llama (token embedding, RMSNorm, q/k/v/o
projections with RoPE and SDPA's causal kernel (GQA where the model has it), RMSNorm, SwiGLU,
a final RMSNorm and an untied head) from the project's model config (`--model`, `--layers`), the
mean cross-entropy in fp32 (torchtitan's), gradient accumulation over `gbs / mbs`
micro-batches, `clip_grad_norm_(1.0)`, AdamW (lr 1e-4, betas 0.9/0.95, weight decay 0.1).
What a strong user writes on a GPU: fp32 weights under bf16 autocast, a fused AdamW, no host
sync in the step (none but the timer's at its end); the same loop `torch.compile`d whole
(`--compile-backend`, inductor by default). On a CPU: fp32 and a foreach AdamW. `stage=train`
runs the same shapes through the CLI (one rank: cluster=gpu_node on a GPU, else cluster=local
with one task), in its own precision (train.dtype's default: bf16 weights with fp32 masters on
nccl, fp32 on gloo; `--train-arg train.dtype=...` changes it); its summary's median step.
Every run leaves out the same first `--warmup` steps (compilation included) and takes the
median of the rest. Prints a table (layout, tokens/s of each, train / compiled); asserts
nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from rich.console import Console
from rich.table import Table
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.models.config import ModelConfig  # noqa: E402

MODELS = REPO / "orchestrator" / "conf" / "model"
console = Console(width=160)


def model_config(name: str, layers: int) -> ModelConfig:
    """The project's model config `name` (orchestrator/conf/model/<name>.yaml), cut to `layers`."""
    fields = yaml.safe_load((MODELS / f"{name}.yaml").read_text())
    if fields.get("experts"):
        raise SystemExit(f"{name} is a mixture of experts: the plain loop is a dense llama")
    return ModelConfig(**{**fields, "layers": layers})


# ---------------------------------------------------------------------------- the plain llama
def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x (batch, seq, heads, head_dim): pairs (i, i + d/2) rotated by position."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class PlainBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        kv = cfg.kv_heads * self.head_dim
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.wq = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.wk = nn.Linear(cfg.hidden, kv, bias=False)
        self.wv = nn.Linear(cfg.hidden, kv, bias=False)
        self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.w_gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w_up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w_down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(b, s, self.heads, self.head_dim)
        k = self.wk(h).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(h).view(b, s, self.kv_heads, self.head_dim)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True,
                                             enable_gqa=self.kv_heads != self.heads)
        x = x + self.wo(out.transpose(1, 2).reshape(b, s, -1))
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class PlainLlama(nn.Module):
    """forward(tokens, targets) -> the mean next-token loss (fp32 cross-entropy)."""

    def __init__(self, cfg: ModelConfig, seq: int):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(PlainBlock(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        head_dim = cfg.hidden // cfg.heads
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq).float(), inv_freq)[:, None, :]  # (s, 1, d/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for name, p in self.named_parameters():
            if "norm" not in name:
                out_proj = name.endswith(("wo.weight", "w_down.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers) if out_proj else 0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.tok_emb(tokens)
        for block in self.blocks:
            x = block(x, self.cos[:s], self.sin[:s])
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def plain_loop(cfg: ModelConfig, seq: int, mbs: int, gbs: int, steps: int, device: torch.device,
               backend: str | None) -> list:
    """Seconds of each step of the plain loop (`backend`: torch.compile's, None: eager)."""
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = PlainLlama(cfg, seq).to(device)
    step_model = model if backend is None else torch.compile(model, backend=backend)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                              **({"fused": True} if cuda else {"foreach": True}))
    batch = torch.randint(0, cfg.vocab, (gbs, seq + 1), device=device)
    micro_batches = gbs // mbs
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda
                else contextlib.nullcontext())
    times = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for i in range(micro_batches):
            rows = batch[i * mbs:(i + 1) * mbs]
            with autocast:
                loss = step_model(rows[:, :-1], rows[:, 1:]) / micro_batches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    del model, step_model, optim, batch
    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return times


# ---------------------------------------------------------------------------- stage=train
def train_run(args, mbs: int, cuda: bool, work: Path) -> dict:
    """stage=train of the same shapes on one rank: {"step_ms", "tokens_per_s"} from its summary,
    or {"error": ...}."""
    profiles = work / f"profiles-mbs{mbs}"
    if args.profiles_dir:  # the given profiles (the prediction), never its checkpoints or runs
        shutil.copytree(args.profiles_dir, profiles,
                        ignore=shutil.ignore_patterns("runs", "multirun", "*.ckpt"))
    cluster = (["cluster=gpu_node"] if cuda else ["cluster=local", "cluster.tasks_per_node=1"])
    cmd = [sys.executable, "-m", "orchestrator", "stage=train", *cluster,
           f"model={args.model}", f"model.layers={args.layers}", "train.pp=1", "train.tp=1",
           f"train.seq_len={args.seq}", f"train.global_batch_size={args.gbs}",
           f"train.micro_batch_size={mbs}", f"train.steps={args.steps}",
           f"train.timing_warmup_steps={args.warmup}", "train.keep_checkpoints=0",
           "train.plot=false", "train.allow_oom_risk=true", "force=true",
           f"profiles_dir={profiles}", *args.train_arg]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    started = time.time()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    if proc.returncode:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}"}
    summaries = [p for p in profiles.glob(f"*/train/{args.model}/*.json")
                 if p.stat().st_mtime >= started]
    if not summaries:
        return {"error": f"no summary under {profiles}"}
    newest = max(summaries, key=lambda p: p.stat().st_mtime)
    if args.keep_summaries:  # beside the stage=train runs of the same profiles (bench/gpu/rows.py)
        kept = Path(args.keep_summaries) / newest.relative_to(profiles)
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(newest, kept)
        console.print(f"mbs {mbs}: stage=train summary kept: {kept}", highlight=False, soft_wrap=True)
    summary = json.loads(newest.read_text())
    measured = summary["measured"]
    return {"step_ms": measured["iteration_ms"], "tokens_per_s": measured["tokens_per_s"],
}


def median_ms(times: list, warmup: int) -> float:
    return statistics.median(times[warmup:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mbs", type=int, nargs="+", default=[2, 8], help="micro-batch sizes")
    ap.add_argument("--model", default="llama2_7b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--gbs", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--profiles-dir", help="profiles stage=train predicts from (copied)")
    ap.add_argument("--keep-summaries", metavar="DIR",
                    help="copy each stage=train summary into this profiles folder (same path)")
    ap.add_argument("--train-arg", action="append", default=[],
                    help="an extra override for stage=train (repeatable), e.g. train.compile=true")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny, 2 layers, seq 64, mbs 1 of 2, 3 steps (1 timed) on CPU; "
                         "compiled with the eager backend (no inductor codegen)")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.layers, args.seq, args.gbs, args.mbs = "tiny", 2, 64, 2, [1]
        args.steps, args.warmup, args.compile_backend = 3, 2, "eager"
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup({args.warmup}) must be below --steps({args.steps})")
    bad = [m for m in args.mbs if args.gbs % m]
    if bad:
        raise SystemExit(f"--gbs({args.gbs}) is not a multiple of --mbs {bad}")
    cfg = model_config(args.model, args.layers)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    where = torch.cuda.get_device_name(device) if cuda else "CPU"
    console.print(f"{args.model} x{args.layers} layers, seq {args.seq}, global batch {args.gbs} "
                  f"on one {where}, torch {torch.__version__}; median of steps "
                  f"{args.warmup + 1}..{args.steps}")
    console.print("plain: " + ("fp32 weights, bf16 autocast, fused AdamW" if cuda else
                               "fp32, foreach AdamW") + ", clip 1.0; compiled: torch.compile("
                  f"model, backend={args.compile_backend!r}); stage=train: "
                  + (" ".join(args.train_arg) or "its defaults") + " ("
                  + ("bf16 weights, fp32 masters" if cuda else "fp32") + " unless train.dtype)")
    tokens = args.gbs * args.seq
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mbs in args.mbs:
            # each figure printed as it is measured: a run cut short (a lent GPU's time
            # limit) keeps what it measured
            train = train_run(args, mbs, cuda, Path(tmp))  # first: the GPU is all its own
            console.print(f"mbs {mbs}: stage=train {train.get('step_ms') or 0:.1f} ms/step",
                          highlight=False)
            eager = median_ms(plain_loop(cfg, args.seq, mbs, args.gbs, args.steps, device,
                                         None), args.warmup)
            console.print(f"mbs {mbs}: plain eager {eager:.1f} ms/step", highlight=False)
            compiled = median_ms(plain_loop(cfg, args.seq, mbs, args.gbs, args.steps, device,
                                            args.compile_backend), args.warmup)
            console.print(f"mbs {mbs}: plain compiled {compiled:.1f} ms/step", highlight=False)
            row = {"layout": f"mbs{mbs} x{args.gbs // mbs}", "plain_eager_ms": eager,
                   "plain_compiled_ms": compiled,
                   "plain_eager_tokens_per_s": tokens / eager * 1e3,
                   "plain_compiled_tokens_per_s": tokens / compiled * 1e3,
                   "train_ms": train.get("step_ms"), "train_tokens_per_s": train.get("tokens_per_s"),
                   "train_error": train.get("error")}
            if train.get("error"):
                console.print(f"mbs {mbs}: stage=train failed: {train['error']}")
            rows.append(row)
    table = Table(title=f"tokens/s (ms/step), {args.model} x{args.layers}, seq {args.seq}, "
                        f"{tokens} tokens a step, {where}")
    for col in ("layout", "plain eager", "plain compiled", "stage=train", "train / compiled"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for r in rows:
        train = (f"{r['train_tokens_per_s']:,.0f} ({r['train_ms']:.1f})" if r["train_ms"]
                 else "failed")
        ratio = (f"{r['train_tokens_per_s'] / r['plain_compiled_tokens_per_s']:.2f}x"
                 if r["train_ms"] else "-")
        table.add_row(r["layout"],
                      f"{r['plain_eager_tokens_per_s']:,.0f} ({r['plain_eager_ms']:.1f})",
                      f"{r['plain_compiled_tokens_per_s']:,.0f} ({r['plain_compiled_ms']:.1f})",
                      train, ratio)
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
