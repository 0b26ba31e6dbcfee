"""Both analysts produce the same artifacts: a validated dictionary and complete, valid labels."""

from __future__ import annotations

import json

import pytest

from tests.openai_server import ScriptedOpenAI
from trace_assets.envs import get_environment
from trace_assets.envs.retail.expert import demonstrate
from trace_assets.identify.capabilities import Capability
from trace_assets.identify.heuristic import CATALOGUE, HeuristicAnalyst, RULES
from trace_assets.identify.llm_analyst import LLMAnalyst
from trace_assets.llm_client import ChatClient, LLMError


def _traj(tid, info, messages=None):
    return {"trajectory_id": tid, "info": info, "messages": messages or [{"role": "user", "content": "hi"}]}


BASE_INFO = {"authenticated": True, "actions": [{"name": "get_order_details", "arguments": {}, "ok": True}],
             "tool_errors": [], "policy_violations": [], "missing_info": [], "gold_writes": [], "n_writes": 0, "confirmations": 0}


def test_rules_on_recorded_facts():
    unauth = {**BASE_INFO, "authenticated": False,
              "policy_violations": [{"rule": "auth_before_action", "detail": "get_order_details"}]}
    assert RULES["authenticate_before_acting"].judge(unauth)[0] == "LACKING"
    assert RULES["authenticate_before_acting"].judge(BASE_INFO)[0] == "PRESENT"
    wrote = {**BASE_INFO, "gold_writes": ["cancel_pending_order"], "n_writes": 1,
             "policy_violations": [{"rule": "confirm_before_write", "detail": "cancel_pending_order {}"}],
             "actions": [{"name": "cancel_pending_order", "arguments": {}, "ok": True}]}
    assert RULES["confirm_before_writing"].judge(wrote)[0] == "LACKING"
    assert RULES["confirm_before_writing"].judge(BASE_INFO)[0] == "NA"
    assert RULES["execute_requested_action"].judge(wrote)[0] == "PRESENT"
    assert RULES["complete_multistep_transactions"].judge(wrote)[0] == "NA"
    multi = {**wrote, "gold_writes": ["modify_user_address", "modify_pending_order_address"],
             "actions": [{"name": "modify_user_address", "arguments": {}, "ok": True}]}
    label, why = RULES["complete_multistep_transactions"].judge(multi)
    assert label == "LACKING" and "modify_pending_order_address" in why
    grounded = {**BASE_INFO, "tool_errors": ["Error: item V1 is not in order W1"]}
    assert RULES["ground_arguments"].judge(grounded)[0] == "LACKING"
    assert RULES["communicate_results"].judge({**BASE_INFO, "missing_info": ["$12.00"]})[0] == "LACKING"
    assert RULES["refuse_forbidden_actions"].judge({**BASE_INFO, "policy_violations": [{"rule": "status", "detail": "x"}]})[0] == "LACKING"
    assert RULES["well_formed_tool_calls"].judge({**BASE_INFO, "tool_errors": ["Error: malformed tool call: bad json"]})[0] == "LACKING"


def test_heuristic_induces_only_what_is_lacking_in_failures():
    env = get_environment("retail")
    good = [demonstrate(env, env.make_task(f, 1))[1] for f in env.families()]
    d_plus = [_traj(f"p{i}", r.info) for i, r in enumerate(good)]
    assert all(r.success for r in good)
    skipped = demonstrate(env, env.make_task("cancel_pending", 2), confirm=False)[1]
    d_minus = [_traj("f0", {**skipped.info, "missing_info": ["$10.00"]})]
    analyst = HeuristicAnalyst()
    caps = analyst.induce(d_plus, d_minus)
    names = {c.name for c in caps}
    assert names == {"confirm_before_writing", "communicate_results"}
    assert all(c.example_trajectory_ids == ["f0"] for c in caps)
    labels = analyst.label(d_plus[0], caps, run=0)
    assert [l.capability for l in labels] == [c.name for c in caps]
    # expert successes show every capability that applies
    for traj in d_plus:
        for rule in CATALOGUE:
            assert rule.judge(traj["info"])[0] in ("PRESENT", "NA"), (traj["trajectory_id"], rule.name)


CAPS = [Capability("confirm_before_writing", "Ask before writing."), Capability("ground_arguments", "Use retrieved ids.")]


def _labels_json(labels):
    return json.dumps({"labels": [{"capability": c, "label": l, "rationale": "because"} for c, l in labels]})


