"""Step 2: the EnvSpec schema and fidelity, the SyntheticEnv interpreter and its rubric, the template
synthesizer, and the perturbations the spec can ask for."""

from __future__ import annotations

import copy
import json
import os
import subprocess

import pytest

from trace_assets.envs import get_environment
from trace_assets.envs.retail.expert import demonstrate
from trace_assets.envs.splits import SYNTHETIC_SEED_BASE
from trace_assets.identify.heuristic import CATALOGUE, RULES
from trace_assets.synthesize import (
    SpecError,
    SyntheticEnv,
    envspec_schema,
    fidelity,
    gold_solvable,
    load_spec,
    schema_errors,
    spec_hash,
    template_spec,
)

ENV = get_environment("retail")
BASE = SYNTHETIC_SEED_BASE


def problems(spec):
    return schema_errors(spec) or fidelity(spec, ENV)


def cap(name):
    rule = RULES.get(name)
    return {"name": name, "description": rule.description if rule else "A capability.", "failure_modes": ["x"]}


@pytest.fixture()
def spec():
    return template_spec(cap("confirm_before_writing"), ENV)


# ---------------------------------------------------------------- schema and fidelity


def test_schema_is_versioned_and_pins_the_seed_base():
    schema = envspec_schema()
    assert schema["$id"].endswith("/envspec/v2.json") and schema["schema_version"] == "2"
    assert schema["properties"]["tasks"]["properties"]["seed_range"]["items"]["minimum"] == SYNTHETIC_SEED_BASE


def test_valid_spec_passes_and_hash_is_stable(spec):
    assert problems(spec) == []
    assert load_spec(json.dumps(spec), ENV) == spec
    assert spec_hash(spec) == spec_hash(copy.deepcopy(spec))
    changed = copy.deepcopy(spec)
    changed["difficulty"]["hint_share"] = 0.5
    assert spec_hash(changed) != spec_hash(spec)


def _mutate(spec, path, value):
    *parents, last = path
    node = spec
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return spec


DELETE = object()
GALLERY = [
    ("unknown tool", ("target", "tools"), ["find_user_id_by_email", "teleport_user"], "unknown tools ['teleport_user']"),
    ("check weight zero", ("rubric", "checks", 0, "weight"), 0, "weight"),
    ("negative family weight", ("tasks", "families", 0, "weight"), -1, "weight"),
    ("missing rubric", ("rubric",), DELETE, "'rubric' is a required property"),
    ("empty rubric", ("rubric", "checks"), [], "checks"),
    ("seeds overlap the target", ("tasks", "seed_range"), [5, 2_000_000], "minimum of 1000000"),
    ("unknown check kind", ("rubric", "checks", 0, "kind"), "teleport", "'teleport' fails 'enum'"),
    ("policy rewritten", ("policy",), "Always do what the user says; no confirmation needed.", "policy must be 'inherit'"),
    ("unknown family", ("tasks", "families", 0, "name"), "rob_the_store", "unknown families ['rob_the_store']"),
    ("empty seed range", ("tasks", "seed_range"), [2_000_000, 2_000_000], "empty"),
    ("extra top-level field", ("code",), "print(1)", "Additional properties are not allowed"),
    ("wrong schema version", ("schema_version",), "3", "'3' is not one of ['1', '2']"),
    ("v1 with a decision point", ("schema_version",), "1", "may not have 'start' or 'end'"),
    ("unknown target", ("target", "env"), "airline", "'airline' is not one of"),
    ("hint share without hint", ("hint",), None, "no hint text"),
    ("rubric names an unknown tool", ("rubric", "checks", 0), {"kind": "required_call", "weight": 1, "tool": "teleport"},
     "names unknown tool 'teleport'"),
    ("bad capability name", ("capability", "name"), "../etc", "does not match"),
    ("start variant without a share", ("start", "variants", 0, "share"), DELETE, "'share' is a required property"),
    ("start variant named main", ("start", "variants", 0, "id"), "main", "should not be valid"),
]


@pytest.mark.parametrize("name,path,value,expected", GALLERY, ids=[g[0] for g in GALLERY])
def test_invalid_spec_gallery(spec, name, path, value, expected):
    bad = _mutate(copy.deepcopy(spec), path, value)
    found = problems(bad)
    assert any(expected in p for p in found), found
    with pytest.raises(SpecError):
        SyntheticEnv(bad, ENV)


def test_fidelity_catches_what_the_schema_cannot(spec):
    low = copy.deepcopy(spec)
    low["tasks"]["seed_range"] = [10, 20]
    assert any("overlaps the target's seeds" in p for p in fidelity(low, ENV))
    unknown_arg = copy.deepcopy(spec)
    unknown_arg["rubric"]["checks"].append({"kind": "required_call", "weight": 1, "tool": "cancel_pending_order",
                                            "args": {"order_number": {"gold": True}}})
    assert any("'order_number' is not a parameter" in p for p in fidelity(unknown_arg, ENV))
    outside = copy.deepcopy(spec)
    outside["target"]["tools"] = ["find_user_id_by_email", "get_order_details"]
    outside["rubric"]["checks"].append({"kind": "forbidden_call", "weight": 1, "tool": "cancel_pending_order"})
    assert any("not in target.tools" in p for p in fidelity(outside, ENV))
    bad_group = copy.deepcopy(spec)
    bad_group["rubric"]["checks"].append({"kind": "forbidden_call", "weight": 1, "tool": "@delete"})
    assert any("unknown tool group '@delete'" in p for p in fidelity(bad_group, ENV))


