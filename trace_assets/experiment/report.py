"""The experiment's report: per-system success over seeds with intervals, the paired differences,
the forest plot, ``reports/experiment.md`` and the README's results section.

:func:`build_report` turns per-seed, per-task outcomes into a JSON-able dict (the one source of
every number downstream); :func:`report_markdown` renders it for ``reports/experiment.md`` and the
asset metadata; :func:`forest_png` draws it; :func:`readme_section` renders the README's results
section from the same dict, which ``trace readme`` splices between ``<!-- experiment:begin -->``
and ``<!-- experiment:end -->`` (``trace_assets.reports.splice``). All of them are pure.

System names (as ``route.evaluation`` writes them): :data:`BASE`, :data:`TRACE` (routed by the
configured router), :data:`SOFT` (the router's soft composition), ``oracle``, every adapter alone, its null control ``null:<adapter>``,
:data:`GRPO` (GRPO on the target at equal rollouts) and :data:`ABLATION` (GRPO at equal rollouts on
the target families the synthetic environments draw from, with the target's binary reward).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import polars as pl

from trace_assets.experiment.stats import LEVEL, SAMPLES, paired_bootstrap, pass_hat_k, per_seed_means
from trace_assets.figures import forest_plot, to_markdown
from trace_assets.reports import wall_text

BASE, TRACE, SOFT, ORACLE, GRPO, ABLATION = ("base", "trace_routed", "trace_soft", "oracle", "grpo_target",
                                            "grpo_target_families")
CONTRASTS = ((TRACE, BASE), (TRACE, GRPO), (TRACE, ABLATION), (ORACLE, TRACE))
"""The paired differences reported, when both systems were evaluated: the two the claim rests on
first, then isolation against reward shaping, then what routing leaves on the table; then each
adapter alone against its null control (:func:`build_report`)."""
LABELS = {BASE: "base", TRACE: "TRACE routed", SOFT: "TRACE soft routing (composed adapters)",
          ORACLE: "oracle routing", GRPO: "GRPO on target",
          ABLATION: "GRPO on target families, binary reward"}
README_SECTION = "experiment"
"""The README's generated section this report fills (``trace_assets.reports.splice``)."""
REPORT_VERSION = 4  # v2: the LACKING-family contrasts; TRACE's gains and routing by family; v3: the target's checks;
# v4: the promotion gate per seed


def label(system: str) -> str:
    if system in LABELS:
        return LABELS[system]
    if system.startswith("null:"):
        return f"null control of {system[5:]}"
    return f"adapter {system} alone"


def contrast_label(a: str, b: str) -> str:
    return f"adapter {a} − its null control" if b == f"null:{a}" else f"{label(a)} − {label(b)}"


