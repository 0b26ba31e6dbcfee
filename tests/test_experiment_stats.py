"""The experiment's statistics and report: paired bootstrap over tasks x seeds, pass^k as tau2-bench
defines it, the report, its forest plot and the README section generated from it."""

from __future__ import annotations

import random

import pytest

from trace_assets.experiment.report import (
    README_SECTION,
    build_report,
    cost_text,
    forest_png,
    readme_section,
    report_markdown,
)
from trace_assets.experiment.stats import Interval, paired_bootstrap, pass_hat_k, per_seed_means


def _rows(p: float, seeds: int, tasks: int, rng: random.Random) -> list[list[bool]]:
    return [[rng.random() < p for _ in range(tasks)] for _ in range(seeds)]


def test_the_estimate_is_the_mean_over_seeds_and_the_interval_is_deterministic_in_its_seed():
    rng = random.Random(1)
    rows = _rows(0.4, 3, 30, rng)
    first, _ = paired_bootstrap({"a": rows}, samples=2000, seed=7)
    again, _ = paired_bootstrap({"a": rows}, samples=2000, seed=7)
    other, _ = paired_bootstrap({"a": rows}, samples=2000, seed=8)
    assert first == again
    assert first["a"].estimate == other["a"].estimate  # the interval may move with the seed, the estimate never
    assert first["a"].estimate == pytest.approx(sum(per_seed_means(rows)) / 3)
    assert first["a"].low < first["a"].estimate < first["a"].high


def test_the_interval_matches_the_exact_bootstrap_distribution_of_a_small_case():
    """One seed, tasks [1, 0]: a replicate's mean is 0, 1/2 or 1 with probabilities 1/4, 1/2, 1/4,
    so the 95 % percentile interval is [0, 1]; with tasks [1, 1, 1, 0] it is [0.25, 1]
    (P(mean = 0) = 1/256 < 0.025 < P(mean <= 0.25) = 13/256, and P(mean = 1) = (3/4)^4 = 0.32)."""
    two, _ = paired_bootstrap({"a": [[1, 0]]}, samples=20_000, seed=0)
    assert (two["a"].low, two["a"].estimate, two["a"].high) == (0.0, 0.5, 1.0)
    four, _ = paired_bootstrap({"a": [[1, 1, 1, 0]]}, samples=20_000, seed=0)
    assert (four["a"].low, four["a"].high) == (0.25, 1.0)
    assert four["a"].estimate == 0.75


def test_seeds_are_resampled_too():
    """Two seeds that disagree entirely: a tasks-only bootstrap would give exactly 0.5 every time;
    resampling seeds reaches 0 and 1."""
    intervals, _ = paired_bootstrap({"a": [[1] * 20, [0] * 20]}, samples=4000, seed=0)
    assert intervals["a"].estimate == 0.5
    assert intervals["a"].low == 0.0 and intervals["a"].high == 1.0


def test_the_difference_is_paired_on_the_same_tasks_and_seeds():
    """B solves A's tasks plus six more, on every seed: each system's interval is wide (task
    difficulty varies), but the paired difference is exactly what B adds, and excludes zero (a
    replicate draws none of the six with probability (34/40)^40 = 0.0015 < 0.025)."""
    rng = random.Random(3)
    a = _rows(0.35, 1, 40, rng) * 3
    extra = {j for j, x in enumerate(a[0]) if not x}
    extra = set(sorted(extra)[:6])
    b = [[x or j in extra for j, x in enumerate(row)] for row in a]
    systems, diffs = paired_bootstrap({"a": a, "b": b}, contrasts=[("b", "a"), ("a", "a")], samples=3000, seed=0)
    d = diffs[("b", "a")]
    assert d.estimate == pytest.approx(sum(sum(r) for r in b) / 120 - sum(sum(r) for r in a) / 120)
    assert d.excludes_zero() and d.low > 0
    assert systems["a"].high > systems["b"].low  # unpaired, the two intervals overlap
    assert diffs[("a", "a")] == Interval(0.0, 0.0, 0.0)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="same seeds x tasks"):
        paired_bootstrap({"a": [[1, 0]], "b": [[1, 0, 1]]})
    with pytest.raises(ValueError, match="no system"):
        paired_bootstrap({"a": [[1, 0]]}, contrasts=[("a", "b")])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        paired_bootstrap({"a": [[2, 0]]})
    with pytest.raises(ValueError):
        paired_bootstrap({"a": []})


def test_pass_hat_k_is_tau2_benchs():
    # task 1: 4/4 -> 1; task 2: 3/4 -> C(3,2)/C(4,2) = 0.5; task 3: 1/4 -> 0
    trials = [[1, 1, 1, 1], [1, 0, 1, 1], [0, 0, 1, 0]]
    assert pass_hat_k(trials, 2) == pytest.approx((1 + 0.5 + 0) / 3)
    assert pass_hat_k(trials, 1) == pytest.approx((4 + 3 + 1) / 12)  # pass^1 is the success rate
    assert pass_hat_k(trials, 4) == pytest.approx(1 / 3)
    assert pass_hat_k([[0.99, 1.0]], 1) == 0.5  # success is reward == 1, as in tau2-bench
    with pytest.raises(ValueError, match="fewer than k"):
        pass_hat_k(trials, 5)
    with pytest.raises(ValueError):
        pass_hat_k(trials, 0)


def _report(seeds=(0, 1, 2), n=18):
    rng = random.Random(0)
    base = _rows(0.4, 1, n, rng) * len(seeds)
    outcomes = {"base": base, "trace_routed": [[x or rng.random() < 0.5 for x in base[0]] for _ in seeds],
                "oracle": [[True] * n for _ in seeds], "grpo_target": _rows(0.4, len(seeds), n, rng),
                "confirm_before_writing": _rows(0.5, len(seeds), n, rng), "null:confirm_before_writing": base}
    return build_report(outcomes, seeds=list(seeds), task_ids=[f"t{i}" for i in range(n)],
                        families=["cancel", "modify", "status"] * (n // 3),
                        rollouts={"base": [0] * len(seeds), "trace_routed": [96] * len(seeds), "grpo_target": [96] * len(seeds)},
                        tokens={"trace_routed": [1000, 1100, None][: len(seeds)]},
                        trials={"base": [[1, 1, 0, 1]] * n}, samples=2000, notes=["trained all of C*"])


def test_the_report_carries_intervals_contrasts_and_what_was_spent():
    report = _report()
    names = [r["system"] for r in report["systems"]]
    assert names == ["base", "trace_routed", "oracle", "grpo_target", "confirm_before_writing", "null:confirm_before_writing"]
    assert [(c["a"], c["b"]) for c in report["contrasts"]] == [("trace_routed", "base"), ("trace_routed", "grpo_target"),
                                                                ("oracle", "trace_routed"),  # no ablation evaluated
                                                                ("confirm_before_writing", "null:confirm_before_writing")]
    for row in report["systems"] + report["contrasts"]:
        assert row["low"] <= row["estimate"] <= row["high"]
    trace = next(r for r in report["systems"] if r["system"] == "trace_routed")
    assert trace["rollouts"]["mean"] == 96 and trace["tokens"]["mean"] == 1050
    assert report["pass_k"][0]["pass_hat_k"] == 0.0 and report["pass_k"][0]["pass_hat_1"] == 0.75
    assert set(report["by_family"]["oracle"].values()) == {1.0}
    md = report_markdown(report, figure="experiment_forest.png")
    assert "95 % interval" in md and "TRACE routed − base" in md and "![forest plot](experiment_forest.png)" in md
    assert "trained all of C*" in md and "null control of confirm_before_writing" in md
    assert report["contrasts"][-1]["label"] == "adapter confirm_before_writing − its null control"
    png = forest_png(report)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    with pytest.raises(ValueError, match="one row per seed"):
        build_report({"base": [[1]]}, seeds=[0, 1], task_ids=["t"], families=["f"])


def test_the_lacking_rows_repeat_the_adapter_contrasts_on_its_lacking_families_alone():
    """An adapter that helps only where its capability was LACKING: the whole-split contrast dilutes
    the gain, the LACKING-family rows show it undiluted, on exactly those tasks."""
    families = ["cancel", "modify", "status"] * 6
    base = [[False] * 18] * 3
    adapter = [[f == "cancel" for f in families]] * 3  # solves every cancel task, nothing else
    outcomes = {"base": base, "confirm_before_writing": adapter, "null:confirm_before_writing": base}
    report = build_report(outcomes, seeds=[0, 1, 2], task_ids=[f"t{i}" for i in range(18)], families=families,
                          samples=500, lacking={"confirm_before_writing": ["cancel", "not_in_the_test_split"]})
    rows = {(r["a"], r["b"]): r for r in report["lacking"]}
    assert set(rows) == {("confirm_before_writing", "base"), ("confirm_before_writing", "null:confirm_before_writing")}
    row = rows[("confirm_before_writing", "base")]
    assert row["families"] == ["cancel"] and row["n_tasks"] == 6
    assert row["estimate"] == row["low"] == row["high"] == 1.0 and row["excludes_zero"]
    assert row["success_a"] == 1.0 and row["success_b"] == 0.0
    whole = next(c for c in report["contrasts"] if c["b"] == "null:confirm_before_writing")
    assert abs(whole["estimate"] - 1 / 3) < 1e-9
    md = report_markdown(report)
    assert "Where the capability was LACKING" in md and "| confirm_before_writing | 6" in md
    assert "on the 6 test tasks of the families where confirm_before_writing was LACKING" in readme_section(report)
    assert build_report(outcomes, seeds=[0, 1, 2], task_ids=[f"t{i}" for i in range(18)], families=families,
                        samples=50, lacking={"confirm_before_writing": ["nowhere"]})["lacking"] == []


def test_the_gains_rows_say_per_family_where_trace_won_lost_and_routed():
    families = ["cancel", "cancel", "status", "status"]
    outcomes = {"base": [[0, 1, 1, 0]] * 2, "trace_routed": [[1, 0, 1, 0], [1, 1, 1, 0]],
                "oracle": [[1, 1, 1, 1]] * 2}
    routed = {"1": ["confirm_before_writing", None, None, None]}  # seed 0 did not record its routing
    report = build_report(outcomes, seeds=[0, 1], task_ids=["a", "b", "c", "d"], families=families, samples=50,
                          routed=routed)
    rows = {r["family"]: r for r in report["gains"]}
    assert rows["cancel"] == {"family": "cancel", "cells": 4, "base": 0.5, "trace": 0.75, "oracle": 1.0, "won": 2,
                              "lost": 1, "left_to_oracle": 1, "routed_to_adapter": 0.5, "routed_seeds": ["1"]}
    assert rows["status"]["won"] == rows["status"]["lost"] == 0 and rows["status"]["left_to_oracle"] == 2
    assert rows["status"]["routed_to_adapter"] == 0.0
    md = report_markdown(report)
    assert "Where TRACE routed won and lost" in md and "routing recorded for seed 1)" in md
    assert "| cancel" in readme_section(report)
    with pytest.raises(ValueError, match="one choice per task"):
        build_report(outcomes, seeds=[0, 1], task_ids=["a", "b", "c", "d"], families=families, routed={"0": [None]})
    assert build_report({"base": [[1]]}, seeds=[0], task_ids=["a"], families=["f"], samples=10)["gains"] == []


def test_the_checks_rows_say_what_an_adapter_changed_in_behaviour():
    """Per-check pass rates per system over tasks x seeds, and the adapter's paired differences on each
    check against the base and its null; a check some episodes lack is rated where present and not
    contrasted."""
    a, n, b = "confirm_before_writing", "null:confirm_before_writing", "base"

    def cells(confirmed, state):
        return [[{"confirmed_writes": c, "state_match": s} for c, s in zip(confirmed, state)]]

    outcomes = {b: [[0, 1, 0, 0]] * 2, a: [[0, 1, 0, 0]] * 2, n: [[0, 1, 0, 0]] * 2}
    checks = {b: cells([0, 1, 0, 1], [0, 1, 0, 0]) * 2,
              a: cells([1, 1, 1, 1], [0, 1, 0, 0]) + cells([1, 1, 0, 1], [0, 1, 0, 0]),
              n: cells([0, 1, 0, 1], [0, 1, 0, 0]) + cells([0, 1, 0, 1], [0, 1, 0, 0])}
    checks[n][1][3] = {"state_match": False}  # one episode of the null without the check
    report = build_report(outcomes, seeds=[0, 1], task_ids=["t0", "t1", "t2", "t3"], families=["f"] * 4, samples=200,
                          checks=checks)
    rates = {(r["check"], r["system"]): r for r in report["checks"]["rates"]}
    assert rates[("confirmed_writes", a)]["pass_rate"] == 7 / 8 and rates[("confirmed_writes", b)]["pass_rate"] == 0.5
    assert rates[("confirmed_writes", n)]["cells"] == 7 and rates[("state_match", n)]["cells"] == 8
    contrasts = {(c["check"], c["b"]): c for c in report["checks"]["contrasts"]}
    assert set(contrasts) == {("confirmed_writes", b), ("state_match", b), ("state_match", n)}
    assert contrasts[("confirmed_writes", b)]["estimate"] == pytest.approx(3 / 8)
    assert contrasts[("state_match", b)]["estimate"] == 0.0
    assert all(c["low"] <= c["estimate"] <= c["high"] for c in contrasts.values())
    md, section = report_markdown(report), readme_section(report)
    assert "The target's checks, per system" in md and "| confirmed_writes" in md
    assert "87.5" in md and "87.5" in section  # the adapter's confirmed_writes pass rate, in both
    assert build_report(outcomes, seeds=[0, 1], task_ids=["t0", "t1", "t2", "t3"], families=["f"] * 4,
                        samples=10)["checks"] == {"rates": [], "contrasts": []}


def test_the_readme_section_is_generated_and_spliced_between_its_markers():
    from trace_assets.reports import ReadmeSectionError, splice

    report = _report()
    section = readme_section(report)
    assert section.startswith("## Experiment results") and "<!--" not in section
    trace_vs_base = report["contrasts"][0]
    assert f"{100 * trace_vs_base['estimate']:+.1f} points" in section
    assert "What this run left out:\n\n- trained all of C*" in section  # the report's notes come along
    begin, end = f"<!-- {README_SECTION}:begin -->", f"<!-- {README_SECTION}:end -->"
    readme = "# Title\n\nintro\n\n" + begin + "\nold numbers\n" + end + "\n\n## After\n"
    spliced = splice(readme, README_SECTION, section)
    assert "old numbers" not in spliced and section in spliced and spliced.endswith("## After\n")
    assert splice(spliced, README_SECTION, section) == spliced  # idempotent
    with pytest.raises(ReadmeSectionError, match="experiment:begin"):
        splice("# T\n" + end + "\n" + begin, README_SECTION, section)


def test_the_report_says_what_the_settings_cut_from_the_design():
    """A cut C* and a missing ablation are written into the report's notes, and a missing seed too."""
    import dataclasses

    from trace_assets.assets.experiment import assemble_report
    from trace_assets.settings import EXPERIMENT

    def evaluation(seed, ablation=False, **extra):
        per_task = {**({"grpo_target_families": [0.0, 1.0, 0.0]} if ablation else {}), "base": [1.0, 0.0, 0.0], "trace_routed": [1.0, 1.0, 0.0], "grpo_target": [0.0, 1.0, 0.0],
                    "trace_soft": [1.0, 1.0, 0.0],
                    "confirm_before_writing": [1.0, 1.0, 0.0], "null:confirm_before_writing": [1.0, 0.0, 0.0]}
        return {"seed": seed, "task_ids": ["a", "b", "c"], "families": ["f", "f", "g"], "per_task": per_task,
                "rollouts": {}, "tokens": {}, "not_trained": [], **extra}

    settings = dataclasses.replace(EXPERIMENT, experiment=dataclasses.replace(EXPERIMENT.experiment, bootstrap_samples=200))
    cut = {"deferred": ["communicate_results", "refuse_forbidden_actions"]}
    report, notes = assemble_report({"0": evaluation(0, **cut), "1": evaluation(1, **cut)}, settings)
    assert any("seeds 2 not evaluated" in n for n in notes)
    assert any("top 1 by mean Δ" in n and "communicate_results, refuse_forbidden_actions" in n for n in notes)
    assert any("ablation" in n and "not trained" in n for n in notes)
    assert report["notes"] == notes and "grpo_target_families" not in {r["system"] for r in report["systems"]}
    labels = {r["system"]: r["label"] for r in report["systems"]}
    assert labels["trace_soft"].startswith("TRACE soft") and labels["confirm_before_writing"].endswith("alone")
    _, full = assemble_report({s: evaluation(int(s), deferred=[], ablation=True) for s in ("0", "1", "2")}, settings)
    assert full == []  # nothing cut, nothing missing: no notes
    report, notes = assemble_report({"0": evaluation(0, deferred=[], ablation=True)}, settings,
                                    lacking={"confirm_before_writing": ["g"], "never_trained": ["f"]})
    assert [(r["a"], r["b"], r["n_tasks"]) for r in report["lacking"]] == [
        ("confirm_before_writing", "base", 1), ("confirm_before_writing", "null:confirm_before_writing", 1),
        ("trace_routed", "base", 1)]
    _, notes = assemble_report({"0": evaluation(0, deferred=[], ablation=True)}, settings,
                               lacking={"confirm_before_writing": []})
    assert any("no train-side trajectory labelled it LACKING" in n for n in notes)


def test_the_forest_plot_keeps_every_label_and_value_inside_the_figure():
    """Long system names and values at an interval's far end once ran off the panel's right edge."""
    import matplotlib.pyplot as plt

    from trace_assets.figures import forest_figure

    rows = [{"label": f"adapter a_rather_long_capability_name_{i} alone", "estimate": 0.9, "low": 0.8, "high": 1.0}
            for i in range(4)] + [{"label": "base", "estimate": 0.05, "low": 0.0, "high": 0.1}]
    fig = forest_figure({"success per system": rows, "paired differences": rows},
                        reference={"paired differences": 0.0}, title="90 test tasks x 1 seed")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    texts = [t for ax in fig.axes for t in (*ax.get_yticklabels(), *ax.get_xticklabels()) if t.get_text()]
    values = [t.get_text() for t in texts if t.get_text().startswith("90.0 [80.0")]
    assert len(values) == 8, values  # every row's value is drawn, in both panels
    for text in texts:
        extent = text.get_window_extent(renderer)
        assert box.x0 - 1 <= extent.x0 and extent.x1 <= box.x1 + 1, (text.get_text(), extent, box)
    plt.close(fig)


def test_the_report_says_what_it_cost_and_where():
    """The cost section sums the timed partitions, says which machine, and names an asset whose
    partitions were not all timed instead of counting them as free."""
    report = _report()
    report["cost"] = {"machine": {"cpu": "Test CPU", "cores": 2, "memory_gb": 23.5, "avx512_bf16": True, "commit": "abc"},
                      "phases": [{"asset": "base_trajectories", "partitions": 1, "timed": 1, "wall_s": 900.0, "min_s": 900.0, "max_s": 900.0},
                                 {"asset": "experiment_adapter", "partitions": 3, "timed": 3, "wall_s": 1500.0, "min_s": 480.0, "max_s": 520.0},
                                 {"asset": "experiment_eval", "partitions": 3, "timed": 2, "wall_s": 600.0, "min_s": 300.0, "max_s": 300.0}]}
    text = cost_text(report["cost"])
    assert "Test CPU, 2 cores" in text and "native bf16 (AVX-512 BF16): yes" in text
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines()
             if line.startswith("| ") and not line.startswith("| asset")}
    assert cells["experiment_adapter"] == ["3", "25 min 00 s", "8 min 00 s – 8 min 40 s"]
    assert cells["base_trajectories"] == ["1", "15 min 00 s", "15 min 00 s"]
    assert "**50 min 00 s**" in text  # 900 + 1500 + 600 s
    assert "No step duration on record for some partitions of: experiment_eval." in text
    assert "## What it cost" in report_markdown(report) and "### What it cost" in readme_section(report)
    assert "every materialization" not in text  # each asset materialized once: one sum
    # experiment_eval re-materialized on its stored episodes (2 min) after the run that played them (60 min each)
    for row in report["cost"]["phases"]:
        row.update(materializations=row["timed"], all_s=row["wall_s"])
    report["cost"]["phases"][2].update(materializations=5, all_s=600.0 + 3 * 3600.0)
    text = cost_text(report["cost"])
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines()
             if line.startswith("| ") and not line.startswith("| asset")}
    assert cells["experiment_eval"] == ["3", "10 min 00 s", "5 min 00 s – 5 min 00 s", "5: 190 min 00 s"]
    assert cells["experiment_adapter"][-1] == "3: 25 min 00 s"
    assert cells["**sum**"][1:] == ["**50 min 00 s**", "", "**230 min 00 s**"]
    assert "Materialized more than once (a code change, or a partition re-run): experiment_eval." in text
    del report["cost"]
    assert "What it cost" not in report_markdown(report) + readme_section(report)


