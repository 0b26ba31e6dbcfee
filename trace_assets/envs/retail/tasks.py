"""Retail task families: scenarios, gold actions, required info and the expected final state.

Contract:

* ``make_task(family, seed)`` is a pure function: the task's database is ``generate_db(seed)``, and
  the target user / order / items are picked from it with ``random.Random(f"retail/{family}/{seed}")``
  among candidates sorted by id.
* A scenario is a list of *intents*, stated by the simulated user one after another. Each intent
  has a ``kind``, a one-sentence ``request``, whether the user ``confirm``s writes, the write
  ``tool`` and its ``target`` id (None for read-only intents) and, for read-only intents, the
  strings the agent must say (``must_say``) for the user to consider it handled.
* ``gold_actions`` = the authentication call followed by each intent's reads and write, in order;
  ``meta["intent_actions"]`` holds the same calls grouped per intent (for the scripted expert).
* ``expected_state_hash`` = the state hash after replaying ``gold_actions`` on a fresh database.
"""

from __future__ import annotations

import random
from typing import Any, Callable

from ..base import Task
from .db import CANCEL_REASONS, RetailDB, generate_db, money, random_address
from .tools import WRITE_TOOLS, Session, run_tool

FAMILIES: list[str] = [
    "order_status",
    "cancel_pending",
    "cancel_declined",
    "cancel_forbidden",
    "return_delivered",
    "exchange_delivered",
    "modify_address",
    "update_address_everywhere",
    "cancel_and_return",
]

Action = dict[str, Any]
Intent = dict[str, Any]


def _call(name: str, **arguments: Any) -> Action:
    return {"name": name, "arguments": arguments}


def describe_options(options: dict[str, str]) -> str:
    return ", ".join(f"{key}: {value}" for key, value in options.items())


def describe_item(item: dict[str, Any]) -> str:
    return f"{item['name']} ({describe_options(item['options'])})"


def describe_address(address: dict[str, str]) -> str:
    return f"{address['address1']}, {address['city']}, {address['zip']}"


def _orders(db: RetailDB, *statuses: str) -> list[dict[str, Any]]:
    return [db.orders[oid] for oid in sorted(db.orders) if db.orders[oid]["status"] in statuses]


def _pick(rng: random.Random, candidates: list[Any], what: str) -> Any:
    if not candidates:  # generate_db guarantees targets; reaching this is an environment bug
        raise ValueError(f"no candidate {what} in this database")
    return rng.choice(candidates)


def _new_address(rng: random.Random, current: dict[str, str]) -> dict[str, str]:
    while True:  # deterministic retry: the new address must differ from the current one
        address = random_address(rng)
        if address != current:
            return address


# ---- intents ---------------------------------------------------------------------------------


def _cancel_intent(db: RetailDB, order: dict[str, Any], rng: random.Random, confirm: bool) -> tuple[Intent, list[Action], list[str]]:
    reason = rng.choice(CANCEL_REASONS)
    phrase = "it is no longer needed" if reason == "no longer needed" else "it was ordered by mistake"
    oid = order["order_id"]
    intent = {"kind": "cancel", "tool": "cancel_pending_order", "target": oid, "order_id": oid,
              "reason": reason, "confirm": confirm, "must_say": [],
              "request": f"I want to cancel my order {oid} because {phrase}."}
    actions = [_call("get_order_details", order_id=oid)]
    if confirm:
        actions.append(_call("cancel_pending_order", order_id=oid, reason=reason))
    return intent, actions, [money(db.order_total(oid))]


def _return_intent(order: dict[str, Any], item: dict[str, Any]) -> tuple[Intent, list[Action], list[str]]:
    oid = order["order_id"]
    intent = {"kind": "return", "tool": "return_delivered_order_items", "target": oid, "order_id": oid,
              "item": describe_item(item), "payment": "the original payment method",
              "confirm": True, "must_say": [],
              "request": f"I want to return the {describe_item(item)} from order {oid}, "
                         f"refunded to the original payment method."}
    actions = [
        _call("get_order_details", order_id=oid),
        _call("return_delivered_order_items", order_id=oid, item_ids=[item["item_id"]],
              payment_method_id=order["payment_method_id"]),
    ]
    return intent, actions, [money(item["price"])]


def _address_intent(kind: str, oid: str, address: dict[str, str], request: str) -> Intent:
    tool = "modify_user_address" if kind == "modify_user_address" else "modify_pending_order_address"
    return {"kind": kind, "tool": tool, "target": oid, "order_id": oid if kind != "modify_user_address" else None,
            "address": address, "confirm": True, "must_say": [], "request": request}


