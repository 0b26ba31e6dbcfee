"""``make experiment``'s code path on the tiny profile, 2 training seeds, end to end on a real Dagster
instance: the wave runner materializes the experiment's assets; the report has intervals and a forest
plot; a second run recomputes nothing; the demo's Step-4 assets are left alone."""

from __future__ import annotations

import dataclasses
import json

import pytest
from dagster import AssetKey, DagsterInstance
from dagster._core.definitions.data_version import StaleStatus

from trace_assets.settings import TINY


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    from trace_assets.assets.experiment import EXPERIMENT_SELECTION
    from trace_assets.definitions import build_definitions
    from trace_assets.orchestrate import run_stale

    home = tmp_path_factory.mktemp("experiment")
    mp = pytest.MonkeyPatch()
    mp.setenv("TRACE_DATA_DIR", str(home / "data"))
    (home / "dagster").mkdir()
    instance = DagsterInstance.local_temp(str(home / "dagster"), overrides={"telemetry": {"enabled": False}})
    # One capability of C*, for the time; two seeds, as the profile has.
    settings = dataclasses.replace(TINY, selection=dataclasses.replace(TINY.selection, max_selected=1))
    assert len(settings.experiment.seeds) == 2
    defs = build_definitions(settings)
    run_ids, failures = run_stale(defs, instance, EXPERIMENT_SELECTION)
    yield defs, instance, run_ids, failures, home / "data"
    mp.undo()


