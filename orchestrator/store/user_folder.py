"""Files written into a folder the user chose (`export.path`, the site folder `stage=init` writes
its cluster file into): a file there that this tool did not write, or one changed since it wrote
it, is kept as `<name>.orig-<time>` before it is replaced, and the command says so.

The folder's `.orchestrator-written.json` records what was written (name -> digest of the bytes).
A file the record does not name, or whose bytes no longer match it, is someone else's (a
hand-edit, another tool's output): it is renamed aside, never lost. A file identical to what is
written now needs no copy. The copy's name does not end in the original's extension, so a tool
that globs `*.json` or `*.yaml` does not read it as one of its own.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from orchestrator.store import atomic_write, file_sha256, json_text, read_json, write_json

MANIFEST = ".orchestrator-written.json"


@dataclass(frozen=True)
class KeptCopy:
    """A file that was in the way of a write, and where it went."""

    path: Path  # the file written now
    copy: Path  # what was there before
    why: str  # "not written by the orchestrator" or "changed since the orchestrator wrote it"

    def describe(self) -> str:
        """The line a command prints about it."""
        return f"kept {self.path.name} ({self.why}) as {self.copy.name}"


class UserFolder:
    """Writes into `folder`, keeping what is not ours (see the module). Use as a context manager:
    the record is saved on exit, also after a failed write (what was written stays known)."""

    def __init__(self, folder: os.PathLike | str):
        self.folder = Path(folder)
        self.kept: List[KeptCopy] = []
        self._written = self._read_record()

    def _read_record(self) -> Dict[str, str]:
        try:
            files = read_json(self.folder / MANIFEST).get("files")
        except (OSError, ValueError, AttributeError):
            return {}  # none, or unreadable: every file there counts as not ours (kept)
        return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}

    def write_text(self, name: str, text: str) -> Path:
        """Write `text` as the file `name` (atomically), after keeping the file there when it
        is not ours (or not ours any more) and differs from `text`. Returns its path."""
        path = self.folder / name
        copy = self._keep(path, text.encode())
        if copy is not None:
            self.kept.append(copy)
        atomic_write(path, lambda f: f.write(text))
        self._written[name] = file_sha256(path)
        return path

    def write_json(self, name: str, obj) -> Path:
        """`obj` as JSON, as store.write_json writes it, through `write_text`."""
        return self.write_text(name, json_text(obj))

    def _keep(self, path: Path, new_bytes: bytes) -> Optional[KeptCopy]:
        """Move the file at `path` aside unless it is ours as we wrote it or holds `new_bytes`
        already; what was moved where (None: nothing)."""
        if not path.is_file():
            return None
        recorded = self._written.get(path.name)
        if file_sha256(path) == recorded or path.read_bytes() == new_bytes:
            return None  # nothing of anyone else's would be lost
        why = ("not written by the orchestrator" if recorded is None
               else "changed since the orchestrator wrote it")
        copy = _free_name(path.with_name(f"{path.name}.orig-{time.strftime('%Y%m%d-%H%M%S')}"))
        os.replace(path, copy)  # a rename: atomic, and the bytes stay as they were
        return KeptCopy(path, copy, why)

    def save(self) -> None:
        """Write the record of what this tool wrote here (atomically)."""
        if self._written:
            write_json(self.folder / MANIFEST, {"files": dict(sorted(self._written.items()))})

    def __enter__(self) -> "UserFolder":
        return self

    def __exit__(self, *exc) -> None:
        self.save()


def _free_name(path: Path) -> Path:
    """`path`, or `path-1`, `path-2`, ... when taken (two copies within one second)."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate
