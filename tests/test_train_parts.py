"""Training parts on one process: deterministic data, the learning-rate schedule, the memory
monitor and its plot."""
from __future__ import annotations

import math
import os
import threading
import time
from itertools import pairwise

import pytest
import torch

from orchestrator.errors import ConfigError
from orchestrator.models.config import ModelConfig
from orchestrator.models.gpt import GPT
from orchestrator.train.data import DataError, TextData, make_data, read_corpus
from orchestrator.train.lr import lr_at
from orchestrator.train.monitor import MemoryMonitor, build_memory_figure, plot_memory

STDLIB = os.path.dirname(os.__file__)
# A small cap keeps the text tests fast; one test reads the default budget.
SMALL_BYTES = 1 << 20


@pytest.fixture(scope="module")
def stdlib_text():
    return make_data(STDLIB, vocab=512, seq_len=64, seed=0, max_bytes=SMALL_BYTES)


@pytest.mark.parametrize("source", [None, STDLIB])
def test_a_sample_is_the_same_whatever_slice_asks_for_it(source):
    data = make_data(source, vocab=512, seq_len=32, seed=3, max_bytes=SMALL_BYTES)
    tokens, targets = data.batch(step=5, first_sample=0, num_samples=8)
    assert tokens.shape == targets.shape == (8, 32) and tokens.dtype == torch.int64
    middle_tokens, middle_targets = data.batch(step=5, first_sample=3, num_samples=2)
    assert torch.equal(middle_tokens, tokens[3:5]) and torch.equal(middle_targets, targets[3:5])
    for dp_rank in range(4):
        rank_tokens, _ = data.rank_batch(step=5, dp_rank=dp_rank, dp=4, samples_per_rank=2)
        assert torch.equal(rank_tokens, tokens[2 * dp_rank:2 * dp_rank + 2])
    # A fresh object (a resumed run) gives the same batch.
    again = make_data(source, vocab=512, seq_len=32, seed=3, max_bytes=SMALL_BYTES)
    assert torch.equal(again.batch(5, 0, 8)[0], tokens)


@pytest.mark.parametrize("source", [None, STDLIB])
def test_steps_seeds_and_samples_give_different_data(source):
    data = make_data(source, vocab=512, seq_len=32, seed=0, max_bytes=SMALL_BYTES)
    other_seed = make_data(source, vocab=512, seq_len=32, seed=1, max_bytes=SMALL_BYTES)
    step0, _ = data.batch(0, 0, 8)
    assert not torch.equal(step0, data.batch(1, 0, 8)[0])
    assert not torch.equal(step0, other_seed.batch(0, 0, 8)[0])
    assert len({tuple(sample.tolist()) for sample in step0}) == 8


def test_targets_are_the_tokens_shifted_by_one():
    data = make_data(None, vocab=512, seq_len=16, seed=0)
    tokens, targets = data.batch(2, 0, 4)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 512


def test_text_windows_are_the_corpus_bytes(stdlib_text):
    corpus = bytes(stdlib_text.corpus)
    tokens, targets = stdlib_text.batch(7, 0, 4)
    for sample_tokens, sample_targets in zip(tokens, targets):
        window = bytes(sample_tokens.tolist()) + bytes([int(sample_targets[-1])])
        assert len(window) == 65 and window in corpus
        assert bytes(sample_targets.tolist()) == window[1:]
    assert int(tokens.max()) < 256


def test_a_folder_is_its_text_files_in_sorted_order_capped(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"second ")
    (tmp_path / "a.py").write_bytes(b"first ")
    (tmp_path / "c.md").write_bytes(b"third and longest")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01 not text")
    corpus, num_files = read_corpus(tmp_path)
    assert bytes(corpus) == b"first second third and longest" and num_files == 3
    capped, num_capped = read_corpus(tmp_path, max_bytes=10)
    assert bytes(capped) == b"first seco" and num_capped == 2
    data = make_data(str(tmp_path), vocab=256, seq_len=8, seed=0)
    assert data.describe() == f"text: {tmp_path} (0.0 MiB, 3 files)"


def test_the_stdlib_reads_fast_at_the_default_budget():
    # CPU time, not wall time: other processes on a shared machine must not fail this test.
    start_s = time.process_time()
    data = make_data(STDLIB, vocab=256, seq_len=256, seed=0)
    cpu_s = time.process_time() - start_s
    assert isinstance(data, TextData) and len(data.corpus) > 10 * 2**20
    assert data.describe().startswith(f"text: {STDLIB} (") and data.describe().endswith(" files)")
    assert cpu_s < 2.0, f"reading {data.describe()} took {cpu_s:.1f} s of CPU"


def test_byte_level_text_refuses_a_smaller_vocab(tmp_path):
    with pytest.raises(ValueError, match=r"byte-level \(256 tokens\) but the model's vocab is 128"):
        make_data(STDLIB, vocab=128, seq_len=16, seed=0)