def test_the_experiment_runs_every_seed_and_reports_intervals(experiment):
    defs, instance, run_ids, failures, data = experiment
    assert not failures, failures
    assert run_ids
    report = json.loads((data / "reports" / "experiment.json").read_text())
    assert report["seeds"] == ["0", "1"]
    systems = {r["system"]: r for r in report["systems"]}
    assert {"base", "trace_routed", "oracle", "grpo_target", "grpo_target_families"} <= set(systems)
    assert any(n.startswith("null:") for n in systems)
    for row in report["systems"] + report["contrasts"]:
        assert row["low"] <= row["estimate"] <= row["high"]
        assert len(row.get("per_seed", [0, 0])) == 2
    assert [(c["a"], c["b"]) for c in report["contrasts"]][:2] == [("trace_routed", "base"), ("trace_routed", "grpo_target")]
    assert systems["grpo_target"]["rollouts"]["mean"] > 0
    passes = {r["system"]: r for r in report["pass_k"]}  # tiny: pass^2 from 2 sampled episodes per task
    assert set(passes) == {"base", "trace_routed", "grpo_target"}
    assert all(r["k"] == 2 and r["trials_per_task"] == 2 and 0.0 <= r["pass_hat_k"] <= r["pass_hat_1"] <= 1.0
               for r in passes.values())
    markdown = (data / "reports" / "experiment.md").read_text()
    assert "95 % interval" in markdown and "TRACE routed − base" in markdown
    # the target's per-check breakdown, for every system, the routed and oracle ones included
    rated = {r["system"] for r in report["checks"]["rates"]}
    assert set(systems) - {"trace_soft"} <= rated, set(systems) - rated  # the soft composition is not broken down
    assert {r["check"] for r in report["checks"]["rates"]} >= {"state_match"}
    assert report["checks"]["contrasts"] and "The target's checks, per system" in markdown
    # the adapter's contrasts again, on the test tasks of the families its capability lacked (train side)
    trained = [n for n in systems if f"null:{n}" in systems]
    lacking = {r["capability"] for r in report["lacking"]}
    assert lacking == set(trained) or any("no train-side trajectory labelled it LACKING" in n for n in report["notes"])
    # each seed's promotion verdict, with what the gate read on the target's train split
    assert {(g["seed"], g["capability"]) for g in report["gates"]} == {(s, n) for s in ("0", "1") for n in trained}
    assert all(g["guard"]["n"] > 0 and g["synthetic"]["n"] > 0 for g in report["gates"]), report["gates"]
    assert "The promotion gate, per seed" in markdown
    gains = {r["family"]: r for r in report["gains"]}
    assert set(gains) == set(report["families"]) and all(r["routed_seeds"] == ["0", "1"] for r in gains.values())
    assert sum(r["won"] - r["lost"] for r in gains.values()) == round(
        (systems["trace_routed"]["estimate"] - systems["base"]["estimate"]) * len(report["task_ids"]) * 2)
    for row in report["lacking"]:
        assert row["n_tasks"] == sum(f in row["families"] for f in report["families"]) > 0
        assert row["low"] <= row["estimate"] <= row["high"]
    # what it cost: every asset it computed, each partition's step timed, the machine named
    phases = {r["asset"]: r for r in report["cost"]["phases"]}
    assert {"base_trajectories", "experiment_env", "experiment_adapter", "experiment_baselines", "experiment_eval"} <= set(phases)
    assert "experiment_report" not in phases
    assert phases["experiment_eval"]["partitions"] == phases["experiment_eval"]["timed"] == 2
    assert phases["experiment_adapter"]["partitions"] == 2 * len(trained)
    for row in phases.values():
        assert row["timed"] == row["partitions"] and 0 < row["min_s"] <= row["max_s"] <= row["wall_s"]
        assert row["materializations"] >= row["timed"] and row["all_s"] >= row["wall_s"]
    assert report["cost"]["machine"]["cores"] >= 1 and "## What it cost" in markdown
    png = (data / "reports" / "experiment_forest.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    event = instance.get_latest_materialization_event(AssetKey("experiment_report"))
    assert "forest_plot" in event.asset_materialization.metadata
    for key in ("router_eval", "grpo_baseline", "lora_adapter"):  # the demo's assets: not this job's
        assert instance.get_latest_materialization_event(AssetKey(key)) is None, key


def test_each_seed_trains_its_own_adapters(experiment):
    defs, instance, *_ = experiment
    from dagster import AssetRecordsFilter

    records = instance.fetch_materializations(AssetRecordsFilter(asset_key=AssetKey("experiment_adapter")), limit=10).records
    by_seed = {}
    for record in records:
        key = record.event_log_entry.dagster_event.partition
        by_seed[key.split("|")[1]] = record.asset_materialization.metadata["model_name"].value
    assert set(by_seed) == {"0", "1"}
    assert by_seed["0"] != by_seed["1"] and all("experiment-seed" in v for v in by_seed.values())


def test_every_evaluated_system_keeps_its_test_episodes_so_a_killed_evaluation_resumes(experiment):
    """Each system's greedy test episodes are stored under an agent id that names its adapter's bytes,
    backend, dtype and episode config: one row per test task for every (seed, system) but the base."""
    from resources.store import TraceStore
    from trace_assets.route.evaluation import EVALUATED_POLICY

    *_, data = experiment
    report = json.loads((data / "reports" / "experiment.json").read_text())
    rows = TraceStore().query("SELECT agent_id, count(DISTINCT task_id) AS n, count(*) AS rows FROM trajectories "
                              "WHERE policy = ? AND split = 'test' GROUP BY agent_id", [EVALUATED_POLICY])
    systems = [r["system"] for r in report["systems"]]
    trained = [n for n in systems if n.startswith("null:") or f"null:{n}" in systems or n.startswith("grpo_target")]
    assert rows.height == len(trained) * len(report["seeds"])  # every seed trains its own: no id shared
    assert set(rows["n"].to_list()) == set(rows["rows"].to_list()) == {report["n_tasks"]}


def test_an_evaluation_run_again_from_nothing_reuses_the_stored_episodes(experiment, tmp_path):
    """A killed experiment loses its Dagster records at worst, not its played episodes: a fresh
    instance on the same data folder re-materializes the evaluation without playing a test episode
    again (the training folders resume from their checkpoints the same way)."""
    from dagster import AssetSelection

    from trace_assets.orchestrate import run_stale

    defs, *_ = experiment
    fresh = DagsterInstance.local_temp(str(tmp_path), overrides={"telemetry": {"enabled": False}})
    run_ids, failures = run_stale(defs, fresh, AssetSelection.assets("experiment_eval").upstream())
    assert not failures, failures
    messages = [e.user_message for run_id in run_ids for e in fresh.all_logs(run_id) if e.user_message]
    assert any("test episodes are stored" in m and "reused" in m for m in messages)
    assert not any(m.startswith("evaluating ") and "test tasks (agent" in m for m in messages), \
        [m for m in messages if m.startswith("evaluating ")]


def test_a_second_run_recomputes_nothing(experiment):
    from trace_assets.assets.experiment import EXPERIMENT_SELECTION
    from trace_assets.orchestrate import run_stale, stale_items

    defs, instance, *_ = experiment
    statuses = stale_items(defs, instance, EXPERIMENT_SELECTION)
    assert statuses and all(s == StaleStatus.FRESH for s in statuses.values()), \
        {k: s for k, s in statuses.items() if s != StaleStatus.FRESH}
    assert run_stale(defs, instance, EXPERIMENT_SELECTION) == ([], [])


def test_trace_readme_takes_the_experiment_section_from_the_experiment_folder(experiment, tmp_path, monkeypatch):
    """`make experiment` writes into a data folder of its own; `trace readme --experiment` reads it
    there, beside the demo report of the main data folder, and copies its forest plot."""
    from trace_assets.cli import main
    from trace_assets.experiment.report import README_SECTION

    *_, data = experiment
    readme = tmp_path / "README.md"
    markers = f"<!-- {README_SECTION}:begin -->\nnot run yet\n<!-- {README_SECTION}:end -->\n"
    readme.write_text("<!-- demo:begin -->\nkept\n<!-- demo:end -->\n" + markers)
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "empty"))
    assert main(["readme", "--readme", str(readme)]) == 2  # no report at all
    assert main(["readme", "--readme", str(readme), "--experiment", str(data)]) == 0  # no demo report: kept
    assert "kept" in readme.read_text() and "not run yet" not in readme.read_text()
    demo_data = tmp_path / "data"
    (demo_data / "reports").mkdir(parents=True)
    (demo_data / "reports" / "demo.md").write_text(
        "# TRACE demo report\n\nGenerated by `trace demo` on a test.\n\n### Wall time and peak RSS per asset\n\n| a |\n")
    monkeypatch.setenv("TRACE_DATA_DIR", str(demo_data))
    readme.write_text("<!-- demo:begin -->\n<!-- demo:end -->\n" + markers)
    assert main(["readme", "--readme", str(readme)]) == 0  # no experiment folder: its section stays
    assert "not run yet" in readme.read_text()
    assert main(["readme", "--readme", str(readme), "--experiment", str(data)]) == 0
    text = readme.read_text()
    assert "not run yet" not in text and "TRACE routed − base" in text
    assert (tmp_path / "docs" / "experiment_forest.png").read_bytes() == (data / "reports" / "experiment_forest.png").read_bytes()
    assert main(["readme", "--readme", str(readme), "--experiment", str(data), "--check"]) == 0


def test_the_closing_summary_shows_the_experiment_report_and_writes_no_demo_report(experiment):
    """`make experiment`'s closing table is titled for the experiment and prints its report; the
    demo's report (which `trace readme` turns into the README's demo section) is not written."""
    from trace_assets.cli import EXPERIMENT_SECTIONS, console, print_summary

    defs, instance, run_ids, _, data = experiment
    with console.capture() as captured:
        print_summary(defs, instance, run_ids, 1.0, name="experiment", sections=EXPERIMENT_SECTIONS)
    out = captured.get()
    assert "TRACE experiment: asset materializations" in out and "TRACE routed − base" in out, out
    assert "TRACE demo" not in out
    assert not (data / "reports" / "demo.md").exists()
