"""Distributed checkpoints: save a training state on every rank, reload it in any layout.

A checkpoint is a folder `step_<step:08d>/` written by `torch.distributed.checkpoint` (DCP), which
stores tensors and DTensors by global shape, so a state saved by dp4 reloads into pp2*tp2. The
folder appears atomically: DCP writes into `.tmp_step_<step>/`, rank 0 then adds `complete.json`
(step, the caller's `extra`, world size, every file with its size) and renames it into place. A
crash mid-save leaves only a `.tmp_` folder: never read, removed by the next save.

Every function that takes a `state` is collective: all ranks of the default process group call
it, and all of them return the same outcome or raise the same error. The file checks
(`find_checkpoints`, `checkpoint_to_load`) are local and torch-free, and `saved_shapes` reads
the DCP .metadata alone (no tensor data, no process group): torch is imported where it is used,
so the CLI checks `train.load` (its files, and that it fits the model: `shape_mismatch`, the
ranks' own rule) before launch without loading it.
"""
from __future__ import annotations

import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from orchestrator.errors import OrchestratorError
from orchestrator.store import read_json, write_json

COMPLETE = "complete.json"
_STEP_DIR = re.compile(r"step_(\d{8})")
_TMP_PREFIX = ".tmp_step_"


class CheckpointError(OrchestratorError):
    """A checkpoint cannot be written or read; the message names its folder and what is wrong."""

    exit_code = 4


class CheckpointMismatchError(CheckpointError):
    """A sound checkpoint that does not fit the state (keys missing, other shapes): another model,
    not a damaged file, so no earlier checkpoint of the same folder would fit either."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped in favour of an earlier one."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint: its step, folder and the `extra` saved with it."""

    step: int
    path: Path
    extra: dict


def step_folder(folder: str | os.PathLike, step: int) -> Path:
    """The folder a checkpoint of `step` lives in once complete."""
    return Path(folder) / f"step_{step:08d}"


# ---- save -------------------------------------------------------------------------------------

def save_checkpoint(folder: str | os.PathLike, step: int, state: dict, extra: dict,
                    keep: int = 2) -> Path:
    """Save `state` ({"model": ..., "optim": ..., "meta": ...}, tensors or DTensors; each rank its
    own keys) as `folder/step_<step>/` with `extra` (JSON-able) in its complete.json. Then keep the
    `keep` newest complete checkpoints up to `step` and delete every other step folder, including
    later ones: this run resumed from before them (they were damaged, or it started afresh), and
    a later resume must not jump back onto them.
    Returns the checkpoint's folder. Collective."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if keep < 1:
        raise ValueError(f"keep={keep}: a save must keep at least the checkpoint it writes")
    folder = Path(folder)
    final = step_folder(folder, step)
    tmp = folder / f"{_TMP_PREFIX}{step:08d}"
    error = None
    if dist.get_rank() == 0:
        error = _on_rank0(lambda: _prepare(folder, tmp), f"cannot write under {folder}")
    _raise_if(_from_rank0(error))
    _dcp_call(dcp.save, state, tmp, "save")
    dist.barrier()  # every rank's files are on disk before rank 0 declares the folder complete
    if dist.get_rank() == 0:
        error = _on_rank0(lambda: _publish(tmp, final, step, extra), f"cannot complete {final}")
        error = error or _on_rank0(lambda: _prune(folder, step, keep), f"cannot prune {folder}")
    _raise_if(_from_rank0(error))
    return final


def _prepare(folder: Path, tmp: Path) -> None:
    """Remove what crashed saves left, then make the temp folder DCP writes into."""
    for partial in folder.glob(f"{_TMP_PREFIX}*"):
        shutil.rmtree(partial)
    tmp.mkdir(parents=True)


def _publish(tmp: Path, final: Path, step: int, extra: dict) -> None:
    """Write complete.json into `tmp`, then rename `tmp` to `final` (replacing an older save of
    the same step: moved aside first, since a folder cannot be renamed over a full one)."""
    import torch.distributed as dist

    file_bytes = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    write_json(tmp / COMPLETE, {"step": step, "extra": extra, "saved_unix_s": time.time(),
                                "world_size": dist.get_world_size(), "file_bytes": file_bytes})
    if final.exists():
        aside = tmp.with_name(f"{tmp.name}.replaced")
        os.replace(final, aside)
        os.replace(tmp, final)
        shutil.rmtree(aside)
    else:
        os.replace(tmp, final)


def _prune(folder: Path, step: int, keep: int) -> None:
    """Delete step folders after `step` and all but the `keep` newest complete ones up to it."""
    kept = 0
    for found_step, path in _step_folders(folder):
        if found_step <= step and (path / COMPLETE).exists() and kept < keep:
            kept += 1
        else:
            shutil.rmtree(path)


# ---- find -------------------------------------------------------------------------------------

def _step_folders(folder: Path) -> List[Tuple[int, Path]]:
    """(step, path) of every `step_<8 digits>` folder, newest first."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir()
             if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


