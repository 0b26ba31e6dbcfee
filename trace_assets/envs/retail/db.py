"""The retail database, generated procedurally from an integer seed.

Contract:

* ``generate_db(seed)`` is a pure function of ``seed``: it uses only ``random.Random(seed)``.
* The database is plain JSON data (dicts, lists, str, float, bool, None) in three tables keyed
  by id: ``users``, ``orders``, ``products``. Money is a float rounded to cents; it is rendered
  to the agent as ``"$12.30"`` by :func:`money`.
* ``RetailDB.state_hash()`` is the sha256 of the canonical JSON of all tables; two databases with
  the same hash hold the same state.
* Ids are short so that a small model can copy them: users ``ana_lee_4821``, orders ``W4821``,
  variants (= order item ids) ``V1093``, products ``P107``, payment methods ``credit_card_77``.
* Every generated database holds at least two users with both a pending and a delivered order,
  and every product has at least two available variants, so each task family finds a target.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

FIRST_NAMES = [
    "ana", "ben", "carla", "dev", "emma", "farid", "grace", "hugo", "ines", "jon",
    "kira", "liam", "maya", "noah", "olga", "pablo", "rosa", "sam", "tara", "yuki",
]
LAST_NAMES = [
    "lee", "kim", "diaz", "patel", "smith", "novak", "silva", "khan", "brown", "rossi",
    "meyer", "chen", "lopez", "ito", "garcia", "ward",
]
CITIES = ["Denver", "Austin", "Boston", "Seattle", "Portland", "Tucson", "Omaha", "Reno"]
STREETS = ["Oak St", "Pine Rd", "Maple Ave", "Cedar Ln", "Elm St", "Birch Rd", "Lake Dr", "Hill St"]

# (product name, option name -> values). Each product gets 2-4 distinct option combinations.
CATALOG: list[tuple[str, dict[str, list[str]]]] = [
    ("T-Shirt", {"color": ["red", "blue", "black", "white"], "size": ["S", "M", "L"]}),
    ("Hoodie", {"color": ["gray", "navy", "green"], "size": ["M", "L", "XL"]}),
    ("Sneakers", {"color": ["white", "black"], "size": ["8", "9", "10", "11"]}),
    ("Backpack", {"color": ["black", "green", "tan"], "capacity": ["20L", "30L"]}),
    ("Water Bottle", {"color": ["blue", "silver", "pink"], "capacity": ["500ml", "1L"]}),
    ("Desk Lamp", {"color": ["black", "white"], "bulb": ["LED", "halogen"]}),
    ("Headphones", {"color": ["black", "white", "blue"], "type": ["wired", "wireless"]}),
    ("Mug", {"color": ["red", "white", "yellow"], "size": ["small", "large"]}),
    ("Yoga Mat", {"color": ["purple", "blue", "black"], "thickness": ["4mm", "6mm"]}),
    ("Watch", {"color": ["gold", "silver", "black"], "strap": ["leather", "metal"]}),
    ("Jacket", {"color": ["black", "olive", "red"], "size": ["S", "M", "L"]}),
    ("Sunglasses", {"color": ["black", "brown"], "lens": ["polarized", "standard"]}),
]

PAYMENT_KINDS = ["credit_card", "paypal", "gift_card"]
STATUSES = ["pending", "processed", "delivered", "cancelled"]
STATUS_WEIGHTS = [4, 2, 4, 1]
CANCEL_REASONS = ["no longer needed", "ordered by mistake"]


def money(amount: float) -> str:
    """Render an amount for the agent: ``12.3 -> "$12.30"``; negative amounts keep their sign."""
    return f"-${-amount:.2f}" if amount < 0 else f"${amount:.2f}"


def cents(amount: float) -> float:
    """Round to cents (all stored money goes through here, so sums hash stably)."""
    return round(amount + 0.0, 2)


@dataclass
class RetailDB:
    """Three JSON tables keyed by id. Mutated in place by the write tools."""

    users: dict[str, dict[str, Any]]
    orders: dict[str, dict[str, Any]]
    products: dict[str, dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"users": self.users, "orders": self.orders, "products": self.products}

    def state_hash(self) -> str:
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def copy(self) -> "RetailDB":
        return RetailDB(copy.deepcopy(self.users), copy.deepcopy(self.orders), copy.deepcopy(self.products))

    def find_variant(self, variant_id: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The (product, variant) holding ``variant_id``, or None."""
        for product in self.products.values():
            variant = product["variants"].get(variant_id)
            if variant is not None:
                return product, variant
        return None

    def order_total(self, order_id: str) -> float:
        return cents(sum(item["price"] for item in self.orders[order_id]["items"]))


def _unique_int(rng: random.Random, low: int, high: int, used: set[int]) -> int:
    while True:
        value = rng.randint(low, high)
        if value not in used:
            used.add(value)
            return value


