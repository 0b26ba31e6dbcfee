"""Step-1 statistics on 1,000,000 synthetic label rows: DuckDB SQL against the Python reference.

10 runs x 20 capabilities x 5,000 trajectories. Both compute the same per-(run, capability)
table (checked here); the script prints both wall times and the ratio. Target: DuckDB < 2 s.

    .venv/bin/python benchmarks/label_stats.py
"""

from __future__ import annotations

import argparse
import time

import duckdb
import polars as pl

from trace_assets.identify.stats import run_stats_reference, run_stats_sql


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--capabilities", type=int, default=20)
    parser.add_argument("--trajectories", type=int, default=5000)
    args = parser.parse_args()

    conn = duckdb.connect()
    conn.execute(f"""
        CREATE TABLE labels AS
        SELECT 't' || t AS trajectory_id, 'cap_' || c AS capability, r AS run,
               (['NA', 'PRESENT', 'LACKING'])[1 + CAST(floor(random() * 3) AS INTEGER)] AS label,
               'v1' AS dictionary_version
        FROM range({args.trajectories}) a(t), range({args.capabilities}) b(c), range({args.runs}) d(r)
    """)
    conn.execute(f"CREATE TABLE outcomes AS SELECT 't' || t AS trajectory_id, random() < 0.4 AS success FROM range({args.trajectories}) a(t)")
    n_rows = conn.execute("SELECT count(*) FROM labels").fetchall()[0][0]

    start = time.perf_counter()
    sql = run_stats_sql(conn, "v1")
    t_sql = time.perf_counter() - start

    labels = conn.execute("SELECT trajectory_id, capability, run, label FROM labels").fetchall()
    success = dict(conn.execute("SELECT trajectory_id, success FROM outcomes").fetchall())
    start = time.perf_counter()
    ref = pl.DataFrame(run_stats_reference(labels, success))
    t_ref = time.perf_counter() - start

    joined = sql.sort("capability", "run").select("delta", "cov")
    expected = ref.sort("capability", "run").select("delta", "cov")
    assert (joined - expected).select(pl.all().abs().max()).max_horizontal().item() < 1e-12, "SQL and reference disagree"

    print(f"label rows:            {n_rows:,}")
    print(f"(run, capability) rows: {sql.height}")
    print(f"DuckDB SQL:            {t_sql:.3f} s   (target < 2 s: {'met' if t_sql < 2 else 'MISSED'})")
    print(f"Python reference:      {t_ref:.3f} s   (label tuples already in memory)")
    print(f"ratio reference/DuckDB: {t_ref / t_sql:.1f}x")


if __name__ == "__main__":
    main()
