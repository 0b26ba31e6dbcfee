"""The retail environment: database, tools, policy rules, task families, scoring and the expert."""

from __future__ import annotations

import json
import re

import pytest

from trace_assets.envs import get_environment
from trace_assets.envs.base import Environment, Episode, Task
from trace_assets.envs.retail import FAMILIES, RetailEnv, RetailEpisode
from trace_assets.envs.retail.db import generate_db, money
from trace_assets.envs.retail.env import load_policy
from trace_assets.envs.retail.expert import demonstrate
from trace_assets.envs.retail.tasks import make_task
from trace_assets.envs.retail.tools import TOOL_NAMES, TOOL_SCHEMAS, WRITE_TOOLS

ENV = RetailEnv()
SEEDS = range(30)


def rules(result) -> list[str]:
    return [v["rule"] for v in result.info["policy_violations"]]


def authed(task: Task) -> RetailEpisode:
    """A fresh episode of ``task`` with its user authenticated by the gold auth call."""
    episode = ENV.start(task)
    auth = task.gold_actions[0]
    assert episode.call_tool(auth["name"], auth["arguments"]) == task.scenario["user_id"]
    return episode


def write_ok(episode: RetailEpisode, name: str, **arguments) -> str:
    """A confirmed write; the observation must not be an error."""
    episode.grant_confirmation()
    observation = episode.call_tool(name, arguments)
    assert not observation.startswith("Error:"), observation
    return observation


def unchanged(episode: RetailEpisode) -> bool:
    """The episode's database still equals a fresh one (no write happened)."""
    return episode.session.db.state_hash() == generate_db(episode.task.seed).state_hash()


def other_user_order(task: Task, *statuses: str) -> str:
    db = generate_db(task.seed)
    return next(o for o, order in sorted(db.orders.items())
                if order["user_id"] != task.scenario["user_id"] and (not statuses or order["status"] in statuses))


def own_order(task: Task, status: str) -> str | None:
    db = generate_db(task.seed)
    return next((o for o in db.users[task.scenario["user_id"]]["orders"] if db.orders[o]["status"] == status), None)


# ---- protocol, registry, prompt ---------------------------------------------------------------


def test_protocols_and_registry():
    env = get_environment("retail")
    assert isinstance(env, Environment) and isinstance(env, RetailEnv) and env.name == "retail"
    assert isinstance(env.start(env.make_task("order_status", 0)), Episode)
    assert env.families() == FAMILIES and len(FAMILIES) >= 8
    with pytest.raises(KeyError):
        get_environment("nope")


def test_tool_schemas_are_openai_format_and_terse():
    schemas = ENV.tool_schemas()
    assert len(schemas) >= 9 and [s["function"]["name"] for s in schemas] == TOOL_NAMES
    for schema in schemas:
        assert schema["type"] == "function"
        fn = schema["function"]
        assert set(fn) == {"name", "description", "parameters"}
        assert len(fn["description"].split()) <= 12
        assert fn["parameters"]["type"] == "object" and fn["parameters"]["properties"]
    schemas[0]["function"]["name"] = "mutated"  # a copy: callers cannot corrupt the module's schemas
    assert TOOL_SCHEMAS[0]["function"]["name"] == "find_user_id_by_email"


def test_system_prompt_holds_the_policy_and_stays_short():
    prompt = ENV.system_prompt()
    policy = load_policy()
    assert prompt.endswith(policy) and prompt.splitlines()[0].startswith("You are a retail")
    assert len(policy.split()) <= 150
    for phrase in ("Authenticate", "confirm", "explicit yes", "pending", "delivered", "gift card",
                   "same product", "human", "One user"):
        assert phrase in policy
    assert len(prompt) + len(json.dumps(ENV.tool_schemas())) < 3600


# ---- database ---------------------------------------------------------------------------------


def test_db_is_deterministic_and_seeds_differ():
    assert generate_db(5).to_dict() == generate_db(5).to_dict()
    assert generate_db(5).state_hash() == generate_db(5).state_hash()
    assert len({generate_db(s).state_hash() for s in range(20)}) == 20


