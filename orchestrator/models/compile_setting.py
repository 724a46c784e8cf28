"""train.compile's setting: whether train (and profile_model, which times the block as train
runs it) compiles its blocks. torch-free (models/compile.py compiles), so the login node's checks
before a launch do not import torch."""
from __future__ import annotations

from orchestrator.errors import ConfigError

COMPILE_SETTINGS = ("auto", "true", "false")


def compile_wanted(setting, device_type: str) -> bool:
    """Whether blocks are compiled for `train.compile` = `setting` ("auto", "true", "false";
    a bool; case-insensitive, as a command line's true becomes "True") on ranks of
    `device_type`: auto compiles on CUDA (it pays there) and not on a CPU (where compiling costs
    tens of seconds per rank for little gain). ValueError for another setting."""
    text = str(setting).strip().lower()
    if text not in COMPILE_SETTINGS:
        raise ValueError(f"train.compile({setting!r}) must be one of "
                         f"{', '.join(COMPILE_SETTINGS)}")
    if text == "auto":
        return device_type == "cuda"
    return text == "true"


def train_compile(cfg, device_type: str) -> bool:
    """Whether train compiles its blocks on ranks of `device_type` (train.compile; auto: on
    CUDA only, compile_wanted); ConfigError (exit 2) for a setting other than auto, true,
    false. profile_model reads it too: it times the block as train runs it."""
    try:
        return compile_wanted(cfg.train.compile, device_type)
    except ValueError as e:
        raise ConfigError(str(e)) from None
