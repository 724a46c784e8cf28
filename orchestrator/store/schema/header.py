"""What every profile file carries: schema version, kind, source and provenance."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional

from orchestrator.choices import Source
from orchestrator.records import FieldError, Record, doc, show

SCHEMA_VERSION = 1


@dataclass(kw_only=True)
class Provenance(Record):
    """How a file was made. Times are Unix seconds."""

    KEEP_NONE: ClassVar[bool] = True

    config: Dict[str, Any] = doc("the composed config the stage ran with", default_factory=dict)
    config_sources: Dict[str, str] = doc("the file each config group's choice came from "
                                         "(cluster, model): a site file's path, or "
                                         "package:<group>/<name>.yaml", default_factory=dict)
    config_hash: Optional[str] = doc("hash of the config sections that change the result; a "
                                     "reader expecting another hash calls the file stale",
                                     default=None)
    job_id: Optional[str] = doc("Slurm job id, null under the local launcher", default=None)
    hosts: List[str] = doc("hosts the ranks ran on", default_factory=list)
    versions: Dict[str, str] = doc("python, torch, mpi4py, mpi, cuda and nccl versions",
                                   default_factory=dict)
    argv: List[str] = doc("the command line", default_factory=list)
    started: Optional[float] = doc("start time", default=None)
    ended: Optional[float] = doc("end time", default=None)


@dataclass(kw_only=True)
class PartMade(Record):
    """Under which settings one sub-part (a benchmark, a (seq, tp) point) was made: a rerun of
    some sub-parts under other settings keeps the others, each saying what it was made under."""

    config_hash: str = doc("the stage's config hash when this part was made; the pipeline "
                           "redoes a part whose hash is not the current one")
    settings: Dict[str, Any] = doc("the stage's own config section it was made under",
                                   default_factory=dict)
    selection: List[str] = doc("the sub-parts the command that made it named, [] for all",
                               default_factory=list)
    job_id: Optional[str] = doc("Slurm job id, null under the local launcher", default=None)
    ended: Optional[float] = doc("when it was written, Unix seconds", default=None)


@dataclass(kw_only=True)
class ImportRecord(Record):
    """What `stage=import` read to make this profile, and what did not carry over."""

    format: str = doc('the files\' format, e.g. "galvatron"')
    path: str = doc("the directory imported")
    files: List[str] = doc("the files read, relative to path", default_factory=list)
    unmapped: List[str] = doc("fields of those files with no place here, one line each",
                              default_factory=list)
    assumptions: List[str] = doc("what was assumed where the files are silent, one line each",
                                 default_factory=list)


@dataclass(kw_only=True)
class Profile(Record):
    """The common header; each kind adds its own fields."""

    KIND: ClassVar[str] = ""
    PRODUCER: ClassVar[str] = ""  # the stage that writes it, for error messages

    schema_version: int = doc("bumped when a reader of the old layout would misread the new",
                              default=SCHEMA_VERSION)
    kind: str = doc('"hardware" | "model" | "strategy"; each kind reads as its own when absent')
    source: Optional[Source] = doc("measured here, or computed from published figures "
                                   "(analytic); absent only in hand-built profiles", default=None)
    provenance: Optional[Provenance] = doc("how the file was made", default=None)
    imported: Optional[ImportRecord] = doc("source galvatron (stage=import): the files read, "
                                           "what does not map, what was assumed", default=None)
    unfinished: Optional[List[str]] = doc(
        "the sub-parts the run writing this file has no data of yet, while it runs or after it "
        "was stopped (absent once it made them all): a reader refuses the file until a rerun of "
        "its stage finishes it", default=None)

    def check(self, path: str) -> None:
        if self.kind != self.KIND:
            raise FieldError("kind", f"expected {show(self.KIND)}, got {show(self.kind)}")

    @classmethod
    def rebuild(cls) -> str:
        """The command that writes this kind of file (with the user's overrides that matter)."""
        from orchestrator.commands import rerun_command

        return rerun_command(cls.PRODUCER)
