"""Profile files: where they live, how they are written (atomically, with provenance), how they are read.

One JSON writer for the whole project: `write_json`; profiles go through it as dataclasses
(`write_profile`, schema in `orchestrator.store.schema`). Readers go through `read_profile`, which
validates the whole record and, on a missing, corrupt, stale or malformed file, raises
ProfileError naming the file, the first bad field and the command that rebuilds it.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Optional, Type, TypeVar

from orchestrator.errors import ProfileError
from orchestrator.store.schema import SCHEMA_VERSION, FieldError, Profile

P = TypeVar("P", bound=Profile)


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it: put it straight back
    os.umask(mask)
    return mask


# Read once at import (setting it is process-wide, so not from threads later).
FILE_MODE = 0o666 & ~_read_umask()


def cluster_dir(profiles_dir: str | os.PathLike, cluster_name: str) -> Path:
    """The folder that holds every file of one cluster: profiles/<cluster.name>/."""
    return Path(profiles_dir) / cluster_name


def hardware_path(profiles_dir, cluster_name) -> Path:
    return cluster_dir(profiles_dir, cluster_name) / "hardware.json"


def model_profile_path(profiles_dir, cluster_name, model_name) -> Path:
    return cluster_dir(profiles_dir, cluster_name) / "model" / f"{model_name}.json"


def strategy_path(profiles_dir, cluster_name, model_name) -> Path:
    return cluster_dir(profiles_dir, cluster_name) / "strategy" / f"{model_name}.json"


# Every file search writes for a model: the strategy, and beside it the layout train reads, the
# exports and the plot (each `<strategy>.with_suffix(...)`).
STRATEGY_SUFFIXES = (".json", ".layout.json", ".megatron.args", ".galvatron.json", ".png")


def kept_strategy_path(strategy: Path, world_size: int) -> Path:
    """Where search keeps the strategy at `strategy` (searched for `world_size` ranks) when a
    search for another number of ranks replaces it: `strategy/<model>@<N>-ranks.json`, its
    layout file `<model>@<N>-ranks.layout.json` beside it."""
    return strategy.with_name(f"{strategy.stem}@{world_size}-ranks{strategy.suffix}")


def calibration_path(profiles_dir, cluster_name, model_name) -> Path:
    return cluster_dir(profiles_dir, cluster_name) / "calibration" / f"{model_name}.json"


def atomic_write(path: str | os.PathLike, write: Callable[[IO], None], binary: bool = False) -> Path:
    """Write a file atomically: `write(f)` fills a temp file in the same folder, then fsync and
    rename. A reader never sees a half-written file; a crash leaves the previous version intact.
    The file gets the user's umask (mkstemp makes it 0600: unreadable by teammates).
    An OSError of the writing itself (a full disk: `[Errno 28]` with no file name) is raised
    naming `path`, with the temp file removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and e.errno is not None and not e.filename:
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    return path


# Errors that mean "the disk (or the user's quota) is full".
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def keep_reserve(path: str | os.PathLike, nbytes: int) -> None:
    """Best effort: a file of `nbytes` allocated at `path` (kept if already that big), which a
    write that must not fail on a full disk can delete to make room (`write_json(reserve=)`).
    Nothing is kept when there is no room for it (or the folder is read-only)."""
    path = Path(path)
    try:
        if path.stat().st_size >= nbytes:
            return
    except OSError:
        pass
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
    except OSError:
        try:  # a partly allocated reserve would only take room without being sure to give it
            path.unlink()
        except OSError:
            pass


def write_json(path: str | os.PathLike, obj: Any,
               reserve: Optional[str | os.PathLike] = None) -> Path:
    """Write obj as JSON atomically (the project's one JSON writer). With `reserve` (a file
    `keep_reserve` made): when the disk is full, that file is deleted and the write tried once
    more, so a record of a failure gets written even then."""
    try:
        return _write_json(path, obj)
    except OSError as e:
        if reserve is None or e.errno not in DISK_FULL:
            raise
        try:
            os.unlink(reserve)
        except FileNotFoundError:
            raise e from None
        return _write_json(path, obj)


def json_text(obj: Any) -> str:
    """`obj` as the text `write_json` writes."""
    return json.dumps(obj, indent=1, default=_json_default) + "\n"


def _write_json(path: str | os.PathLike, obj: Any) -> Path:
    text = json_text(obj)  # serialised first: a value that is not JSON leaves the file as it was
    return atomic_write(path, lambda f: f.write(text))


PNG_DPI = 110  # every plot's resolution


def save_figure(fig, path: str | os.PathLike, dpi: int = PNG_DPI) -> Path:
    """A matplotlib figure as PNG, atomically."""
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi), binary=True)


