"""Routing evaluation: accuracy, confusion, the hindsight oracle, attribution, tables and plots.

Conventions: a "system" is an adapter name or the base. The base may be keyed ``None`` or ``"base"``
(:data:`~trace_assets.route.router.BASE_NAME`); choices are written ``"base"`` in tables. A task
succeeds when its reward is ``>= success_threshold`` (default 1.0, the tau2-bench convention
``success = reward == 1``). Plots return PNG bytes (matplotlib, Agg backend).

* :func:`oracle_choice`: per task, the adapter with the highest reward; the base (``None``) when no
  adapter beats the base strictly (ties go to the base); ties between adapters go to the first in
  dict order.
* :func:`attribution`: per adapter, the task ids it ``fixed`` (base failed, adapter succeeded) and
  ``broke`` (base succeeded, adapter failed).
"""

from __future__ import annotations

import io
import math
from typing import Any, Mapping, Sequence

import polars as pl

from trace_assets.route.router import BASE_NAME, Decision


def _choice(d: Decision | str | None) -> str | None:
    if isinstance(d, Decision):
        return d.choice
    return None if d in (None, BASE_NAME) else d


def _name(choice: str | None) -> str:
    return BASE_NAME if choice is None else choice


def _is_base(system: str | None) -> bool:
    return system is None or system == BASE_NAME


def routing_accuracy(decisions: Sequence[Decision | str | None], targets: Sequence[str | None]) -> float:
    """Share of decisions equal to their target (``None``/``"base"`` both mean base). 0.0 when empty."""
    if len(decisions) != len(targets):
        raise ValueError(f"{len(decisions)} decisions but {len(targets)} targets")
    if not targets:
        return 0.0
    return sum(_choice(d) == _choice(t) for d, t in zip(decisions, targets)) / len(targets)


def confusion_matrix(decisions: Sequence[Decision | str | None],
                     labels_or_families: Sequence[str | None]) -> pl.DataFrame:
    """Counts: one row per true label/family (column ``target``), one column per routed choice.

    Rows and choice columns are sorted by name; ``None`` is written ``"base"``; missing cells are 0.
    """
    if len(decisions) != len(labels_or_families):
        raise ValueError(f"{len(decisions)} decisions but {len(labels_or_families)} labels")
    targets = [_name(_choice(t)) for t in labels_or_families]
    chosen = [_name(_choice(d)) for d in decisions]
    rows = sorted(set(targets))
    cols = sorted(set(chosen))
    counts = {(t, c): 0 for t in rows for c in cols}
    for t, c in zip(targets, chosen):
        counts[(t, c)] += 1
    data: dict[str, list[Any]] = {"target": rows}
    for c in cols:
        data[c] = [counts[(t, c)] for t in rows]
    return pl.DataFrame(data, schema={"target": pl.String, **{c: pl.Int64 for c in cols}})


def _split_base(per_system: Mapping[str | None, Sequence[float]]) -> tuple[Sequence[float], dict[str, Sequence[float]]]:
    base = [v for k, v in per_system.items() if _is_base(k)]
    if len(base) != 1:
        raise ValueError("per-system rewards need exactly one base entry (key None or 'base')")
    adapters = {k: v for k, v in per_system.items() if not _is_base(k)}
    n = len(base[0])
    if any(len(v) != n for v in adapters.values()):
        raise ValueError("every system needs one reward per task")
    return base[0], adapters  # type: ignore[return-value]


def oracle_choice(per_system_rewards: Mapping[str | None, Sequence[float]]) -> list[str | None]:
    """The best system per task in hindsight (see the module docstring)."""
    base, adapters = _split_base(per_system_rewards)
    out: list[str | None] = []
    for i, b in enumerate(base):
        best, best_reward = None, float(b)
        for name, rewards in adapters.items():
            if float(rewards[i]) > best_reward:
                best, best_reward = name, float(rewards[i])
        out.append(best)
    return out


def oracle_rewards(per_system_rewards: Mapping[str | None, Sequence[float]]) -> list[float]:
    """Reward of the oracle choice per task (the routing upper bound)."""
    base, adapters = _split_base(per_system_rewards)
    choices = oracle_choice(per_system_rewards)
    return [float(base[i]) if c is None else float(adapters[c][i]) for i, c in enumerate(choices)]


def routed_rewards(decisions: Sequence[Decision | str | None],
                   per_system_rewards: Mapping[str | None, Sequence[float]]) -> list[float]:
    """Reward per task of the system each decision chose (when every system ran every task)."""
    base, adapters = _split_base(per_system_rewards)
    out = []
    for i, d in enumerate(decisions):
        c = _choice(d)
        out.append(float(base[i]) if c is None else float(adapters[c][i]))
    return out