def test_a_missing_or_empty_or_short_source_is_refused_naming_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DataError, match=rf"text data {missing}: no such file or folder"):
        make_data(str(missing), vocab=256, seq_len=16, seed=0)
    (tmp_path / "only.bin").write_bytes(b"\x00" * 100)
    with pytest.raises(DataError, match=rf"text data {tmp_path}: no readable text files"):
        make_data(str(tmp_path), vocab=256, seq_len=16, seed=0)
    short = tmp_path / "short.txt"
    short.write_text("0123456789")
    with pytest.raises(DataError, match=r"short.txt: 10 bytes, shorter than one sample of "
                                        r"seq_len\+1=17 bytes"):
        make_data(str(short), vocab=256, seq_len=16, seed=0)
    # A data error is a config error: the CLI exits 2 before launch.
    assert issubclass(DataError, ConfigError) and DataError("x").exit_code == 2


def test_synthetic_targets_follow_the_chain_except_for_a_few_noise_tokens():
    data = make_data(None, vocab=512, seq_len=128, seed=0)
    assert data.describe() == "synthetic (seed 0)"
    tokens, targets = data.batch(0, 0, 32)
    follows = data.next_token(tokens) == targets
    # About (1 - 0.05)^2 of the pairs are clean: neither token replaced by noise.
    assert 0.85 < follows.float().mean().item() < 0.95
    # Every token appears as a start somewhere: nothing to learn from the unigram alone.
    assert len(set(data.batch(0, 0, 2000)[0][:, 0].tolist())) > 400


@pytest.fixture
def one_torch_thread():
    # Two threads on a 2-core machine shared with other test runs spin and run 10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_tiny_model_learns_the_synthetic_data(one_torch_thread):
    torch.manual_seed(0)
    cfg = ModelConfig(layers=1, seq_len=32)
    data = make_data(None, vocab=cfg.vocab, seq_len=cfg.seq_len, seed=0)
    model = GPT(cfg, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(30):
        loss = model(*data.batch(step, 0, 8))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(cfg.vocab)) < 0.5
    # Uniform tokens would stay at ln(512) = 6.24; the chain is learnt.
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses


@pytest.mark.parametrize("step,expected", [
    (0, 1e-3 / 10),            # first warm-up step already moves
    (4, 1e-3 * 5 / 10),
    (9, 1e-3),                 # end of warm-up: the base rate
    (10, 1e-3),                # cosine starts at the base rate
    (55, 1e-4 + 0.9e-3 * 0.5),  # halfway through the decay
    (100, 1e-4),               # total: min_ratio * base
    (1000, 1e-4),              # beyond: stays at the floor
])
def test_lr_warms_up_then_decays_to_the_floor(step, expected):
    assert lr_at(step, base_lr=1e-3, warmup_steps=10, total_steps=100) == pytest.approx(expected)


def test_lr_without_warmup_and_with_warmup_longer_than_the_run():
    assert lr_at(0, base_lr=0.5, warmup_steps=0, total_steps=10) == pytest.approx(0.5)
    assert lr_at(10, base_lr=0.5, warmup_steps=0, total_steps=10, min_ratio=0.0) == 0.0
    assert lr_at(3, base_lr=0.5, warmup_steps=8, total_steps=4) == pytest.approx(0.25)
    decay = [lr_at(s, 1.0, 0, 20) for s in range(21)]
    assert all(a >= b for a, b in pairwise(decay))
    with pytest.raises(ValueError, match=r"step=-1"):
        lr_at(-1, 1.0, 0, 10)


def _wait_for_background_samples(monitor: MemoryMonitor, count: int, timeout_s: float = 60.0):
    """Until the monitor's thread has taken `count` readings of its own (label None)."""
    deadline = time.monotonic() + timeout_s
    while sum(sample["label"] is None for sample in list(monitor.samples)) < count:
        assert time.monotonic() < deadline, f"under {count} background samples in {timeout_s} s"
        time.sleep(0.01)


def test_memory_monitor_samples_in_the_background():
    threads_before = set(threading.enumerate())
    monitor = MemoryMonitor(interval_s=0.05, device="cpu")
    made_s = time.monotonic()
    with monitor:
        samplers = set(threading.enumerate()) - threads_before
        _wait_for_background_samples(monitor, 3)
        monitor.mark("step 10")
        waited_s = time.monotonic() - made_s
    labels = [sample["label"] for sample in monitor.samples]
    assert labels.count(None) >= 3  # the thread's own samples
    assert labels[0] == "start" and labels[-1] == "stop" and "step 10" in labels
    elapsed = [sample["elapsed_s"] for sample in monitor.samples]
    assert elapsed == sorted(elapsed) and elapsed[-1] >= waited_s  # seconds since it was made
    assert all(sample["rss_MiB"] > 1 for sample in monitor.samples)
    assert monitor.peak_MiB() >= max(sample["rss_MiB"] for sample in monitor.samples)
    # Stopped means stopped: the sampling thread is gone, so no sample can come later.
    assert len(samplers) == 1 and not any(thread.is_alive() for thread in samplers)