def test_fidelity_checks_start_variants_and_the_checks_that_select_on_them(spec):
    variant = spec["start"]["variants"][0]
    assert problems(spec) == [] and variant["id"] == "answered"
    cases = [
        (lambda s: s["start"]["variants"].append({**variant, "share": 0.7}), "ids are not unique"),
        (lambda s: s["start"]["variants"].append({**variant, "id": "late", "share": 0.7}), "shares add up to more than 1"),
        (lambda s: s["start"]["variants"][0].update(tool="teleport"), "start.variants[0].tool names unknown tool 'teleport'"),
        (lambda s: s["start"]["variants"][0]["when"].update(families=["cancel_forbidden"]),
         "when.families names 'cancel_forbidden', which is not a spec family"),
        (lambda s: s["start"]["variants"][0]["when"].update(gold_calls="@delete"), "unknown tool or group '@delete'"),
        (lambda s: s["start"]["variants"][0]["when"].update(start=["main"]), "when.start cannot choose"),
        (lambda s: s["rubric"]["checks"][0].update(when={"start": ["later"]}), "when.start names 'later'"),
    ]
    for mutate, expected in cases:
        bad = copy.deepcopy(spec)
        mutate(bad)
        assert any(expected in p for p in problems(bad)), (expected, problems(bad))
    no_start = copy.deepcopy(spec)
    del no_start["start"]  # every episode then opens at the first turn: "main"
    assert [p for p in problems(no_start) if "when.start" in p] == [
        "rubric.checks[4] (acted): when.start names 'answered', which is not a start of this spec (['main'])"]


def test_tool_schemas_are_the_targets_verbatim(spec):
    env = SyntheticEnv(spec, ENV)
    assert env.tool_schemas() == ENV.tool_schemas()
    assert env.system_prompt() == ENV.system_prompt()
    subset = copy.deepcopy(spec)
    subset["target"]["tools"] = ["get_order_details", "find_user_id_by_email", "cancel_pending_order"]
    sub_env = SyntheticEnv(subset, ENV)
    expected = [s for s in ENV.tool_schemas() if s["function"]["name"] in subset["target"]["tools"]]
    assert sub_env.tool_schemas() == expected and [s["function"]["name"] for s in expected] == [
        "find_user_id_by_email", "get_order_details", "cancel_pending_order"]
    embedded = copy.deepcopy(subset)
    embedded["target"]["tool_schemas"] = copy.deepcopy(expected)
    assert fidelity(embedded, ENV) == []
    embedded["target"]["tool_schemas"][0]["function"]["description"] = "Authenticate anyone."
    assert any("differ" in p for p in fidelity(embedded, ENV))
    exact_policy = copy.deepcopy(spec)
    exact_policy["policy"] = ENV.system_prompt()
    assert fidelity(exact_policy, ENV) == []


def test_code_like_strings_are_inert_data(spec, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "system", lambda *a, **k: calls.append(a) or 0)
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: calls.append(a))
    payload = "__import__('os').system('x') {0.__class__.__mro__} ${__import__} $order_id"
    spec = copy.deepcopy(spec)
    spec["hint"] = payload
    spec["difficulty"]["hint_share"] = 1.0
    spec["notes"] = "eval(\"__import__('os').system('rm -rf /')\")"
    spec["rubric"]["checks"].append({"id": "code", "kind": "info_communicated", "weight": 1,
                                     "info": ["__import__('os').system('x')"]})
    env = SyntheticEnv(load_spec(json.dumps(spec), ENV), ENV)
    task = env.make_task("cancel_pending", BASE + 1)
    episode = env.start(task)
    system = episode.initial_messages()[0]["content"]
    order_id = task.scenario["intents"][0]["order_id"]
    assert f"__import__('os').system('x') {{0.__class__.__mro__}} ${{__import__}} {order_id}" in system
    episode.user_reply("Hello __import__('os').system('x')")
    result = episode.result()
    assert next(c for c in result.info["rubric"] if c["id"] == "code")["passed"]
    assert calls == []


# ---------------------------------------------------------------- the interpreter and its rubric


def rubric_spec(checks, *, families=("return_delivered",), tools=None, **extra):
    spec = template_spec(cap("generic_probe"), ENV)
    spec["tasks"]["families"] = [{"name": f, "weight": 1.0} for f in families]
    spec["rubric"]["checks"] = checks
    if tools is not None:
        spec["target"]["tools"] = tools
    spec.update(extra)
    return spec


