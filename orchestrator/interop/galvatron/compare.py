"""Another tool's strategy priced by our cost model, next to our best, term by term.

`price_galvatron_strategy` reads a Galvatron strategy and evaluates it like any of our layouts;
`compare_predictions` lines two Predictions up per breakdown term (each Prediction's terms sum to
its iteration time, so the differences do too), then iteration time, peak memory and whether it
fits; `compare_table` prints them with the lines of what did not map.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, Tuple, Union

from rich.table import Table

from orchestrator.errors import ProfileError
from orchestrator.interop.galvatron.strategy import read_strategy
from orchestrator.layout import LayoutError
from orchestrator.planner.options import BREAKDOWN_KINDS, CostOptions, GiB
from orchestrator.planner.prediction import Prediction, evaluate
from orchestrator.planner.hardware_model import HardwareModel
from orchestrator.planner.model_cost import ModelCost
@dataclass(frozen=True)
class CompareRow:
    """One line of a comparison: a breakdown term, "iteration" (ms), "peak_memory" (GiB) or
    "feasible" (bool: fits the memory budget)."""

    term: str
    unit: str  # "ms", "GiB", or "" for feasible
    ours: Union[float, bool]
    theirs: Union[float, bool]

    @property
    def diff(self) -> Optional[float]:
        """theirs - ours in `unit`; None for feasible."""
        if isinstance(self.ours, bool):
            return None
        return self.theirs - self.ours

    @property
    def diff_pct(self) -> Optional[float]:
        """diff as a percentage of ours; None for feasible or when ours is 0."""
        diff = self.diff
        return None if diff is None or self.ours == 0 else 100.0 * diff / self.ours


def compare_predictions(ours: Prediction, theirs: Prediction) -> List[CompareRow]:
    """One row per breakdown term (BREAKDOWN_KINDS, ms; each side's terms sum to its iteration
    time), then iteration time (ms), peak memory per device (GiB) and feasible."""
    rows = [CompareRow(kind, "ms", ours.breakdown_us[kind] / 1e3, theirs.breakdown_us[kind] / 1e3)
            for kind in BREAKDOWN_KINDS]
    rows.append(CompareRow("iteration", "ms", ours.iteration_time_us / 1e3,
                           theirs.iteration_time_us / 1e3))
    rows.append(CompareRow("peak_memory", "GiB", ours.peak_memory_bytes / GiB,
                           theirs.peak_memory_bytes / GiB))
    rows.append(CompareRow("feasible", "", bool(ours.feasible), bool(theirs.feasible)))
    return rows


def _cell(value: Union[float, bool, None], fmt: str) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    return format(value, fmt)


def compare_table(rows: Sequence[CompareRow], *, ours_label: str, theirs_label: str,
                  notes: Sequence[str]) -> Table:
    """A rich Table of `rows` (term, ours, theirs, theirs - ours, % of ours) titled with both
    labels; `notes` (what did not map or was approximated) go below it, one per line."""
    table = Table(title=f"ours: {ours_label}\ntheirs: {theirs_label}", title_justify="left",
                  caption="\n".join(notes) or None, caption_justify="left")
    for header in ("term", "ours", "theirs", "theirs - ours", "% of ours"):
        table.add_column(header, justify="left" if header == "term" else "right")
    for row in rows:
        term = f"{row.term} ({row.unit})" if row.unit else row.term
        table.add_row(term, _cell(row.ours, ".3f"), _cell(row.theirs, ".3f"),
                      _cell(row.diff, "+.3f"), _cell(row.diff_pct, "+.1f"))
    return table


def price_galvatron_strategy(source: Union[str, Path, Mapping[str, Any]], model: ModelCost,
                             hardware: HardwareModel, *, world_size: int, seq_len: int,
                             budget_bytes: Optional[float], options: CostOptions = CostOptions(),
                             sequence_parallel: bool = False) -> Tuple[Prediction, List[str]]:
    """Our cost model's Prediction (us, bytes) of a Galvatron strategy file (or dict) on
    `world_size` ranks, and the lines of what did not map or was approximated (read_strategy's),
    plus why it does not fit when it does not. ProfileError when the file is not a strategy for
    this model or our model cannot price it (e.g. a tp that does not divide the heads)."""
    layout, notes = read_strategy(source, world_size=world_size, num_layers=model.layers,
                                  sequence_parallel=sequence_parallel)
    try:
        prediction = evaluate(layout, model, hardware, seq_len, budget_bytes, options)
    except LayoutError as e:
        name = source if not isinstance(source, Mapping) else "Galvatron strategy"
        raise ProfileError(f"{name}: {layout.describe()} cannot be priced for {model.name}: "
                           f"{e}") from None
    if not prediction.feasible:
        notes.append(f"over the memory budget: {prediction.reason}")
    return prediction, notes
