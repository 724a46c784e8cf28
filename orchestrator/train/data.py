"""Training batches that depend only on (seed, step, global sample index).

Every layout with the same global batch sees the same samples, and a resumed run continues with
the same data: sample i of step s is computed from a hash of (seed, s, i), never from a stream
that earlier batches advanced. Two sources:
- synthetic (no source): learnable chains x[t+1] = (a*x[t] + b) % vocab with a random start per
  sample and a few random tokens, so a model's loss falls within a few dozen steps;
- text (a file or folder): byte-level tokens (token = byte), windows at hashed offsets.
Variable-length samples (dynamic micro-batching) take the same windows cut to a length drawn
from (seed, step, index) alone (`sample_lengths`, `varlen_windows`); `micro_batch_tensors` pads
a planned micro-batch of them, its padding ignored by the loss.
"""
from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from orchestrator.errors import ConfigError
from orchestrator.models.gpt import IGNORE_INDEX
from orchestrator.planner.dynamic import MicroBatch

# Suffixes read from a folder: text a byte-level model can learn from.
TEXT_SUFFIXES = frozenset({".py", ".txt", ".md", ".rst", ".json", ".yaml", ".yml", ".toml",
                           ".cfg", ".ini", ".html", ".csv", ".c", ".h"})
BYTE_VOCAB = 256
DEFAULT_MAX_BYTES = 64 << 20
# Fraction of synthetic tokens replaced by uniform noise (the rest follow the chain).
NOISE_FRACTION = 0.05

_U64 = np.uint64
# (tokens, targets): int64 tensors of shape (samples, seq_len).
Batch = tuple[torch.Tensor, torch.Tensor]


class DataError(ConfigError, ValueError):
    """A data source that cannot be used (exit 2 like every config error; also a ValueError)."""