def test_db_shape_and_short_ids():
    for seed in range(50):
        db = generate_db(seed)
        assert 6 <= len(db.users) <= 10 and 8 <= len(db.products) <= 12
        for uid, user in db.users.items():
            assert re.fullmatch(r"[a-z]+_[a-z]+_\d{4}", uid)
            assert 1 <= len(user["payment_methods"]) <= 3 and 2 <= len(user["orders"]) <= 4
            for pm_id, pm in user["payment_methods"].items():
                assert re.fullmatch(r"(credit_card|paypal|gift_card)_\d{2}", pm_id)
                assert ("balance" in pm) == (pm["kind"] == "gift_card")
        for oid, order in db.orders.items():
            assert re.fullmatch(r"W\d{4}", oid) and oid in db.users[order["user_id"]]["orders"]
            assert order["status"] in {"pending", "processed", "delivered", "cancelled"}
            assert (order["tracking_id"] is not None) == (order["status"] == "delivered")
            assert order["payment_method_id"] in db.users[order["user_id"]]["payment_methods"]
            for item in order["items"]:
                assert item["item_id"] in db.products[item["product_id"]]["variants"]
        for pid, product in db.products.items():
            assert re.fullmatch(r"P\d{3}", pid) and 2 <= len(product["variants"]) <= 4
            assert all(re.fullmatch(r"V\d{4}", v) for v in product["variants"])
            assert sum(v["available"] for v in product["variants"].values()) >= 2
            combos = [json.dumps(v["options"], sort_keys=True) for v in product["variants"].values()]
            assert len(set(combos)) == len(combos)  # options identify a variant


def test_db_copy_is_deep_and_hash_tracks_state():
    db = generate_db(1)
    clone = db.copy()
    oid = next(iter(clone.orders))
    clone.orders[oid]["status"] = "cancelled" if clone.orders[oid]["status"] != "cancelled" else "pending"
    assert clone.state_hash() != db.state_hash()
    assert db.state_hash() == generate_db(1).state_hash()


def test_money_format():
    assert money(12.3) == "$12.30" and money(0) == "$0.00" and money(-5) == "-$5.00"


# ---- tasks ------------------------------------------------------------------------------------


def test_make_task_is_deterministic_and_seeds_differ():
    for family in FAMILIES:
        task = make_task(family, 7)
        assert task.to_json() == make_task(family, 7).to_json()
        assert task.to_json() != make_task(family, 8).to_json()
        assert task.task_id == f"retail/{family}/00007" and task.env == "retail" and task.family == family
        assert Task.from_dict(json.loads(task.to_json())) == task
    with pytest.raises(ValueError):
        make_task("nope", 0)


def test_every_family_finds_a_target_for_200_seeds():
    for family in FAMILIES:
        for seed in range(200):
            task = make_task(family, seed)
            assert task.gold_actions[0]["name"].startswith("find_user_id_by_")
            assert [a for group in task.meta["intent_actions"] for a in group] == task.gold_actions[1:]


def test_family_contracts():
    for seed in range(20):
        tasks = {family: make_task(family, seed) for family in FAMILIES}
        writes = {f: [a["name"] for a in t.gold_actions if a["name"] in WRITE_TOOLS] for f, t in tasks.items()}
        assert writes["order_status"] == [] and writes["cancel_declined"] == [] and writes["cancel_forbidden"] == []
        assert writes["cancel_pending"] == ["cancel_pending_order"]
        assert writes["return_delivered"] == ["return_delivered_order_items"]
        assert writes["exchange_delivered"] == ["exchange_delivered_order_items"]
        assert writes["modify_address"] == ["modify_pending_order_address"]
        assert writes["update_address_everywhere"] == ["modify_user_address", "modify_pending_order_address"]
        assert writes["cancel_and_return"] == ["cancel_pending_order", "return_delivered_order_items"]
        fresh = generate_db(seed).state_hash()
        for family in ("order_status", "cancel_declined", "cancel_forbidden"):
            assert tasks[family].expected_state_hash == fresh
        for family in set(FAMILIES) - {"order_status", "cancel_declined", "cancel_forbidden"}:
            assert tasks[family].expected_state_hash != fresh
        db = generate_db(seed)
        status = tasks["order_status"]
        oid = status.scenario["intents"][0]["order_id"]
        assert status.required_info == [db.orders[oid]["status"], money(db.order_total(oid))]
        forbidden = tasks["cancel_forbidden"].scenario["intents"][0]["order_id"]
        assert db.orders[forbidden]["status"] in {"processed", "delivered"}
        assert tasks["cancel_forbidden"].required_info == [db.orders[forbidden]["status"]]
        assert tasks["cancel_declined"].scenario["intents"][0]["confirm"] is False
        # The second write depends on the first: the same new address.
        everywhere = tasks["update_address_everywhere"].gold_actions
        user_write, order_write = (a["arguments"] for a in everywhere if a["name"] in WRITE_TOOLS)
        assert {k: user_write[k] for k in ("address1", "city", "zip")} == {
            k: order_write[k] for k in ("address1", "city", "zip")}
        for task in tasks.values():  # identity is never in the opening message
            assert task.scenario["email"] not in task.scenario["opening"]
            assert task.scenario["zip"] not in task.scenario["opening"]


