"""``TraceStore``: the DuckDB file that holds trajectories (and, later, labels and stats).

Contracts:

* ``insert_trajectories`` is idempotent: rows are keyed by ``trajectory_id`` and an id already
  stored is never overwritten or duplicated. The insert is one transaction: all new rows land, or
  none do.
* Every batch of newly inserted rows is also written as a Parquet file under
  ``<data>/trajectories/<env>/``, so the data stays readable without this project.
* Connections are short-lived: DuckDB allows one writing process per file, and the sensor, the
  webserver and runs all open the store. ``connect`` retries while another process holds the lock.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import polars as pl
from dagster import ConfigurableResource
from pydantic import Field

from trace_assets import paths
from trace_assets.identify.capabilities import Label
from trace_assets.identify.stats import run_stats_sql

PIPELINE_SOURCE = "base_rollout"
"""``source`` of the base agent's rollouts that ``base_trajectories`` stores (imports name their file)."""

TRAJECTORY_COLUMNS = (
    "trajectory_id", "task_id", "env", "split", "policy", "messages",
    "reward", "success", "info", "source", "created_at", "agent_id",
)

SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS trajectories (
    trajectory_id VARCHAR PRIMARY KEY,
    task_id       VARCHAR NOT NULL,
    env           VARCHAR NOT NULL,
    split         VARCHAR NOT NULL,
    policy        VARCHAR NOT NULL,
    messages      JSON NOT NULL,
    reward        DOUBLE NOT NULL,
    success       BOOLEAN NOT NULL,
    info          JSON NOT NULL,
    source        VARCHAR NOT NULL,
    created_at    TIMESTAMPTZ NOT NULL,
    agent_id      VARCHAR NOT NULL DEFAULT ''
);
-- Data folders from before agent identities: the column is added, their rows keep '' (an agent
-- nobody recorded) and are never read as the rows of a current agent. Nothing is deleted.
ALTER TABLE trajectories ADD COLUMN IF NOT EXISTS agent_id VARCHAR DEFAULT '';
CREATE TABLE IF NOT EXISTS labels (
    trajectory_id      VARCHAR NOT NULL,
    capability         VARCHAR NOT NULL,
    run                INTEGER NOT NULL,
    label              VARCHAR NOT NULL CHECK (label IN ('NA', 'PRESENT', 'LACKING')),
    rationale          VARCHAR NOT NULL,
    analyst            VARCHAR NOT NULL,
    dictionary_version VARCHAR NOT NULL,
    created_at         TIMESTAMPTZ NOT NULL,
    step               INTEGER,
    PRIMARY KEY (trajectory_id, capability, run, dictionary_version)
);
-- Data folders from before decision points: their labels keep step NULL (no step was recorded).
ALTER TABLE labels ADD COLUMN IF NOT EXISTS step INTEGER;
CREATE TABLE IF NOT EXISTS label_errors (
    trajectory_id      VARCHAR NOT NULL,
    capability         VARCHAR NOT NULL,
    run                INTEGER NOT NULL,
    error              VARCHAR NOT NULL,
    analyst            VARCHAR NOT NULL,
    dictionary_version VARCHAR NOT NULL,
    created_at         TIMESTAMPTZ NOT NULL
);
"""


class StoreBusyError(RuntimeError):
    """Another process held the database's write lock for longer than ``lock_timeout_s``."""


