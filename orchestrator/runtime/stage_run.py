"""StageRun: a stage's handle on its own bookkeeping, on every rank.

It gives the sub-parts to run, marks each one in the ledger as it starts and ends (rank 0 only),
and loads what an earlier, interrupted run of the same config already wrote, so that a rerun
resumes instead of starting over.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import traceback
from pathlib import Path
from typing import Optional

from orchestrator.config import Config
from orchestrator.runtime.context import RankContext
from orchestrator.runtime.request import StageRequest
from orchestrator.stages import StagePlan
from orchestrator.console import stage_console
from orchestrator.store import new_profile, provenance, read_json, set_aside, write_json
from orchestrator.store.ledger import Ledger, State

log = logging.getLogger("orchestrator.stage_run")


class StageRun:
    def __init__(self, request: StageRequest, ctx: RankContext):
        self.request = request
        self.ctx = ctx
        self.cfg: Config = request.config
        self.plan: StagePlan = request.plan
        self.todo = list(request.todo)
        self.started = time.time()
        self.ledger = Ledger(request.ledger_dir) if ctx.is_root else None
        self._aside: Optional[Path] = None  # a file of another source, kept aside on first write
        if self.ledger is not None:  # a queued job starts: its `took` counts from here, even
            # when it ends between two of the CLI's polls (or with no CLI polling: wait=false)
            self.ledger.transition(self.key, State.running, from_states=(State.pending,))

    @property
    def key(self) -> str:
        return self.request.ledger_key

    def subpart_key(self, name: str) -> str:
        return f"{self.key}/{name}"

    @contextlib.contextmanager
    def subpart(self, name: str):
        """Run one sub-part: ledger running -> done, or failed with the error, on rank 0.

        Write the sub-part's results inside the block: it is marked done only after them.
        """
        if self.ledger is not None:
            self.ledger.start_subpart(self.subpart_key(name), self.request.config_hash,
                                      self.request.run_dir, self.ctx.job_id)
        try:
            yield
        except SystemExit:  # submitit requeues the job (time limit, preemption): runs it again
            if self.ledger is not None:
                self.ledger.transition(self.subpart_key(name), State.pending,
                                       error="interrupted; the job was requeued")
            raise
        except BaseException as e:
            if self.ledger is not None:
                try:
                    self.ledger.transition(self.subpart_key(name), State.failed,
                                           error=f"{type(e).__name__}: {e}",
                                           traceback=traceback.format_exc(limit=5))
                except OSError:  # a full disk: the error that ended the part is the one to
                    pass  # report; the CLI marks the part failed when the launch ends
            raise
        if self.ledger is not None:
            self.ledger.transition(self.subpart_key(name), State.done)

    def provenance(self) -> dict:
        return provenance(dataclasses.asdict(self.cfg), self.request.config_hash,
                          job_id=self.ctx.job_id, hosts=self.ctx.hostnames, started=self.started,
                          config_sources=self.request.config_sources)

    def resume_profile(self, path: Path, kind: str, source: str, identity: str, **fields) -> dict:
        """The profile at `path` if it holds the same kind, source and `fields[identity]` (the
        cluster or the model profiled), else a new one of `fields`. A resumed one takes this
        run's settings among `fields` (a number or string: `micro_batch_size`).

        Parts made under other settings stay, each marked in `parts` with what it was made
        under, until they are redone. A file of another source or shape (or a corrupt one)
        stays until this run has made its first part, then is kept aside (mark_part), not
        written over. `unfinished` lists the parts this run makes that the file has no data of
        (and those a stopped run left, where still planned); mark_part takes each off, so a
        file a stopped run leaves says it is not whole, and readers refuse it."""
        old = self._same_profile(path, kind, source, identity, fields[identity])
        if old is None:
            self._aside = path if path.exists() else None  # moved when this run writes there
            profile = new_profile(kind, source, self.provenance(), **fields)
        else:
            old["provenance"] = self.provenance()
            # this run's settings (e.g. micro_batch_size); what parts add to stays as it is
            old.update({k: v for k, v in fields.items()
                        if v is not None and not isinstance(v, (list, dict))})
            profile = old
        written = profile.pop("unfinished", None) or []
        made = profile.get("parts") or {}
        left = [n for n in written if n in self.plan.subparts]
        unfinished = [n for n in dict.fromkeys(left + list(self.todo)) if n not in made]
        if unfinished:
            profile["unfinished"] = unfinished
        if old is not None and unfinished != written:  # a stop before the first part
            write_json(path, profile)  # leaves a file that says so
        return profile

    @staticmethod
    def _same_profile(path: Path, kind: str, source: str, identity: str,
                      value) -> Optional[dict]:
        """The profile at `path` when it is of this kind, source and identity; else None."""
        try:
            old = read_json(path)
        except (OSError, ValueError):
            return None
        if (isinstance(old, dict) and (old.get("kind"), old.get("source")) == (kind, source)
                and old.get(identity) == json.loads(json.dumps(value))):  # as the file holds it
            return old
        return None

    def keep_aside_other(self, path: Path, kind: str, source: str, identity: str,
                         value) -> None:
        """Before a whole profile of `source` is written at `path` (an analytic one, an import):
        a file there of another source or shape is kept aside, not written over."""
        if path.exists() and self._same_profile(path, kind, source, identity, value) is None:
            self._keep_aside(path)

    def _keep_aside(self, path: Path) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        aside = set_aside(path, stamp)
        plot = path.with_suffix(".png")  # its plot goes with it: the new run writes its own
        if plot.exists():
            set_aside(plot, stamp)
        note = f"{path} is of another source or shape: kept as {aside.name}"
        stage_console().print(f"{self.plan.stage}: {note}", markup=False)
        log.info("%s", note)  # the rank's log keeps it where mpiexec's output is cut

    def mark_part(self, profile: dict, name: str) -> None:
        """Rank 0, after sub-part `name` was merged into `profile` (and before its write):
        record the settings it was made under (`parts`) and the run's provenance; take it off
        `unfinished`; keep aside the file of another source it will replace."""
        profile["parts"] = {**(profile.get("parts") or {}), name: {
            "config_hash": self.request.config_hash,
            "settings": dataclasses.asdict(getattr(self.cfg, self.plan.stage)),
            "selection": list(self.plan.selection), "job_id": self.ctx.job_id,
            "ended": time.time()}}
        left = [n for n in profile.pop("unfinished", None) or () if n != name]
        if left:
            profile["unfinished"] = left
        profile["provenance"] = self.provenance()
        if self._aside is not None and self._aside.exists():  # resume_profile's, on first write
            self._keep_aside(self._aside)
        self._aside = None

    def finish(self, result: Optional[dict]) -> None:
        """Rank 0: mark the stage done in the ledger."""
        if self.ledger is not None:
            self.ledger.transition(self.key, State.done,
                                   summary=result if isinstance(result, dict) else None)