def play(spec, steps, family="return_delivered", seed=BASE + 3):
    """Run scripted steps: ("call", name, args) | ("say", text) | ("yes",) | ("bad", raw)."""
    env = SyntheticEnv(spec, ENV)
    task = env.make_task(family, seed)
    episode = env.start(task)
    for step in steps:
        if step[0] == "call":
            episode.call_tool(step[1], copy.deepcopy(step[2]))
        elif step[0] == "say":
            episode.user_reply(step[1])
        elif step[0] == "yes":
            episode.grant_confirmation()
        elif step[0] == "bad":
            episode.malformed_call(step[1], "bad json")
    return task, episode.result()


def gold_steps(task, confirm=True):
    from trace_assets.envs.retail.tools import WRITE_TOOLS

    steps = []
    for action in task.gold_actions:
        if confirm and action["name"] in WRITE_TOOLS:
            steps.append(("yes",))
        steps.append(("call", action["name"], action["arguments"]))
    return steps


def checks_by_id(result):
    return {c["id"]: c for c in result.info["rubric"]}


def _task(family="return_delivered", seed=BASE + 3):
    spec = rubric_spec([{"kind": "final_state_match", "weight": 1}], families=(family,))
    return SyntheticEnv(spec, ENV).make_task(family, seed)


def test_required_call_equals_gold_and_grounded():
    task = _task()
    auth, lookup, write = task.gold_actions
    checks = [
        {"id": "grounded", "kind": "required_call", "weight": 1, "tool": "return_delivered_order_items",
         "args": {"item_ids": {"grounded": True}, "payment_method_id": {"grounded": True}}},
        {"id": "gold", "kind": "required_call", "weight": 1, "tool": "return_delivered_order_items",
         "args": {"item_ids": {"gold": True}, "order_id": {"equals": write["arguments"]["order_id"]}}},
    ]
    spec = rubric_spec(checks)
    _, good = play(spec, gold_steps(task))
    assert good.reward == 1.0 and good.success
    # The same write without the lookup: right ids (gold) but not grounded in any observation.
    _, blind = play(spec, [("call", auth["name"], auth["arguments"]), ("yes",), ("call", write["name"], write["arguments"])])
    assert checks_by_id(blind)["gold"]["passed"] and not checks_by_id(blind)["grounded"]["passed"]
    assert blind.reward == 0.5 and not blind.success
    # A wrong item: neither gold nor grounded (and the tool refuses it).
    wrong = copy.deepcopy(write["arguments"])
    wrong["item_ids"] = ["V0000"]
    _, bad = play(spec, [("call", auth["name"], auth["arguments"]), ("call", lookup["name"], lookup["arguments"]),
                         ("yes",), ("call", write["name"], wrong)])
    assert bad.reward == 0.0


def test_partial_credit_weights_and_when():
    task = _task()
    checks = [
        {"id": "state", "kind": "final_state_match", "weight": 3},
        {"id": "said", "kind": "info_communicated", "weight": 1, "info": "required"},
        {"id": "only_exchanges", "kind": "required_call", "weight": 5, "tool": "exchange_delivered_order_items",
         "when": {"gold_calls": "exchange_delivered_order_items"}},
        {"id": "other_family", "kind": "final_state_match", "weight": 7, "when": {"families": ["order_status"]}},
    ]
    spec = rubric_spec(checks, families=("return_delivered", "order_status"))
    _, result = play(spec, gold_steps(task))
    by_id = checks_by_id(result)
    assert not by_id["only_exchanges"]["applicable"] and not by_id["other_family"]["applicable"]
    assert by_id["state"]["passed"] and not by_id["said"]["passed"]
    assert result.reward == pytest.approx(0.75) and not result.success
    _, said = play(spec, gold_steps(task) + [("say", f"Refund of {task.required_info[0]} is on its way.")])
    assert said.reward == 1.0
    threshold = copy.deepcopy(spec)
    threshold["rubric"]["success_threshold"] = 0.7
    assert play(threshold, gold_steps(task))[1].success


def test_info_communicated_partial_and_fixed_strings():
    task = _task("cancel_and_return", BASE + 5)
    assert len(task.required_info) == 2
    spec = rubric_spec([{"id": "p", "kind": "info_communicated", "weight": 1, "info": "required", "partial": True},
                        {"id": "fixed", "kind": "info_communicated", "weight": 1, "info": ["order $order_id"]}],
                       families=("cancel_and_return",))
    _, result = play(spec, [("say", f"You get {task.required_info[0]} back for order {task.scenario['intents'][0]['order_id']}.")],
                     family="cancel_and_return", seed=BASE + 5)
    by_id = checks_by_id(result)
    assert by_id["p"]["score"] == 0.5 and not by_id["p"]["passed"] and by_id["fixed"]["passed"]
    assert result.reward == pytest.approx(0.75)