def build_report(outcomes: Mapping[str, Sequence[Sequence[float | bool]]], *, seeds: Sequence[str | int],
                 task_ids: Sequence[str], families: Sequence[str],
                 rollouts: Mapping[str, Sequence[int | None]] | None = None,
                 tokens: Mapping[str, Sequence[int | None]] | None = None,
                 trials: Mapping[str, Sequence[Sequence[bool | float]]] | None = None, pass_k: int = 4,
                 samples: int = SAMPLES, level: float = LEVEL, bootstrap_seed: int = 0,
                 notes: Sequence[str] = (), lacking: Mapping[str, Sequence[str]] | None = None,
                 routed: Mapping[str, Sequence[str | None]] | None = None,
                 checks: Mapping[str, Sequence[Sequence[Mapping[str, bool]]]] | None = None,
                 gates: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The report dict (module docstring). ``outcomes[system]``: seeds x tasks successes, rows in the
    order of ``seeds``, columns in the order of ``task_ids`` (``families`` gives each task's family).
    ``rollouts`` / ``tokens``: per system, what its training spent with each seed (None: not
    recorded). ``trials``: per system, per task (or per (seed, task): pass^k is then the mean over
    seeds), the successes of repeated sampled episodes, for pass^``pass_k``. ``notes``: lines the report carries verbatim (what was cut, and why).
    ``lacking``: per adapter, the families where Step 1 labelled its capability LACKING on the train
    side; the report's ``lacking`` rows repeat the adapter's contrasts (against the base, its null
    control, and TRACE routed against the base) on the test tasks of those families alone, where
    the adapter is meant to help. ``routed``: per seed (as in ``seeds``), the router's choice per
    task (None: the base), for the seeds that recorded it; the ``gains`` rows say, per family, where
    TRACE routed won and lost against the base, what it left to oracle routing, and how often it
    routed to an adapter. ``checks``: per system (any subset), seeds x tasks of the target's
    per-check outcomes (``{check id: passed}``); the ``checks`` rows give each check's pass rate per
    system and each adapter's paired differences on it against the base and its null control
    (:func:`check_rows`): what an adapter changed in behaviour where success does not say.
    ``gates``: each seed's adapters' promotion verdicts (:func:`gates_table` names the fields), carried
    verbatim: which adapters TRACE routed could choose on each seed, and why."""
    order = list(outcomes)
    n_seeds = len(seeds)
    if any(len(rows) != n_seeds for rows in outcomes.values()):
        raise ValueError(f"every system needs one row per seed ({n_seeds})")
    if len(task_ids) != len(families) or any(len(row) != len(task_ids) for rows in outcomes.values() for row in rows):
        raise ValueError("every row needs one outcome per task, and every task a family")
    contrasts = [(a, b) for a, b in CONTRASTS if a in outcomes and b in outcomes]
    # each adapter against its null control (same per-layer norms, random directions)
    contrasts += [(n, f"null:{n}") for n in order if f"null:{n}" in outcomes]
    systems, differences = paired_bootstrap(outcomes, contrasts=contrasts, samples=samples, level=level,
                                            seed=bootstrap_seed)

    def spent(table, name):
        values = list((table or {}).get(name) or [])
        known = [v for v in values if v is not None]
        return {"per_seed": values, "mean": sum(known) / len(known) if known else None}

    rows = [{"system": name, "label": label(name), **systems[name].to_dict(), "per_seed": per_seed_means(outcomes[name]),
             "rollouts": spent(rollouts, name), "tokens": spent(tokens, name)} for name in order]
    contrast_rows = [{"a": a, "b": b, "label": contrast_label(a, b), **differences[(a, b)].to_dict(),
                      "excludes_zero": differences[(a, b)].excludes_zero()} for a, b in contrasts]
    by_family: dict[str, dict[str, float]] = {}
    for name in order:
        for family in sorted(set(families)):
            columns = [j for j, f in enumerate(families) if f == family]
            cells = [float(row[j]) for row in outcomes[name] for j in columns]
            by_family.setdefault(name, {})[family] = sum(cells) / len(cells)
    if any(len(choices) != len(task_ids) for choices in (routed or {}).values()):
        raise ValueError("every recorded routing needs one choice per task")
    gains = gains_by_family(outcomes, seeds=[str(x) for x in seeds], families=families, routed=routed or {})
    lacking_rows = []
    for name, wanted in (lacking or {}).items():
        columns = [j for j, f in enumerate(families) if f in set(wanted)]
        pairs = [(a, b) for a, b in ((name, BASE), (name, f"null:{name}"), (TRACE, BASE)) if a in outcomes and b in outcomes]
        if not columns or not pairs:
            continue
        subset = {n: [[row[j] for j in columns] for row in outcomes[n]] for n in {x for pair in pairs for x in pair}}
        on_subset, subset_differences = paired_bootstrap(subset, contrasts=pairs, samples=samples, level=level,
                                                         seed=bootstrap_seed)
        for a, b in pairs:
            lacking_rows.append({"capability": name, "families": sorted(set(wanted) & set(families)),
                                 "n_tasks": len(columns), "a": a, "b": b, "label": contrast_label(a, b),
                                 "success_a": on_subset[a].estimate, "success_b": on_subset[b].estimate,
                                 **subset_differences[(a, b)].to_dict(),
                                 "excludes_zero": subset_differences[(a, b)].excludes_zero()})
    pass_rows = []
    for name, per_task in (trials or {}).items():
        n = min((len(t) for t in per_task), default=0)
        pass_rows.append({"system": name, "label": label(name), "k": pass_k, "trials_per_task": n,
                          "pass_hat_k": pass_hat_k(per_task, pass_k) if n >= pass_k else None,
                          "pass_hat_1": pass_hat_k(per_task, 1) if n else None})
    return {
        "version": REPORT_VERSION, "seeds": [str(s) for s in seeds], "n_tasks": len(task_ids),
        "task_ids": list(task_ids), "families": list(families), "level": level, "bootstrap_samples": samples,
        "bootstrap_seed": bootstrap_seed, "systems": rows, "contrasts": contrast_rows, "by_family": by_family,
        "gains": gains, "lacking": lacking_rows, "pass_k": pass_rows, "notes": list(notes),
        "checks": check_rows(checks or {}, order=order, samples=samples, level=level, bootstrap_seed=bootstrap_seed),
        "gates": [dict(g) for g in gates],
    }


def check_rows(checks: Mapping[str, Sequence[Sequence[Mapping[str, bool]]]], *, order: Sequence[str],
               samples: int = SAMPLES, level: float = LEVEL, bootstrap_seed: int = 0) -> dict[str, list[dict[str, Any]]]:
    """``{"rates": [...], "contrasts": [...]}`` (see :func:`build_report`). A rate is over the
    tasks x seeds cells where the system's episode reported the check; a contrast is drawn only where
    both systems reported it in every cell (paired bootstrap, as the success contrasts)."""
    systems = [n for n in order if n in checks]
    ids = sorted({c for n in systems for row in checks[n] for cell in row for c in cell})
    rates = []
    for check in ids:
        for name in systems:
            cells = [cell[check] for row in checks[name] for cell in row if check in cell]
            if cells:
                rates.append({"check": check, "system": name, "label": label(name), "cells": len(cells),
                              "pass_rate": sum(map(bool, cells)) / len(cells)})
    pairs = [(n, b) for n in systems if f"null:{n}" in checks for b in (BASE, f"null:{n}") if b in checks]
    contrast_rows = []
    for check in ids:
        complete = [(a, b) for a, b in pairs
                    if all(check in cell for n in (a, b) for row in checks[n] for cell in row)]
        if not complete:
            continue
        matrices = {n: [[bool(cell[check]) for cell in row] for row in checks[n]] for pair in complete for n in pair}
        on_check, differences = paired_bootstrap(matrices, contrasts=complete, samples=samples, level=level,
                                                 seed=bootstrap_seed)
        for a, b in complete:
            contrast_rows.append({"check": check, "a": a, "b": b, "label": contrast_label(a, b),
                                  "rate_a": on_check[a].estimate, "rate_b": on_check[b].estimate,
                                  **differences[(a, b)].to_dict(), "excludes_zero": differences[(a, b)].excludes_zero()})
    return {"rates": rates, "contrasts": contrast_rows}


def checks_tables(report: dict[str, Any]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The ``checks`` rows as two tables: pass rate (%) per system and check, and the contrasts."""
    rows = report.get("checks", {}).get("rates", [])
    ids = sorted({r["check"] for r in rows})
    by_system: dict[str, dict[str, Any]] = {}
    for r in rows:
        by_system.setdefault(r["label"], {"system": r["label"], **{c: None for c in ids}})[r["check"]] = _pct(r["pass_rate"])
    contrasts = pl.DataFrame([{
        "check": c["check"], "difference": c["label"], "pass a %": _pct(c["rate_a"]), "pass b %": _pct(c["rate_b"]),
        **_contrast_columns(c, report["level"]),
    } for c in report.get("checks", {}).get("contrasts", [])])
    return pl.DataFrame(list(by_system.values())), contrasts


def _checks_blocks(report: dict[str, Any], heading: str = "##") -> list[str]:
    """The checks section's markdown blocks (none without per-check data); ``heading``: its level."""
    if not report.get("checks", {}).get("rates"):
        return []
    rates, contrasts = checks_tables(report)
    blocks = [CHECKS_HEADING.replace("##", heading, 1), to_markdown(rates, float_precision=1)]
    return blocks + ([to_markdown(contrasts, float_precision=1)] if contrasts.height else [])


CHECKS_HEADING = ("## The target's checks, per system\n\n"
                  "Pass rate (%) of each check the target environment scores an episode by (`info[\"checks\"]`), over "
                  "tasks × seeds, then each adapter's paired differences on them: what it changed in behaviour, even "
                  "where success did not move.")


def gains_by_family(outcomes: Mapping[str, Sequence[Sequence[float | bool]]], *, seeds: Sequence[str],
                    families: Sequence[str], routed: Mapping[str, Sequence[str | None]]) -> list[dict[str, Any]]:
    """Per family, over its tasks x seeds cells: TRACE routed's wins and losses against the base
    (cells one solves and the other does not), the cells only oracle routing solves, and the share
    of routed choices that went to an adapter (over the seeds in ``routed``; None when none
    recorded it). Empty without both the base and TRACE routed."""
    if BASE not in outcomes or TRACE not in outcomes:
        return []
    rows = []
    for family in sorted(set(families)):
        columns = [j for j, f in enumerate(families) if f == family]
        cells = [(s, j) for s in range(len(seeds)) for j in columns]

        def solved(name: str, s: int, j: int) -> bool:
            return float(outcomes[name][s][j]) >= 1.0

        choices = [routed[seeds[s]][j] for s, j in cells if seeds[s] in routed]
        rows.append({
            "family": family, "cells": len(cells),
            "base": sum(solved(BASE, s, j) for s, j in cells) / len(cells),
            "trace": sum(solved(TRACE, s, j) for s, j in cells) / len(cells),
            "oracle": (sum(solved(ORACLE, s, j) for s, j in cells) / len(cells)) if ORACLE in outcomes else None,
            "won": sum(solved(TRACE, s, j) and not solved(BASE, s, j) for s, j in cells),
            "lost": sum(solved(BASE, s, j) and not solved(TRACE, s, j) for s, j in cells),
            "left_to_oracle": (sum(solved(ORACLE, s, j) and not solved(TRACE, s, j) for s, j in cells)
                               if ORACLE in outcomes else None),
            "routed_to_adapter": (sum(c is not None for c in choices) / len(choices)) if choices else None,
            "routed_seeds": sorted({seeds[s] for s, _ in cells if seeds[s] in routed}),
        })
    return rows


def gains_table(report: dict[str, Any]) -> pl.DataFrame:
    """The ``gains`` rows as a table (percentages; "—" where not measured)."""
    pct = lambda x: "—" if x is None else f"{100.0 * x:.1f}"  # noqa: E731
    return pl.DataFrame([{
        "family": r["family"], "tasks × seeds": r["cells"], "base %": pct(r["base"]), "TRACE %": pct(r["trace"]),
        "oracle %": pct(r["oracle"]), "TRACE won": r["won"], "TRACE lost": r["lost"],
        "left to oracle": "—" if r["left_to_oracle"] is None else r["left_to_oracle"],
        "routed to an adapter %": pct(r["routed_to_adapter"]),
    } for r in report.get("gains", [])])


def _gains_heading(report: dict[str, Any]) -> str:
    seeds = sorted({s for r in report["gains"] for s in r["routed_seeds"]}, key=int)
    recorded = (f"routing recorded for seed{'s' if len(seeds) != 1 else ''} {', '.join(seeds)}" if seeds
                else "routing not recorded")
    return ("## Where TRACE routed won and lost, by family\n\n"
            "Cells are test tasks × seeds. Won / lost: cells TRACE routed solves and the base does not, and the "
            f"reverse; left to oracle: cells oracle routing solves and TRACE routed does not ({recorded}).")


def systems_table(report: dict[str, Any]) -> pl.DataFrame:
    """One row per system: success (mean over seeds) with its interval, per-seed means, rollouts and tokens."""
    return pl.DataFrame([{
        "system": r["label"], "success %": _pct(r["estimate"]),
        f"{round(100 * report['level'])} % interval": f"[{_pct(r['low'])}, {_pct(r['high'])}]",
        "per seed %": ", ".join(f"{_pct(x)}" for x in r["per_seed"]),
        "rollouts": _spent_text(r["rollouts"]), "tokens": _spent_text(r["tokens"]),
    } for r in report["systems"]])


def _pct(x: float) -> float:
    """A rate or difference in percent (points), to one decimal."""
    return round(100.0 * x, 1)


def _contrast_columns(row: dict[str, Any], level: float) -> dict[str, Any]:
    """A contrast's figures as table columns: points, the interval and whether it excludes zero."""
    return {"points": _pct(row["estimate"]), f"{round(100 * level)} % interval": f"[{_pct(row['low'])}, {_pct(row['high'])}]",
            "excludes 0": "yes" if row["excludes_zero"] else "no"}


def contrasts_table(report: dict[str, Any]) -> pl.DataFrame:
    return pl.DataFrame([{"difference": c["label"], **_contrast_columns(c, report["level"])} for c in report["contrasts"]], schema={"difference": pl.String, "points": pl.Float64,
                                             f"{round(100 * report['level'])} % interval": pl.String, "excludes 0": pl.String})


def lacking_table(report: dict[str, Any]) -> pl.DataFrame:
    """The ``lacking`` rows: each adapter's contrasts on the test tasks of the families where its
    capability was LACKING on the train side."""
    return pl.DataFrame([{
        "capability": r["capability"], "tasks": r["n_tasks"], "difference": r["label"],
        "success a %": _pct(r["success_a"]), "success b %": _pct(r["success_b"]), **_contrast_columns(r, report["level"]),
    } for r in report.get("lacking", [])])


def _lacking_heading(report: dict[str, Any]) -> str:
    families = sorted({f for r in report["lacking"] for f in r["families"]})
    return ("## Where the capability was LACKING (train-side labels of Step 1)\n\n"
            f"The same contrasts on the test tasks of the families where Step 1 labelled the adapter's capability "
            f"LACKING on the train side ({', '.join(families)}), tasks × seeds.")


GATES_HEADING = ("## The promotion gate, per seed (train side)\n\n"
                 "What the gate read before TRACE routed could choose an adapter: greedy success on its environment's "
                 "held-out synthetic seeds (base, null control, adapter), and the target guard: base and adapter on the "
                 "target's train-split tasks, every family in turn, with the one-sided sign test that the base succeeds "
                 "more often (success decides). A refused adapter is not routed to (unless `[route] include_unpromoted`): "
                 "on a seed where no adapter is promoted, TRACE routed is the base. Target checks the adapter passed "
                 "significantly less often there are reported, not gating.")


def gates_table(report: dict[str, Any]) -> pl.DataFrame:
    """The ``gates`` rows: per seed and adapter, ``promoted``; ``synthetic`` ``{"n", "base", "null",
    "adapter"}`` (success rates); ``guard`` and ``guard_lacking`` ``{"n", "base", "adapter", "p"}``
    (successes on the target guard's tasks, and on those of the capability's LACKING families; None
    where the gate played none); ``checks_lost``: ``[{"check", "applicable", "base", "adapter", "p"}]``."""
    def synthetic(s):
        return "—" if not s else f"{_pct(s['base']):.0f} / {_pct(s['null']):.0f} / {_pct(s['adapter']):.0f} (n {s['n']})"

    def guard(g, with_p=True):
        if not g:
            return "not measured"
        return f"{g['base']} → {g['adapter']} of {g['n']}" + (f" (p {g['p']:.3f})" if with_p else "")

    return pl.DataFrame([{
        "seed": g["seed"], "adapter": g["capability"], "promoted": "yes" if g["promoted"] else "no",
        "synthetic success % base / null / adapter": synthetic(g.get("synthetic")),
        "target train tasks, successes base → adapter": guard(g.get("guard")),
        "its LACKING families": guard(g.get("guard_lacking"), with_p=False),
        "target checks lost": ", ".join(f"{c['check']} {c['base']} → {c['adapter']} of {c['applicable']} (p {c['p']:.3f})"
                                        for c in g.get("checks_lost", [])) or "none",
    } for g in report.get("gates", [])])


def _spent_text(spent: dict[str, Any]) -> str:
    """The mean over seeds; "—" when the caller gave nothing for the system or seeds."""
    return "—" if spent["mean"] is None else f"{spent['mean']:,.0f}"


def _protocol(report: dict[str, Any]) -> str:
    return (f"{report['n_tasks']} held-out test tasks × {len(report['seeds'])} training seeds "
            f"({', '.join(report['seeds'])}); success is the mean over seeds; intervals: {round(100 * report['level'])} % "
            f"paired bootstrap over tasks × seeds ({report['bootstrap_samples']:,} replicates, seed "
            f"{report['bootstrap_seed']}).")


def cost_text(cost: dict[str, Any]) -> str:
    """What the experiment cost and where (``report["cost"]``: the machine, from
    ``trace_assets.reports.machine``, and each asset's step durations, from
    ``trace_assets.reports.phase_rows``), as a sentence and a table. Where an asset was
    materialized more than once, a column adds every materialization's time: the latest alone may
    have reused what an earlier one computed."""
    host = cost["machine"]
    # rows from before the history was kept count their latest materializations only
    rows = [{"materializations": r["timed"], "all_s": r["wall_s"], **r} for r in cost["phases"]]
    timed = [r for r in rows if r["timed"]]
    head = (f"Report written on {host['cpu']}, {host['cores']} cores, {host['memory_gb']} GB RAM, native bf16 (AVX-512 "
            f"BF16): {'yes' if host['avx512_bf16'] else 'no'}, at commit `{host['commit']}`; the steps ran where and when "
            "their runs did (a resumed experiment may span machines). Each asset's Dagster step durations over its "
            "partitions' latest materializations; steps run one at a time, so the sum is the experiment's compute time, "
            "without the seconds each step process takes to start.")
    redone = [r for r in timed if r["materializations"] > r["timed"]]
    table = pl.DataFrame([{"asset": r["asset"], "partitions": r["partitions"], "wall time": wall_text(r["wall_s"]),
                           "per partition": wall_text(r["min_s"]) if r["partitions"] == 1
                           else f"{wall_text(r['min_s'])} – {wall_text(r['max_s'])}",
                           **({"every materialization": f"{r['materializations']}: {wall_text(r['all_s'])}"}
                              if redone else {})}
                          for r in timed]
                         + [{"asset": "**sum**", "partitions": sum(r["partitions"] for r in timed),
                             "wall time": f"**{wall_text(sum(r['wall_s'] for r in timed))}**", "per partition": "",
                             **({"every materialization": f"**{wall_text(sum(r['all_s'] for r in timed))}**"}
                                if redone else {})}])
    if redone:
        head += (f" Materialized more than once (a code change, or a partition re-run): {', '.join(r['asset'] for r in redone)}. "
                 "A latest materialization can reuse what an earlier one computed (stored test episodes, a finished "
                 "training) and take minutes where the work took hours, so \"every materialization\" adds the earlier "
                 "ones' step durations, which counts work redone after a change twice: read the first sum as a lower "
                 "bound of what the results cost, the second as an upper one.")
    untimed = [r["asset"] for r in rows if r["timed"] < r["partitions"]]
    tail = f"\n\nNo step duration on record for some partitions of: {', '.join(untimed)}." if untimed else ""
    return f"{head}\n\n{to_markdown(table)}{tail}"


def report_markdown(report: dict[str, Any], *, figure: str | None = None) -> str:
    """``reports/experiment.md``: protocol, systems, differences, the forest plot (``figure``: its
    path relative to the markdown), pass^k, success by family, notes."""
    parts = ["# TRACE experiment", _protocol(report), "## Success per system", to_markdown(systems_table(report), float_precision=1),
             "## Paired differences", to_markdown(contrasts_table(report), float_precision=1) if report["contrasts"] else "_none_"]
    if figure:
        parts.append(f"![forest plot]({figure})")
    if report.get("gates"):
        parts += [GATES_HEADING, to_markdown(gates_table(report))]
    if report.get("lacking"):
        parts += [_lacking_heading(report), to_markdown(lacking_table(report), float_precision=1)]
    if report.get("gains"):
        parts += [_gains_heading(report), to_markdown(gains_table(report))]
    parts += _checks_blocks(report)
    if report["pass_k"]:
        parts += ["## pass^k (tau2-bench: mean over tasks of C(c, k) / C(n, k))",
                  to_markdown(pl.DataFrame([{"system": r["label"], "k": r["k"], "trials per task": r["trials_per_task"],
                                             "pass^k": r["pass_hat_k"], "pass^1": r["pass_hat_1"]} for r in report["pass_k"]]))]
    families = sorted({f for per in report["by_family"].values() for f in per})
    parts += ["## Success by task family (mean over seeds, %)",
              to_markdown(pl.DataFrame([{"system": label(name), **{f: round(100.0 * per[f], 1) for f in families}}
                                        for name, per in report["by_family"].items()]), float_precision=1)]
    if report.get("cost"):
        parts += ["## What it cost", cost_text(report["cost"])]
    if report["notes"]:
        parts += ["## Notes", "\n".join(f"- {n}" for n in report["notes"])]
    parts.append(f"<!-- report data: {json.dumps({'version': report['version'], 'seeds': report['seeds']})} -->")
    return "\n\n".join(parts) + "\n"


def forest_png(report: dict[str, Any]) -> bytes:
    """The forest plot: success per system, and the paired differences against a zero line."""
    panels = {"success per system": [{"label": r["label"], **{k: r[k] for k in ("estimate", "low", "high")}}
                                     for r in report["systems"]]}
    reference = {}
    if report["contrasts"]:
        panels["paired differences"] = [{"label": c["label"], **{k: c[k] for k in ("estimate", "low", "high")}}
                                        for c in report["contrasts"]]
        reference["paired differences"] = 0.0
    n = len(report["seeds"])
    title = (f"{report['n_tasks']} test tasks x {n} seed{'s' if n != 1 else ''}; {round(100 * report['level'])} % "
             "paired bootstrap intervals over tasks x seeds")
    return forest_plot(panels, reference=reference, xlabels={"success per system": "success, %"}, title=title)


def readme_section(report: dict[str, Any], *, figure: str = "docs/experiment_forest.png") -> str:
    """The body of the README's results section, generated from the report (never typed by hand)."""
    headline = {(c["a"], c["b"]): c for c in report["contrasts"]}
    lines = ["## Experiment results", "",
             "_Generated from `reports/experiment.md` by `trace_assets.experiment.report.readme_section`; do not edit by hand._",
             "", _protocol(report), "", to_markdown(systems_table(report), float_precision=1), "", to_markdown(contrasts_table(report), float_precision=1)
             if report["contrasts"] else "_no paired differences_", ""]
    for key in ((TRACE, BASE), (TRACE, GRPO)):
        if key in headline:
            c = headline[key]
            verdict = "excludes zero" if c["excludes_zero"] else "includes zero: not resolved"
            lines.append(f"- {c['label']}: {100 * c['estimate']:+.1f} points, interval "
                         f"[{100 * c['low']:+.1f}, {100 * c['high']:+.1f}] ({verdict}).")
    for r in report.get("lacking", []):
        if r["b"] != BASE or r["a"] == TRACE:
            continue
        verdict = "excludes zero" if r["excludes_zero"] else "includes zero: not resolved"
        lines.append(f"- {r['label']} on the {r['n_tasks']} test tasks of the families where "
                     f"{r['capability']} was LACKING on the train side: {100 * r['estimate']:+.1f} points, interval "
                     f"[{100 * r['low']:+.1f}, {100 * r['high']:+.1f}] ({verdict}).")
    lines += ["", f"![forest plot]({figure})"]
    if report.get("gates"):
        lines += ["", GATES_HEADING.replace("## ", "### ", 1), "", to_markdown(gates_table(report))]
    if report.get("gains"):
        lines += ["", _gains_heading(report).replace("## ", "### ", 1), "", to_markdown(gains_table(report))]
    lines += [line for block in _checks_blocks(report, "###") for line in ("", block)]
    if report.get("cost"):
        lines += ["", "### What it cost", "", cost_text(report["cost"])]
    if report["notes"]:  # what was cut or missing travels with the figures
        lines += ["", "What this run left out:", "", *(f"- {n}" for n in report["notes"])]
    return "\n".join(lines)