def test_llm_analyst_labels_and_retries_bad_answers():
    answers = [
        "Sure! here you go: not json at all",
        _labels_json([("confirm_before_writing", "MAYBE"), ("ground_arguments", "NA")]),  # unknown label
        _labels_json([("confirm_before_writing", "LACKING"), ("teleport", "NA")]),  # unknown capability
        "```json\n" + _labels_json([("confirm_before_writing", "LACKING"), ("ground_arguments", "present")]) + "\n```",
    ]
    with ScriptedOpenAI(answers) as server:
        analyst = LLMAnalyst(ChatClient(server.base_url, "m"), max_retries=3, temperature=0.7)
        labels = analyst.label(_traj("t1", BASE_INFO), CAPS, run=4)
        assert [(l.capability, l.label, l.run) for l in labels] == [
            ("confirm_before_writing", "LACKING", 4), ("ground_arguments", "PRESENT", 4)]
        assert analyst.calls == 4
        assert server.requests[0]["temperature"] == 0.7 and server.requests[0]["seed"] == 4
        # the model is shown its error on retry
        assert "unknown label" in server.requests[2]["messages"][-1]["content"]
        assert "unknown capability" in server.requests[3]["messages"][-1]["content"]


def test_llm_analyst_names_the_lacking_step_and_is_told_when_it_is_not_an_assistant_turn():
    messages = [{"role": "system", "content": "policy"}, {"role": "user", "content": "cancel my order"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "cancel_pending_order", "arguments": {"order_id": "#W1"}}}]},
                {"role": "tool", "name": "cancel_pending_order", "content": "cancelled"},
                {"role": "assistant", "content": "Done."}]

    def answer(step):
        return json.dumps({"labels": [
            {"capability": "confirm_before_writing", "label": "LACKING", "rationale": "wrote at once", "step": step},
            {"capability": "ground_arguments", "label": "PRESENT", "rationale": "ok", "step": 4}]})

    with ScriptedOpenAI([answer(3), answer(2)]) as server:
        analyst = LLMAnalyst(ChatClient(server.base_url, "m"), max_retries=2)
        labels = analyst.label(_traj("t1", BASE_INFO, messages), CAPS, run=0)
        prompt = server.requests[0]["messages"][0]["content"]
        assert "[2] assistant: CALL cancel_pending_order" in prompt and "[3] tool: cancelled" in prompt
        assert "step 3 of confirm_before_writing is not an assistant message" in server.requests[1]["messages"][-1]["content"]
    assert [(l.label, l.step) for l in labels] == [("LACKING", 2), ("PRESENT", None)]  # a step only for LACKING


def test_llm_analyst_gives_up_after_bounded_retries():
    missing = _labels_json([("confirm_before_writing", "NA")])
    with ScriptedOpenAI([missing] * 5) as server:
        analyst = LLMAnalyst(ChatClient(server.base_url, "m"), max_retries=2)
        with pytest.raises(LLMError, match="missing labels"):
            analyst.label(_traj("t1", BASE_INFO), CAPS, run=0)
        assert len(server.requests) == 3


def test_llm_analyst_induces_a_validated_dictionary():
    bad_name = json.dumps({"capabilities": [{"name": "../../escape", "description": "Escapes the sandbox for fun."}]})
    good = json.dumps({"capabilities": [
        {"name": "Confirm Before Writing", "description": "Ask for an explicit yes before any write.",
         "failure_modes": ["cancels at once"], "example_trajectory_ids": ["f1"]},
        {"name": "ground_arguments", "description": "Copy ids from tool results, never guess them."},
    ]})
    with ScriptedOpenAI([bad_name, good]) as server:
        analyst = LLMAnalyst(ChatClient(server.base_url, "m"))
        caps = analyst.induce([_traj("p1", BASE_INFO)], [_traj("f1", BASE_INFO)])
        assert [c.name for c in caps] == ["confirm_before_writing", "ground_arguments"]
        assert "looks like a path" in server.requests[1]["messages"][-1]["content"]
        prompt = server.requests[0]["messages"][0]["content"]
        assert "## D+ (successes)" in prompt and "### f1" in prompt


def test_http_errors_are_reported():
    client = ChatClient("http://127.0.0.1:9/v1", "m", timeout_s=1)
    with pytest.raises(LLMError, match="127.0.0.1:9"):
        client.chat([{"role": "user", "content": "hi"}])
