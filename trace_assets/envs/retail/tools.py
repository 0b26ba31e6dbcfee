"""Retail tools: OpenAI-format schemas, argument checking, and the policy rules the tools enforce.

Contract:

* Each tool is declared once, by the :func:`tool` decorator on its handler (schema and handler
  side by side, as tau2-bench's toolkit does), in the order :data:`TOOL_SCHEMAS` lists them:
  ``{"type": "function", "function": {name, description, parameters}}``; descriptions are terse
  because they ride in every prompt.
* :func:`run_tool` never raises on agent mistakes. It returns a :class:`ToolOutcome` whose
  ``observation`` is compact JSON (or a plain id / message) on success and starts with
  ``"Error:"`` on failure. A failure that breaks a written policy rule also carries a
  ``violation`` ``{"rule", "detail"}``:
  ``auth_before_action`` (account tool before authentication), ``one_user`` (another user's
  data), ``status`` (wrong order status), ``exchange`` (other product or unavailable variant),
  ``payment`` (payment method not the user's), ``refund_method`` (return refund neither to the
  original method nor to a gift card).
* Authentication is enforced through :class:`Session`: account tools need a successful
  ``find_user_id_by_*`` first, and act only on that user's data.
* Confirmation is not enforced here; the episode records it (tau2-bench style).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from .db import CANCEL_REASONS, RetailDB, cents, money


def _schema(name: str, description: str, **params: dict[str, Any]) -> dict[str, Any]:
    # Every parameter is required (check_arguments enforces it); the schema omits "required" to
    # keep the prompt short.
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": params},
        },
    }


_S = {"type": "string"}
_LIST = {"type": "array", "items": {"type": "string"}}

AUTH_TOOLS = frozenset({"find_user_id_by_email", "find_user_id_by_name_zip"})
WRITE_TOOLS = frozenset({
    "cancel_pending_order",
    "modify_pending_order_address",
    "return_delivered_order_items",
    "exchange_delivered_order_items",
    "modify_user_address",
})
# Tools that touch account data and therefore need authentication.
ACCOUNT_TOOLS = frozenset({"get_user_details", "get_order_details"}) | WRITE_TOOLS


class ToolError(Exception):
    """A refused call: ``message`` goes to the agent; ``rule`` names a broken policy rule."""

    def __init__(self, message: str, rule: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.rule = rule


@dataclass
class Session:
    """Per-episode tool state: the database and who is authenticated."""

    db: RetailDB
    user_id: str | None = None
    transferred: bool = False


@dataclass
class ToolOutcome:
    observation: str
    ok: bool
    violation: dict[str, str] | None = None


Handler = Callable[[Session, dict[str, Any]], Any]


@dataclass(frozen=True)
class Tool:
    """One retail tool: its OpenAI-format schema and the handler that runs it, declared together."""

    schema: dict[str, Any]
    handler: Handler

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


_TOOLS: dict[str, Tool] = {}  # in declaration order: the order of TOOL_SCHEMAS in every prompt


def tool(name: str, description: str, **params: dict[str, Any]) -> Callable[[Handler], Handler]:
    """Declare the decorated handler as tool ``name``, with this description and these parameters."""

    def register(handler: Handler) -> Handler:
        if name in _TOOLS:
            raise ValueError(f"retail tool {name!r} is declared twice")
        _TOOLS[name] = Tool(_schema(name, description, **params), handler)
        return handler

    return register


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def check_arguments(name: str, arguments: Any) -> str | None:
    """An error message if ``arguments`` do not fit the schema of ``name``, else None."""
    if not isinstance(name, str) or name not in _PARAMS:
        return f"Error: unknown tool '{name}'"
    if not isinstance(arguments, dict):
        return "Error: arguments must be a JSON object"
    params = _PARAMS[name]
    for key in params:
        if key not in arguments:
            return f"Error: missing argument '{key}'"
    for key, value in arguments.items():
        spec = params.get(key)
        if spec is None:
            return f"Error: unexpected argument '{key}'"
        if spec["type"] == "string" and not isinstance(value, str):
            return f"Error: argument '{key}' must be a string"
        if spec["type"] == "array" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return f"Error: argument '{key}' must be a list of strings"
        if "enum" in spec and value not in spec["enum"]:
            return f"Error: argument '{key}' must be one of {spec['enum']}"
    return None


def run_tool(session: Session, name: str, arguments: Any) -> ToolOutcome:
    """Run one call against ``session``; never raises on agent mistakes."""
    error = check_arguments(name, arguments)
    if error is not None:
        return ToolOutcome(error, ok=False)
    if name in ACCOUNT_TOOLS and session.user_id is None:
        return ToolOutcome("Error: authenticate the user first", ok=False,
                           violation={"rule": "auth_before_action", "detail": name})
    try:
        result = _TOOLS[name].handler(session, arguments)
    except ToolError as exc:
        violation = {"rule": exc.rule, "detail": f"{name}: {exc.message}"} if exc.rule else None
        return ToolOutcome(f"Error: {exc.message}", ok=False, violation=violation)
    return ToolOutcome(result if isinstance(result, str) else _dump(result), ok=True)


# ---- lookups shared by the tools -------------------------------------------------------------


def _authenticate(session: Session, user_id: str) -> str:
    if session.user_id is not None and session.user_id != user_id:
        raise ToolError("another user is already authenticated; one user per conversation", "one_user")
    session.user_id = user_id
    return user_id


def _own_user(session: Session, user_id: str) -> dict[str, Any]:
    user = session.db.users.get(user_id)
    if user is None:
        raise ToolError("user not found")
    if user_id != session.user_id:
        raise ToolError("user is not the authenticated user", "one_user")
    return user


def _own_order(session: Session, order_id: str) -> dict[str, Any]:
    order = session.db.orders.get(order_id)
    if order is None:
        raise ToolError("order not found")
    if order["user_id"] != session.user_id:
        raise ToolError("order does not belong to the authenticated user", "one_user")
    return order


def _require_status(order: dict[str, Any], status: str, action: str) -> None:
    if order["status"] != status:
        raise ToolError(f"order is {order['status']}; only {status} orders can be {action}", "status")


def _order_items(order: dict[str, Any], item_ids: list[str]) -> list[dict[str, Any]]:
    if not item_ids:
        raise ToolError("item_ids is empty")
    if len(set(item_ids)) != len(item_ids):
        raise ToolError("duplicate item ids")
    by_id = {item["item_id"]: item for item in order["items"]}
    for item_id in item_ids:
        if item_id not in by_id:
            raise ToolError(f"item {item_id} is not in order {order['order_id']}")
    return [by_id[item_id] for item_id in item_ids]


def _own_payment(session: Session, payment_method_id: str) -> dict[str, Any]:
    method = session.db.users[session.user_id]["payment_methods"].get(payment_method_id)
    if method is None:
        raise ToolError(f"payment method {payment_method_id} is not the user's", "payment")
    return method


def _address(arguments: dict[str, Any]) -> dict[str, str]:
    address = {key: arguments[key].strip() for key in ("address1", "city", "zip")}
    if not all(address.values()):
        raise ToolError("address1, city and zip must not be empty")
    return address


def _order_view(session: Session, order: dict[str, Any]) -> dict[str, Any]:
    view = {
        "order_id": order["order_id"],
        "user_id": order["user_id"],
        "status": order["status"],
        "items": [{**item, "price": money(item["price"])} for item in order["items"]],
        "total": money(session.db.order_total(order["order_id"])),
        "address": order["address"],
        "payment_method_id": order["payment_method_id"],
    }
    if order.get("tracking_id"):
        view["tracking_id"] = order["tracking_id"]
    for key in ("cancel_reason", "return", "exchange"):
        if key in order:
            view[key] = order[key]
    if order["refunds"]:
        view["refunds"] = [{**r, "amount": money(r["amount"])} for r in order["refunds"]]
    return view


# ---- the tools -------------------------------------------------------------------------------


@tool("find_user_id_by_email", "Authenticate a user by email.", email=_S)
def _find_user_id_by_email(session: Session, args: dict[str, Any]) -> str:
    email = args["email"].strip().lower()
    for user in session.db.users.values():
        if user["email"] == email:
            return _authenticate(session, user["user_id"])
    raise ToolError("user not found")


@tool("find_user_id_by_name_zip", "Authenticate a user by name and zip.",
      first_name=_S, last_name=_S, zip=_S)
def _find_user_id_by_name_zip(session: Session, args: dict[str, Any]) -> str:
    first, last, zip_code = args["first_name"].strip().lower(), args["last_name"].strip().lower(), args["zip"].strip()
    for user in session.db.users.values():
        if (user["first_name"].lower(), user["last_name"].lower(), user["address"]["zip"]) == (first, last, zip_code):
            return _authenticate(session, user["user_id"])
    raise ToolError("user not found")


@tool("get_user_details", "User profile, payment methods, orders.", user_id=_S)
def _get_user_details(session: Session, args: dict[str, Any]) -> dict[str, Any]:
    user = _own_user(session, args["user_id"])
    methods = []
    for method in user["payment_methods"].values():
        view = {"id": method["id"], "kind": method["kind"]}
        if "balance" in method:
            view["balance"] = money(method["balance"])
        methods.append(view)
    return {
        "user_id": user["user_id"],
        "name": f"{user['first_name']} {user['last_name']}",
        "email": user["email"],
        "address": user["address"],
        "payment_methods": methods,
        "orders": user["orders"],
    }


@tool("get_order_details", "Order status, items, total.", order_id=_S)
def _get_order_details(session: Session, args: dict[str, Any]) -> dict[str, Any]:
    return _order_view(session, _own_order(session, args["order_id"]))


@tool("get_product_details", "Product variants and their item ids.", product_id=_S)
def _get_product_details(session: Session, args: dict[str, Any]) -> dict[str, Any]:
    product = session.db.products.get(args["product_id"])
    if product is None:
        raise ToolError("product not found")
    return {
        "product_id": product["product_id"],
        "name": product["name"],
        "variants": [{**v, "price": money(v["price"])} for v in product["variants"].values()],
    }


def _refund(session: Session, order: dict[str, Any], payment_method_id: str, amount: float) -> None:
    order["refunds"].append({"payment_method_id": payment_method_id, "amount": cents(amount)})
    method = session.db.users[session.user_id]["payment_methods"][payment_method_id]
    if method["kind"] == "gift_card":  # gift cards are credited at once; cards and paypal later
        method["balance"] = cents(method["balance"] + amount)


@tool("cancel_pending_order", "Cancel a pending order.",
      order_id=_S, reason={"type": "string", "enum": list(CANCEL_REASONS)})
def _cancel_pending_order(session: Session, args: dict[str, Any]) -> dict[str, Any]:
    order = _own_order(session, args["order_id"])
    _require_status(order, "pending", "cancelled")
    total = session.db.order_total(order["order_id"])
    order["status"] = "cancelled"
    order["cancel_reason"] = args["reason"]
    _refund(session, order, order["payment_method_id"], total)
    return {"order_id": order["order_id"], "status": "cancelled", "refund": money(total),
            "payment_method_id": order["payment_method_id"]}


@tool("modify_pending_order_address", "Change a pending order's address.",
      order_id=_S, address1=_S, city=_S, zip=_S)
def _modify_pending_order_address(session: Session, args: dict[str, Any]) -> dict[str, Any]:
    order = _own_order(session, args["order_id"])
    _require_status(order, "pending", "modified")
    order["address"] = _address(args)
    return {"order_id": order["order_id"], "address": order["address"]}


@tool("return_delivered_order_items", "Return delivered items.",
      order_id=_S, item_ids=_LIST, payment_method_id=_S)
def _return_delivered_order_items(session: Session, args: dict[str, Any]) -> dict[str, Any]:
    order = _own_order(session, args["order_id"])
    _require_status(order, "delivered", "returned")
    items = _order_items(order, args["item_ids"])
    method = _own_payment(session, args["payment_method_id"])
    if method["id"] != order["payment_method_id"] and method["kind"] != "gift_card":
        raise ToolError("refunds go to the original payment method or a gift card", "refund_method")
    amount = cents(sum(item["price"] for item in items))
    order["status"] = "return requested"
    order["return"] = {"item_ids": sorted(args["item_ids"]), "payment_method_id": method["id"]}
    _refund(session, order, method["id"], amount)
    return {"order_id": order["order_id"], "status": order["status"], "refund": money(amount),
            "payment_method_id": method["id"]}


@tool("exchange_delivered_order_items", "Exchange delivered items for new variants.",
      order_id=_S, item_ids=_LIST, new_item_ids=_LIST, payment_method_id=_S)
def _exchange_delivered_order_items(session: Session, args: dict[str, Any]) -> dict[str, Any]:
    order = _own_order(session, args["order_id"])
    _require_status(order, "delivered", "exchanged")
    items = _order_items(order, args["item_ids"])
    new_ids = args["new_item_ids"]
    if len(new_ids) != len(items):
        raise ToolError("item_ids and new_item_ids must have the same length")
    difference = 0.0
    for item, new_id in zip(items, new_ids):
        found = session.db.find_variant(new_id)
        if found is None:
            raise ToolError(f"item {new_id} not found")
        product, variant = found
        if product["product_id"] != item["product_id"]:
            raise ToolError(f"item {new_id} is not a variant of the same product", "exchange")
        if new_id == item["item_id"]:
            raise ToolError(f"item {new_id} is the same item")
        if not variant["available"]:
            raise ToolError(f"item {new_id} is not available", "exchange")
        difference += variant["price"] - item["price"]
    difference = cents(difference)
    method = _own_payment(session, args["payment_method_id"])
    if method["kind"] == "gift_card" and method["balance"] < difference:
        raise ToolError("insufficient gift card balance")
    order["status"] = "exchange requested"
    order["exchange"] = {
        "pairs": sorted([old, new] for old, new in zip(args["item_ids"], new_ids)),
        "payment_method_id": method["id"],
        "price_difference": difference,
    }
    if method["kind"] == "gift_card":
        method["balance"] = cents(method["balance"] - difference)
    outcome = {"order_id": order["order_id"], "status": order["status"], "payment_method_id": method["id"]}
    if difference >= 0:
        outcome["charge"] = money(difference)
    else:
        outcome["refund"] = money(-difference)
    return outcome


@tool("modify_user_address", "Change a user's address.", user_id=_S, address1=_S, city=_S, zip=_S)
def _modify_user_address(session: Session, args: dict[str, Any]) -> dict[str, Any]:
    user = _own_user(session, args["user_id"])
    user["address"] = _address(args)
    return {"user_id": user["user_id"], "address": user["address"]}


@tool("transfer_to_human_agents", "Transfer to a human agent.", summary=_S)
def _transfer_to_human_agents(session: Session, args: dict[str, Any]) -> str:
    session.transferred = True
    return "Transfer successful"


TOOL_SCHEMAS: list[dict[str, Any]] = [t.schema for t in _TOOLS.values()]
TOOL_NAMES: list[str] = list(_TOOLS)
_PARAMS = {t.name: t.schema["function"]["parameters"]["properties"] for t in _TOOLS.values()}