def test_the_report_says_per_seed_which_adapters_the_gate_refused_and_what_it_read():
    """Each seed's verdict travels into the report with what the gate read on the train side: the
    synthetic comparison, the target guard (all tasks and the LACKING families' tasks) and the target
    checks lost at the gate's alpha; an adapter gated before the guard existed says it was not measured."""
    import dataclasses

    from trace_assets.assets.experiment import assemble_report
    from trace_assets.experiment.report import report_markdown, readme_section
    from trace_assets.settings import EXPERIMENT

    def adapter(promoted, guard):
        report = lambda rate: {"n": 48, "success_rate": rate}  # noqa: E731
        return {"promoted": promoted, "reward_before": report(0.1875), "reward_after": report(0.25), "null": report(0.21),
                "promotion": {"alpha": 0.05, "promoted": promoted, **({"target_guard": guard} if guard else {})}}

    guard = {"success": {"applicable": 27, "base": 6, "adapter": 2, "p_greater": 0.109},
             "success_lacking_families": {"applicable": 21, "base": 1, "adapter": 1, "p_greater": 0.75},
             "info_communicated": {"applicable": 27, "base": 18, "adapter": 8, "p_greater": 0.003},
             "state_match": {"applicable": 27, "base": 13, "adapter": 10, "p_greater": 0.274}}
    per_task = {"base": [1.0, 0.0], "trace_routed": [1.0, 1.0], "confirm_before_writing": [1.0, 1.0],
                "null:confirm_before_writing": [0.0, 0.0]}
    evaluation = lambda seed: {"seed": seed, "task_ids": ["a", "b"], "families": ["f", "g"], "per_task": per_task,  # noqa: E731
                               "rollouts": {}, "tokens": {}, "not_trained": []}
    settings = dataclasses.replace(EXPERIMENT, experiment=dataclasses.replace(EXPERIMENT.experiment, bootstrap_samples=50))
    adapters = {"0": {"confirm_before_writing": adapter(True, None)},
                "1": {"confirm_before_writing": adapter(False, guard)},
                "2": {"confirm_before_writing": adapter(True, guard)}}  # seed 2 not evaluated: no row
    report, _ = assemble_report({"0": evaluation(0), "1": evaluation(1)}, settings, adapters=adapters)
    old, refused = report["gates"]
    assert (old["seed"], old["promoted"], old["guard"], old["checks_lost"]) == ("0", True, None, [])
    assert refused["seed"] == "1" and not refused["promoted"]
    assert refused["synthetic"] == {"n": 48, "base": 0.1875, "null": 0.21, "adapter": 0.25}
    assert refused["guard"] == {"n": 27, "base": 6, "adapter": 2, "p": 0.109}
    assert refused["guard_lacking"] == {"n": 21, "base": 1, "adapter": 1, "p": 0.75}
    assert [c["check"] for c in refused["checks_lost"]] == ["info_communicated"]  # state_match's p is above alpha
    for text in (report_markdown(report), readme_section(report)):
        assert "promotion gate, per seed" in text
        assert "| 1    | confirm_before_writing | no " in text, text
        assert "6 → 2 of 27 (p 0.109)" in text and "1 → 1 of 21" in text and "info_communicated 18 → 8 of 27 (p 0.003)" in text
        assert "19 / 21 / 25 (n 48)" in text and "not measured" in text
