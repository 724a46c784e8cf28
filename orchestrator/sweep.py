"""Sweeps (`python -m orchestrator -m ...`): points that keep their own results, and one table
comparing them.

Naming. A point of a sweep whose swept overrides touch a stage's own config section (a stage
opts in with `Stage.sweep_section`, e.g. `search`) gets its own ledger key and output files,
labelled by the swept keys of that section, leaf name and value, in command-line order:

    -m stage=search search.pp=1,2 search.tp=1,2  ->  ledger key  search/tiny@pp=2,tp=2
                                                     outputs     strategy/tiny@pp=2,tp=2.json
                                                     (and its .layout.json, exports, .png)

A list value joins its items with `+` (`zero_stages=1+3`); any character outside
`[A-Za-z0-9._+=-]` becomes `_`, so a label is a safe file name. Swept keys of other sections
(e.g. `model=tiny,llama2_7b`) already change the stage's key or files and add nothing. A plain run
(no `-m`) keeps `strategy/<model>.json`; rerunning the same sweep skips the points that are done.

The sweep is known from the command line (Hydra's OverridesParser), in the CLI process, where
Hydra's basic launcher runs every point (a Slurm `wait=false` sweep submits from there too).

The table. `SweepTable` is a Hydra callback (`hydra.callbacks` in conf/config.yaml): each job's
return value (the CLI's stage rows) becomes a row; at the end it prints the table and writes it
as `sweep.csv` and `sweep.json` in Hydra's sweep folder (profiles/<cluster>/multirun/<time>/). A
point that fails (an invalid value, a failed job) is a row with its error; the sweep then exits
with the worst exit code of its points. A point whose layout cannot exist on these ranks or this
model (InvalidLayout, from search or train alike) is a row "skipped" with its reason, exit 0;
a sweep whose every point is skipped ran nothing: exit 2 (ConfigError), after its table.
"""
from __future__ import annotations

import csv
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.experimental.callback import Callback

GiB = 2**30
# Memory per device, each figure named as the stage's own table names it: "model peak GiB", the
# planner's peak of the model itself (search's table; a train point's prediction), "reserve GiB",
# what search keeps free beside it (budget = model peak + reserve + headroom), and "measured peak
# GiB", a train point's largest rank.
COLUMNS = ("point", "state", "layout", "iteration ms", "measured ms", "error %", "tokens/s",
           "model peak GiB", "reserve GiB", "measured peak GiB", "job id", "error")

_swept_keys: List[str] = []


def set_swept_keys(argv: Sequence[str]) -> None:
    """Record which keys this command sweeps (none without `-m`/`--multirun`), once, in the CLI."""
    _swept_keys[:] = swept_keys(argv)


def swept_keys(argv: Sequence[str]) -> List[str]:
    """The keys `argv` sweeps (`search.pp=1,2` -> `search.pp`), in order; [] if not a multirun."""
    from orchestrator.commands import parse_overrides

    if not any(a in ("-m", "--multirun") for a in argv):
        return []
    return [o.key_or_group for o in parse_overrides(tuple(argv)) or () if o.is_sweep_override()]


def _values_count(override) -> int:
    """How many values a sweep override runs, counted without listing them (`range(0, 10**9)`
    would take minutes to list): a choice's items, a range's steps, a glob's group names."""
    from hydra.core.override_parser.types import Glob, RangeSweep

    value = override.value()
    if isinstance(value, RangeSweep):
        return max(0, math.ceil((value.stop - value.start) / value.step)) if value.step else 0
    if isinstance(value, Glob):
        from orchestrator.conf_folders import config_dirs, group_options

        return max(1, len(value.filter(group_options(override.key_or_group, config_dirs()))))
    return len(value.list)


def check_sweep_size(argv: Sequence[str]) -> None:
    """ConfigError (exit 2, before Hydra lists a single point) when a `-m` sweep has more points
    than limits.max_sweep_points (the command line's value, else its default)."""
    from orchestrator.commands import parse_overrides
    from orchestrator.limits import LimitsConfig, check_sweep_points

    if not any(a in ("-m", "--multirun") for a in argv):
        return
    overrides = parse_overrides(tuple(argv)) or ()
    limits = LimitsConfig()
    for o in overrides:
        if o.key_or_group == "limits.max_sweep_points" and not o.is_sweep_override():
            try:
                limits.max_sweep_points = int(o.value())
            except (TypeError, ValueError):
                pass  # a wrong type: refused in one line by the type check after this
    swept = [o for o in overrides if o.is_sweep_override()]
    points = math.prod(_values_count(o) for o in swept)
    check_sweep_points(limits, points, " ".join(o.input_line for o in swept))


def _label_value(value: Any) -> str:
    items = value if isinstance(value, (list, tuple)) else [value]
    text = "+".join(str(v) for v in items)  # a Choice by its value
    return re.sub(r"[^A-Za-z0-9._+=-]", "_", text)


def point_label(cfg, section: Optional[str]) -> str:
    """`pp=2,tp=2`: the swept keys of `section` with this point's values; "" when none."""
    if not section:
        return ""
    parts = []
    for key in _swept_keys:
        head, _, leaf = key.partition(".")
        if head == section and leaf:
            value = getattr(cfg, section)
            for name in leaf.split("."):
                value = getattr(value, name)
            parts.append(f"{leaf}={_label_value(value)}")
    return ",".join(parts)


def labelled(path: Path, label: str) -> Path:
    """`strategy/tiny.json` -> `strategy/tiny@pp=2,tp=2.json` (unchanged without a label)."""
    return path.with_name(f"{path.stem}@{label}{path.suffix}") if label else path