def random_address(rng: random.Random) -> dict[str, str]:
    return {
        "address1": f"{rng.randint(1, 99)} {rng.choice(STREETS)}",
        "city": rng.choice(CITIES),
        "zip": str(rng.randint(10000, 99999)),
    }


def _make_products(rng: random.Random) -> dict[str, dict[str, Any]]:
    products: dict[str, dict[str, Any]] = {}
    used_pid: set[int] = set()
    used_vid: set[int] = set()
    for name, option_values in rng.sample(CATALOG, rng.randint(8, 12)):
        product_id = f"P{_unique_int(rng, 100, 999, used_pid)}"
        combos = [{}]
        for key, values in option_values.items():
            combos = [{**combo, key: value} for combo in combos for value in values]
        chosen = rng.sample(combos, rng.randint(2, min(4, len(combos))))
        base_price = rng.randint(1500, 20000) / 100
        variants: dict[str, dict[str, Any]] = {}
        for index, options in enumerate(chosen):
            variant_id = f"V{_unique_int(rng, 1000, 9999, used_vid)}"
            variants[variant_id] = {
                "item_id": variant_id,
                "options": options,
                "price": cents(base_price + rng.randint(-300, 600) / 100),
                # The first two variants stay available so that every item has an exchange target.
                "available": index < 2 or rng.random() < 0.6,
            }
        products[product_id] = {"product_id": product_id, "name": name, "variants": variants}
    return products


def generate_db(seed: int) -> RetailDB:
    """The database of ``seed``: 6-10 users, 8-12 products, 2-4 orders per user."""
    rng = random.Random(seed)
    products = _make_products(rng)
    product_ids = sorted(products)

    users: dict[str, dict[str, Any]] = {}
    orders: dict[str, dict[str, Any]] = {}
    used_uid: set[int] = set()
    used_oid: set[int] = set()
    used_pm: set[int] = set()
    used_trk: set[int] = set()
    names = rng.sample([(f, l) for f in FIRST_NAMES for l in LAST_NAMES], rng.randint(6, 10))
    for user_index, (first, last) in enumerate(names):
        user_id = f"{first}_{last}_{_unique_int(rng, 1000, 9999, used_uid)}"
        address = random_address(rng)
        # The first method is never a gift card, so every user can pay a price difference.
        kinds = [rng.choice(PAYMENT_KINDS[:2])] + rng.sample(PAYMENT_KINDS, rng.randint(0, 2))
        payment_methods: dict[str, dict[str, Any]] = {}
        for kind in kinds:
            pm_id = f"{kind}_{_unique_int(rng, 10, 99, used_pm)}"
            payment_methods[pm_id] = {"id": pm_id, "kind": kind}
            if kind == "gift_card":
                payment_methods[pm_id]["balance"] = cents(rng.randint(0, 200))
        n_orders = rng.randint(2, 4)
        statuses = rng.choices(STATUSES, weights=STATUS_WEIGHTS, k=n_orders)
        if user_index < 2:  # guarantee multi-order tasks (cancel one, return another) a target
            statuses[0], statuses[1] = "pending", "delivered"
        order_ids = []
        for status in statuses:
            order_id = f"W{_unique_int(rng, 1000, 9999, used_oid)}"
            items = []
            for product_id in rng.sample(product_ids, rng.randint(1, 3)):
                product = products[product_id]
                variant = product["variants"][rng.choice(sorted(product["variants"]))]
                items.append({
                    "item_id": variant["item_id"],
                    "product_id": product_id,
                    "name": product["name"],
                    "options": dict(variant["options"]),
                    "price": variant["price"],
                })
            payment_method_id = rng.choice(sorted(payment_methods))
            order: dict[str, Any] = {
                "order_id": order_id,
                "user_id": user_id,
                "status": status,
                "items": items,
                "address": dict(address),
                "payment_method_id": payment_method_id,
                "tracking_id": f"T{_unique_int(rng, 100000, 999999, used_trk)}" if status == "delivered" else None,
                "refunds": [],
            }
            if status == "cancelled":
                order["cancel_reason"] = rng.choice(CANCEL_REASONS)
                order["refunds"].append({
                    "payment_method_id": payment_method_id,
                    "amount": cents(sum(item["price"] for item in items)),
                })
            orders[order_id] = order
            order_ids.append(order_id)
        users[user_id] = {
            "user_id": user_id,
            "first_name": first.capitalize(),
            "last_name": last.capitalize(),
            "email": f"{first}.{last}{rng.randint(1, 99)}@mail.com",
            "address": address,
            "payment_methods": payment_methods,
            "orders": order_ids,
        }
    return RetailDB(users=users, orders=orders, products=products)