class TraceStore(ConfigurableResource):
    """The project's DuckDB database. ``database`` defaults to ``<TRACE_DATA_DIR>/trace.duckdb``."""

    database: str = Field(default="", description="DuckDB file; empty means the data folder's.")
    lock_timeout_s: float = Field(default=60.0, description="How long to wait for another writer.")

    @property
    def path(self) -> Path:
        return Path(self.database) if self.database else paths.duckdb_path()

    @contextmanager
    def connect(self, read_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection with the schema in place. Retries while another process holds the file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.lock_timeout_s
        while True:
            try:
                conn = duckdb.connect(str(self.path), read_only=read_only and self.path.exists())
                break
            except duckdb.IOException as exc:  # the file is locked by another process
                if "lock" not in str(exc).lower():
                    raise
                if time.monotonic() > deadline:
                    raise StoreBusyError(
                        f"{self.path}: another process still holds DuckDB's write lock after "
                        f"{self.lock_timeout_s:.0f} s of waiting; try again when it is done"
                    ) from None
                time.sleep(0.2 + random.random() * 0.3)  # jitter: two waiters do not retry in lockstep
        try:
            if not read_only:
                conn.execute(SCHEMA_SQL)
            yield conn
        finally:
            conn.close()

    def insert_trajectories(self, records: Sequence[dict[str, Any]], *, batch_name: str) -> int:
        """Insert normalised trajectory records; return how many were new.

        ``records`` must already be validated (see ``trace_assets.trajectories``). ``batch_name``
        names the Parquet file of the new rows (a path-safe string).
        """
        if not records:
            return 0
        frame = _records_frame(records)
        with self.connect() as conn:
            conn.register("batch", frame.to_arrow())
            conn.execute("BEGIN TRANSACTION")
            try:
                conn.execute(
                    "CREATE TEMP TABLE new_rows AS SELECT DISTINCT ON (trajectory_id) * FROM batch "
                    "WHERE trajectory_id NOT IN (SELECT trajectory_id FROM trajectories)"
                )
                inserted = conn.execute("SELECT count(*) FROM new_rows").fetchall()[0][0]
                conn.execute(
                    f"INSERT INTO trajectories SELECT {', '.join(_casts())} FROM new_rows"
                )
                if inserted:
                    self._write_parquet(conn, batch_name)
                conn.execute("DROP TABLE new_rows")
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            finally:
                conn.unregister("batch")
        return int(inserted)

    def _write_parquet(self, conn: duckdb.DuckDBPyConnection, batch_name: str) -> None:
        for (env,) in conn.execute("SELECT DISTINCT env FROM new_rows").fetchall():
            folder = paths.sub("trajectories", env)
            with paths.atomic_path(folder / f"{batch_name}.parquet") as tmp:
                conn.execute(f"COPY (SELECT * FROM new_rows WHERE env = ?) TO '{tmp}' (FORMAT parquet)", [env])

    def insert_labels(self, rows: Sequence[tuple], *, analyst: str, version: str) -> int:
        """Insert ``(trajectory_id, capability, run, label, rationale[, step])`` rows (``Label``'s
        fields; a missing step is NULL); return how many were new. Labels already stored for the same
        key are kept as they are (never overwritten)."""
        if not rows:
            return 0
        frame = pl.DataFrame(
            [(*r[:5], r[5] if len(r) > 5 else None, analyst, version) for r in rows], orient="row",
            schema={"trajectory_id": pl.String, "capability": pl.String, "run": pl.Int64, "label": pl.String,
                    "rationale": pl.String, "step": pl.Int64, "analyst": pl.String, "dictionary_version": pl.String},
        )
        with self.connect() as conn:
            conn.register("batch", frame.to_arrow())
            before = conn.execute("SELECT count(*) FROM labels").fetchall()[0][0]
            conn.execute(
                "INSERT OR IGNORE INTO labels (trajectory_id, capability, run, label, rationale, analyst, "
                "dictionary_version, created_at, step) SELECT trajectory_id, capability, CAST(run AS INTEGER), label, "
                "rationale, analyst, dictionary_version, now(), CAST(step AS INTEGER) FROM batch"
            )
            after = conn.execute("SELECT count(*) FROM labels").fetchall()[0][0]
            conn.unregister("batch")
        return int(after - before)

    def lacking_steps(self, version: str, capability: str, ids: Sequence[str] | None = None) -> list[Label]:
        """The LACKING labels of ``capability`` under dictionary ``version`` that name a step (on the
        trajectories ``ids``, or all), by trajectory, run and step: what ``synthesize.prefix`` cuts at."""
        frame = self.query(
            "SELECT trajectory_id, capability, run, label, rationale, step FROM labels WHERE dictionary_version = ? "
            "AND capability = ? AND label = 'LACKING' AND step IS NOT NULL "
            "AND (?::VARCHAR[] IS NULL OR list_contains(?::VARCHAR[], trajectory_id)) ORDER BY trajectory_id, run, step",
            [version, capability, None if ids is None else list(ids), None if ids is None else list(ids)],
        )
        return [Label(**row) for row in frame.to_dicts()]

    def lacking_families(self, capability: str, tasks: Sequence[Any], *, version: str | None = None) -> list[str]:
        """The families of ``tasks`` (objects with ``task_id`` and ``family``) that hold a stored
        train-split trajectory the labels of dictionary ``version`` (None: any) call ``capability``
        LACKING at least once: where Step 1 found the capability missing, hence where its adapter
        should help on the test split."""
        family = {t.task_id: t.family for t in tasks}
        frame = self.query(
            "SELECT DISTINCT t.task_id FROM labels l JOIN trajectories t USING (trajectory_id) "
            "WHERE l.capability = ? AND l.label = 'LACKING' AND t.split = 'train' "
            "AND (?::VARCHAR IS NULL OR l.dictionary_version = ?)", [capability, version, version])
        return sorted({family[i] for i in frame["task_id"].to_list() if i in family})

    def insert_label_errors(self, rows: Sequence[tuple], *, analyst: str, version: str) -> None:
        """Record ``(trajectory_id, capability, run, error)`` rows of failed labelling attempts."""
        if not rows:
            return
        with self.connect() as conn:
            conn.executemany(
                "INSERT INTO label_errors VALUES (?, ?, ?, ?, ?, ?, now())",
                [(*r, analyst, version) for r in rows],
            )

    def labelled_keys(self, version: str) -> set[tuple[str, str, int]]:
        """The (trajectory_id, capability, run) keys already labelled for a dictionary version."""
        frame = self.query(
            "SELECT trajectory_id, capability, run FROM labels WHERE dictionary_version = ?", [version]
        )
        return set(frame.iter_rows())

    def label_summary(self, version: str, ids: Sequence[str]) -> dict[str, Any]:
        """The labels of dictionary ``version`` on the trajectories ``ids``: ``n`` (how many),
        ``hash`` (md5 over every trajectory, capability, run and label, in key order: what the
        label matrix holds) and ``counts`` (a frame: one row per capability, a column per label)."""
        with self.connect() as conn:
            [(n, digest)] = conn.execute(
                "SELECT count(*), md5(string_agg(trajectory_id || capability || run || label, ',' "
                "ORDER BY trajectory_id, capability, run)) FROM labels WHERE dictionary_version = ? "
                "AND trajectory_id IN (SELECT unnest(?::VARCHAR[]))", [version, list(ids)],
            ).fetchall()
            counts = conn.sql(
                "SELECT capability, label, count(*) AS n FROM labels WHERE dictionary_version = ? "
                "AND trajectory_id IN (SELECT unnest(?::VARCHAR[])) GROUP BY ALL ORDER BY ALL", params=[version, list(ids)],
            ).pl()
        return {"n": n, "hash": digest, "counts": counts.pivot(on="label", index="capability", values="n").fill_null(0)}

    def capability_run_stats(self, version: str, outcomes: pl.DataFrame) -> pl.DataFrame:
        """``identify.stats.run_stats_sql`` over the labels of dictionary ``version`` against
        ``outcomes`` (``trajectory_id``, ``success``: the current D+ and D-), also kept in the table
        ``capability_run_stats`` (replaced each time)."""
        with self.connect() as conn:
            conn.register("outcomes", outcomes.to_arrow())
            runs = run_stats_sql(conn, version)
            conn.register("runs", runs.to_arrow())
            conn.execute("CREATE OR REPLACE TABLE capability_run_stats AS SELECT ?::VARCHAR AS dictionary_version, * "
                         "FROM runs", [version])
        return runs

    def trajectories_by_id(self, ids: Sequence[str]) -> list[dict[str, Any]]:
        """The stored records among ``ids`` (decoded like ``trajectories``)."""
        if not ids:
            return []
        frame = self.query("SELECT * FROM trajectories WHERE list_contains(?, trajectory_id)", [list(ids)])
        return [_decoded(row) for row in frame.to_dicts()]

    def query(self, sql: str, params: Sequence[Any] | None = None) -> pl.DataFrame:
        """Run a read query and return a polars frame."""
        with self.connect() as conn:
            return conn.sql(sql, params=list(params or [])).pl()

    def trajectories(self, **equals: Any) -> list[dict[str, Any]]:
        """Trajectory records matching column equalities, with messages and info decoded.

        Readers that are about one agent pass ``agent_id``: rows of other agents (an earlier
        warm-start, adapter, backend or dtype) are kept in the store but never mixed in."""
        where = " AND ".join(f"{col} = ?" for col in equals) or "TRUE"
        for col in equals:
            if col not in TRAJECTORY_COLUMNS:
                raise ValueError(f"unknown trajectory column {col!r}")
        frame = self.query(
            f"SELECT * FROM trajectories WHERE {where} ORDER BY trajectory_id", list(equals.values())
        )
        return [_decoded(row) for row in frame.to_dicts()]

    def agent_trajectories(self, *, split: str, agent_id: str, policy: str = "base",
                           imported: bool = True) -> list[dict[str, Any]]:
        """The ``split`` rows of one agent: those the pipeline recorded under ``agent_id`` and, with
        ``imported``, logs imported under ``policy`` without an agent id (the importer's user says
        which agent they are from; see the trajectory schema). Rows the pipeline wrote for any
        other agent, and rows from before agent ids (``''`` with ``source = 'base_rollout'``), are
        left out. Decoded as :meth:`trajectories` does."""
        frame = self.query(
            "SELECT * FROM trajectories WHERE split = ? AND policy = ? AND (agent_id = ? OR (? AND agent_id = '' "
            "AND source <> ?)) ORDER BY trajectory_id", [split, policy, agent_id, imported, PIPELINE_SOURCE])
        return [_decoded(row) for row in frame.to_dicts()]


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    row["messages"] = json.loads(row["messages"])
    row["info"] = json.loads(row["info"])
    row["created_at"] = row["created_at"].isoformat()
    return row


def _casts() -> list[str]:
    return [
        "CAST(created_at AS TIMESTAMPTZ)" if col == "created_at" else col
        for col in TRAJECTORY_COLUMNS
    ]


def _records_frame(records: Sequence[dict[str, Any]]) -> pl.DataFrame:
    rows = [
        {
            **{col: rec.get(col) for col in TRAJECTORY_COLUMNS},
            "messages": json.dumps(rec["messages"], ensure_ascii=False),
            "info": json.dumps(rec["info"], ensure_ascii=False, default=str),
            "reward": float(rec["reward"]),
            "success": bool(rec["success"]),
            "agent_id": rec.get("agent_id") or "",
        }
        for rec in records
    ]
    return pl.DataFrame(rows, schema={col: _POLARS_TYPES[col] for col in TRAJECTORY_COLUMNS})


_POLARS_TYPES = {
    "trajectory_id": pl.String, "task_id": pl.String, "env": pl.String, "split": pl.String,
    "policy": pl.String, "messages": pl.String, "reward": pl.Float64, "success": pl.Boolean,
    "info": pl.String, "source": pl.String, "created_at": pl.String, "agent_id": pl.String,
}