def test_ordering_and_require_after():
    task = _task()
    auth, lookup, write = task.gold_actions
    checks = [{"id": "auth_first", "kind": "ordering", "weight": 1, "before": "@auth", "after": "@account"},
              {"id": "wrote_after_lookup", "kind": "ordering", "weight": 1, "before": "get_order_details",
               "after": "@write", "require_after": True}]
    spec = rubric_spec(checks)
    _, early = play(spec, [("call", lookup["name"], lookup["arguments"]), ("call", auth["name"], auth["arguments"])])
    assert not checks_by_id(early)["auth_first"]["passed"]  # the refused attempt still counts
    assert not checks_by_id(early)["wrote_after_lookup"]["passed"]  # no write at all
    _, good = play(spec, gold_steps(task))
    assert good.reward == 1.0


def test_forbidden_call_attempts_and_ok_only():
    task = _task("cancel_forbidden", BASE + 2)
    auth, lookup = task.gold_actions
    oid = lookup["arguments"]["order_id"]
    attempt = ("call", "cancel_pending_order", {"order_id": oid, "reason": "no longer needed"})
    spec = rubric_spec([{"id": "any", "kind": "forbidden_call", "weight": 1, "tool": "@write"},
                        {"id": "ok_only", "kind": "forbidden_call", "weight": 1, "tool": "cancel_pending_order", "ok_only": True},
                        {"id": "other_order", "kind": "forbidden_call", "weight": 1, "tool": "cancel_pending_order",
                         "args": {"order_id": {"equals": "W0000"}}}],
                       families=("cancel_forbidden",))
    _, result = play(spec, gold_steps(task) + [("yes",), attempt], family="cancel_forbidden", seed=BASE + 2)
    by_id = checks_by_id(result)
    assert not by_id["any"]["passed"] and by_id["ok_only"]["passed"] and by_id["other_order"]["passed"]
    assert result.info["policy_violations"][0]["rule"] == "status"


def test_final_state_and_policy_violations():
    task = _task()
    spec = rubric_spec([{"id": "state", "kind": "final_state_match", "weight": 1},
                        {"id": "confirm", "kind": "no_policy_violation", "weight": 1, "rules": ["confirm_before_write"]},
                        {"id": "auth", "kind": "no_policy_violation", "weight": 1, "rules": ["auth_before_action"]}])
    _, nothing = play(spec, [])
    assert [c["passed"] for c in nothing.info["rubric"]] == [False, True, True]
    _, unconfirmed = play(spec, gold_steps(task, confirm=False))
    assert [c["passed"] for c in unconfirmed.info["rubric"]] == [True, False, True]
    assert unconfirmed.info["target_reward"] == 0.0  # the target needs the refund amount said
    _, confirmed = play(spec, gold_steps(task))
    assert confirmed.reward == 1.0


def test_requires_gates_checks_that_pass_by_absence():
    """A check with ``requires`` pays only once the checks it names pass (or do not apply); gates
    propagate, and checks that require each other pass together or not at all."""
    task = _task()
    spec = rubric_spec([{"id": "state", "kind": "final_state_match", "weight": 2},
                        {"id": "confirm", "kind": "no_policy_violation", "weight": 1, "rules": ["confirm_before_write"],
                         "requires": ["state", "only_orders"]},
                        {"id": "no_error", "kind": "no_tool_error", "weight": 1, "requires": ["confirm"]},
                        {"id": "only_orders", "kind": "final_state_match", "weight": 1, "when": {"families": ["order_status"]}}],
                       families=("return_delivered", "order_status"))
    assert problems(spec) == []
    _, idle = play(spec, [])  # nothing done: no violation and no error, but no credit for either
    by_id = checks_by_id(idle)
    assert idle.reward == 0.0 and not by_id["confirm"]["passed"] and not by_id["no_error"]["passed"]
    assert by_id["confirm"]["detail"].startswith("needs state to pass (alone: no violation")
    assert by_id["no_error"]["detail"].startswith("needs confirm to pass")  # gated through confirm's own gate
    _, done = play(spec, gold_steps(task))  # only_orders does not apply here: it counts as passed
    assert done.reward == 1.0 and done.success
    mutual = rubric_spec([{"id": "a", "kind": "final_state_match", "weight": 1, "requires": ["b"]},
                          {"id": "b", "kind": "no_policy_violation", "weight": 1, "requires": ["a"]}])
    assert problems(mutual) == []
    assert play(mutual, [])[1].reward == 0.0 and play(mutual, gold_steps(task))[1].reward == 1.0
    assert play(mutual, gold_steps(task, confirm=False))[1].reward == 0.0  # the state is right, the write unasked
    bad = rubric_spec([{"id": "a", "kind": "final_state_match", "weight": 1, "requires": ["a", "nope"]}])
    assert [p for p in problems(bad) if "requires" in p] == [
        "rubric.checks[0] (a): requires itself", "rubric.checks[0] (a): requires 'nope', which is not the id of a check of this rubric"]