def _hash64(*keys) -> np.ndarray:
    """splitmix64 over broadcast uint64 keys: a stateless, platform-independent generator."""
    h = np.zeros(1, dtype=_U64)  # an array, not a scalar: numpy wraps array overflow silently
    for key in keys:
        h = h ^ np.asarray(key, dtype=_U64)
        h = h + _U64(0x9E3779B97F4A7C15)
        h = (h ^ (h >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        h = (h ^ (h >> _U64(27))) * _U64(0x94D049BB133111EB)
        h = h ^ (h >> _U64(31))
    return h


def _unit_uniform(h: np.ndarray) -> np.ndarray:
    """Hashes -> floats in [0, 1) (their top 53 bits)."""
    return (h >> _U64(11)).astype(np.float64) * 2.0**-53


@dataclass(frozen=True)
class LengthDistribution:
    """Sample lengths (tokens): lognormal with mean `mean_len` before clipping and shape
    `sigma` (long-tailed, as real corpora), clipped to [min_len, max_len]."""

    mean_len: float
    max_len: int
    min_len: int = 1
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise DataError(f"sample lengths: need 1 <= min_len({self.min_len}) <= "
                            f"max_len({self.max_len})")
        if self.mean_len <= 0 or self.sigma < 0:
            raise DataError(f"sample lengths: mean_len({self.mean_len}) must be > 0 and "
                            f"sigma({self.sigma}) >= 0")

    def describe(self) -> str:
        return (f"lengths lognormal (mean {self.mean_len:g}, sigma {self.sigma:g}) in "
                f"[{self.min_len}, {self.max_len}]")

    def lengths(self, uniform_a: np.ndarray, uniform_b: np.ndarray) -> np.ndarray:
        """Lengths (int64) from two arrays of uniforms in [0, 1) (Box-Muller)."""
        normal = np.sqrt(-2.0 * np.log1p(-uniform_a)) * np.cos(2.0 * np.pi * uniform_b)
        mu = math.log(self.mean_len) - self.sigma**2 / 2  # E[exp(mu + sigma z)] = mean_len
        raw = np.exp(mu + self.sigma * normal)
        return np.clip(np.rint(raw), self.min_len, self.max_len).astype(np.int64)


class TokenData(ABC):
    """Deterministic (tokens, targets) batches; subclasses say how a sample is built."""

    def __init__(self, vocab: int, seq_len: int, seed: int):
        if seq_len < 1:
            raise DataError(f"seq_len={seq_len} must be at least 1")
        self.vocab = vocab
        self.seq_len = seq_len
        self.seed = seed
        self._seed_key = _U64(seed % 2**64)  # any int seed, negative ones included

    @abstractmethod
    def _windows(self, step: int, sample_index: np.ndarray) -> np.ndarray:
        """(len(sample_index), seq_len + 1) int64 token windows."""

    @abstractmethod
    def describe(self) -> str:
        """One line saying where the tokens come from, for the run's log and summary."""

    def batch(self, step: int, first_sample: int, num_samples: int) -> Batch:
        """Samples [first_sample, first_sample + num_samples) of step `step`: (tokens, targets),
        int64 tensors of shape (num_samples, seq_len); targets are the tokens shifted by one."""
        if step < 0 or first_sample < 0 or num_samples < 1:
            raise ValueError(f"batch(step={step}, first_sample={first_sample}, "
                             f"num_samples={num_samples}): all must be >= 0, num_samples >= 1")
        index = np.arange(first_sample, first_sample + num_samples, dtype=np.int64)
        windows = torch.from_numpy(self._windows(step, index))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def rank_batch(self, step: int, dp_rank: int, dp: int,
                   samples_per_rank: int) -> Batch:
        """The dp rank's contiguous slice [dp_rank*samples_per_rank, (dp_rank+1)*samples_per_rank)
        of step `step`'s global batch of dp*samples_per_rank samples."""
        if not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp={dp})")
        return self.batch(step, dp_rank * samples_per_rank, samples_per_rank)

    def sample_lengths(self, step: int, first_sample: int, num_samples: int,
                       distribution: LengthDistribution) -> np.ndarray:
        """Token lengths (int64) of samples [first_sample, first_sample + num_samples) of step
        `step`: each from (seed, step, index) alone, so any slice of a batch agrees."""
        if distribution.max_len > self.seq_len:
            raise DataError(f"sample lengths: max_len({distribution.max_len}) > the data's "
                            f"seq_len({self.seq_len}); lower the cap or raise seq_len")
        index = np.arange(first_sample, first_sample + num_samples, dtype=np.int64)
        # Five keys (tokens use three or four): lengths are independent of the token hashes.
        keys = (self._seed_key, _U64(step), index.astype(_U64), _U64(1 << 63))
        uniform_a = _unit_uniform(_hash64(*keys, _U64(0)))
        uniform_b = _unit_uniform(_hash64(*keys, _U64(1)))
        return distribution.lengths(uniform_a, uniform_b)

    def varlen_windows(self, step: int, sample_index: Sequence[int],
                       lengths: Sequence[int]) -> list[torch.Tensor]:
        """Per sample, its int64 window of length + 1 tokens (tokens = window[:-1], targets =
        window[1:]): the fixed-length sample's window cut to the length."""
        if len(sample_index) != len(lengths):
            raise ValueError(f"{len(sample_index)} samples but {len(lengths)} lengths")
        if any(not 1 <= n <= self.seq_len for n in lengths):
            raise DataError(f"sample lengths {list(lengths)} must be in [1, seq_len="
                            f"{self.seq_len}]")
        windows = torch.from_numpy(self._windows(step, np.asarray(sample_index, np.int64)))
        return [windows[i, :n + 1] for i, n in enumerate(lengths)]


class SyntheticData(TokenData):
    """Chains x[t+1] = (a*x[t] + b) % vocab, a and b fixed by the seed, a hashed start per sample,
    NOISE_FRACTION of positions replaced by hashed random tokens."""

    def __init__(self, vocab: int, seq_len: int, seed: int):
        super().__init__(vocab, seq_len, seed)
        if vocab < 2:
            raise DataError(f"vocab={vocab}: synthetic data needs at least 2 tokens")
        a0, b0 = (int(v) for v in _hash64(self._seed_key, np.array([1, 2], dtype=_U64)))
        # a coprime to vocab makes the step a permutation: every token has one successor.
        self.a = 2 + a0 % max(vocab - 2, 1)
        while math.gcd(self.a, vocab) != 1:
            self.a = self.a % (vocab - 1) + 1
        self.b = 1 + b0 % (vocab - 1)
        # x[t] = mult[t]*x[0] + add[t] (mod vocab), so a whole window is one vectorised expression.
        mult, add = [1], [0]
        for _ in range(seq_len):
            mult.append(mult[-1] * self.a % vocab)
            add.append((add[-1] * self.a + self.b) % vocab)
        self._mult = np.array(mult, dtype=np.int64)
        self._add = np.array(add, dtype=np.int64)

    def next_token(self, token):
        """The chain's successor of a token id or a tensor of them (what a model learns)."""
        return (self.a * token + self.b) % self.vocab

    def _windows(self, step: int, sample_index: np.ndarray) -> np.ndarray:
        seed, step_u = self._seed_key, _U64(step)
        samples = sample_index.astype(_U64)[:, None]
        start = (_hash64(seed, step_u, samples, _U64(0)) % _U64(self.vocab)).astype(np.int64)
        windows = (self._mult[None, :] * start + self._add[None, :]) % self.vocab
        positions = np.arange(self.seq_len + 1, dtype=_U64)[None, :]
        noise = _hash64(seed, step_u, samples, positions + _U64(1))
        # The low 24 bits pick whether a position is noise, the high bits which token it gets.
        is_noise = (noise & _U64(0xFFFFFF)).astype(np.float64) < NOISE_FRACTION * (1 << 24)
        noise_token = ((noise >> _U64(32)) % _U64(self.vocab)).astype(np.int64)
        return np.where(is_noise, noise_token, windows)

    def describe(self) -> str:
        return f"synthetic (seed {self.seed})"


class TextData(TokenData):
    """Byte-level windows of seq_len + 1 bytes of a text corpus, at offsets hashed from
    (seed, step, sample index). The corpus is read once, at construction."""

    def __init__(self, source: str | os.PathLike, vocab: int, seq_len: int, seed: int,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        super().__init__(vocab, seq_len, seed)
        if vocab < BYTE_VOCAB:
            raise DataError(f"text data is byte-level (256 tokens) but the model's vocab is "
                            f"{vocab}: use a model with vocab >= {BYTE_VOCAB}, or synthetic data")
        self.source = Path(source)
        self.corpus, self.num_files = read_corpus(self.source, max_bytes)
        if len(self.corpus) < seq_len + 1:
            raise DataError(f"text data {self.source}: {len(self.corpus)} bytes, shorter than "
                            f"one sample of seq_len+1={seq_len + 1} bytes")

    def _windows(self, step: int, sample_index: np.ndarray) -> np.ndarray:
        num_offsets = _U64(len(self.corpus) - self.seq_len)
        offsets = _hash64(self._seed_key, _U64(step), sample_index.astype(_U64))
        offsets = (offsets % num_offsets).astype(np.int64)
        return self.corpus[offsets[:, None] + np.arange(self.seq_len + 1)].astype(np.int64)

    def describe(self) -> str:
        files = "1 file" if self.num_files == 1 else f"{self.num_files} files"
        return f"text: {self.source} ({len(self.corpus) / 2**20:.1f} MiB, {files})"


def micro_batch_tensors(windows: Sequence[torch.Tensor], micro_batch: MicroBatch,
                        pad_token: int = 0) -> Batch:
    """(tokens, targets) int64 of shape (micro_batch.size, padded_len) for a planned micro-batch
    of this rank's variable-length `windows` (indexed by micro_batch.samples): each sample is
    left-aligned, padding tokens are `pad_token` and padding targets IGNORE_INDEX (no loss)."""
    shape = (micro_batch.size, micro_batch.padded_len)
    tokens = torch.full(shape, pad_token, dtype=torch.int64)
    targets = torch.full(shape, IGNORE_INDEX, dtype=torch.int64)
    for row, sample in enumerate(micro_batch.samples):
        window = windows[sample]
        length = len(window) - 1
        if length > micro_batch.padded_len:
            raise ValueError(f"sample {sample} has {length} tokens, more than the micro-batch's "
                             f"padded_len({micro_batch.padded_len})")
        tokens[row, :length] = window[:-1]
        targets[row, :length] = window[1:]
    return tokens, targets


def packed_tensors(windows: Mapping[int, torch.Tensor], rows: Sequence[Sequence[int]],
                   row_len: int, pad_token: int = 0) -> Batch:
    """(tokens, targets) int64 of shape (len(rows), row_len) for a packed micro-batch: each row
    holds its samples' windows back to back (each sample's targets are its own next tokens, so
    no target crosses into the next sample), the rest is padding (targets IGNORE_INDEX)."""
    tokens = torch.full((len(rows), row_len), pad_token, dtype=torch.int64)
    targets = torch.full((len(rows), row_len), IGNORE_INDEX, dtype=torch.int64)
    for r, row in enumerate(rows):
        at = 0
        for sample in row:
            window = windows[sample]
            length = len(window) - 1
            if at + length > row_len:
                raise ValueError(f"row {r}: samples {list(row)} hold more than row_len"
                                 f"({row_len}) tokens")
            tokens[r, at:at + length] = window[:-1]
            targets[r, at:at + length] = window[1:]
            at += length
    return tokens, targets


def packed_segments(row_lengths: Sequence[Sequence[int]], row_len: int) -> torch.Tensor:
    """int64 (len(row_lengths), row_len): each token's sample within its packed row (0, 1, ..
    in row order; the row's padding after them one more segment), for packed rows of samples of
    these lengths (tokens) back to back, as packed_tensors lays them out. The model attends
    within each segment only and restarts positions per segment (models/gpt.packed_rows)."""
    segments = torch.empty((len(row_lengths), row_len), dtype=torch.int64)
    for r, lengths in enumerate(row_lengths):
        if sum(lengths) > row_len:
            raise ValueError(f"row {r}: samples of {list(lengths)} tokens hold more than "
                             f"row_len({row_len})")
        ids = torch.arange(len(lengths) + 1)
        counts = torch.tensor([*lengths, row_len - sum(lengths)])
        segments[r] = torch.repeat_interleave(ids, counts)
    return segments


def _text_files(folder: str) -> Iterator[str]:
    """Files with a TEXT_SUFFIXES suffix under `folder`, depth first in sorted name order,
    skipping hidden folders, __pycache__ and symlinked folders (no cycles)."""
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(".") or entry.name == "__pycache__":
            continue
        if entry.is_dir(follow_symlinks=False):
            yield from _text_files(entry.path)
        elif entry.is_file() and os.path.splitext(entry.name)[1] in TEXT_SUFFIXES:
            yield entry.path


def read_corpus(source: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[np.ndarray, int]:
    """(the bytes of a file, or of a folder's text files concatenated in sorted path order,
    capped at max_bytes, as a uint8 array; the number of files read)."""
    if not source.exists():
        raise DataError(f"text data {source}: no such file or folder")
    is_file = source.is_file()
    files = [str(source)] if is_file else _text_files(str(source))
    parts: list[bytes] = []
    num_bytes = 0
    for path in files:
        if num_bytes >= max_bytes:
            break
        try:
            with open(path, "rb") as f:
                part = f.read(max_bytes - num_bytes)
        except OSError as error:
            if is_file:
                raise DataError(f"text data {source}: {error.strerror or error}") from error
            continue  # an unreadable file in a folder is skipped, as a folder of text allows
        parts.append(part)
        num_bytes += len(part)
    if not parts:
        suffixes = " ".join(sorted(TEXT_SUFFIXES))
        raise DataError(f"text data {source}: no readable text files (suffixes {suffixes})")
    return np.frombuffer(b"".join(parts), dtype=np.uint8), len(parts)


def make_data(source: str | None, vocab: int, seq_len: int, seed: int,
              max_bytes: int = DEFAULT_MAX_BYTES) -> TokenData:
    """Synthetic chains when `source` is None (or empty), else byte-level text from a file or
    folder (at most max_bytes of it). Raises DataError (a ConfigError and a ValueError) naming
    the path or the numbers when the source cannot be used."""
    if not source:
        return SyntheticData(vocab, seq_len, seed)
    return TextData(source, vocab, seq_len, seed, max_bytes)
