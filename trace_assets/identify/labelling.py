"""Phase 2 of Step 1: label every (trajectory, capability, run) NA / PRESENT / LACKING, incrementally.

Contract of :func:`label_trajectories`: only (trajectory, run) pairs with a capability not yet
labelled for the dictionary version go to the analyst; labels already stored are reused, never
redone. Progress is stored every ``checkpoint_every`` pairs, so a killed run loses at most that
many pairs' work. An analyst error (``LLMError``, after the analyst's own retries) is recorded in
``label_errors`` for every capability of the pair, and labelling goes on; the caller decides, with
:meth:`LabellingRun.failure`, whether the share of errors fails the step.

``store`` is a ``resources.store.TraceStore`` (or anything with its ``trajectories``,
``labelled_keys``, ``insert_labels`` and ``insert_label_errors``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trace_assets.identify.capabilities import Capability

CHECKPOINT_EVERY = 50
"""Pairs labelled between two writes of the labels to the store."""


def train_trajectories(store: Any, ids: Sequence[str]) -> list[dict[str, Any]]:
    """The stored train-split trajectories among ``ids``, in the store's order (by id)."""
    wanted = set(ids)
    return [t for t in store.trajectories(split="train") if t["trajectory_id"] in wanted]


@dataclass
class LabellingRun:
    """What one call of :func:`label_trajectories` did."""

    pairs_sent: int
    """(trajectory, run) pairs that went to the analyst."""
    labels_reused: int
    """Labels already stored for this dictionary version (all trajectories, before this call)."""
    expected: int
    """trajectories x capabilities x runs."""
    errors: list[tuple[str, str, int, str]] = field(default_factory=list)
    """``(trajectory_id, capability, run, error)`` of every failed pair's capabilities."""

    def failure(self, max_error_share: float) -> str | None:
        """Why the step fails, when more than ``max_error_share`` of the expected labels failed."""
        share = len(self.errors) / self.expected if self.expected else 0.0
        if share <= max_error_share:
            return None
        sample = ", ".join(f"{t}/{c} (run {r}): {e[:120]}" for t, c, r, e in self.errors[:5])
        return (f"label_matrix: {len(self.errors)} of {self.expected} pairs failed ({share:.1%} > "
                f"{max_error_share:.0%}); first: {sample}. Stored labels are kept.")


def label_trajectories(analyst: Any, store: Any, capabilities: Sequence[Capability], ids: Sequence[str], runs: int,
                       version: str, *, log: Callable[[str], None] = lambda message: None,
                       checkpoint_every: int = CHECKPOINT_EVERY) -> LabellingRun:
    """Label the trajectories ``ids`` against ``capabilities`` in ``runs`` runs with ``analyst`` (an
    ``identify`` analyst: ``name`` and ``label(trajectory, capabilities, run)``), storing the labels
    under the dictionary ``version`` (module docstring)."""
    from trace_assets.llm_client import LLMError

    done = store.labelled_keys(version)
    pending = [
        (tid, run) for tid in ids for run in range(runs)
        if any((tid, c.name, run) not in done for c in capabilities)
    ]
    by_id = {t["trajectory_id"]: t for t in train_trajectories(store, sorted({tid for tid, _ in pending}))}
    log(f"{len(pending)} (trajectory, run) pairs to label of {len(ids) * runs}; {len(done)} labels reused")
    result = LabellingRun(pairs_sent=len(pending), labels_reused=len(done), expected=len(ids) * len(capabilities) * runs)
    new_rows: list[tuple] = []
    for i, (tid, run) in enumerate(pending, start=1):
        try:
            labels = analyst.label(by_id[tid], capabilities, run)
            new_rows.extend((l.trajectory_id, l.capability, l.run, l.label, l.rationale, l.step) for l in labels)
        except LLMError as exc:
            result.errors.extend((tid, c.name, run, str(exc)[:500]) for c in capabilities)
        if i % checkpoint_every == 0 or i == len(pending):
            log(f"labelled {i}/{len(pending)} pairs")
            store.insert_labels(new_rows, analyst=analyst.name, version=version)  # keep progress
            new_rows = []
    store.insert_labels(new_rows, analyst=analyst.name, version=version)
    store.insert_label_errors(result.errors, analyst=analyst.name, version=version)
    return result