# ---- gold replay and expert -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_gold_replay_scores_one(family):
    for seed in SEEDS:
        task = make_task(family, seed)
        result = ENV.replay(task, task.gold_actions, say=task.required_info)
        assert result.reward == 1.0 and result.success, (task.task_id, result.info)
        assert result.info["policy_violations"] == [] and result.info["tool_errors"] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_scores_one_without_violations(family):
    for seed in SEEDS:
        task = make_task(family, seed)
        messages, result = demonstrate(ENV, task)
        assert result.reward == 1.0, (task.task_id, result.info)
        info = result.info
        assert info["policy_violations"] == [] and info["tool_errors"] == [] and info["authenticated"]
        assert info["user_done"] and info["n_writes"] == len(info["gold_writes"])
        assert info["confirmations"] == len(task.scenario["intents"]) - sum(
            i["tool"] is None for i in task.scenario["intents"])
        assert [a["name"] for a in info["actions"]] == [a["name"] for a in task.gold_actions]
        json.dumps(messages), json.dumps(info)


def test_expert_message_format():
    task = make_task("exchange_delivered", 3)
    messages, _ = demonstrate(ENV, task)
    assert messages[0] == {"role": "system", "content": ENV.system_prompt()}
    assert messages[1] == {"role": "user", "content": task.scenario["opening"]}
    assert messages[-1] == {"role": "user", "content": "That is all, thank you."}
    for message in messages:
        if message["role"] == "assistant" and "tool_calls" in message:
            assert message["content"] == "" and len(message["tool_calls"]) == 1
            call = message["tool_calls"][0]
            assert call["type"] == "function" and isinstance(call["function"]["arguments"], dict)
        elif message["role"] == "assistant":
            assert 0 < len(message["content"]) < 200
        elif message["role"] == "tool":
            assert set(message) == {"role", "name", "content"}
    texts = [m["content"] for m in messages if m["role"] == "assistant" and m["content"]]
    assert any("Do you confirm? (yes/no)" in t and task.required_info[0] in t for t in texts)


def test_expert_without_confirmation_is_imperfect():
    for seed in range(5):
        declined = make_task("cancel_declined", seed)
        _, result = demonstrate(ENV, declined, confirm=False)
        assert result.reward == 0.0 and not result.info["state_match"]
        assert "confirm_before_write" in rules(result)
        pending = make_task("cancel_pending", seed)
        _, result = demonstrate(ENV, pending, confirm=False)
        # The right final state, but the policy requires a yes before every write.
        assert result.info["state_match"] and result.info["info_score"] == 1.0
        assert result.reward == 0.0 and rules(result) == ["confirm_before_write"]
        checks = {c["id"]: c for c in result.info["checks"]}
        assert not checks["confirmed_writes"]["passed"] and "without an explicit yes" in checks["confirmed_writes"]["detail"]
        assert checks["state_match"]["passed"] and checks["info_communicated"]["passed"]


# ---- scoring ----------------------------------------------------------------------------------


def test_missing_write_scores_zero():
    for family in ("cancel_pending", "return_delivered", "exchange_delivered", "modify_address"):
        task = make_task(family, 2)
        reads = [a for a in task.gold_actions if a["name"] not in WRITE_TOOLS]
        result = ENV.replay(task, reads, say=task.required_info)
        assert result.reward == 0.0 and not result.info["state_match"] and result.info["info_score"] == 1.0


def test_multi_step_needs_both_writes():
    for family in ("update_address_everywhere", "cancel_and_return"):
        task = make_task(family, 4)
        first_write = next(i for i, a in enumerate(task.gold_actions) if a["name"] in WRITE_TOOLS)
        result = ENV.replay(task, task.gold_actions[: first_write + 1], say=task.required_info)
        assert result.reward == 0.0 and result.info["n_writes"] == 1