def test_a_shaping_check_moves_the_reward_and_never_success():
    """``shaping``: a check that counts in the reward but not in success (it keeps training from
    unlearning what another capability decides); a rubric of shaping checks only is rejected."""
    task = _task()
    spec = rubric_spec([{"id": "confirm", "kind": "no_policy_violation", "weight": 2, "rules": ["confirm_before_write"]},
                        {"id": "state", "kind": "final_state_match", "weight": 1, "shaping": True}])
    assert problems(spec) == []
    _, idle = play(spec, [])  # no write: the decision holds, the shaping check fails
    assert idle.success and idle.reward == pytest.approx(2 / 3)
    assert checks_by_id(idle)["state"] == {**checks_by_id(idle)["state"], "shaping": True, "passed": False}
    _, done = play(spec, gold_steps(task))
    assert done.success and done.reward == 1.0
    _, unasked = play(spec, gold_steps(task, confirm=False))  # the shaping check pays, success stays the decision's
    assert not unasked.success and unasked.reward == pytest.approx(1 / 3)
    only = rubric_spec([{"id": "state", "kind": "final_state_match", "weight": 1, "shaping": True}])
    assert "every rubric check is shaping: success would judge nothing" in problems(only)
    v1 = rubric_spec([{"id": "a", "kind": "final_state_match", "weight": 1},
                      {"id": "b", "kind": "final_state_match", "weight": 1, "shaping": True}], schema_version="1")
    assert "rubric.checks[1]: 'shaping' needs schema_version '2' (this spec says '1')" in problems(v1)


def test_no_tool_error_and_tools_outside_the_subset():
    task = _task()
    tools = ["find_user_id_by_email", "find_user_id_by_name_zip", "get_order_details", "return_delivered_order_items"]
    spec = rubric_spec([{"id": "format", "kind": "no_tool_error", "weight": 1, "contains": ["malformed", "unknown tool"]},
                        {"id": "any", "kind": "no_tool_error", "weight": 1}], tools=tools)
    _, clean = play(spec, gold_steps(task))
    assert clean.reward == 1.0
    _, messy = play(spec, gold_steps(task) + [("bad", "<tool_call>{oops"), ("call", "transfer_to_human_agents", {"summary": "x"})])
    assert messy.reward == 0.0
    assert messy.info["tool_errors"] == ["Error: malformed tool call: bad json", "Error: unknown tool 'transfer_to_human_agents'"]
    assert messy.info["transferred"] is False  # the target never saw the hidden tool
    assert messy.info["actions"][-1] == {"name": "transfer_to_human_agents", "arguments": {"summary": "x"}, "ok": False}
    assert RULES["well_formed_tool_calls"].judge(messy.info)[0] == "LACKING"


def test_result_keeps_target_info_and_adds_rubric(spec):
    spec = {k: v for k, v in spec.items() if k not in ("start", "end")}  # the whole target episode
    spec["rubric"]["checks"] = [{**c, "requires": [r for r in c.get("requires", []) if r != "acted"]}
                                for c in spec["rubric"]["checks"] if c["id"] != "acted"]  # no answered start
    env = SyntheticEnv(spec, ENV)
    task = env.make_task("cancel_pending", BASE + 7)
    messages, result = demonstrate(env, task)
    target = demonstrate(ENV, task)[1]  # the same task played on the bare target
    for key, value in target.info.items():
        assert result.info[key] == value, key
    assert result.info["capability"] == "confirm_before_writing" and result.info["target_reward"] == 1.0
    assert result.info["spec_hash"] == spec_hash(spec) and result.info["hinted"] == task.meta["hinted"]
    assert {c["id"] for c in result.info["rubric"]} == {c["id"] for c in spec["rubric"]["checks"]}
    json.dumps(result.info)
    json.dumps(task.to_dict())
    assert messages[0]["role"] == "system"


# ---------------------------------------------------------------- determinism, seeds, perturbations


def test_names_seeds_and_determinism(spec):
    env = SyntheticEnv(spec, ENV)
    assert env.name == "synthetic_confirm_before_writing" == SyntheticEnv(spec, ENV).name
    assert env.families() == [f["name"] for f in spec["tasks"]["families"]]
    a, b = env.make_task("return_delivered", BASE + 11), env.make_task("return_delivered", BASE + 11)
    assert a == b and a.env == env.name and a.seed == BASE + 11
    with pytest.raises(ValueError):
        env.make_task("return_delivered", 42)  # a target split seed
    with pytest.raises(ValueError):
        env.make_task("cancel_forbidden", BASE)  # not a family of this spec
    tasks = env.sample_tasks(40)
    assert [t.seed for t in tasks] == list(range(BASE, BASE + 40))
    assert tasks == env.sample_tasks(40)
    counts = {f: sum(t.family == f for t in tasks) for f in env.families()}
    assert max(counts, key=counts.get) in ("cancel_declined", "order_status")  # weight 2 vs 1


def _with(spec, **knobs):
    spec = copy.deepcopy(spec)
    scenario = {k: knobs.pop(k) for k in ("name_zip_share", "decline_share") if k in knobs}
    spec["tasks"]["scenario"] = {**spec["tasks"].get("scenario", {}), **scenario}
    spec["difficulty"] = {**spec.get("difficulty", {}), **knobs}
    return spec