# ---- families: each returns (user, intents, per-intent actions, required_info) -----------------


Built = tuple[dict[str, Any], list[Intent], list[list[Action]], list[str]]


def _order_status(db: RetailDB, rng: random.Random) -> Built:
    order = _pick(rng, _orders(db, "pending", "processed", "delivered", "cancelled"), "order")
    oid = order["order_id"]
    info = [order["status"], money(db.order_total(oid))]
    intent = {"kind": "order_status", "tool": None, "target": None, "order_id": oid, "confirm": True,
              "must_say": info, "request": f"What is the status of my order {oid}, and what was its total?"}
    return db.users[order["user_id"]], [intent], [[_call("get_order_details", order_id=oid)]], info


def _cancel(confirm: bool) -> Callable[[RetailDB, random.Random], Built]:
    def build(db: RetailDB, rng: random.Random) -> Built:
        order = _pick(rng, _orders(db, "pending"), "pending order")
        intent, actions, info = _cancel_intent(db, order, rng, confirm)
        return db.users[order["user_id"]], [intent], [actions], info
    return build


def _cancel_forbidden(db: RetailDB, rng: random.Random) -> Built:
    order = _pick(rng, _orders(db, "processed", "delivered"), "processed or delivered order")
    oid = order["order_id"]
    intent = {"kind": "cancel_forbidden", "tool": None, "target": None, "order_id": oid, "confirm": True,
              "reason": "no longer needed", "must_say": [order["status"]],
              "request": f"I want to cancel my order {oid} because it is no longer needed."}
    return db.users[order["user_id"]], [intent], [[_call("get_order_details", order_id=oid)]], [order["status"]]


def _return_delivered(db: RetailDB, rng: random.Random) -> Built:
    order = _pick(rng, _orders(db, "delivered"), "delivered order")
    item = rng.choice(order["items"])
    intent, actions, info = _return_intent(order, item)
    return db.users[order["user_id"]], [intent], [actions], info


def _exchange_delivered(db: RetailDB, rng: random.Random) -> Built:
    candidates = []
    for order in _orders(db, "delivered"):
        method = db.users[order["user_id"]]["payment_methods"][order["payment_method_id"]]
        for item in order["items"]:
            variants = db.products[item["product_id"]]["variants"]
            for vid in sorted(variants):
                variant = variants[vid]
                diff = round(variant["price"] - item["price"], 2)
                affordable = method["kind"] != "gift_card" or method["balance"] >= diff
                if vid != item["item_id"] and variant["available"] and affordable:
                    candidates.append((order, item, variant, diff))
    order, item, variant, diff = _pick(rng, candidates, "exchangeable item")
    oid = order["order_id"]
    new_options = describe_options(variant["options"])
    intent = {"kind": "exchange", "tool": "exchange_delivered_order_items", "target": oid, "order_id": oid,
              "item": describe_item(item), "new_options": new_options, "payment": "the original payment method",
              "confirm": True, "must_say": [],
              "request": f"I want to exchange the {describe_item(item)} from order {oid} "
                         f"for the one with {new_options}."}
    actions = [
        _call("get_order_details", order_id=oid),
        _call("get_product_details", product_id=item["product_id"]),
        _call("exchange_delivered_order_items", order_id=oid, item_ids=[item["item_id"]],
              new_item_ids=[variant["item_id"]], payment_method_id=order["payment_method_id"]),
    ]
    return db.users[order["user_id"]], [intent], [actions], [money(abs(diff))]


def _modify_address(db: RetailDB, rng: random.Random) -> Built:
    order = _pick(rng, _orders(db, "pending"), "pending order")
    oid = order["order_id"]
    address = _new_address(rng, order["address"])
    intent = _address_intent("modify_order_address", oid, address,
                             f"Please change the shipping address of my order {oid} to {describe_address(address)}.")
    actions = [_call("get_order_details", order_id=oid),
               _call("modify_pending_order_address", order_id=oid, **address)]
    return db.users[order["user_id"]], [intent], [actions], []


