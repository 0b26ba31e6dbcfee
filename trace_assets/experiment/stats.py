"""Statistics of the experiment: success over seeds with paired bootstrap intervals, and pass^k.

Data shape. An *outcome matrix* is one row per training seed and one column per test task: the
task's success (1/0, or a reward in [0, 1]) for one system trained with that seed. Every system of
one experiment has the same seeds in the same order and the same tasks in the same order; a system
that does not train (the base) repeats its row for every seed.

* :func:`paired_bootstrap`: each system's success as the mean over seeds (of each seed's mean over
  tasks: with equal task counts, the mean of the whole matrix), with a percentile interval from a
  two-way bootstrap over tasks x seeds: every replicate draws ``n_tasks`` task columns and ``n_seeds``
  seed rows with replacement, and the replicate's value is the mean of the drawn cells. It is
  *paired*: one replicate uses the same draws for every system, so a contrast ``a - b`` is computed
  cell by cell on the same tasks and seeds, and the shared task difficulty cancels. Deterministic
  given ``seed``.
* :func:`pass_hat_k`: pass^k as tau2-bench defines it, for ``n`` trials per task of which ``c``
  succeeded: the mean over tasks of ``C(c, k) / C(n, k)``, the probability that ``k`` trials drawn
  without replacement all succeed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

LEVEL = 0.95
SAMPLES = 10_000


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided percentile interval at ``level``."""

    estimate: float
    low: float
    high: float
    level: float = LEVEL

    def excludes_zero(self) -> bool:
        return self.low > 0.0 or self.high < 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def text(self, scale: float = 100.0, digits: int = 1) -> str:
        """``"40.7 [33.3, 48.1]"`` (percentage points by default)."""
        return f"{self.estimate * scale:.{digits}f} [{self.low * scale:.{digits}f}, {self.high * scale:.{digits}f}]"


def outcome_matrix(rows: Sequence[Sequence[float | bool]]) -> np.ndarray:
    """``rows`` (seeds x tasks) as a float array; raises on ragged, empty or out-of-[0, 1] input."""
    matrix = np.asarray([[float(x) for x in row] for row in rows], dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] == 0 or matrix.shape[1] == 0:
        raise ValueError(f"an outcome matrix needs >= 1 seed and >= 1 task, with one value per task in every row; "
                         f"got shape {matrix.shape}")
    if not np.all((matrix >= 0.0) & (matrix <= 1.0)):
        raise ValueError("outcomes must lie in [0, 1]")
    return matrix


def paired_bootstrap(outcomes: Mapping[str, Sequence[Sequence[float | bool]]], *,
                     contrasts: Sequence[tuple[str, str]] = (), samples: int = SAMPLES, level: float = LEVEL,
                     seed: int = 0) -> tuple[dict[str, Interval], dict[tuple[str, str], Interval]]:
    """``({system: Interval}, {(a, b): Interval of a - b})`` (module docstring).

    ``outcomes[system]`` is a seeds x tasks matrix; all must have the same shape. The estimate is
    the mean of the observed matrix (of ``a - b`` for a contrast); the interval is the
    ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the replicates (numpy's default linear
    interpolation). One seed row gives a bootstrap over tasks only.
    """
    if not outcomes:
        raise ValueError("no systems")
    if samples < 1 or not 0.0 < level < 1.0:
        raise ValueError("samples must be >= 1 and level in (0, 1)")
    matrices = {name: outcome_matrix(rows) for name, rows in outcomes.items()}
    shapes = {m.shape for m in matrices.values()}
    if len(shapes) != 1:
        raise ValueError(f"every system needs the same seeds x tasks; got shapes "
                         f"{ {n: m.shape for n, m in matrices.items()} }")
    for a, b in contrasts:
        for name in (a, b):
            if name not in matrices:
                raise ValueError(f"contrast {a} - {b}: no system {name!r}")
    n_seeds, n_tasks = next(iter(shapes))
    rng = np.random.default_rng(seed)
    seed_draws = rng.integers(0, n_seeds, size=(samples, n_seeds))
    task_draws = rng.integers(0, n_tasks, size=(samples, n_tasks))
    # Replicate r's mean over the drawn cells = (seed weights) . matrix . (task weights) / (n_seeds n_tasks).
    seed_weights = np.stack([np.bincount(row, minlength=n_seeds) for row in seed_draws]).astype(np.float64)
    task_weights = np.stack([np.bincount(row, minlength=n_tasks) for row in task_draws]).astype(np.float64)
    quantiles = ((1.0 - level) / 2.0, (1.0 + level) / 2.0)

    def interval(matrix: np.ndarray) -> Interval:
        replicates = np.einsum("rs,st,rt->r", seed_weights, matrix, task_weights) / (n_seeds * n_tasks)
        low, high = np.quantile(replicates, quantiles)
        return Interval(float(matrix.mean()), float(low), float(high), level)

    systems = {name: interval(m) for name, m in matrices.items()}
    differences = {(a, b): interval(matrices[a] - matrices[b]) for a, b in contrasts}
    return systems, differences


def per_seed_means(rows: Sequence[Sequence[float | bool]]) -> list[float]:
    """Each seed's mean over tasks (the spread the interval summarizes)."""
    return [float(x) for x in outcome_matrix(rows).mean(axis=1)]


def pass_hat_k(trials: Sequence[Sequence[bool | float]], k: int) -> float:
    """tau2-bench's pass^k: ``mean over tasks of C(c, k) / C(n, k)`` with ``n`` the task's trials and
    ``c`` its successes (a trial succeeds when its value is ``>= 1``, tau2's ``reward == 1``).
    Every task needs at least ``k`` trials; ``k >= 1``."""
    if k < 1:
        raise ValueError("k must be >= 1")
    if not trials:
        raise ValueError("no tasks")
    total = 0.0
    for i, task in enumerate(trials):
        n = len(task)
        if n < k:
            raise ValueError(f"task {i} has {n} trials, fewer than k = {k}")
        c = sum(float(x) >= 1.0 for x in task)
        total += math.comb(c, k) / math.comb(n, k)
    return total / len(trials)
