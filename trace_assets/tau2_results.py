"""Import tau2-bench's own simulation output (``results.json``) into the trajectory store.

A user who already ran tau2-bench can run Step 1 on those runs: ``trace import --format tau2
results.json``. Same contract as the JSONL importer (``trajectories.import_file``): every
simulation is converted and validated on its own, an error names the file, the simulation
(``simulations[i]``, reported as line ``i + 1``) and the field; valid ones are stored, invalid ones
are not, nothing stored is touched; a file with any error is copied to the quarantine folder next
to a ``.reason.json``; re-importing adds nothing twice (ids derive from the content and tau2's
simulation id).

Mapping: ``env`` is ``tau2_<domain>``; ``task_id`` is ``<env>/<tau2 task id>`` as the
``tau2_airline`` environment names its tasks; ``split`` comes from the domain's official
``split_tasks.json`` (a task in neither list is an error: it must never leak into Step 1);
``policy`` is ``base``; tau2's flat tool calls become OpenAI ``tool_calls``; ``reward`` is
``reward_info.reward``; tau2's termination reason, reward breakdown, checks and agent model go to
``info["tau2"]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trace_assets.trajectories import (
    ImportReport,
    RecordError,
    RecordErrors,
    batch_name,
    normalize,
    now_iso,
    quarantine,
    trajectory_id,
)

FORMATS = ("trace", "tau2")


def _official_split(domain: str) -> tuple[dict[str, str], dict[str, str]]:
    """``({tau2 task id: split}, {tau2 task id: family})`` for a domain we ship, else empty."""
    if domain != "airline":
        return {}, {}
    from trace_assets.envs.tau2 import airline_spec, load_tasks

    spec = airline_spec()
    splits = load_tasks(spec.tasks_path, spec.split_path, env=spec.name, write_tools=spec.write_tools)
    where = {t.scenario["tau2_id"]: name for name, tasks in splits.items() for t in tasks}
    family = {t.scenario["tau2_id"]: t.family for tasks in splits.values() for t in tasks}
    return where, family


def _messages(sim: dict[str, Any], policy_text: str | None, where: str) -> list[dict[str, Any]]:
    raw = sim.get("messages")
    if not isinstance(raw, list):
        raise ValueError(f"{where}.messages: expected a list")
    out: list[dict[str, Any]] = [{"role": "system", "content": policy_text}] if policy_text else []
    for k, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ("assistant", "user", "tool"):
            raise ValueError(f"{where}.messages[{k}].role: expected assistant, user or tool")
        for item in m.get("tool_messages") or [m]:  # a tau2 MultiToolMessage holds several results
            if item.get("role") == "tool":
                tool = {"role": "tool", "content": item.get("content") or ""}
                if item.get("id"):
                    tool["tool_call_id"] = str(item["id"])
                out.append(tool)
                continue
            message: dict[str, Any] = {"role": item["role"], "content": item.get("content") or ""}
            calls = []
            for j, call in enumerate(item.get("tool_calls") or []):
                if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                    raise ValueError(f"{where}.messages[{k}].tool_calls[{j}].name: expected a string")
                fn = {"name": call["name"], "arguments": call.get("arguments") if call.get("arguments") is not None else {}}
                calls.append({**({"id": str(call["id"])} if call.get("id") else {}), "type": "function", "function": fn})
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def convert(data: Any, *, file: str, now: str) -> tuple[list[dict[str, Any]], list[RecordError]]:
    """Trajectory records and errors for a parsed tau2 ``results.json``."""
    if not isinstance(data, dict) or not isinstance(data.get("simulations"), list):
        return [], [RecordError(file, 0, "simulations", "not a tau2-bench results file (no 'simulations' list)")]
    info = data.get("info") or {}
    env_info = info.get("environment_info") or {}
    domain = env_info.get("domain_name")
    if not isinstance(domain, str) or not domain:
        return [], [RecordError(file, 0, "info.environment_info.domain_name", "missing: which tau2 domain is this?")]
    env = f"tau2_{domain}"
    split_of, family_of = _official_split(domain)
    if not split_of:
        return [], [RecordError(file, 0, "info.environment_info.domain_name",
                                f"domain {domain!r}: no official split known here (only 'airline'), so no task can be placed in train or test")]
    agent = (info.get("agent_info") or {}).get("llm")
    records, errors = [], []
    for i, sim in enumerate(data["simulations"]):
        where = f"simulations[{i}]"
        line = i + 1
        try:
            if not isinstance(sim, dict):
                raise ValueError(f"{where}: expected an object")
            tid = sim.get("task_id")
            if not isinstance(tid, (str, int)):
                raise ValueError(f"{where}.task_id: missing")
            tid = str(tid)
            if tid not in split_of:
                raise ValueError(f"{where}.task_id: task {tid!r} is in neither list of {domain}'s official split")
            reward_info = sim.get("reward_info") or {}
            reward = reward_info.get("reward")
            if not isinstance(reward, (int, float)) or isinstance(reward, bool):
                raise ValueError(f"{where}.reward_info.reward: missing (the simulation was not evaluated)")
            messages = _messages(sim, env_info.get("policy"), where)
        except ValueError as exc:
            field, _, message = str(exc).partition(": ")
            errors.append(RecordError(file, line, field, message))
            continue
        task_id = f"{env}/{tid}"
        db = reward_info.get("db_check") or {}
        raw = {
            "trajectory_id": trajectory_id(task_id, env, "base", messages, salt=str(sim.get("id", i))),
            "task_id": task_id, "env": env, "split": split_of[tid], "policy": "base", "messages": messages,
            "reward": float(reward), "source": Path(file).name,
            "info": {
                "family": family_of.get(tid, "unknown"),
                "state_match": db.get("db_match"),
                "tau2": {
                    "simulation_id": sim.get("id"), "trial": sim.get("trial"), "agent": agent,
                    "termination_reason": sim.get("termination_reason"),
                    "reward_basis": reward_info.get("reward_basis"), "reward_breakdown": reward_info.get("reward_breakdown"),
                    "communicate_checks": reward_info.get("communicate_checks"), "action_checks": reward_info.get("action_checks"),
                },
            },
        }
        try:
            records.append(normalize(raw, file=file, line=line, source=Path(file).name, now=now))
        except RecordErrors as exc:
            errors.extend(RecordError(e.file, e.line, f"{where}->{e.field}", e.message) for e in exc.errors)
    return records, errors


def import_results(path: str | Path, store: Any, *, quarantine_folder: Path | None = None) -> ImportReport:
    """Validate a tau2-bench ``results.json`` and store its valid simulations (see module doc)."""
    path = Path(path)
    report = ImportReport(file=str(path))
    if not path.is_file():
        report.errors.append(RecordError(str(path), 0, "<file>", "no such file"))
        return report
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        data, report.errors = None, [RecordError(str(path), 0, "<file>", f"not UTF-8 text: {exc.reason}")]
    except json.JSONDecodeError as exc:
        data, report.errors = None, [RecordError(str(path), exc.lineno, "<file>", f"not valid JSON: {exc.msg} at column {exc.colno}")]
    if data is not None:
        records, report.errors = convert(data, file=str(path), now=now_iso())
        report.n_lines = len(data.get("simulations") or []) if isinstance(data, dict) else 0
        report.n_valid = len(records)
        if records:
            report.n_inserted = store.insert_trajectories(records, batch_name=batch_name(path))
    if report.errors:
        report.quarantined_to = str(quarantine(path, report.errors, move=False, folder=quarantine_folder))
    return report
