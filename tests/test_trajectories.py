"""The trajectory store and importer: validation errors name file:line:field, nothing is lost."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from resources.store import TraceStore
from trace_assets.trajectories import import_file, normalize, RecordErrors


def _record(i: int, **extra) -> dict:
    return {
        "task_id": f"retail/order_status/{i:05d}",
        "env": "retail",
        "messages": [
            {"role": "system", "content": "You are an agent."},
            {"role": "user", "content": f"Where is order W{i}?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_order_details", "arguments": json.dumps({"order_id": f"W{i}"})}}
            ]},
            {"role": "tool", "name": "get_order_details", "content": "{}"},
            {"role": "assistant", "content": "It is pending."},
        ],
        "reward": float(i % 2),
        **extra,
    }


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture()
def store(tmp_path, monkeypatch) -> TraceStore:
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    return TraceStore(database=str(tmp_path / "data" / "t.duckdb"))


def test_valid_file_imports_once_and_writes_parquet(store, tmp_path):
    path = _write_jsonl(tmp_path / "good.jsonl", [json.dumps(_record(i)) for i in range(5)])
    first = import_file(path, store)
    assert (first.n_lines, first.n_valid, first.n_inserted, first.errors) == (5, 5, 5, [])
    again = import_file(path, store)
    assert again.n_inserted == 0 and again.ok
    rows = store.trajectories(env="retail")
    assert len(rows) == 5
    assert rows[0]["split"] == "train" and rows[0]["policy"] == "base" and rows[0]["source"] == "good.jsonl"
    # string arguments are normalised to dicts; success defaults to reward == 1
    call = rows[0]["messages"][2]["tool_calls"][0]["function"]
    assert isinstance(call["arguments"], dict)
    assert {r["success"] for r in rows} == {True, False}
    parquet = list((tmp_path / "data" / "trajectories" / "retail").glob("*.parquet"))
    assert len(parquet) == 1 and pl.read_parquet(parquet[0]).height == 5


def test_bad_lines_are_named_valid_lines_kept_file_quarantined(store, tmp_path):
    bad_reward = _record(2, reward=1.5)
    missing_env = _record(3)
    del missing_env["env"]
    lines = [
        json.dumps(_record(1)),
        "{not json",
        json.dumps(bad_reward),
        json.dumps(missing_env),
        json.dumps(_record(4, colour="blue")),
        json.dumps(_record(5)),
    ]
    path = _write_jsonl(tmp_path / "mixed.jsonl", lines)
    report = import_file(path, store, quarantine_folder=tmp_path / "q")
    assert report.n_lines == 6 and report.n_valid == 2 and report.n_inserted == 2
    messages = [str(e) for e in report.errors]
    assert any(m.startswith(f"{path}:2: field '<line>'") for m in messages)
    assert any(m.startswith(f"{path}:3: field 'reward'") for m in messages)
    assert any(m.startswith(f"{path}:4: field 'env'") for m in messages)
    assert any(m.startswith(f"{path}:5: field 'colour'") for m in messages)
    quarantined = Path(report.quarantined_to)
    assert quarantined.read_text() == path.read_text()
    reason = json.loads(Path(str(quarantined) + ".reason.json").read_text())
    assert len(reason["errors"]) == 4
    assert path.exists(), "a user's file is copied, not moved, unless move_bad=True"


def test_bad_file_never_loses_stored_rows(store, tmp_path):
    import_file(_write_jsonl(tmp_path / "a.jsonl", [json.dumps(_record(i)) for i in range(3)]), store)
    binary = tmp_path / "broken.parquet"
    binary.write_bytes(b"PAR1 not really parquet")
    report = import_file(binary, store, move_bad=True, quarantine_folder=tmp_path / "q")
    assert report.errors and report.errors[0].field == "<file>" and "broken.parquet" in str(report.errors[0])
    assert not binary.exists() and Path(report.quarantined_to).exists()
    assert len(store.trajectories()) == 3


def test_parquet_import_with_json_string_columns(store, tmp_path):
    rows = [_record(i, trajectory_id=f"t{i}", split="test") for i in range(3)]
    frame = pl.DataFrame([{**r, "messages": json.dumps(r["messages"])} for r in rows])
    path = tmp_path / "logs.parquet"
    frame.write_parquet(path)
    report = import_file(path, store)
    assert report.ok and report.n_inserted == 3
    assert sorted(r["trajectory_id"] for r in store.trajectories(split="test")) == ["t0", "t1", "t2"]


def test_explicit_ids_are_not_overwritten(store, tmp_path):
    import_file(_write_jsonl(tmp_path / "a.jsonl", [json.dumps(_record(1, trajectory_id="x1", reward=0.0))]), store)
    import_file(_write_jsonl(tmp_path / "b.jsonl", [json.dumps(_record(1, trajectory_id="x1", reward=1.0))]), store)
    (row,) = store.trajectories(trajectory_id="x1")
    assert row["reward"] == 0.0


def test_normalize_rejects_unsafe_ids_and_envs():
    with pytest.raises(RecordErrors) as exc:
        normalize(_record(1, trajectory_id="../../etc/passwd", env="Retail Env"), file="f", line=7, source="f", now="2026-01-01T00:00:00+00:00")
    fields = {e.field for e in exc.value.errors}
    assert fields == {"trajectory_id", "env"}
    assert all(e.line == 7 for e in exc.value.errors)
