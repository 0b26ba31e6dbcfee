"""Contrastive statistics of Step 1, exactly as DESIGN.md defines them, and the selection of C*.

Per labelling run r and capability c, over that run's labels, with F the failed and P the passed
trajectories and ``total_failed = |F|``:

* ER-(c) = LACKING_F / (LACKING_F + PRESENT_F)   (NA excluded; a zero denominator gives 0)
* ER+(c) = LACKING_P / (LACKING_P + PRESENT_P)   (NA excluded; a zero denominator gives 0)
* Delta(c) = ER-(c) - ER+(c)
* Cov(c) = LACKING_F / total_failed               (NA included; a zero denominator gives 0)
* c passes run r when Delta >= delta and Cov >= rho; it is selected when it passes >= K of N runs.

``run_stats_sql`` computes this in DuckDB over the ``labels`` table joined to the ``outcomes`` of
the current trajectory set; ``run_stats_reference`` is the straightforward Python twin that the
tests and the benchmark compare against. Thresholds live only in ``select``, so changing them never
invalidates the stats.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import duckdb
import polars as pl

COUNT_COLUMNS = ("lacking_f", "present_f", "na_f", "lacking_p", "present_p", "na_p")

RUN_STATS_SQL = """
WITH l AS (
    SELECT lb.run, lb.capability, lb.label, o.success
    FROM labels lb JOIN outcomes o USING (trajectory_id)
    WHERE lb.dictionary_version = $version
),
failed AS (SELECT count(*) FILTER (WHERE NOT success) AS total_failed, count(*) FILTER (WHERE success) AS total_passed FROM outcomes),
counts AS (
    SELECT run, capability,
        count(*) FILTER (WHERE label = 'LACKING' AND NOT success) AS lacking_f,
        count(*) FILTER (WHERE label = 'PRESENT' AND NOT success) AS present_f,
        count(*) FILTER (WHERE label = 'NA'      AND NOT success) AS na_f,
        count(*) FILTER (WHERE label = 'LACKING' AND success)     AS lacking_p,
        count(*) FILTER (WHERE label = 'PRESENT' AND success)     AS present_p,
        count(*) FILTER (WHERE label = 'NA'      AND success)     AS na_p
    FROM l GROUP BY run, capability
)
SELECT c.*, f.total_failed, f.total_passed,
    CASE WHEN lacking_f + present_f = 0 THEN 0.0 ELSE lacking_f / (lacking_f + present_f) END AS er_minus,
    CASE WHEN lacking_p + present_p = 0 THEN 0.0 ELSE lacking_p / (lacking_p + present_p) END AS er_plus,
    er_minus - er_plus AS delta,
    CASE WHEN f.total_failed = 0 THEN 0.0 ELSE lacking_f / f.total_failed END AS cov