def attribution(base_rewards: Sequence[float], adapter_rewards: Mapping[str, Sequence[float]], *,
                task_ids: Sequence[str] | None = None, success_threshold: float = 1.0) -> dict[str, dict[str, list[str]]]:
    """Per adapter: ``{"fixed": [task ids], "broke": [task ids]}`` against the base."""
    ids = list(task_ids) if task_ids is not None else [str(i) for i in range(len(base_rewards))]
    if len(ids) != len(base_rewards):
        raise ValueError("task_ids and base_rewards differ in length")
    out: dict[str, dict[str, list[str]]] = {}
    for name, rewards in adapter_rewards.items():
        if len(rewards) != len(base_rewards):
            raise ValueError(f"adapter {name!r} has {len(rewards)} rewards for {len(base_rewards)} tasks")
        fixed, broke = [], []
        for tid, b, a in zip(ids, base_rewards, rewards):
            base_ok, ad_ok = float(b) >= success_threshold, float(a) >= success_threshold
            if ad_ok and not base_ok:
                fixed.append(tid)
            elif base_ok and not ad_ok:
                broke.append(tid)
        out[name] = {"fixed": fixed, "broke": broke}
    return out


def paired_comparison(a: Sequence[float], b: Sequence[float], *, success_threshold: float = 1.0) -> dict[str, Any]:
    """System ``a`` against system ``b`` on the same tasks: ``wins`` (a succeeds where b fails),
    ``losses`` (the reverse), ``delta`` (success-rate difference) and ``p_value``, the exact
    two-sided McNemar (sign) test on the discordant tasks: how likely a split at least this uneven
    is when neither system is better; ``p_greater``, its one-sided form (how likely at least this
    many wins are when ``a`` is no better than ``b``). Both 1.0 when no task is discordant."""
    if len(a) != len(b):
        raise ValueError(f"paired comparison needs the same tasks: {len(a)} vs {len(b)} rewards")
    ok_a = [float(x) >= success_threshold for x in a]
    ok_b = [float(x) >= success_threshold for x in b]
    wins = sum(x and not y for x, y in zip(ok_a, ok_b))
    losses = sum(y and not x for x, y in zip(ok_a, ok_b))
    n = wins + losses
    tail = sum(math.comb(n, i) for i in range(min(wins, losses) + 1)) / 2**n if n else 1.0
    greater = sum(math.comb(n, i) for i in range(wins, n + 1)) / 2**n if n else 1.0
    return {"wins": wins, "losses": losses, "delta": (wins - losses) / len(a) if len(a) else 0.0,
            "p_value": min(1.0, 2 * tail), "p_greater": greater}


def success_table(per_system_rewards: Mapping[str | None, Sequence[float]], *, success_threshold: float = 1.0,
                  rollouts_spent: Mapping[str | None, int] | None = None) -> pl.DataFrame:
    """One row per system, in the given order: ``system, n, success_rate, mean_reward`` (and
    ``rollouts_spent`` when given; missing systems get null)."""
    rows = []
    spent = {_name(None if _is_base(k) else k): v for k, v in (rollouts_spent or {}).items()}
    for system, rewards in per_system_rewards.items():
        name = _name(None if _is_base(system) else system)
        n = len(rewards)
        row: dict[str, Any] = {
            "system": name, "n": n,
            "success_rate": sum(float(r) >= success_threshold for r in rewards) / n if n else 0.0,
            "mean_reward": sum(float(r) for r in rewards) / n if n else 0.0,
        }
        if rollouts_spent is not None:
            row["rollouts_spent"] = spent.get(name)
        rows.append(row)
    schema: dict[str, Any] = {"system": pl.String, "n": pl.Int64, "success_rate": pl.Float64, "mean_reward": pl.Float64}
    if rollouts_spent is not None:
        schema["rollouts_spent"] = pl.Int64
    return pl.DataFrame(rows, schema=schema)


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def plot_success_by_system(table: pl.DataFrame, *, title: str = "Success rate by system") -> bytes:
    """PNG bar chart of ``success_rate`` per ``system`` (a :func:`success_table`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = table["system"].to_list()
    rates = table["success_rate"].to_list()
    fig, ax = plt.subplots(figsize=(max(4.0, 0.8 * len(systems) + 2), 3.2))
    bars = ax.bar(range(len(systems)), rates, color="#4C72B0")
    for bar, rate in zip(bars, rates):
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.01, f"{rate:.2f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(systems)), systems, rotation=30, ha="right")
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("success rate")
    ax.set_title(title)
    return _png(fig)


def plot_success_vs_rollouts(curves: Mapping[str, Sequence[tuple[float, float]]], *,
                             title: str = "Success against rollouts spent") -> bytes:
    """PNG line/scatter plot: per system (e.g. ``"TRACE"``, ``"GRPO baseline"``), points of
    ``(rollouts spent, success rate)``; a single point is drawn as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for name, points in curves.items():
        pts = sorted(points)
        if not pts:
            continue
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("rollouts spent")
    ax.set_ylabel("success rate")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=8)
    ax.set_title(title)
    return _png(fig)
