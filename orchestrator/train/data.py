"""Training batches that depend only on (seed, step, global sample index).

Every layout with the same global batch sees the same samples, and a resumed run continues with
the same data: sample i of step s is computed from a hash of (seed, s, i), never from a stream
that earlier batches advanced. Two sources:
- synthetic (no source): learnable chains x[t+1] = (a*x[t] + b) % vocab with a random start per
  sample and a few random tokens, so a model's loss falls within a few dozen steps;
- text (a file or folder): byte-level tokens (token = byte), windows at hashed offsets.
"""
from __future__ import annotations

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from orchestrator.errors import ConfigError

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