def _json_default(obj):
    # numpy scalars and arrays, Paths: the only non-JSON types the stages produce.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def config_hash(section: Any) -> str:
    """A short stable hash of a config section (plain containers), used to tell stale results."""
    blob = json.dumps(section, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def file_sha256(path: str | os.PathLike) -> str:
    """A short digest of a file's bytes (which version of a profile a result was built from)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def library_versions() -> dict:
    """Versions that change what a measurement means: python, torch, NCCL, MPI.

    A process that has not imported torch or initialised MPI (the CLI running search or an
    analytic profile) reads the installed versions instead: importing torch to read its version
    costs 1.6 s, and MPI reports its library only once initialised."""
    versions = {"python": platform.python_version()}
    if "torch" in sys.modules:
        import torch

        versions["torch"] = torch.__version__
        if torch.cuda.is_available():
            versions["cuda"] = torch.version.cuda
            versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        versions.update(_installed("torch"))
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI
        import mpi4py

        versions["mpi4py"] = mpi4py.__version__
        # Open MPI ends its version string with a NUL
        versions["mpi"] = MPI.Get_library_version().replace("\0", "").strip().splitlines()[0]
    else:
        versions.update(_installed("mpi4py"))
    return versions


def _installed(package: str) -> dict:
    """{package: its installed version}, or {} when it is not installed."""
    from importlib import metadata

    try:
        return {package: metadata.version(package)}
    except metadata.PackageNotFoundError:
        return {}


def provenance(config: Mapping, config_hash_: str, *, job_id: Optional[str], hosts: list,
               started: float, ended: Optional[float] = None,
               config_sources: Optional[Mapping[str, str]] = None) -> dict:
    """The provenance block every profile carries. Times are Unix seconds; `config_sources`:
    the file each config group's choice came from (`cluster`, `model`)."""
    return {
        "config": config,
        "config_sources": dict(config_sources or {}),
        "config_hash": config_hash_,
        "job_id": job_id,
        "hosts": sorted(set(hosts)) or [socket.gethostname()],
        "versions": library_versions(),
        "argv": sys.argv,
        "started": started,
        "ended": ended if ended is not None else time.time(),
    }


def new_profile(kind: str, source: str, prov: dict, **fields) -> dict:
    """The common header of every profile file, then the kind's own fields."""
    return {"schema_version": SCHEMA_VERSION, "kind": kind, "source": source,
            "provenance": prov, **fields}


def set_aside(path: str | os.PathLike, stamp: Optional[str] = None, tag: str = "old") -> Path:
    """Rename `path` (a file or folder) to `<name>.<tag>-<stamp>` beside it, so that what a
    new run writes in its place does not destroy it (a name no reader's glob picks up); returns
    the new path. `stamp` defaults to now (YYYYmmdd-HHMMSS); a second one in the same second
    gets a counter."""
    path = Path(path)
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S")
    aside, n = path.with_name(f"{path.name}.{tag}-{stamp}"), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.{tag}-{stamp}-{n}")
    return path.rename(aside)


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as f:
        return json.load(f)


def write_profile(path: str | os.PathLike, profile: Profile) -> Path:
    """Write a profile dataclass as JSON, atomically (the one profile writer)."""
    return write_json(path, profile.to_dict())


def parse_profile(raw: Any, cls: Type[P], where: str, rebuild: Optional[str] = None) -> P:
    """`raw` (a loaded JSON object) as a `cls` record; ProfileError naming `where`, the first
    field that does not fit and the command that rebuilds it."""
    try:
        return cls.from_dict(raw)
    except FieldError as e:
        raise ProfileError(f"{where}: {e}. Rerun: {rebuild or cls.rebuild()} force=true") from None


def read_profile(path: str | os.PathLike, cls: Type[P], rebuild: str,
                 expect_hash: Optional[str] = None, config: Any = None) -> P:
    """Read and validate a profile file as the dataclass `cls` (HardwareProfile, ...).

    `rebuild` is the command that writes it; every error names the file and that command.
    With `expect_hash`, a file written under another config (provenance.config_hash) is stale.
    With `config` (the command's composed Config), a model or hardware profile that is not the
    model or cluster the config asks for (schema/identity.py) is stale, each field named.
    """
    path = Path(path)
    kind = cls.KIND
    if not path.exists():
        raise ProfileError(f"{path}: missing. Run: {rebuild}")
    try:
        raw = read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path}: corrupt JSON ({e}). Rerun: {rebuild} force=true")
    if not isinstance(raw, dict) or raw.get("kind") != kind:
        raise ProfileError(f"{path}: not a {kind} profile. Rerun: {rebuild} force=true")
    left = raw.get("unfinished")
    if left:  # a run of its stage is making it, or was stopped (schema/header.py)
        names = ", ".join(map(str, left[:4])) + (", ..." if len(left) > 4 else "")
        raise ProfileError(f"{path}: unfinished: {len(left)} part(s) still to make ({names}); "
                           f"the run making it is going on or was stopped. Finish it: {rebuild}")
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ProfileError(f"{path}: schema version {version}, this orchestrator reads "
                           f"{SCHEMA_VERSION}: stale. Rerun: {rebuild} force=true")
    profile = parse_profile(raw, cls, str(path), rebuild)
    got_hash = profile.provenance.config_hash if profile.provenance else None
    if expect_hash is not None and got_hash != expect_hash:
        raise ProfileError(f"{path}: written under another config (hash {got_hash}, "
                           f"now {expect_hash}): stale. Rerun: {rebuild}")
    if config is not None:
        check_identity(path, profile, config, rebuild)
    return profile


def check_identity(path: str | os.PathLike, profile: Profile, config: Any, rebuild: str) -> None:
    """ProfileError (exit 4) when `profile` is not the model or cluster `config` asks for
    (schema/identity.py): the file, each differing field in the profile and in the command,
    and `rebuild`."""
    from orchestrator.store.schema.identity import differences, mismatch_message

    found = differences(profile, config)
    if found:
        raise ProfileError(mismatch_message(path, found, rebuild))