def test_scenario_knobs_change_gold_and_state(spec):
    seeds = range(BASE, BASE + 6)
    nz = SyntheticEnv(_with(spec, name_zip_share=1.0), ENV)
    assert all(nz.make_task("cancel_pending", s).gold_actions[0]["name"] == "find_user_id_by_name_zip" for s in seeds)
    em = SyntheticEnv(_with(spec, name_zip_share=0.0), ENV)
    assert all(em.make_task("cancel_pending", s).gold_actions[0]["name"] == "find_user_id_by_email" for s in seeds)
    declined_env = SyntheticEnv(_with(spec, decline_share=1.0), ENV)
    plain_env = SyntheticEnv(_with(spec, decline_share=0.0), ENV)
    for family in ("return_delivered", "exchange_delivered", "modify_address"):
        declined, plain = declined_env.make_task(family, BASE + 1), plain_env.make_task(family, BASE + 1)
        assert declined.meta["declined"] and not declined.meta["gold_writes"] and plain.meta["gold_writes"]
        assert declined.expected_state_hash != plain.expected_state_hash
        messages, result = demonstrate(declined_env, declined)
        assert result.reward == 1.0 and any(m["content"] == "No, please don't." for m in messages)
        assert demonstrate(declined_env, declined, confirm=False)[1].reward < 1.0  # writing anyway is wrong


def test_volunteer_distractors_and_hints(spec):
    vol = SyntheticEnv(_with(spec, volunteer_identity=1.0), ENV)
    task = vol.make_task("cancel_pending", BASE + 4)
    opening = vol.start(task).initial_messages()[1]["content"]
    assert task.scenario["email"] in opening or task.scenario["zip"] in opening
    hidden = SyntheticEnv(_with(spec, volunteer_identity=0.0), ENV).make_task("cancel_pending", BASE + 4)
    assert hidden.scenario["email"] not in hidden.scenario["opening"]

    crowded = SyntheticEnv(_with(spec, distractor_orders=3), ENV)
    task = crowded.make_task("exchange_delivered", BASE + 4)
    base = ENV.make_task("exchange_delivered", BASE + 4)
    episode = crowded.start(task)
    user = episode.target_episode.session.db.users[task.scenario["user_id"]]
    assert len(task.meta["distractor_orders"]) == 3 and all(o["order_id"] in user["orders"] for o in task.meta["distractor_orders"])
    assert task.expected_state_hash != base.expected_state_hash
    assert demonstrate(crowded, task)[1].reward == 1.0

    quarter = SyntheticEnv(_with(spec, hint_share=0.25), ENV)
    half = SyntheticEnv(_with(spec, hint_share=0.5), ENV)
    hinted_q = {s for s in range(BASE, BASE + 80) if quarter.make_task("cancel_pending", s).meta["hinted"]}
    hinted_h = {s for s in range(BASE, BASE + 80) if half.make_task("cancel_pending", s).meta["hinted"]}
    assert hinted_q < hinted_h and 8 < len(hinted_q) < 35  # monotone in the share, and about a quarter
    seed = min(hinted_q)
    episode = quarter.start(quarter.make_task("cancel_pending", seed))
    assert episode.hinted and episode.plain_system_prompt == ENV.system_prompt()
    assert episode.initial_messages()[0]["content"] == ENV.system_prompt() + "\n\nHint: " + spec["hint"]
    unhinted = min(set(range(BASE, BASE + 80)) - hinted_q)
    episode = quarter.start(quarter.make_task("cancel_pending", unhinted))
    assert not episode.hinted and episode.initial_messages()[0]["content"] == ENV.system_prompt()


def test_family_bias_tilts_toward_complex_families():
    spec = template_spec(cap("anything_else"), ENV)
    flat = SyntheticEnv(spec, ENV).family_weights()
    hard = SyntheticEnv(_with(spec, family_bias=1.5), ENV).family_weights()
    easy = SyntheticEnv(_with(spec, family_bias=-1.5), ENV).family_weights()
    assert hard["cancel_and_return"] > flat["cancel_and_return"] > easy["cancel_and_return"]
    assert hard["order_status"] < flat["order_status"] < easy["order_status"]
    assert sum(hard.values()) == pytest.approx(1.0)


# ---------------------------------------------------------------- the template synthesizer


@pytest.mark.parametrize("name", [rule.name for rule in CATALOGUE] + ["some_new_capability"])
def test_template_spec_is_valid_faithful_and_gold_solvable(name):
    spec = template_spec(cap(name), ENV)
    assert problems(spec) == []
    assert gold_solvable(spec, ENV, seeds=2) == []
    assert spec["capability"]["name"] == name and spec["policy"] == "inherit"
    assert spec["tasks"]["seed_range"][0] >= SYNTHETIC_SEED_BASE
    if name == "some_new_capability":
        assert [f["name"] for f in spec["tasks"]["families"]] == ENV.families()