def test_a_disabled_monitor_takes_no_samples_but_reads_a_peak():
    threads_before = set(threading.enumerate())
    monitor = MemoryMonitor(interval_s=0, device=torch.device("cpu")).start()
    assert set(threading.enumerate()) <= threads_before  # no sampling thread to add samples
    monitor.stop()
    assert monitor.samples == [] and monitor.peak_MiB() > 1


def test_memory_plot_has_a_line_per_rank_and_writes_a_png(tmp_path):
    samples_by_rank = {
        rank: [{"elapsed_s": t * 0.1, "rss_MiB": 100.0 + 10 * rank + t,
                "label": "step 1" if t == 2 else None} for t in range(5)]
        for rank in range(3)}
    samples_by_rank[3] = []  # a rank that took none is left out
    fig = build_memory_figure(samples_by_rank)
    (ax,) = [ax for ax in fig.axes if ax.get_label() == "memory"]
    lines = [line for line in ax.get_lines() if line.get_label().startswith("rank")]
    assert [line.get_label() for line in lines] == ["rank 0", "rank 1", "rank 2"]
    assert list(lines[2].get_ydata()) == [120.0, 121.0, 122.0, 123.0, 124.0]
    assert ax.get_ylabel() == "RSS (MiB)"
    path = plot_memory(samples_by_rank, tmp_path / "plots" / "memory.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == ["memory.png"]  # no temp file left
    with pytest.raises(ValueError, match="no memory samples"):
        plot_memory({0: []}, tmp_path / "empty.png")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_memory_monitor_reads_the_cuda_allocator():
    device = torch.device("cuda", torch.cuda.current_device())
    monitor = MemoryMonitor(interval_s=0.05, device=device)
    before = monitor.mark("before")
    block = torch.empty(64 << 20, dtype=torch.uint8, device=device)  # 64 MiB
    with monitor:
        _wait_for_background_samples(monitor, 1)
    after = monitor.samples[-1]
    assert after["allocated_MiB"] - before["allocated_MiB"] == pytest.approx(64, abs=1)
    assert after["reserved_MiB"] >= after["allocated_MiB"] and after["peak_MiB"] >= 64
    del block
    assert monitor.peak_MiB() >= after["allocated_MiB"]
    assert build_memory_figure({0: monitor.samples}).axes[0].get_ylabel() == "allocated (MiB)"


def test_measured_parts_takes_each_stage_s_ranks_in_the_layout_s_rank_order():
    """CP 2 x PP 2 on 4 ranks: ranks 0 and 1 (one sequence's CP ranks) are stage 0, 2 and 3
    stage 1 (rank order tp, cp, dp, pp); each stage's compute is its own ranks' median."""
    from orchestrator.layout import ParallelLayout
    from orchestrator.train.report import measured_parts

    layout = ParallelLayout(world_size=4, pp=2, tp=1, dp=1, cp=2, layers_per_stage=(2, 2))
    per_rank = [{"rank": r, "peak_MiB": 1.0, "process_peak_MiB": 1.0,
                 "medians_s": {"step_s": 1.0, "compute_s": 0.1 * (1 + r // 2), "fwd_bwd_s": 0.5,
                               "norm_s": 0.0, "sync_wait_s": 0.0, "optimizer_s": 0.0}}
                for r in range(4)]
    stages = measured_parts(per_rank, layout)["stages"]
    assert [round(s["compute_ms"]) for s in stages] == [100, 200]


def test_a_result_of_another_config_is_kept_aside_with_its_plots_not_overwritten(tmp_path):
    """A rerun of the same layout under other settings (steps, lr, the model's shape) writes a
    new result: the earlier one, a measurement of its own, is moved beside it, not lost."""
    import json
    from types import SimpleNamespace

    from orchestrator.train.report import _set_aside_another_configs

    out = tmp_path / "pp1-tp1-dp4-zero0-mbs1x2-1f1b.json"
    out.write_text(json.dumps({"provenance": {"config_hash": "sixty-steps"}}))
    out.with_suffix(".png").write_bytes(b"png")
    notes = []
    log = SimpleNamespace(note=notes.append)
    _set_aside_another_configs(out, "sixty-steps", log)  # the same config: rewritten in place
    assert out.exists() and notes == []
    _set_aside_another_configs(out, "two-steps", log)
    (kept,) = tmp_path.glob(f"{out.name}.old-*")
    assert json.loads(kept.read_text())["provenance"]["config_hash"] == "sixty-steps"
    (plot,) = tmp_path.glob("*.png.old-*")
    assert plot.name == f"{out.stem}.png.old-{kept.name.rsplit('.old-', 1)[1]}"
    assert not out.exists() and notes == [f"{out.name} was written under another config: "
                                          f"kept as {kept.name}"]
    # A second one in the same second does not overwrite the first kept one.
    out.write_text(json.dumps({"provenance": {"config_hash": "two-steps"}}))
    _set_aside_another_configs(out, "three-steps", log)
    assert len(list(tmp_path.glob(f"{out.name}.old-*"))) == 2