def test_missing_required_info_scores_zero():
    task = make_task("cancel_and_return", 3)
    result = ENV.replay(task, task.gold_actions, say=[])
    assert result.reward == 0.0 and result.info["state_match"] and result.info["info_score"] == 0.0
    assert result.info["missing_info"] == task.required_info
    partial = ENV.replay(task, task.gold_actions, say=[f"Refund: {task.required_info[0]}"])
    assert partial.reward == 0.0 and partial.info["missing_info"] == task.required_info[1:]
    shouting = ENV.replay(task, task.gold_actions, say=[" ".join(task.required_info).upper()])
    assert shouting.reward == 1.0  # case-insensitive substring


def test_wrong_item_returned_scores_zero():
    for seed in range(50):
        task = make_task("return_delivered", seed)
        write = task.gold_actions[-1]
        order = generate_db(seed).orders[write["arguments"]["order_id"]]
        others = [i["item_id"] for i in order["items"] if i["item_id"] != write["arguments"]["item_ids"][0]]
        if others:
            break
    wrong = {**write, "arguments": {**write["arguments"], "item_ids": [others[0]]}}
    result = ENV.replay(task, task.gold_actions[:-1] + [wrong], say=task.required_info)
    assert result.info["n_writes"] == 1 and result.reward == 0.0


def test_wrong_order_cancelled_scores_zero():
    for seed in range(50):
        task = make_task("cancel_and_return", seed)
        uid = task.scenario["user_id"]
        db = generate_db(seed)
        target = task.scenario["intents"][0]["order_id"]
        others = [o for o in db.users[uid]["orders"] if db.orders[o]["status"] == "pending" and o != target]
        if others:
            break
    gold = [dict(a) for a in task.gold_actions]
    index = next(i for i, a in enumerate(gold) if a["name"] == "cancel_pending_order")
    gold[index] = {"name": "cancel_pending_order", "arguments": {**gold[index]["arguments"], "order_id": others[0]}}
    result = ENV.replay(task, gold, say=task.required_info)
    assert result.info["n_writes"] == 2 and result.reward == 0.0


def test_wrong_reason_or_address_scores_zero():
    task = make_task("cancel_pending", 0)
    gold = [dict(a) for a in task.gold_actions]
    args = gold[-1]["arguments"]
    other = "ordered by mistake" if args["reason"] == "no longer needed" else "no longer needed"
    gold[-1] = {"name": gold[-1]["name"], "arguments": {**args, "reason": other}}
    assert ENV.replay(task, gold, say=task.required_info).reward == 0.0
    task = make_task("modify_address", 0)
    gold = [dict(a) for a in task.gold_actions]
    gold[-1] = {"name": gold[-1]["name"], "arguments": {**gold[-1]["arguments"], "zip": "00000"}}
    assert ENV.replay(task, gold).reward == 0.0


def test_declined_or_forbidden_tasks_fail_on_any_write():
    task = make_task("cancel_declined", 1)
    cancel = {"name": "cancel_pending_order",
              "arguments": {"order_id": task.scenario["intents"][0]["order_id"], "reason": "no longer needed"}}
    assert ENV.replay(task, task.gold_actions + [cancel], say=task.required_info).reward == 0.0
    assert ENV.replay(task, task.gold_actions, say=task.required_info).reward == 1.0


def test_result_is_pure_and_json_serialisable():
    task = make_task("cancel_pending", 5)
    episode = authed(task)
    first = episode.result()
    assert episode.result() == first
    info = json.loads(json.dumps(first.info))
    for key in ("state_match", "info_score", "missing_info", "actions", "tool_errors", "policy_violations",
                "authenticated", "confirmations", "n_writes", "gold_writes", "family"):
        assert key in info
    assert info["family"] == "cancel_pending" and info["gold_writes"] == ["cancel_pending_order"]
    assert info["actions"] == [{"name": task.gold_actions[0]["name"],
                                "arguments": task.gold_actions[0]["arguments"], "ok": True}]


# ---- episode protocol -------------------------------------------------------------------------


