"""Other tools' files, to and from our profiles: what maps, what does not, what is assumed.

Each importer returns an `Imported`: the profile body it could build, the files it read, and two
lists a user reads once (printed by `stage=import`, kept in the profile's `imported` record):
the fields of the files that have no place in our profiles, and the assumptions made to fill
ours where the files are silent.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List


@dataclass
class Imported:
    """What an importer made of a directory of another tool's files."""

    body: Dict[str, Any]  # the profile's own fields (no header: kind, source, provenance)
    files: List[Path] = field(default_factory=list)  # the files read
    unmapped: List[str] = field(default_factory=list)  # one line per field that does not map
    assumptions: List[str] = field(default_factory=list)  # one line per assumption made