def _check_folder(step: int, path: Path) -> Tuple[Optional[CheckpointInfo], Optional[str]]:
    """The checkpoint in `path`, or None and what is wrong with it (files only, no DCP read)."""
    try:
        complete = read_json(path / COMPLETE)
    except FileNotFoundError:
        return None, f"{COMPLETE} missing (the save did not finish)"
    except (OSError, ValueError) as e:
        return None, f"{COMPLETE} unreadable ({e})"
    if not isinstance(complete, dict) or complete.get("step") != step or \
            not isinstance(complete.get("file_bytes"), dict):
        return None, f"{COMPLETE} is not a checkpoint record of step {step}"
    if ".metadata" not in complete["file_bytes"] or not (path / ".metadata").is_file():
        return None, "DCP .metadata missing"
    for name, expect_bytes in complete["file_bytes"].items():
        if not (path / name).is_file():
            return None, f"{name} missing"
        got_bytes = (path / name).stat().st_size
        if got_bytes != expect_bytes:
            return None, f"{name} is {got_bytes} bytes, {COMPLETE} says {expect_bytes}"
    return CheckpointInfo(step, path, complete.get("extra") or {}), None


def find_checkpoints(folder: str | os.PathLike) -> Tuple[List[CheckpointInfo], List[str]]:
    """The checkpoints of `folder` whose files are all there, newest first, and one line per step
    folder that is damaged (naming it and what is wrong). Temp folders are ignored. Local: no
    collective."""
    good, problems = [], []
    for step, path in _step_folders(Path(folder)):
        info, problem = _check_folder(step, path)
        if info is not None:
            good.append(info)
        else:
            problems.append(f"checkpoint {path} skipped: {problem}")
    return good, problems


def latest_checkpoint(folder: str | os.PathLike) -> Optional[CheckpointInfo]:
    """The newest checkpoint of `folder` whose files are all there, or None. Each damaged one is
    reported as a CheckpointWarning (`find_checkpoints` returns them as lines instead)."""
    good, problems = find_checkpoints(folder)
    for problem in problems:
        warnings.warn(problem, CheckpointWarning, stacklevel=2)
    return good[0] if good else None


# ---- load -------------------------------------------------------------------------------------

# What `train.load` must name, for the messages that refuse another folder.
CHECKPOINT_FOLDER = (f"a checkpoint is a folder step_<8 digits>/ holding {COMPLETE} and DCP's "
                     f".metadata with its data files (what train writes under "
                     f"profiles/<cluster>/train/<model>/<layout>.ckpt/); give one such folder, or "
                     f"the folder of them (its newest complete one is loaded)")