def test_initial_messages_and_bad_calls_never_raise():
    task = make_task("order_status", 0)
    episode = ENV.start(task)
    system, user = episode.initial_messages()
    assert system == {"role": "system", "content": ENV.system_prompt()}
    assert user == {"role": "user", "content": task.scenario["opening"]}
    assert episode.call_tool("delete_everything", {}) == "Error: unknown tool 'delete_everything'"
    assert episode.call_tool(None, {}).startswith("Error: unknown tool")  # type: ignore[arg-type]
    assert episode.call_tool("get_order_details", ["W1"]) == "Error: arguments must be a JSON object"  # type: ignore
    assert episode.call_tool("find_user_id_by_email", {}) == "Error: missing argument 'email'"
    assert episode.call_tool("find_user_id_by_email", {"email": "x", "pw": 1}) == "Error: unexpected argument 'pw'"
    assert episode.call_tool("find_user_id_by_email", {"email": 3}) == "Error: argument 'email' must be a string"
    observation = episode.malformed_call("<tool_call>{oops", "invalid JSON")
    assert observation == "Error: malformed tool call: invalid JSON"
    info = episode.result().info
    assert len(info["tool_errors"]) == 7 and info["tool_errors"][-1] == observation
    assert [a["ok"] for a in info["actions"]] == [False] * 6
    assert not info["authenticated"] and info["policy_violations"] == []


# ---- tools: happy paths and errors ------------------------------------------------------------


def test_find_user_by_email_and_name_zip():
    task = make_task("order_status", 3)
    s = task.scenario
    episode = ENV.start(task)
    assert episode.call_tool("find_user_id_by_email", {"email": "nobody@mail.com"}) == "Error: user not found"
    assert not episode.result().info["authenticated"]
    assert episode.call_tool("find_user_id_by_email", {"email": s["email"].upper()}) == s["user_id"]
    assert episode.result().info["authenticated"]
    episode = ENV.start(task)
    args = {"first_name": s["first_name"].lower(), "last_name": s["last_name"], "zip": s["zip"]}
    assert episode.call_tool("find_user_id_by_name_zip", {**args, "zip": "00000"}) == "Error: user not found"
    assert episode.call_tool("find_user_id_by_name_zip", args) == s["user_id"]


def test_authentication_is_enforced_for_account_tools():
    task = make_task("cancel_pending", 0)
    oid = task.scenario["intents"][0]["order_id"]
    uid = task.scenario["user_id"]
    calls = {
        "get_user_details": {"user_id": uid},
        "get_order_details": {"order_id": oid},
        "cancel_pending_order": {"order_id": oid, "reason": "no longer needed"},
        "modify_pending_order_address": {"order_id": oid, "address1": "1 A St", "city": "Reno", "zip": "12345"},
        "return_delivered_order_items": {"order_id": oid, "item_ids": ["V1"], "payment_method_id": "x"},
        "exchange_delivered_order_items": {"order_id": oid, "item_ids": ["V1"], "new_item_ids": ["V2"],
                                           "payment_method_id": "x"},
        "modify_user_address": {"user_id": uid, "address1": "1 A St", "city": "Reno", "zip": "12345"},
    }
    episode = ENV.start(task)
    for name, args in calls.items():
        assert episode.call_tool(name, args) == "Error: authenticate the user first", name
    result = episode.result()
    assert rules(result) == ["auth_before_action"] * len(calls)
    assert [v["detail"] for v in result.info["policy_violations"]] == list(calls)
    assert unchanged(episode)
    # Product lookups and transfers are not account actions.
    pid = generate_db(0).orders[oid]["items"][0]["product_id"]
    assert json.loads(episode.call_tool("get_product_details", {"product_id": pid}))["product_id"] == pid


def test_one_user_per_conversation():
    task = make_task("cancel_pending", 0)
    episode = authed(task)
    db = generate_db(0)
    other_uid = next(u for u in sorted(db.users) if u != task.scenario["user_id"])
    other_oid = other_user_order(task, "pending")
    assert episode.call_tool("get_user_details", {"user_id": other_uid}) == "Error: user is not the authenticated user"
    assert episode.call_tool("get_order_details", {"order_id": other_oid}) == (
        "Error: order does not belong to the authenticated user")
    episode.grant_confirmation()
    assert episode.call_tool("cancel_pending_order", {"order_id": other_oid, "reason": "no longer needed"}).startswith(
        "Error: order does not belong")
    assert episode.call_tool("find_user_id_by_email", {"email": db.users[other_uid]["email"]}).startswith(
        "Error: another user is already authenticated")
    assert rules(episode.result()) == ["one_user"] * 4
    assert unchanged(episode) and episode.session.user_id == task.scenario["user_id"]
    assert episode.call_tool("get_user_details", {"user_id": "ghost_user_0000"}) == "Error: user not found"
    assert episode.call_tool("get_order_details", {"order_id": "W0000"}) == "Error: order not found"