def _update_address_everywhere(db: RetailDB, rng: random.Random) -> Built:
    order = _pick(rng, _orders(db, "pending"), "pending order")
    user = db.users[order["user_id"]]
    uid, oid = user["user_id"], order["order_id"]
    address = _new_address(rng, user["address"])
    first = _address_intent("modify_user_address", uid, address,
                            f"I moved. Please update my account address to {describe_address(address)}.")
    second = _address_intent("modify_order_address", oid, address,
                             f"Please also change the shipping address of my pending order {oid} to the same new address.")
    actions = [
        [_call("get_user_details", user_id=uid), _call("modify_user_address", user_id=uid, **address)],
        [_call("get_order_details", order_id=oid), _call("modify_pending_order_address", order_id=oid, **address)],
    ]
    return user, [first, second], actions, []


def _cancel_and_return(db: RetailDB, rng: random.Random) -> Built:
    users = [u for _, u in sorted(db.users.items())
             if any(db.orders[o]["status"] == "pending" for o in u["orders"])
             and any(db.orders[o]["status"] == "delivered" for o in u["orders"])]
    user = _pick(rng, users, "user with pending and delivered orders")
    pending = rng.choice([db.orders[o] for o in sorted(user["orders"]) if db.orders[o]["status"] == "pending"])
    delivered = rng.choice([db.orders[o] for o in sorted(user["orders"]) if db.orders[o]["status"] == "delivered"])
    item = rng.choice(delivered["items"])
    cancel, cancel_actions, cancel_info = _cancel_intent(db, pending, rng, True)
    ret, return_actions, return_info = _return_intent(delivered, item)
    ret["request"] = "I also " + ret["request"].removeprefix("I ")
    return user, [cancel, ret], [cancel_actions, return_actions], cancel_info + return_info


_BUILDERS: dict[str, Callable[[RetailDB, random.Random], Built]] = {
    "order_status": _order_status,
    "cancel_pending": _cancel(True),
    "cancel_declined": _cancel(False),
    "cancel_forbidden": _cancel_forbidden,
    "return_delivered": _return_delivered,
    "exchange_delivered": _exchange_delivered,
    "modify_address": _modify_address,
    "update_address_everywhere": _update_address_everywhere,
    "cancel_and_return": _cancel_and_return,
}
assert list(_BUILDERS) == FAMILIES


def replay_actions(db: RetailDB, actions: list[Action]) -> RetailDB:
    """Apply ``actions`` to ``db`` in place (authentication included) and return it."""
    session = Session(db)
    for action in actions:
        outcome = run_tool(session, action["name"], action["arguments"])
        if not outcome.ok:
            raise RuntimeError(f"gold action failed: {action} -> {outcome.observation}")
    return db


def make_task(family: str, seed: int) -> Task:
    """The task of ``family`` generated from ``seed`` (see the module docstring)."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown retail family {family!r}; known: {FAMILIES}")
    db = generate_db(seed)
    rng = random.Random(f"retail/{family}/{seed}")
    user, intents, intent_actions, required_info = _BUILDERS[family](db, rng)

    id_method = "name_zip" if rng.random() < 0.3 else "email"
    if id_method == "email":
        auth = _call("find_user_id_by_email", email=user["email"])
    else:
        auth = _call("find_user_id_by_name_zip", first_name=user["first_name"],
                     last_name=user["last_name"], zip=user["address"]["zip"])
    gold = [auth] + [action for group in intent_actions for action in group]
    expected = replay_actions(generate_db(seed), gold).state_hash()

    name = f"{user['first_name']} {user['last_name']}"
    confirms = all(intent["confirm"] for intent in intents)
    instruction = (
        f"You are {name} (email {user['email']}, zip {user['address']['zip']}). "
        + "Your requests, in order: "
        + " ".join(f"({i}) {intent['request']}" for i, intent in enumerate(intents, 1))
        + (" Confirm when asked." if confirms else " When asked to confirm, say no.")
    )
    scenario = {
        "user_id": user["user_id"],
        "first_name": user["first_name"],
        "last_name": user["last_name"],
        "email": user["email"],
        "zip": user["address"]["zip"],
        "id_method": id_method,  # name_zip: the user does not remember their email
        "opening": "Hi! " + intents[0]["request"],
        "intents": intents,
    }
    return Task(
        task_id=f"retail/{family}/{seed:05d}",
        env="retail",
        family=family,
        seed=seed,
        instruction=instruction,
        scenario=scenario,
        gold_actions=gold,
        required_info=required_info,
        expected_state_hash=expected,
        meta={"intent_actions": intent_actions,
              "gold_writes": [a["name"] for a in gold if a["name"] in WRITE_TOOLS]},
    )