# ---------------------------------------------------------------- the table
def _row_values(row: Dict[str, Any]) -> Dict[str, str]:
    """What the table shows of a stage row: its state, and the layout, time, throughput and
    memory of the strategy it wrote (read back, so skipped points show them too): the model's
    own peak and the reserve apart, as search's own table and memory line give them."""
    values = {"state": str(row.get("state", "")), "job id": str(row.get("job_id") or ""),
              "error": str(row.get("error") or "")}
    for path in row.get("outputs") or ():
        try:
            written = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            continue
        if written.get("kind") == "strategy":
            prediction, reserve_GiB = written["prediction"], written["headroom"]["reserve_GiB"]
            values.update({"layout": written.get("describe", ""),
                           "iteration ms": f"{prediction['iteration_time_us'] / 1e3:.3f}",
                           "tokens/s": f"{prediction['tokens_per_s']:.1f}",
                           "model peak GiB":
                               f"{prediction['peak_memory_bytes'] / GiB - reserve_GiB:.3f}",
                           "reserve GiB": f"{reserve_GiB:.3f}"})
        elif written.get("kind") == "train":
            values.update(train_row(written))
    return values


def train_row(summary: Dict[str, Any]) -> Dict[str, str]:
    """A train summary's columns: layout, predicted ("iteration ms") and measured iteration
    time, their error, measured tokens/s, the predicted peak memory of the model (no reserve:
    what the ranks themselves use) and the largest rank's measured peak."""
    measured, predicted = summary["measured"], summary.get("predicted")
    err = summary.get("iteration_time_error")
    # variable lengths (train.microbatching): the median step of the plans, and as measured,
    # which the error compares
    planned = (summary.get("microbatching") or {}) if not predicted else {}
    return {"layout": summary.get("describe", ""),
            "iteration ms": (f"{predicted['iteration_ms']:.1f}" if predicted else
                             f"{planned['predicted_ms']:.1f}" if planned.get("predicted_ms")
                             else ""),
            "measured ms": f"{planned.get('measured_ms') or measured['iteration_ms']:.1f}",
            "error %": f"{err * 100:+.1f}" if err is not None else "",
            "tokens/s": f"{measured['tokens_per_s']:.1f}",
            "model peak GiB": f"{predicted['peak_memory_MiB'] / 1024:.3f}" if predicted else "",
            "measured peak GiB": f"{max(measured['peak_memory_MiB']) / 1024:.3f}"}


class SweepTable(Callback):
    """Collects each point's rows (`on_job_end`); prints and writes the table at the end."""

    def __init__(self) -> None:
        self.rows: List[Dict[str, str]] = []
        self.exit_codes: List[int] = []
        self.states: List[str] = []
        self.sweep_dir: Optional[Path] = None

    def on_multirun_start(self, config, **kwargs) -> None:
        # Hydra makes the sweep folder, profiles/<cluster.name>/multirun/..., before any point
        # runs: a name from a cluster file is checked here (the command line's before Hydra).
        from orchestrator.console import report_error
        from orchestrator.config_keys import check_path_name
        from orchestrator.errors import ConfigError

        try:
            check_path_name("cluster.name", config.cluster.name)
        except ConfigError as e:
            report_error(e)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from hydra.core.utils import JobStatus

        # The job's own folder is <sweep dir>/<subdir>.
        self.sweep_dir = Path(job_return.hydra_cfg.hydra.runtime.output_dir).parent
        point = " ".join(o for o in job_return.overrides
                         if o.split("=", 1)[0].lstrip("+~") in _swept_keys)
        if job_return.status == JobStatus.COMPLETED:
            stage_rows = job_return.return_value or [{}]
        else:  # a bug, not an OrchestratorError: still a row
            stage_rows = [{"state": "failed", "error": repr(job_return._return_value),
                           "exit_code": 1}]
        last = stage_rows[-1] if isinstance(stage_rows, list) else {}
        self.exit_codes.append(int(last.get("exit_code") or 0))
        self.states.append(str(last.get("state") or ""))
        self.rows.append({c: "" for c in COLUMNS} | {"point": point} | _row_values(last))

    def on_multirun_end(self, config, **kwargs) -> None:
        if not self.rows:
            return
        _print_table(self.rows)
        if self.sweep_dir is not None:
            write_table(self.rows, self.sweep_dir)
        worst = max(self.exit_codes, default=0)
        if worst:
            sys.exit(worst)
        if all(state == "skipped" for state in self.states):  # a script must not read success
            from orchestrator.console import report_error
            from orchestrator.errors import ConfigError

            report_error(ConfigError(f"every point of the sweep was skipped ({len(self.rows)}): "
                                     f"none can run on these ranks or this model (the table "
                                     f"says why each)"))


def write_table(rows: List[Dict[str, str]], folder: Path) -> None:
    """`sweep.csv` and `sweep.json` ({"columns", "rows"}) in `folder`."""
    from orchestrator.store import atomic_write, write_json

    folder.mkdir(parents=True, exist_ok=True)

    def write_csv(f):
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)

    atomic_write(folder / "sweep.csv", write_csv)
    write_json(folder / "sweep.json", {"columns": list(COLUMNS), "rows": rows})


def _print_table(rows: List[Dict[str, str]]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"sweep: {len(rows)} point(s)")
    columns = [c for c in COLUMNS if any(r.get(c) for r in rows) or c in COLUMNS[:2]]
    for col in columns:
        table.add_column(col, justify="right" if col.endswith(("ms", "/s", "GiB")) else "left")
    for row in rows:
        table.add_row(*(escape(row.get(c, "")) for c in columns))
    Console(highlight=False, width=None if sys.stdout.isatty() else 200).print(table)