def test_get_user_order_product_details():
    task = make_task("exchange_delivered", 2)
    episode = authed(task)
    db = generate_db(2)
    uid = task.scenario["user_id"]
    user = json.loads(episode.call_tool("get_user_details", {"user_id": uid}))
    assert user["user_id"] == uid and user["orders"] == db.users[uid]["orders"]
    assert {m["id"] for m in user["payment_methods"]} == set(db.users[uid]["payment_methods"])
    oid = task.scenario["intents"][0]["order_id"]
    order = json.loads(episode.call_tool("get_order_details", {"order_id": oid}))
    assert order["status"] == "delivered" and order["total"] == money(db.order_total(oid))
    assert order["tracking_id"] == db.orders[oid]["tracking_id"]
    assert all(re.fullmatch(r"\$\d+\.\d\d", item["price"]) for item in order["items"])
    pid = order["items"][0]["product_id"]
    product = json.loads(episode.call_tool("get_product_details", {"product_id": pid}))
    assert {v["item_id"] for v in product["variants"]} == set(db.products[pid]["variants"])
    assert episode.call_tool("get_product_details", {"product_id": "P000"}) == "Error: product not found"
    assert unchanged(episode)  # reads change nothing


def test_cancel_pending_order():
    task = make_task("cancel_pending", 1)
    episode = authed(task)
    oid = task.scenario["intents"][0]["order_id"]
    db = generate_db(1)
    bad = episode.call_tool("cancel_pending_order", {"order_id": oid, "reason": "too expensive"})
    assert bad.startswith("Error: argument 'reason' must be one of")
    out = json.loads(write_ok(episode, "cancel_pending_order", order_id=oid, reason=task.gold_actions[-1]["arguments"]["reason"]))
    assert out == {"order_id": oid, "status": "cancelled", "refund": money(db.order_total(oid)),
                   "payment_method_id": db.orders[oid]["payment_method_id"]}
    assert episode.result().info["state_match"]
    again = episode.call_tool("cancel_pending_order", {"order_id": oid, "reason": "no longer needed"})
    assert again == "Error: order is cancelled; only pending orders can be cancelled"
    assert rules(episode.result()) == ["status"]


def test_cancel_refunds_gift_card_balance():
    for seed in range(100):
        db = generate_db(seed)
        hit = [o for o in db.orders.values() if o["status"] == "pending"
               and db.users[o["user_id"]]["payment_methods"][o["payment_method_id"]]["kind"] == "gift_card"]
        if hit:
            break
    order = hit[0]
    user = db.users[order["user_id"]]
    episode = ENV.start(make_task("order_status", seed))
    assert episode.call_tool("find_user_id_by_email", {"email": user["email"]}) == user["user_id"]
    write_ok(episode, "cancel_pending_order", order_id=order["order_id"], reason="no longer needed")
    after = episode.session.db.users[user["user_id"]]["payment_methods"][order["payment_method_id"]]["balance"]
    before = user["payment_methods"][order["payment_method_id"]]["balance"]
    assert after == pytest.approx(before + db.order_total(order["order_id"]))


@pytest.mark.parametrize("status", ["processed", "delivered", "cancelled"])
def test_cancel_and_modify_need_pending(status):
    for seed in range(50):
        task = make_task("cancel_pending", seed)
        oid = own_order(task, status)
        if oid:
            break
    episode = authed(task)
    assert episode.call_tool("cancel_pending_order", {"order_id": oid, "reason": "no longer needed"}) == (
        f"Error: order is {status}; only pending orders can be cancelled")
    assert episode.call_tool("modify_pending_order_address",
                             {"order_id": oid, "address1": "1 A St", "city": "Reno", "zip": "12345"}) == (
        f"Error: order is {status}; only pending orders can be modified")
    result = episode.result()
    assert rules(result) == ["status", "status"] and unchanged(episode) and result.info["n_writes"] == 0


def test_modify_pending_order_address():
    task = make_task("modify_address", 6)
    episode = authed(task)
    write = task.gold_actions[-1]["arguments"]
    oid = write["order_id"]
    blank = episode.call_tool("modify_pending_order_address", {**write, "city": "  "})
    assert blank == "Error: address1, city and zip must not be empty"
    out = json.loads(write_ok(episode, "modify_pending_order_address", **write))
    assert out == {"order_id": oid, "address": {k: write[k] for k in ("address1", "city", "zip")}}
    assert episode.result().info["state_match"]


