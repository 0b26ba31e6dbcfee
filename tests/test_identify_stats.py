"""Step 1 formulas, pinned on hand-made label sets (DESIGN.md's definitions, exactly)."""

from __future__ import annotations

import random

import duckdb
import polars as pl
import pytest

from trace_assets.identify.stats import (
    SelectionRule, aggregate, bootstrap_lower, run_stats_reference, run_stats_sql, select, ztest_pvalue,
)

# 4 failed (f1..f4), 2 passed (p1, p2).
SUCCESS = {"f1": False, "f2": False, "f3": False, "f4": False, "p1": True, "p2": True}
LABELS = [
    # auth: F = LACKING, LACKING, PRESENT, NA ; P = PRESENT, NA
    ("f1", "auth", 0, "LACKING"), ("f2", "auth", 0, "LACKING"), ("f3", "auth", 0, "PRESENT"), ("f4", "auth", 0, "NA"),
    ("p1", "auth", 0, "PRESENT"), ("p2", "auth", 0, "NA"),
    # confirm: only NA in P (zero denominator gives ER+ = 0), one LACKING in F
    ("f1", "confirm", 0, "LACKING"), ("f2", "confirm", 0, "NA"), ("f3", "confirm", 0, "NA"), ("f4", "confirm", 0, "NA"),
    ("p1", "confirm", 0, "NA"), ("p2", "confirm", 0, "NA"),
    # ground: all NA in F (ER- = 0), LACKING in P: negative delta
    ("f1", "ground", 0, "NA"), ("f2", "ground", 0, "NA"), ("f3", "ground", 0, "NA"), ("f4", "ground", 0, "NA"),
    ("p1", "ground", 0, "LACKING"), ("p2", "ground", 0, "PRESENT"),
]


def _sql(labels, success, version="v1"):
    conn = duckdb.connect()
    conn.execute("CREATE TABLE labels (trajectory_id VARCHAR, capability VARCHAR, run INTEGER, label VARCHAR, dictionary_version VARCHAR)")
    conn.executemany("INSERT INTO labels VALUES (?, ?, ?, ?, ?)", [(*l, version) for l in labels])
    conn.execute("INSERT INTO labels VALUES ('f1', 'auth', 0, 'PRESENT', 'old-version')")  # other versions are ignored
    outcomes = pl.DataFrame({"trajectory_id": list(success), "success": list(success.values())})
    conn.register("outcomes", outcomes.to_arrow())
    return run_stats_sql(conn, version)


def test_hand_computed_values():
    rows = {r["capability"]: r for r in run_stats_reference(LABELS, SUCCESS)}
    auth = rows["auth"]
    assert (auth["lacking_f"], auth["present_f"], auth["na_f"], auth["lacking_p"], auth["present_p"], auth["na_p"]) == (2, 1, 1, 0, 1, 1)
    assert auth["er_minus"] == pytest.approx(2 / 3)  # NA excluded
    assert auth["er_plus"] == 0.0
    assert auth["delta"] == pytest.approx(2 / 3)
    assert auth["cov"] == pytest.approx(2 / 4)  # NA included: |F| = 4
    confirm = rows["confirm"]
    assert confirm["er_minus"] == 1.0 and confirm["er_plus"] == 0.0  # zero denominator -> 0
    assert confirm["cov"] == pytest.approx(0.25)
    ground = rows["ground"]
    assert ground["er_minus"] == 0.0 and ground["er_plus"] == 0.5 and ground["delta"] == -0.5 and ground["cov"] == 0.0


def test_sql_matches_reference_exactly():
    sql = _sql(LABELS, SUCCESS).sort("capability", "run")
    ref = pl.DataFrame(run_stats_reference(LABELS, SUCCESS)).sort("capability", "run")
    for col in ("lacking_f", "present_f", "na_f", "lacking_p", "present_p", "na_p", "total_failed", "total_passed"):
        assert sql[col].to_list() == ref[col].to_list(), col
    for col in ("er_minus", "er_plus", "delta", "cov"):
        assert sql[col].to_list() == pytest.approx(ref[col].to_list()), col