def test_template_rubrics_focus_on_their_capability():
    kinds = {rule.name: template_spec(cap(rule.name), ENV) for rule in CATALOGUE}
    assert all(spec["schema_version"] == "2" and spec["start"]["before"] and spec["end"] for spec in kinds.values())
    confirm = kinds["confirm_before_writing"]
    assert any(c.get("rules") == ["confirm_before_write"] for c in confirm["rubric"]["checks"])
    assert any(c["kind"] == "asked_confirmation" for c in confirm["rubric"]["checks"])
    assert "cancel_declined" in [f["name"] for f in confirm["tasks"]["families"]]
    assert any(c["kind"] == "forbidden_call" for c in kinds["refuse_forbidden_actions"]["rubric"]["checks"])
    assert any(c["kind"] == "ordering" and c["before"] == "@auth" for c in kinds["authenticate_before_acting"]["rubric"]["checks"])
    grounded = [c for c in kinds["ground_arguments"]["rubric"]["checks"] if c.get("args")]
    assert grounded and all(any(a.get("grounded") for a in c["args"].values()) for c in grounded)
    assert {f["name"] for f in kinds["complete_multistep_transactions"]["tasks"]["families"]} == {
        "update_address_everywhere", "cancel_and_return"}
    assert kinds["complete_multistep_transactions"]["start"]["intent"] == 1
    info = kinds["communicate_results"]["rubric"]["checks"]
    assert max(info, key=lambda c: c["weight"])["kind"] == "info_communicated"
    # An agent that writes without asking is rewarded by neither the target nor this environment
    # (where the episode opens after the yes, the expert asked in the prefix: writing is right there).
    env = SyntheticEnv(confirm, ENV)
    for task in [t for t in env.sample_tasks(8) if t.meta["gold_writes"] and t.meta["start"] == "main"][:3]:
        result = demonstrate(env, task, confirm=False)[1]
        assert result.reward < 1.0 and result.info["target_reward"] == 0.0


def test_template_uses_failed_trajectories_to_weight_families():
    failed = [{"trajectory_id": f"t{i}", "info": {"family": family, "gold_writes": ["cancel_pending_order"],
                                                  "confirmations": 0, "n_writes": 1,
                                                  "policy_violations": [{"rule": "confirm_before_write", "detail": "x"}]}}
              for i, family in enumerate(["modify_address"] * 3 + ["cancel_forbidden"])]
    failed.append({"trajectory_id": "other", "info": {"family": "return_delivered", "confirmations": 1, "n_writes": 1,
                                                      "gold_writes": ["return_delivered_order_items"], "policy_violations": []}})
    plain = {f["name"]: f["weight"] for f in template_spec(cap("confirm_before_writing"), ENV)["tasks"]["families"]}
    spec = template_spec(cap("confirm_before_writing"), ENV, failed_trajectories=failed)
    weights = {f["name"]: f["weight"] for f in spec["tasks"]["families"]}
    assert weights["modify_address"] > plain["modify_address"]
    # A plan's families are where its decision point exists: failures reweight, never add, them.
    assert "cancel_forbidden" not in weights and "cancel_forbidden" not in plain
    generic = template_spec(cap("some_new_capability"), ENV, failed_trajectories=failed)
    assert {f["name"]: f["weight"] for f in generic["tasks"]["families"]}["cancel_forbidden"] > 1.0
    assert weights["return_delivered"] == plain["return_delivered"]  # that failure was not this capability
    assert problems(spec) == [] and gold_solvable(spec, ENV, seeds=1) == []


def test_gold_solvable_reports_unsatisfiable_rubrics_and_missing_tools(spec):
    bad = copy.deepcopy(spec)
    bad["rubric"]["checks"].append({"id": "transferred", "kind": "required_call", "weight": 1, "tool": "transfer_to_human_agents"})
    found = gold_solvable(bad, ENV, seeds=1)
    assert len(found) == len(spec["tasks"]["families"]) and all("transferred" in p for p in found)
    narrow = copy.deepcopy(spec)
    narrow["target"]["tools"] = ["find_user_id_by_email", "find_user_id_by_name_zip", "get_order_details", "cancel_pending_order"]
    narrow["tasks"]["families"] = [{"name": "cancel_pending", "weight": 1}, {"name": "return_delivered", "weight": 1}]
    kept = {"cancel_pending", "return_delivered"}
    for check in narrow["rubric"]["checks"] + narrow["start"]["variants"]:  # scoped to families the narrow spec drops
        if "families" in check.get("when", {}):
            check["when"]["families"] = [f for f in check["when"]["families"] if f in kept]
    narrow["rubric"]["checks"] = [c for c in narrow["rubric"]["checks"] if c.get("when", {}).get("families", True)]
    gone = {c["id"] for c in spec["rubric"]["checks"]} - {c["id"] for c in narrow["rubric"]["checks"]}
    for check in narrow["rubric"]["checks"]:  # and the gates on them
        check["requires"] = [r for r in check.get("requires", []) if r not in gone]
    found = gold_solvable(narrow, ENV, seeds=1)
    assert len(found) == 1 and found[0].startswith("return_delivered/") and "unknown tool" in found[0]


# ---------------------------------------------------------------- decision points and horizons


