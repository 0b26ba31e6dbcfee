"""Concurrent writers of one DuckDB file, as real processes: nothing lost, nothing doubled, and the
single-writer lock is a bounded wait, then an error naming the database file, never a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import polars as pl
import pytest

from resources.store import StoreBusyError, TraceStore
from trace_assets import paths

REPO = paths.REPO_ROOT


def _record(i: int) -> dict:
    return {
        "task_id": f"retail/order_status/{i:05d}", "env": "retail",
        "messages": [{"role": "user", "content": f"Where is order W{i}?"},
                     {"role": "assistant", "content": "It is pending."}],
        "reward": float(i % 2),
    }


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "TRACE_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(REPO), "COLUMNS": "500"}


def _write(path: Path, ids: range) -> Path:
    path.write_text("".join(json.dumps(_record(i)) + "\n" for i in ids))
    return path


def test_two_trace_imports_of_overlapping_files_at_once(tmp_path):
    # 8 files of 40 records; the two commands share files 2..5, and files overlap in content too
    files = [_write(tmp_path / f"f{k}.jsonl", range(k * 20, k * 20 + 40)) for k in range(8)]
    first = [str(f) for f in files[:6]]
    second = [str(f) for f in reversed(files[2:])]
    procs = [subprocess.Popen([sys.executable, "-m", "trace_assets.cli", "import", *args], cwd=REPO, env=_env(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args in (first, second)]
    outs = [p.communicate(timeout=240) for p in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, out + err
        assert "Traceback" not in out + err
    store = TraceStore(database=str(tmp_path / "data" / "trace.duckdb"))
    expected = {f"retail/order_status/{i:05d}" for i in range(0, 7 * 20 + 40)}
    rows = store.query("SELECT task_id, count(*) AS n FROM trajectories GROUP BY task_id")
    assert set(rows["task_id"]) == expected and rows["n"].max() == 1
    # every stored row is in exactly one Parquet batch
    batches = pl.concat([pl.read_parquet(p) for p in (tmp_path / "data" / "trajectories" / "retail").glob("*.parquet")])
    assert batches.height == len(expected) and batches["trajectory_id"].n_unique() == len(expected)
    # and the reported "new" counts add up to what is stored
    new = [int(n) for out, _ in outs for n in re.findall(r"valid, (\d+) new", out)]
    assert len(new) == 12 and sum(new) == len(expected)


LABEL_WRITER = textwrap.dedent("""
    import sys
    from resources.store import TraceStore
    store = TraceStore(database=sys.argv[1])
    offset = int(sys.argv[2])
    total = 0
    for batch in range(30):
        rows = [(f"t{(offset + batch * 10 + i) % 400}", cap, run, "LACKING", "r")
                for i in range(10) for cap in ("a", "b") for run in range(2)]
        total += store.insert_labels(rows, analyst="llm", version="v1")
    print(total)
""")


def test_two_label_writers_at_once_lose_and_double_nothing(tmp_path):
    db = tmp_path / "data" / "trace.duckdb"
    TraceStore(database=str(db)).query("SELECT 1")  # the schema exists before the race
    procs = [subprocess.Popen([sys.executable, "-c", LABEL_WRITER, str(db), str(offset)], cwd=REPO, env=_env(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for offset in (0, 150)]  # trajectories 150..299 are written by both
    outs = [p.communicate(timeout=240) for p in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err
    store = TraceStore(database=str(db))
    stored = store.query("SELECT count(*) AS n, count(DISTINCT (trajectory_id, capability, run)) AS keys FROM labels").row(0)
    expected = {f"t{i % 400}" for offset in (0, 150) for i in range(offset, offset + 300)}
    assert stored == (len(expected) * 4, len(expected) * 4)
    assert sum(int(out) for out, _ in outs) == len(expected) * 4  # each new label counted by exactly one writer


HOLDER = textwrap.dedent("""
    import sys, time, duckdb
    conn = duckdb.connect(sys.argv[1])
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
""")


def _hold_lock(db: Path, seconds: float, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(db), str(seconds)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_held_lock_is_waited_for_then_named(tmp_path):
    db = tmp_path / "data" / "trace.duckdb"
    TraceStore(database=str(db)).query("SELECT 1")
    holder = _hold_lock(db, 2.0, _env(tmp_path))
    start = time.monotonic()
    assert TraceStore(database=str(db), lock_timeout_s=30).insert_labels([("t", "a", 0, "NA", "r")], analyst="x", version="v") == 1
    assert time.monotonic() - start >= 1.0  # it waited for the holder instead of failing
    holder.wait(timeout=30)
    holder = _hold_lock(db, 30.0, _env(tmp_path))
    try:
        with pytest.raises(StoreBusyError, match=f"{db}: another process still holds DuckDB's write lock after 1 s"):
            TraceStore(database=str(db), lock_timeout_s=1).query("SELECT 1")
    finally:
        holder.kill()
        holder.wait()


LABEL_RUN = textwrap.dedent("""
    import json, sys
    from dagster import asset, materialize
    from resources.llm import AnalystResource
    from resources.store import TraceStore
    from trace_assets.assets.identify import build_identify_assets
    from trace_assets.identify.capabilities import Capability, dictionary_version
    from trace_assets.identify.heuristic import RULES

    ids = json.loads(sys.argv[2])
    caps = [Capability(name, f"the {name} rule of the offline analyst") for name in sorted(RULES)]

    @asset(name="trajectory_splits")
    def splits():
        return {"d_plus": ids[::2], "d_minus": ids[1::2]}

    @asset(name="capability_dictionary")
    def dictionary():
        return {"version": dictionary_version(caps), "analyst": "heuristic", "capabilities": [c.to_dict() for c in caps]}

    from trace_assets.settings import load_settings
    [label_matrix] = [a for a in build_identify_assets(load_settings())
                      if any(k.path == ["label_matrix"] for k in getattr(a, "keys", ()))]
    result = materialize([splits, dictionary, label_matrix],
                         resources={"store": TraceStore(database=sys.argv[1]), "analyst": AnalystResource(kind="heuristic")})
    checks = [e.event_specific_data.passed for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]
    print(json.dumps({"success": result.success, "checks": checks, "n_caps": len(caps)}))
""")


def test_two_dagster_runs_writing_labels_at_once(tmp_path, monkeypatch):
    """Two label_matrix runs (separate processes, as two runs of the multiprocess executor or of two
    instances are) over the same trajectories: each sees the labels complete, none is doubled."""
    from trace_assets.trajectories import import_file

    info = {"authenticated": True, "actions": [], "tool_errors": [], "policy_violations": [], "missing_info": [],
            "gold_writes": [], "n_writes": 0, "confirmations": 0}
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({**_record(i), "info": {**info, "authenticated": i % 3 != 0}}) + "\n" for i in range(60)))
    db = tmp_path / "data" / "trace.duckdb"
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    store = TraceStore(database=str(db))
    assert import_file(path, store).n_inserted == 60
    ids = sorted(store.query("SELECT trajectory_id FROM trajectories")["trajectory_id"])
    procs = [subprocess.Popen([sys.executable, "-c", LABEL_RUN, str(db), json.dumps(ids)], cwd=REPO, env=_env(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    reports = []
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    n_caps = reports[0]["n_caps"]
    assert all(r["success"] and r["checks"] == [True] for r in reports), reports
    n, keys = store.query("SELECT count(*), count(DISTINCT (trajectory_id, capability, run)) FROM labels").row(0)
    assert n == keys == 60 * n_caps
    assert store.query("SELECT count(*) FROM label_errors").item() == 0