def test_sql_matches_reference_on_random_runs():
    rng = random.Random(3)
    success = {f"t{i}": rng.random() < 0.4 for i in range(60)}
    labels = [(t, f"c{c}", r, rng.choice(["NA", "PRESENT", "LACKING"])) for t in success for c in range(4) for r in range(5)]
    sql = _sql(labels, success).sort("capability", "run")
    ref = pl.DataFrame(run_stats_reference(labels, success)).sort("capability", "run")
    assert sql["delta"].to_list() == pytest.approx(ref["delta"].to_list())
    assert sql["cov"].to_list() == pytest.approx(ref["cov"].to_list())


def test_no_failures_gives_zero_coverage():
    success = {"p1": True, "p2": True}
    rows = run_stats_reference([("p1", "a", 0, "LACKING"), ("p2", "a", 0, "PRESENT")], success)
    assert rows[0]["cov"] == 0.0 and rows[0]["er_minus"] == 0.0 and rows[0]["delta"] == -0.5
    assert _sql([("p1", "a", 0, "LACKING"), ("p2", "a", 0, "PRESENT")], success)["cov"].to_list() == [0.0]


def _runs(deltas_covs):
    return pl.DataFrame([
        {"capability": "c", "run": r, "delta": d, "cov": c, "lacking_f": 5, "present_f": 5, "lacking_p": 1, "present_p": 9,
         "er_minus": 0.5, "er_plus": 0.1}
        for r, (d, c) in enumerate(deltas_covs)
    ])


def test_selection_boundaries_and_k_of_n():
    rule = SelectionRule(delta=0.2, rho=0.1, runs=10, min_runs_passed=8)
    # exactly at the thresholds passes (>=), just below fails
    eight = [(0.2, 0.1)] * 8 + [(0.19, 0.5), (0.5, 0.09)]
    seven = [(0.2, 0.1)] * 7 + [(0.19, 0.5)] * 3
    assert select(rule, _runs(eight)).row(0, named=True)["selected"] is True
    assert select(rule, _runs(seven)).row(0, named=True)["runs_passed"] == 7
    assert select(rule, _runs(seven)).row(0, named=True)["selected"] is False


def test_training_budget_keeps_the_top_passing_capabilities_by_delta():
    runs = pl.concat([
        _runs([(d, 0.5)]).with_columns(pl.lit(name).alias("capability"))
        for name, d in (("weak", 0.25), ("strong", 0.7), ("middle", 0.4), ("tied_a", 0.4), ("below", 0.1))
    ])
    table = {r["capability"]: r for r in select(SelectionRule(max_selected=3), runs).iter_rows(named=True)}
    assert {n for n, r in table.items() if r["selected"]} == {"strong", "middle", "tied_a"}  # tie broken by name
    assert {n for n, r in table.items() if r["deferred"]} == {"weak"}  # passed, but over the budget
    assert table["below"]["selected"] is False and table["below"]["deferred"] is False
    assert sum(select(SelectionRule(), runs)["selected"]) == 4  # 0 = no budget
    with pytest.raises(ValueError, match="max_selected"):
        SelectionRule(max_selected=-1)


def test_aggregate_mean_and_std():
    agg = aggregate(_runs([(0.2, 0.1), (0.4, 0.3)])).row(0, named=True)
    assert agg["delta_mean"] == pytest.approx(0.3) and agg["delta_std"] == pytest.approx(0.1)
    assert agg["cov_mean"] == pytest.approx(0.2) and agg["n_runs"] == 2


def test_significance_alternatives():
    assert ztest_pvalue(10, 0, 0, 10) < 0.001
    assert ztest_pvalue(5, 5, 5, 5) == pytest.approx(0.5)
    assert ztest_pvalue(0, 0, 3, 3) == 1.0  # undefined -> not significant
    assert bootstrap_lower(18, 2, 2, 18, alpha=0.05, samples=500, seed=0) > 0.4
    assert bootstrap_lower(5, 5, 5, 5, alpha=0.05, samples=500, seed=0) < 0
    rule = SelectionRule(method="ztest", alpha=0.05)
    row = select(rule, _runs([(0.4, 0.5)])).row(0, named=True)
    assert row["runs_passed_ztest"] == 1 and row["selected"] is True
    with pytest.raises(ValueError):
        SelectionRule(runs=10, min_runs_passed=11)
