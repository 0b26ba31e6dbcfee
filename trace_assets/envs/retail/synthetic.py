"""The retail target's side of a synthetic task (``RetailEnv.synthetic_task``, a target hook).

A synthetic seed is any seed: ``make_task(family, seed)`` generates the task and its database, then
the spec's knobs perturb it, each from its own seeded stream (:func:`~trace_assets.envs.splits.synthetic_draw`):
the user's id method (``scenario.name_zip_share``), a declined last write (``scenario.decline_share``;
the gold drops that write), identity volunteered in the opening (``difficulty.volunteer_identity``)
and extra distractor orders on the user's account (``difficulty.distractor_orders``).
``gold_actions`` and ``expected_state_hash`` (a replay of the gold on the perturbed database) follow
the perturbations. ``meta["distractor_orders"]`` is applied to the database of every episode of the
task (``RetailEnv.start``).
"""

from __future__ import annotations

import copy
import random
from typing import Any

from ..base import Task
from ..splits import synthetic_draw
from .db import RetailDB, generate_db
from .tasks import make_task, replay_actions
from .tools import WRITE_TOOLS

KNOBS = frozenset({"name_zip_share", "decline_share", "hint_share", "volunteer_identity", "distractor_orders", "family_bias"})
"""The scenario and difficulty knobs this target interprets (hint_share and family_bias are the
synthetic environment's own; every other one is applied here)."""


def synthetic_task(family: str, seed: int, *, scenario: dict[str, Any], difficulty: dict[str, Any]) -> Task:
    """The retail task of ``(family, seed)`` under the knobs ``scenario`` and ``difficulty`` (module docstring)."""
    base = make_task(family, seed)
    slots = copy.deepcopy(base.scenario)
    intents = slots["intents"]
    intent_actions = copy.deepcopy(base.meta["intent_actions"])

    share = scenario["name_zip_share"]
    if share is not None:
        slots["id_method"] = "name_zip" if synthetic_draw("id_method", family, seed) < share else "email"
    writes = [i for i, intent in enumerate(intents) if intent["tool"] is not None and intent["confirm"]]
    declined = bool(writes) and synthetic_draw("decline", family, seed) < scenario["decline_share"]
    if declined:
        intents[writes[-1]]["confirm"] = False  # the expert still proposes it; the user says no
    gold = [_auth_action(slots)] + [
        action for intent, group in zip(intents, intent_actions) for action in group
        if intent["confirm"] or action["name"] not in WRITE_TOOLS
    ]
    volunteered = synthetic_draw("volunteer", family, seed) < difficulty["volunteer_identity"]
    if volunteered:
        slots["opening"] = f"Hi! {_identity_sentence(slots)} {intents[0]['request']}"

    db = generate_db(seed)
    distractors = _distractor_orders(db, slots, int(difficulty["distractor_orders"]), family, seed)
    if distractors or declined:
        apply_distractors(db, distractors)
        expected = replay_actions(db, gold).state_hash()
    else:  # the authentication call never changes the state
        expected = base.expected_state_hash
    return Task(
        task_id=base.task_id, env=base.env, family=family, seed=seed, instruction=_instruction(slots),
        scenario=slots, gold_actions=gold, required_info=list(base.required_info), expected_state_hash=expected,
        meta={"intent_actions": intent_actions, "volunteered": volunteered, "declined": declined,
              "id_method": slots["id_method"], "distractor_orders": distractors},
    )


def _auth_action(scenario: dict[str, Any]) -> dict[str, Any]:
    if scenario["id_method"] == "name_zip":
        return {"name": "find_user_id_by_name_zip", "arguments": {
            "first_name": scenario["first_name"], "last_name": scenario["last_name"], "zip": scenario["zip"]}}
    return {"name": "find_user_id_by_email", "arguments": {"email": scenario["email"]}}


def _identity_sentence(scenario: dict[str, Any]) -> str:
    if scenario["id_method"] == "name_zip":
        return f"My name is {scenario['first_name']} {scenario['last_name']} and my zip code is {scenario['zip']}."
    return f"My email is {scenario['email']}."


def _distractor_orders(db: RetailDB, scenario: dict[str, Any], n: int, family: str, seed: int) -> list[dict[str, Any]]:
    """``n`` extra orders for the task's user: same products as the target order where possible."""
    if n <= 0:
        return []
    rng = random.Random(f"synthetic/distractors/{family}/{seed}")
    user = db.users[scenario["user_id"]]
    target_oid = next((i.get("order_id") for i in scenario["intents"] if i.get("order_id")), None)
    target_products = sorted({it["product_id"] for it in db.orders[target_oid]["items"]}) if target_oid else []
    all_products = sorted(db.products)
    used_oid = {int(oid[1:]) for oid in db.orders}
    used_trk = {int(o["tracking_id"][1:]) for o in db.orders.values() if o.get("tracking_id")}
    out = []
    for _ in range(n):
        oid = _fresh(rng, 1000, 9999, used_oid)
        pids = [rng.choice(target_products or all_products)]
        if rng.random() < 0.5:
            pids.append(rng.choice([p for p in all_products if p not in pids]))
        items = []
        for pid in pids:
            product = db.products[pid]
            variant = product["variants"][rng.choice(sorted(product["variants"]))]
            items.append({"item_id": variant["item_id"], "product_id": pid, "name": product["name"],
                          "options": dict(variant["options"]), "price": variant["price"]})
        status = rng.choice(["pending", "processed", "delivered"])
        tracking = None
        if status == "delivered":
            tracking = _fresh(rng, 100000, 999999, used_trk)
        out.append({"order_id": f"W{oid}", "user_id": user["user_id"], "status": status, "items": items,
                    "address": dict(user["address"]), "payment_method_id": rng.choice(sorted(user["payment_methods"])),
                    "tracking_id": f"T{tracking}" if tracking else None, "refunds": []})
    return out


def _fresh(rng: random.Random, low: int, high: int, used: set[int]) -> int:
    while True:  # deterministic retry, as in the target's own id generator
        value = rng.randint(low, high)
        if value not in used:
            used.add(value)
            return value


def apply_distractors(db: RetailDB, orders: list[dict[str, Any]]) -> None:
    """Insert distractor orders into a retail database in place (same order every time)."""
    for order in orders:
        db.orders[order["order_id"]] = copy.deepcopy(order)
        db.users[order["user_id"]]["orders"].append(order["order_id"])


def _instruction(scenario: dict[str, Any]) -> str:
    s = scenario
    requests = " ".join(
        f"({i}) {intent['request']}" + ("" if intent["confirm"] else " When asked to confirm this one, say no.")
        for i, intent in enumerate(s["intents"], 1)
    )
    tail = " Confirm when asked." if all(i["confirm"] for i in s["intents"]) else ""
    return f"You are {s['first_name']} {s['last_name']} (email {s['email']}, zip {s['zip']}). Your requests, in order: {requests}{tail}"