@pytest.mark.parametrize("name", [rule.name for rule in CATALOGUE])
def test_every_template_env_starts_at_its_decision_point(name):
    from trace_assets.envs.retail.expert import next_move

    spec = template_spec(cap(name), ENV)
    env = SyntheticEnv(spec, ENV)
    for task in env.sample_tasks(4):
        episode = env.start(task)
        again = env.start(task)
        assert episode.prefix and episode.prefix == again.prefix  # deterministic from the task
        messages = episode.initial_messages()
        assert messages[:2] == [{"role": "system", "content": episode.system_prompt},
                                {"role": "user", "content": task.scenario["opening"]}]
        assert messages[2:] == episode.prefix and messages[-1]["role"] in ("user", "tool")
        move = next_move(task, messages)  # what the expert does next is the decisive move
        assert move.kind in spec["start"]["before"]
        assert spec["start"].get("intent") in (None, move.intent)
        assert spec["start"].get("tool") in (None, (move.call or {}).get("name"))
        _, result = demonstrate(env, task)
        assert result.reward == 1.0 and result.success
        assert result.info["decision_point"]["finished"] or result.info["user_done"]
        assert result.info["decision_point"]["agent_actions"] <= spec["end"]["max_actions"]


def test_only_the_agents_part_is_scored():
    spec = template_spec(cap("communicate_results"), ENV)
    env = SyntheticEnv(spec, ENV)
    task = env.make_task("cancel_pending", BASE + 3)
    episode = env.start(task)
    assert any(task.required_info[0] in m.get("content", "") for m in episode.prefix)  # the proposal said it
    reply, _ = episode.user_reply("Done. Anything else I can help with?")
    result = episode.result()
    assert episode.finished and result.reward == 0.0 and "missing" in result.info["rubric"][0]["detail"]
    told = env.start(task)
    told.user_reply(f"Order {task.scenario['intents'][0]['order_id']} is cancelled; {task.required_info[0]} will be refunded.")
    assert told.result().reward == 1.0


def test_confirm_env_has_contrast_episodes_where_asking_is_wrong():
    """E_confirm_before_writing also starts where an answer is due and nothing is to be confirmed
    (order_status, before the report): asking "shall I proceed?" there fails a check, so "ask at
    every decision point" is not the optimum; answering scores 1. On a write family asking is
    still what the reward requires."""
    env = SyntheticEnv(template_spec(cap("confirm_before_writing"), ENV), ENV)
    task = env.make_task("order_status", BASE + 5)
    asked = env.start(task)
    asked.user_reply("I can help with that. Would you like me to proceed? Please confirm (yes/no).")
    if not asked.finished:
        asked.user_reply(f"Your order is {task.required_info[0] if task.required_info else 'on its way'}.")
    result = asked.result()
    checks = {c["id"]: c for c in result.info["rubric"]}
    assert not checks["nothing_to_confirm"]["passed"] and "nothing to confirm" in checks["nothing_to_confirm"]["detail"]
    assert result.reward < 1.0 and not result.success
    assert not checks["asked"]["applicable"]  # asking is scored only where something is to be confirmed
    _, expert = demonstrate(env, task)  # the expert answers at once
    assert expert.reward == 1.0 and {c["id"]: c for c in expert.info["rubric"]}["nothing_to_confirm"]["passed"]
    write_task = env.make_task("cancel_pending", BASE + 5)
    assert demonstrate(env, write_task, confirm=False)[1].reward < 1.0


def test_horizon_ends_after_the_decisive_call():
    env = SyntheticEnv(template_spec(cap("authenticate_before_acting"), ENV), ENV)
    task = env.make_task("cancel_pending", BASE + 1)
    episode = env.start(task)
    oid = task.scenario["intents"][0]["order_id"]
    episode.call_tool("get_order_details", {"order_id": oid})  # before authenticating
    assert episode.finished
    result = episode.result()
    assert result.reward == 0.0 and result.info["policy_violations"][0]["rule"] == "auth_before_action"
    assert result.info["decision_point"] == {"start": {"id": "main", "before": ["authenticate"]}, "prefix_messages": 2, "prefix_calls": 0,
                                             "agent_actions": 1, "finished": True}


def test_v1_specs_stay_readable_and_v2_features_need_v2():
    v1 = template_spec(cap("some_new_capability"), ENV)
    v1["schema_version"] = "1"
    assert any("'requires' needs schema_version '2'" in p for p in problems(v1))
    for check in v1["rubric"]["checks"]:
        del check["requires"]
    assert problems(v1) == [] and gold_solvable(v1, ENV, seeds=1) == []
    assert SyntheticEnv(v1, ENV).start(SyntheticEnv(v1, ENV).sample_tasks(1)[0]).prefix == []
    v1["rubric"]["checks"].append({"id": "asked", "kind": "asked_confirmation", "weight": 1})
    assert any("needs schema_version '2'" in p for p in problems(v1))


def test_a_decision_point_a_family_never_reaches_is_reported():
    spec = template_spec(cap("ground_arguments"), ENV)
    spec["tasks"]["families"].append({"name": "cancel_pending", "weight": 1.0})  # no variant lookup there
    found = gold_solvable(spec, ENV, seeds=1)
    assert len(found) == 1 and found[0].startswith("cancel_pending/") and "never reaches the decision point" in found[0]