FROM counts c CROSS JOIN failed f
ORDER BY capability, run
"""


def run_stats_sql(conn: duckdb.DuckDBPyConnection, version: str) -> pl.DataFrame:
    """Per (run, capability) counts and rates. Needs tables/views ``labels`` and ``outcomes``
    (``outcomes(trajectory_id, success)`` = the current D+ and D-)."""
    return conn.sql(RUN_STATS_SQL, params={"version": version}).pl()


def _rate(num: int, den: int) -> float:
    return num / den if den else 0.0


def run_stats_reference(labels: Iterable[tuple[str, str, int, str]], success: dict[str, bool]) -> list[dict[str, Any]]:
    """The Python reference: ``labels`` are (trajectory_id, capability, run, label) tuples."""
    counts: dict[tuple[int, str], dict[str, int]] = defaultdict(lambda: dict.fromkeys(COUNT_COLUMNS, 0))
    for trajectory_id, capability, run, label in labels:
        if trajectory_id not in success:
            continue
        side = "p" if success[trajectory_id] else "f"
        counts[(run, capability)][f"{label.lower()}_{side}"] += 1
    total_failed = sum(not s for s in success.values())
    total_passed = len(success) - total_failed
    rows = []
    for (run, capability), c in sorted(counts.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        er_minus = _rate(c["lacking_f"], c["lacking_f"] + c["present_f"])
        er_plus = _rate(c["lacking_p"], c["lacking_p"] + c["present_p"])
        rows.append({
            "run": run, "capability": capability, **c, "total_failed": total_failed, "total_passed": total_passed,
            "er_minus": er_minus, "er_plus": er_plus, "delta": er_minus - er_plus,
            "cov": _rate(c["lacking_f"], total_failed),
        })
    return rows


def aggregate(run_stats: pl.DataFrame) -> pl.DataFrame:
    """Per capability over runs: mean and (population) std of Delta and Cov, and the number of runs."""
    return (
        run_stats.group_by("capability")
        .agg(
            pl.len().alias("n_runs"),
            pl.col("delta").mean().alias("delta_mean"), pl.col("delta").std(ddof=0).alias("delta_std"),
            pl.col("cov").mean().alias("cov_mean"), pl.col("cov").std(ddof=0).alias("cov_std"),
            pl.col("er_minus").mean().alias("er_minus_mean"), pl.col("er_plus").mean().alias("er_plus_mean"),
        )
        .sort("capability")
    )


# --- selection -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SelectionRule:
    """How C* is chosen. ``method``: ``threshold`` (Delta >= delta) or ``ztest`` / ``bootstrap``
    (Delta significantly > 0 at level ``alpha``, a data-driven alternative to a fixed delta).
    Cov >= rho and K-of-N apply to every method.

    Also the ``[selection]`` settings section. There N and K are left open (``runs = 0``): N is the
    analyst's (``[analyst] runs``), and :meth:`for_analyst` fills both in."""

    delta: float = 0.20
    rho: float = 0.10
    runs: int = 1
    """N, the labelling runs; 0 = not known yet (the settings section), see :meth:`for_analyst`."""
    min_runs_passed: int = 1
    """K; 0 with ``runs = 0`` = the analyst's default (:meth:`for_analyst`)."""
    method: str = "threshold"
    alpha: float = 0.05
    bootstrap_samples: int = 2000
    seed: int = 0
    max_selected: int = 0
    """A training budget: keep at most this many of the passing capabilities, by mean Delta
    (ties by name); the rest are reported as ``deferred``. 0 keeps every passing capability."""

    def __post_init__(self) -> None:
        if self.max_selected < 0:
            raise ValueError(f"max_selected must be >= 0, not {self.max_selected}")
        if self.method not in ("threshold", "ztest", "bootstrap"):
            raise ValueError(f"selection method {self.method!r} must be threshold, ztest or bootstrap")
        if self.runs and not 1 <= self.min_runs_passed <= self.runs:
            raise ValueError(f"need 1 <= K={self.min_runs_passed} <= N={self.runs}")
        if self.runs < 0 or self.min_runs_passed < 0:
            raise ValueError(f"N={self.runs} and K={self.min_runs_passed} must be >= 0")

    def for_analyst(self, kind: str, runs: int) -> "SelectionRule":
        """This rule for ``runs`` labelling runs (N) of a ``kind`` analyst. K = 0 takes the default:
        1 for the deterministic ``heuristic`` analyst, min(8, N) for an LLM analyst (the paper's 8
        of 10)."""
        if self.runs and self.runs != runs:
            raise ValueError(f"the selection rule's N={self.runs} is not the analyst's {runs} runs: "
                             "N is set by [analyst] runs")
        k = self.min_runs_passed or (1 if kind == "heuristic" else min(8, runs))
        return replace(self, runs=runs, min_runs_passed=k)


