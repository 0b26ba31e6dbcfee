"""``identify.labelling``: the incremental labelling loop against a real DuckDB store, and
``TraceStore.label_summary`` (the label matrix's count, content hash and per-label counts)."""

from __future__ import annotations

from datetime import datetime, timezone

from resources.store import TraceStore
from trace_assets.identify.capabilities import Capability, Label
from trace_assets.identify.labelling import label_trajectories
from trace_assets.llm_client import LLMError

CAPS = [Capability("alpha", "the first"), Capability("beta", "the second")]


def _store(tmp_path, n: int) -> tuple[TraceStore, list[str]]:
    store = TraceStore(database=str(tmp_path / "trace.duckdb"))
    now = datetime.now(timezone.utc).isoformat()
    records = [{
        "trajectory_id": f"t{i}", "task_id": f"retail/x/{i}", "env": "retail", "split": "train", "policy": "base",
        "messages": [{"role": "user", "content": f"hi {i}"}], "reward": float(i % 2), "success": bool(i % 2),
        "info": {}, "source": "test", "created_at": now, "agent_id": "",
    } for i in range(n)]
    store.insert_trajectories(records, batch_name="labelling_test")
    return store, [r["trajectory_id"] for r in records]


class Analyst:
    name = "fake"

    def __init__(self, failing: set[str] = frozenset()):
        self.failing, self.calls = failing, []

    def label(self, trajectory, capabilities, run):
        tid = trajectory["trajectory_id"]
        self.calls.append((tid, run))
        if tid in self.failing:
            raise LLMError(f"no valid labels for {tid}")
        return [Label(tid, c.name, run, "LACKING" if c.name == "alpha" else "NA", "because") for c in capabilities]


def test_labels_are_stored_reused_and_errors_recorded(tmp_path, monkeypatch):
    store, ids = _store(tmp_path, 5)
    writes = []
    insert = TraceStore.insert_labels

    def counting_insert(self, rows, **kw):
        writes.append(len(rows))
        return insert(self, rows, **kw)

    monkeypatch.setattr(TraceStore, "insert_labels", counting_insert)
    run = label_trajectories(Analyst(failing={"t3"}), store, CAPS, ids, 2, "v1", checkpoint_every=4)
    assert (run.pairs_sent, run.labels_reused, run.expected) == (10, 0, 5 * 2 * 2)
    assert sorted(run.errors) == sorted(("t3", c.name, r, "no valid labels for t3") for r in (0, 1) for c in CAPS)
    assert writes == [8, 4, 4, 0]  # progress kept every 4 pairs (t3's two failed), then the rest
    assert store.query("SELECT count(*) FROM label_errors").item() == 4
    summary = store.label_summary("v1", ids)
    assert summary["n"] == 16
    counts = {r["capability"]: r for r in summary["counts"].to_dicts()}
    assert counts["alpha"]["LACKING"] == 8 and counts["beta"]["NA"] == 8
    assert run.failure(0.5) is None
    assert run.failure(0.05).startswith("label_matrix: 4 of 20 pairs failed (20.0% > 5%); first: t3/")

    again = Analyst()  # the failed pairs are the only ones left to label
    second = label_trajectories(again, store, CAPS, ids, 2, "v1")
    assert sorted(again.calls) == [("t3", 0), ("t3", 1)] and second.labels_reused == 16 and not second.errors
    full = store.label_summary("v1", ids)
    assert full["n"] == 20 and full["hash"] != summary["hash"]
    assert store.label_summary("v1", ids)["hash"] == full["hash"]  # a content hash: same labels, same hash
    assert store.label_summary("v1", ids[:2])["n"] == 8  # only the trajectories asked for
    assert store.label_summary("v2", ids)["n"] == 0  # and only the dictionary version asked for
    assert label_trajectories(Analyst(), store, CAPS, ids, 2, "v1").pairs_sent == 0