def checkpoint_to_load(path: str | os.PathLike) -> Tuple[CheckpointInfo, List[str]]:
    """The checkpoint `path` names: a step folder (`.../step_00000004`), or the newest complete
    one of a folder of step folders; with one line per damaged step folder skipped. Raises
    CheckpointError saying what is missing or damaged there and what a checkpoint folder
    holds. Local (files only, no collective)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"does not exist; {CHECKPOINT_FOLDER}")
    if not path.is_dir():
        raise CheckpointError(f"not a folder; {CHECKPOINT_FOLDER}")
    step = _STEP_DIR.fullmatch(path.name)
    if step:  # one step folder
        info, problem = _check_folder(int(step.group(1)), path)
        if info is None:
            raise CheckpointError(f"{problem}; {CHECKPOINT_FOLDER}")
        return info, []
    good, problems = find_checkpoints(path)
    if good:
        return good[0], problems
    if problems:
        raise CheckpointError(f"no complete checkpoint in it ({'; '.join(problems)}); "
                              f"{CHECKPOINT_FOLDER}")
    raise CheckpointError(f"no checkpoint in it; {CHECKPOINT_FOLDER}")



def load_checkpoint(info: CheckpointInfo, state: dict) -> dict:
    """Load checkpoint `info` in place into `state` (tensors and DTensors already allocated in the
    target layout; keys of the checkpoint that `state` lacks are left out). Returns its `extra`.
    Raises CheckpointMismatchError when `state` has keys or shapes the checkpoint lacks, and
    CheckpointError when its files do not read. Collective."""
    import torch.distributed.checkpoint as dcp

    saved, error = None, None
    try:
        saved = saved_shapes(info.path)
    except CheckpointError as e:
        error = str(e)
    _raise_if(_agreed(error))
    mismatch = shape_mismatch(saved, _state_shapes(state))
    mismatch = _agreed(f"checkpoint {info.path} does not fit this model: {mismatch}"
                       if mismatch else None)
    if mismatch:
        raise CheckpointMismatchError(mismatch)
    _dcp_call(dcp.load, state, info.path, "load")
    return info.extra


def load_latest(folder: str | os.PathLike,
                state) -> Tuple[Optional[CheckpointInfo], List[str]]:
    """Load the newest checkpoint of `folder` that reads, into `state` in place (a dict, or a
    function that makes it: called only when there is a checkpoint to load). Returns it (None
    when the folder holds no checkpoint) and one line per damaged checkpoint skipped, for the
    caller to print. Rank 0 decides which folders to try, so every rank loads the same one.
    Raises CheckpointError when there are checkpoints but none reads, CheckpointMismatchError when
    the newest does not fit `state`. Collective."""
    import torch.distributed as dist

    scanned = [find_checkpoints(folder) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(scanned, src=0)
    candidates, problems = scanned[0]
    for info in candidates:
        try:
            load_checkpoint(info, state() if callable(state) else state)
            return info, problems
        except CheckpointMismatchError:
            raise
        except CheckpointError as e:
            problems.append(f"{e}; skipped")
    if problems:
        raise CheckpointError(f"no checkpoint in {folder} reads:\n  " + "\n  ".join(problems)
                              + f"\nMove {folder} away to start from step 0.")
    return None, problems


def _flatten(state: Mapping, prefix: str = "") -> dict:
    """{DCP key: value}: nested mappings joined with dots, as DCP names what it stores."""
    flat = {}
    for key, value in state.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def saved_shapes(path: str | os.PathLike) -> Dict[str, Optional[Tuple[int, ...]]]:
    """{DCP key: global shape} of what the checkpoint in `path` holds (None for a non-tensor
    value), read from its DCP .metadata alone (no tensor data, no process group). Raises
    CheckpointError naming the file when it does not read."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a damaged pickle raises anything; every case means "cannot read"
        raise CheckpointError(f"checkpoint {path}: .metadata unreadable "
                              f"({type(e).__name__}: {e})") from None
    return {key: tuple(saved.size) if isinstance(saved, TensorStorageMetadata) else None
            for key, saved in metadata.state_dict_metadata.items()}


def _state_shapes(state: Mapping) -> Dict[str, Optional[Tuple[int, ...]]]:
    """{DCP key: global shape} of a state dict (a DTensor's shape is the global one; None for a
    non-tensor value)."""
    import torch

    return {key: tuple(value.shape) if isinstance(value, torch.Tensor) else None
            for key, value in _flatten(state).items()}


def shape_mismatch(saved: Mapping[str, Optional[Tuple[int, ...]]],
                   wanted: Mapping[str, Optional[Tuple[int, ...]]]) -> Optional[str]:
    """What of `wanted` ({DCP key: global shape, None: no shape to compare}) a checkpoint
    holding `saved` cannot fill: a few missing keys and the shapes that differ; None when
    everything fits. Keys the checkpoint has beyond `wanted` are fine (left out), and so is any
    layout: DCP reshards by global shape. The one rule for the ranks' load and the CLI's check
    before launch."""
    missing, shapes = [], []
    for key, shape in wanted.items():
        # A list of tensors is stored as one key per element ("key.0").
        if key not in saved and not any(k.startswith(f"{key}.") for k in saved):
            missing.append(key)
            continue
        have = saved.get(key)
        if shape is not None and have is not None and tuple(have) != tuple(shape):
            shapes.append(f"{key} {tuple(have)} saved, {tuple(shape)} here")
    lines = []
    if missing:
        lines.append(f"{len(missing)} keys missing ({', '.join(missing[:3])}"
                     f"{', ...' if len(missing) > 3 else ''})")
    if shapes:
        lines.append(f"other shapes: {'; '.join(shapes[:3])}{'; ...' if len(shapes) > 3 else ''}")
    return "; ".join(lines) or None


# ---- collective helpers -----------------------------------------------------------------------

def _dcp_call(call: Callable, state: dict, path: Path, what: str) -> None:
    """dcp.save / dcp.load; their CheckpointException (a BaseException, raised on every rank
    alike) as a CheckpointError naming the folder and each failing rank's error."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        call(state, checkpoint_id=str(path))
    except CheckpointException as e:
        causes = "; ".join(f"rank {rank}: {type(exc).__name__}: {_first_sentence(exc)}"
                           for rank, (exc, _trace) in sorted(e.failures.items()))
        raise CheckpointError(f"checkpoint {path}: DCP {what} failed ({causes})"
                              f"{_free_space(path) if what == 'save' else ''}") from None


def _free_space(path: Path) -> str:
    """'; <n> GiB free on its disk' (torch's writer reports a full disk as an enforce failure
    of its zip container, naming no cause)."""
    import shutil

    for folder in (path, *path.parents):
        if folder.exists():
            return f"; {shutil.disk_usage(folder).free / 2**30:.1f} GiB free on its disk"
    return ""


def _first_sentence(error: BaseException, max_chars: int = 100) -> str:
    """The gist of a torch error (torch.load's go on for paragraphs, with advice that does not
    apply to a damaged file)."""
    text = str(error).strip().split("\n", 1)[0].split(". ", 1)[0]
    return text if len(text) <= max_chars else text[:max_chars] + "..."


def _on_rank0(action: Callable[[], Any], what: str) -> Optional[str]:
    """Run rank 0's file work; its error as a line to share with the other ranks."""
    try:
        action()
    except Exception as e:
        return f"{what}: {type(e).__name__}: {e}"
    return None


def _from_rank0(error: Optional[str]) -> Optional[str]:
    """Rank 0's `error` on every rank."""
    import torch.distributed as dist

    shared = [error]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def _agreed(error: Optional[str]) -> Optional[str]:
    """The first rank's error, if any rank has one, on every rank."""
    import torch.distributed as dist

    errors: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def _raise_if(error: Optional[str]) -> None:
    if error:
        raise CheckpointError(error)