def test_modify_user_address():
    task = make_task("update_address_everywhere", 6)
    episode = authed(task)
    args = next(a["arguments"] for a in task.gold_actions if a["name"] == "modify_user_address")
    out = json.loads(write_ok(episode, "modify_user_address", **args))
    assert out["address"] == {k: args[k] for k in ("address1", "city", "zip")}
    assert episode.session.db.users[args["user_id"]]["address"] == out["address"]
    assert episode.call_tool("modify_user_address", {**args, "user_id": "ghost_user_0000"}) == "Error: user not found"


def test_return_delivered_order_items():
    task = make_task("return_delivered", 0)  # seed 0: the user has another card and a pending order
    write = task.gold_actions[-1]["arguments"]
    oid, item_id, pm = write["order_id"], write["item_ids"][0], write["payment_method_id"]
    db = generate_db(0)
    uid = task.scenario["user_id"]
    episode = authed(task)
    call = lambda **kw: episode.call_tool("return_delivered_order_items", {**write, **kw})  # noqa: E731
    assert call(item_ids=[]) == "Error: item_ids is empty"
    assert call(item_ids=[item_id, item_id]) == "Error: duplicate item ids"
    assert call(item_ids=["V0000"]) == f"Error: item V0000 is not in order {oid}"
    assert call(payment_method_id="credit_card_00").startswith("Error: payment method credit_card_00 is not the user's")
    other_pms = [p for p, m in db.users[uid]["payment_methods"].items() if p != pm and m["kind"] != "gift_card"]
    assert other_pms and call(payment_method_id=other_pms[0]) == (
        "Error: refunds go to the original payment method or a gift card")
    pending = own_order(task, "pending")
    assert pending and call(order_id=pending).startswith("Error: order is pending; only delivered orders can be returned")
    assert episode.result().info["n_writes"] == 0 and unchanged(episode)
    out = json.loads(write_ok(episode, "return_delivered_order_items", **write))
    price = next(i["price"] for i in db.orders[oid]["items"] if i["item_id"] == item_id)
    assert out == {"order_id": oid, "status": "return requested", "refund": money(price), "payment_method_id": pm}
    assert episode.result().info["state_match"]
    assert call().startswith("Error: order is return requested; only delivered orders")
    assert rules(episode.result()) == ["payment", "refund_method", "status", "status"]


def test_return_refund_to_gift_card_credits_it():
    for seed in range(100):
        task = make_task("return_delivered", seed)
        db = generate_db(seed)
        uid = task.scenario["user_id"]
        write = task.gold_actions[-1]["arguments"]
        cards = [p for p, m in db.users[uid]["payment_methods"].items()
                 if m["kind"] == "gift_card" and p != write["payment_method_id"]]
        if cards:
            break
    episode = authed(task)
    out = json.loads(write_ok(episode, "return_delivered_order_items", **{**write, "payment_method_id": cards[0]}))
    balance = episode.session.db.users[uid]["payment_methods"][cards[0]]["balance"]
    assert balance == pytest.approx(db.users[uid]["payment_methods"][cards[0]]["balance"] + float(out["refund"][1:]))
    assert rules(episode.result()) == [] and not episode.result().info["state_match"]  # valid, but not the gold


def test_exchange_delivered_order_items():
    task = make_task("exchange_delivered", 0)  # seed 0: the product has an unavailable variant
    write = task.gold_actions[-1]["arguments"]
    oid, old, new = write["order_id"], write["item_ids"][0], write["new_item_ids"][0]
    db = generate_db(0)
    product = db.products[next(i["product_id"] for i in db.orders[oid]["items"] if i["item_id"] == old)]
    other_product = next(p for p in db.products.values() if p["product_id"] != product["product_id"])
    episode = authed(task)
    call = lambda **kw: episode.call_tool("exchange_delivered_order_items", {**write, **kw})  # noqa: E731
    assert call(new_item_ids=[]) == "Error: item_ids and new_item_ids must have the same length"
    assert call(new_item_ids=["V0000"]) == "Error: item V0000 not found"
    assert call(new_item_ids=[old]) == f"Error: item {old} is the same item"
    foreign = next(iter(other_product["variants"]))
    assert call(new_item_ids=[foreign]) == f"Error: item {foreign} is not a variant of the same product"
    unavailable = [v for v, var in product["variants"].items() if not var["available"] and v != old]
    assert unavailable and call(new_item_ids=[unavailable[0]]) == f"Error: item {unavailable[0]} is not available"
    assert call(payment_method_id="paypal_00").startswith("Error: payment method paypal_00")
    assert episode.result().info["n_writes"] == 0
    out = json.loads(write_ok(episode, "exchange_delivered_order_items", **write))
    diff = round(product["variants"][new]["price"] - product["variants"][old]["price"], 2)
    assert out[("charge" if diff >= 0 else "refund")] == money(abs(diff)) == task.required_info[0]
    assert out["status"] == "exchange requested" and episode.result().info["state_match"]
    assert rules(episode.result()) == ["exchange", "exchange", "payment"]