def ztest_pvalue(lacking_f: int, present_f: int, lacking_p: int, present_p: int) -> float:
    """One-sided two-proportion z-test of H1: ER- > ER+ (pooled variance). 1.0 when undefined."""
    n_f, n_p = lacking_f + present_f, lacking_p + present_p
    if n_f == 0 or n_p == 0:
        return 1.0
    pooled = (lacking_f + lacking_p) / (n_f + n_p)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_f + 1 / n_p))
    diff = lacking_f / n_f - lacking_p / n_p
    if se == 0:
        return 0.0 if diff > 0 else 1.0
    return 0.5 * math.erfc((diff / se) / math.sqrt(2))


def bootstrap_lower(lacking_f: int, present_f: int, lacking_p: int, present_p: int, *, alpha: float, samples: int, seed: int) -> float:
    """The one-sided (1 - alpha) lower confidence bound of Delta by a seeded percentile bootstrap."""
    n_f, n_p = lacking_f + present_f, lacking_p + present_p
    if n_f == 0:
        return -1.0
    rng = random.Random(seed)
    deltas = []
    for _ in range(samples):
        er_minus = sum(rng.random() < lacking_f / n_f for _ in range(n_f)) / n_f
        er_plus = sum(rng.random() < lacking_p / n_p for _ in range(n_p)) / n_p if n_p else 0.0
        deltas.append(er_minus - er_plus)
    deltas.sort()
    return deltas[int(alpha * samples)]


def passes(rule: SelectionRule, row: dict[str, Any], method: str | None = None) -> bool:
    """Whether one run's row passes under ``method`` (default: the rule's)."""
    method = method or rule.method
    if row["cov"] < rule.rho:
        return False
    counts = (row["lacking_f"], row["present_f"], row["lacking_p"], row["present_p"])
    if method == "threshold":
        return row["delta"] >= rule.delta
    if method == "ztest":
        return ztest_pvalue(*counts) < rule.alpha
    return bootstrap_lower(*counts, alpha=rule.alpha, samples=rule.bootstrap_samples, seed=rule.seed) > 0


def select(rule: SelectionRule, run_stats: pl.DataFrame) -> pl.DataFrame:
    """Per capability: runs passed under each method, the p-value, and ``selected`` under the rule.

    A capability with fewer labelled runs than N can still be selected if it passed K of them;
    the label-completeness check is what guards against missing runs. With ``rule.max_selected``
    only the top passing capabilities by mean Delta stay ``selected``; the others get ``deferred``.
    """
    if not rule.runs:
        raise ValueError("the selection rule's N and K are not set: use rule.for_analyst(kind, runs)")
    rows = []
    for capability, group in run_stats.sort("run").group_by("capability", maintain_order=True):
        runs = group.to_dicts()
        passed = {m: sum(passes(rule, r, m) for r in runs) for m in ("threshold", "ztest", "bootstrap")}
        pooled = {k: sum(r[k] for r in runs) for k in ("lacking_f", "present_f", "lacking_p", "present_p")}
        rows.append({
            "capability": capability[0],
            "runs": len(runs),
            "runs_passed": passed[rule.method],
            "runs_passed_threshold": passed["threshold"],
            "runs_passed_ztest": passed["ztest"],
            "runs_passed_bootstrap": passed["bootstrap"],
            "pvalue_pooled": ztest_pvalue(**pooled),
            "selected": passed[rule.method] >= rule.min_runs_passed,
            "selected_threshold": passed["threshold"] >= rule.min_runs_passed,
            "selected_significance": passed["ztest"] >= rule.min_runs_passed,
            "deferred": False,
            "_delta": sum(r["delta"] for r in runs) / len(runs),
        })
    if rule.max_selected:
        ranked = sorted((r for r in rows if r["selected"]), key=lambda r: (-r["_delta"], r["capability"]))
        for row in ranked[rule.max_selected:]:
            row["selected"], row["deferred"] = False, True
    for row in rows:
        del row["_delta"]
    return pl.DataFrame(rows) if rows else pl.DataFrame(schema={"capability": pl.String, "selected": pl.Boolean})