def test_exchange_with_gift_card_needs_balance():
    for seed in range(200):
        db = generate_db(seed)
        for order in (o for o in db.orders.values() if o["status"] == "delivered"):
            cards = [m for m in db.users[order["user_id"]]["payment_methods"].values() if m["kind"] == "gift_card"]
            for item in order["items"]:
                for vid, v in db.products[item["product_id"]]["variants"].items():
                    if cards and v["available"] and vid != item["item_id"] and v["price"] - item["price"] > cards[0]["balance"]:
                        user = db.users[order["user_id"]]
                        episode = ENV.start(make_task("order_status", seed))
                        episode.call_tool("find_user_id_by_email", {"email": user["email"]})
                        observation = episode.call_tool("exchange_delivered_order_items", {
                            "order_id": order["order_id"], "item_ids": [item["item_id"]],
                            "new_item_ids": [vid], "payment_method_id": cards[0]["id"]})
                        assert observation == "Error: insufficient gift card balance"
                        return
    pytest.fail("no gift-card exchange above the balance in 200 seeds")


def test_transfer_ends_the_conversation():
    task = make_task("order_status", 0)
    episode = ENV.start(task)
    assert episode.call_tool("transfer_to_human_agents", {"summary": "wants a refund"}) == "Transfer successful"
    reply, done = episode.user_reply("I transferred you to a human agent.")
    assert done and episode.result().info["transferred"]


# ---- confirmation rule ------------------------------------------------------------------------


def test_write_without_yes_is_a_confirm_violation():
    task = make_task("cancel_pending", 3)
    episode = authed(task)
    write = task.gold_actions[-1]
    episode.call_tool(write["name"], write["arguments"])
    result = episode.result()
    assert rules(result) == ["confirm_before_write"] and result.info["state_match"]
    assert result.info["confirmations"] == 0


def test_confirmation_from_the_simulated_user():
    task = make_task("update_address_everywhere", 3)
    episode = authed(task)
    first, second = (a for a in task.gold_actions if a["name"] in WRITE_TOOLS)
    reply, done = episode.user_reply("I will update your account address. Do you confirm? (yes/no)")
    assert (reply, done) == ("Yes, please proceed.", False)
    episode.call_tool(first["name"], first["arguments"])
    assert rules(episode.result()) == []
    episode.call_tool(second["name"], second["arguments"])  # one yes covers one write
    assert rules(episode.result()) == ["confirm_before_write"]
    assert episode.result().info["confirmations"] == 1


def test_yes_followed_by_another_message_no_longer_counts():
    task = make_task("cancel_pending", 8)
    episode = authed(task)
    assert episode.user_reply("Shall I cancel it?")[0] == "Yes, please proceed."
    episode.user_reply("Let me check one more thing.")
    write = task.gold_actions[-1]
    episode.call_tool(write["name"], write["arguments"])
    assert rules(episode.result()) == ["confirm_before_write"]


def test_write_after_no_is_a_violation_and_fails_the_task():
    task = make_task("cancel_declined", 2)
    episode = authed(task)
    oid = task.scenario["intents"][0]["order_id"]
    assert episode.user_reply(f"Cancel order {oid}. Do you confirm? (yes/no)") == ("No, please don't.", False)
    episode.call_tool("cancel_pending_order", {"order_id": oid, "reason": "no longer needed"})
    result = episode.result()
    assert rules(result) == ["confirm_before_write"] and result.info["confirmations"] == 1
    assert result.reward == 0.0
