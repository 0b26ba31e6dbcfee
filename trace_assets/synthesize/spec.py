"""EnvSpec: the declarative JSON document that defines one synthetic environment.

Contract:

* A spec is JSON data validated by ``trace_assets/schemas/envspec.schema.json`` (v2; a v1 document
  is read as v2 without ``start``, ``end`` and the v2 check kinds, which fidelity reports in v1). Nothing in it is
  ever evaluated or executed; the only text processing is ``string.Template.safe_substitute`` with
  the whitelisted slots in :data:`TEXT_SLOTS` (see :func:`fill_text`).
* :func:`schema_errors` reports schema violations as ``"path: message"`` strings; :func:`fidelity`
  reports what the schema cannot see: tools unknown to the target, embedded tool schemas that differ
  from the target's, a policy that is not inherited, seeds overlapping ``[0, SYNTHETIC_SEED_BASE)``,
  unknown families, rubric selectors naming unknown tools or tools outside the spec's subset, a
  ``requires`` naming itself or no check of the rubric, a rubric whose every check is ``shaping``.
* :func:`validate_spec` = both; it raises :class:`SpecError` (with every problem) or returns a
  deep copy of the spec. :func:`spec_hash` is the data version of a spec: the hash of its
  canonical JSON.
"""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

import jsonschema

from trace_assets.envs.base import Environment, target_hook
from trace_assets.envs.splits import SYNTHETIC_SEED_BASE
from trace_assets.hashing import stable_hash
from trace_assets.settings import schema_error_text

SCHEMA_FILE = "envspec.schema.json"
SCHEMA_VERSION = "2"
V1_CHECK_KINDS = ("required_call", "ordering", "forbidden_call", "final_state_match", "info_communicated",
                  "no_policy_violation", "no_tool_error")
CHECK_KINDS = V1_CHECK_KINDS + ("asked_confirmation", "calls_satisfy", "replied", "no_confirmation_question")
KNOBS = ("hint_share", "volunteer_identity", "distractor_orders", "family_bias")
DEFAULT_DIFFICULTY: dict[str, Any] = {"hint_share": 0.0, "volunteer_identity": 0.0, "distractor_orders": 0,
                                      "family_bias": 0.0, "frozen": []}
DEFAULT_SCENARIO: dict[str, Any] = {"name_zip_share": None, "decline_share": 0.0}
TEXT_SLOTS = ("first_name", "order_id", "family")
"""The only names ``$slot`` may use in hint and info strings; anything else stays literal."""
GROUPS = ("@auth", "@read", "@write", "@account", "@any")


class SpecError(ValueError):
    """An invalid spec; ``problems`` lists every reason."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid EnvSpec: " + "; ".join(problems))
        self.problems = list(problems)


def envspec_schema() -> dict[str, Any]:
    return json.loads(resources.files("trace_assets.schemas").joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))


_VALIDATOR: jsonschema.Draft202012Validator | None = None


def _validator() -> jsonschema.Draft202012Validator:
    global _VALIDATOR
    if _VALIDATOR is None:
        _VALIDATOR = jsonschema.Draft202012Validator(envspec_schema())
    return _VALIDATOR


def schema_errors(spec: Any) -> list[str]:
    """Schema violations of ``spec`` as ``"path: message"``, most specific first; [] when valid."""
    out = []
    for err in sorted(_validator().iter_errors(spec), key=lambda e: (list(map(str, e.absolute_path)), e.message)):
        path = "/".join(str(p) for p in err.absolute_path) or "(root)"
        if err.validator == "not" and path == "(root)":  # the schema's only root-level "not": v1 vs v2
            out.append("(root): a schema_version '1' spec may not have 'start' or 'end'; decision points "
                       "and horizons need schema_version '2'")
            continue
        out.append(f"{path}: {schema_error_text(err)}")
    return out


# ---- the target's tool groups ------------------------------------------------------------------


def tool_groups(target_env: Environment) -> dict[str, frozenset[str]]:
    """The tool groups rubric selectors may name, from the target's tool classes (its
    ``tool_classes`` hook); a target without that hook cannot carry a synthetic environment."""
    names = [s["function"]["name"] for s in target_env.tool_schemas()]
    try:
        classes = target_hook(target_env, "tool_classes")()
    except NotImplementedError as exc:
        raise SpecError([str(exc)]) from None

    return {
        "@auth": frozenset(classes["auth"]),
        "@write": frozenset(classes["write"]),
        "@account": frozenset(classes["account"]),
        "@read": frozenset(n for n in names if n not in classes["write"]),
        "@any": frozenset(names),
    }


def selector_tools(selector: str | list[str], groups: dict[str, frozenset[str]]) -> set[str]:
    """The tool names a selector covers (unknown names are kept as-is; fidelity reports them)."""
    items = [selector] if isinstance(selector, str) else list(selector)
    out: set[str] = set()
    for item in items:
        out |= set(groups.get(item, {item}))
    return out


# ---- fidelity --------------------------------------------------------------------------------


def _selectors(check: dict[str, Any]) -> list[tuple[str, Any]]:
    found = [(key, check[key]) for key in ("tool", "before", "after") if key in check]
    when = check.get("when") or {}
    found += [(f"when.{key}", when[key]) for key in ("gold_calls", "gold_avoids") if key in when]
    return found


def fidelity(spec: dict[str, Any], target_env: Environment) -> list[str]:
    """Problems that keep ``spec`` from being faithful to ``target_env``; [] = faithful.

    Run it on a schema-valid spec (it tolerates missing keys but reports only what it can see).
    """
    problems: list[str] = []
    target = spec.get("target", {})
    if target.get("env") != target_env.name:
        problems.append(f"target.env {target.get('env')!r} is not the target environment {target_env.name!r}")
    schemas = target_env.tool_schemas()
    known = [s["function"]["name"] for s in schemas]
    tools = list(target.get("tools", []))
    unknown = [t for t in tools if t not in known]
    if unknown:
        problems.append(f"unknown tools {unknown}; the target has {known}")
    if "tool_schemas" in target:
        expected = [s for s in schemas if s["function"]["name"] in tools]
        if target["tool_schemas"] != expected:
            problems.append("target.tool_schemas differ from the target's schemas of these tools "
                            "(they must be identical, in the target's order; or leave them out)")
    policy = spec.get("policy")
    if policy != "inherit" and policy != target_env.system_prompt():
        problems.append("policy must be 'inherit' or the exact target system prompt; a changed policy breaks fidelity")

    version = spec.get("schema_version")
    for i, check in enumerate(spec.get("rubric", {}).get("checks", [])):
        if version == "1" and check.get("kind") in CHECK_KINDS and check.get("kind") not in V1_CHECK_KINDS:
            problems.append(f"rubric.checks[{i}]: check kind {check['kind']!r} needs schema_version '2' (this spec says '1')")
        for key in ("requires", "shaping"):
            if version == "1" and check.get(key):
                problems.append(f"rubric.checks[{i}]: {key!r} needs schema_version '2' (this spec says '1')")
    starts = spec.get("start") or {}
    variants = starts.get("variants") or []
    for where, block in [("start", starts)] + [(f"start.variants[{i}]", v) for i, v in enumerate(variants)]:
        if block.get("tool") is not None and block["tool"] not in known:
            problems.append(f"{where}.tool names unknown tool {block['tool']!r}")
    start_ids = ["main"] + [v.get("id") for v in variants]
    if len(set(start_ids)) != len(start_ids):
        problems.append(f"start.variants ids are not unique: {start_ids[1:]}")
    if sum(float(v.get("share", 0)) for v in variants) > 1 + 1e-9:
        problems.append("start.variants shares add up to more than 1")
    after_call = (spec.get("end") or {}).get("after_call")
    for item in ([after_call] if isinstance(after_call, str) else list(after_call or [])):
        if item.startswith("@") and item not in GROUPS:
            problems.append(f"end.after_call names unknown tool group {item!r}; known: {list(GROUPS)}")
        elif not item.startswith("@") and item not in known:
            problems.append(f"end.after_call names unknown tool {item!r}")

    tasks = spec.get("tasks", {})
    families = [f.get("name") for f in tasks.get("families", [])]
    bad_families = [f for f in families if f not in target_env.families()]
    if bad_families:
        problems.append(f"unknown families {bad_families}; the target has {target_env.families()}")
    if len(set(families)) != len(families):
        problems.append("families are listed more than once")
    if any(not isinstance(f.get("weight"), (int, float)) or f["weight"] <= 0 for f in tasks.get("families", [])):
        problems.append("family weights must be > 0")
    seed_range = tasks.get("seed_range")
    if isinstance(seed_range, list) and len(seed_range) == 2:
        start, end = seed_range
        if not (isinstance(start, int) and isinstance(end, int)) or start < SYNTHETIC_SEED_BASE:
            problems.append(f"seed_range {seed_range} overlaps the target's seeds [0, {SYNTHETIC_SEED_BASE})")
        elif end <= start:
            problems.append(f"seed_range {seed_range} is empty (need start < end)")
    else:
        problems.append("tasks.seed_range must be [start, end)")

    try:
        groups = tool_groups(target_env)
    except SpecError as exc:
        return problems + exc.problems
    checks = spec.get("rubric", {}).get("checks", [])
    if not checks:
        problems.append("the rubric has no checks")
    elif all(c.get("shaping") for c in checks):
        problems.append("every rubric check is shaping: success would judge nothing")
    ids = [c.get("id") for c in checks if c.get("id")]
    if len(set(ids)) != len(ids):
        problems.append("rubric check ids are not unique")
    for i, check in enumerate(checks):
        where = f"rubric.checks[{i}]" + (f" ({check['id']})" if check.get("id") else "")
        if check.get("kind") not in CHECK_KINDS:
            problems.append(f"{where}: unknown check kind {check.get('kind')!r}; known: {list(CHECK_KINDS)}")
        weight = check.get("weight")
        if not isinstance(weight, (int, float)) or isinstance(weight, bool) or weight <= 0:
            problems.append(f"{where}: weight must be > 0")
        for key, selector in _selectors(check):
            items = [selector] if isinstance(selector, str) else list(selector)
            for item in items:
                if item.startswith("@") and item not in GROUPS:
                    problems.append(f"{where}: {key} names unknown tool group {item!r}; known: {list(GROUPS)}")
                elif not item.startswith("@") and item not in known:
                    problems.append(f"{where}: {key} names unknown tool {item!r}")
                elif not item.startswith("@") and item not in tools and not key.startswith("when"):
                    problems.append(f"{where}: {key} names tool {item!r}, which is not in target.tools")
        for name in check.get("requires") or []:
            if name == check.get("id"):
                problems.append(f"{where}: requires itself")
            elif name not in ids:
                problems.append(f"{where}: requires {name!r}, which is not the id of a check of this rubric")
        for family in (check.get("when") or {}).get("families", []):
            if family not in families:
                problems.append(f"{where}: when.families names {family!r}, which is not a spec family")
        for name in (check.get("when") or {}).get("start", []):
            if name not in start_ids:  # "main": the spec's start, or the first turn when it has none
                problems.append(f"{where}: when.start names {name!r}, which is not a start of this spec ({start_ids})")
        for arg in (check.get("args") or {}):
            tool_names = selector_tools(check.get("tool", []), groups)
            params = {p for s in schemas if s["function"]["name"] in tool_names
                      for p in s["function"]["parameters"].get("properties", {})}
            if params and arg not in params:
                problems.append(f"{where}: argument {arg!r} is not a parameter of {sorted(tool_names)}")
    for i, variant in enumerate(variants):
        where, when = f"start.variants[{i}] ({variant.get('id')})", variant.get("when") or {}
        if "start" in when:
            problems.append(f"{where}: when.start cannot choose a task's start (it is what the variant decides)")
        for family in when.get("families", []):
            if family not in families:
                problems.append(f"{where}: when.families names {family!r}, which is not a spec family")
        for key, selector in _selectors({"when": when}):
            for item in [selector] if isinstance(selector, str) else list(selector):
                if (item.startswith("@") and item not in GROUPS) or (not item.startswith("@") and item not in known):
                    problems.append(f"{where}: {key} names unknown tool or group {item!r}")
    difficulty = spec.get("difficulty") or {}
    problems += unsupported_knobs(spec, target_env)
    if difficulty.get("hint_share", 0) > 0 and not spec.get("hint"):
        problems.append("difficulty.hint_share > 0 but there is no hint text")
    return problems


def unsupported_knobs(spec: dict[str, Any], target_env: Environment) -> list[str]:
    """A problem for each scenario or difficulty knob the spec moves off its default although the
    target does not interpret it (its ``synthesis_knobs`` hook): a knob without effect would let the
    calibrator believe it changed the difficulty."""
    try:
        supported = target_hook(target_env, "synthesis_knobs")()
    except NotImplementedError as exc:
        return [str(exc)]
    scenario = (spec.get("tasks") or {}).get("scenario") or {}
    difficulty = spec.get("difficulty") or {}
    moved = [(f"tasks.scenario.{k}", v) for k, v in scenario.items() if k in DEFAULT_SCENARIO and v != DEFAULT_SCENARIO[k]]
    moved += [(f"difficulty.{k}", v) for k, v in difficulty.items() if k in KNOBS and v != DEFAULT_DIFFICULTY[k]]
    return [f"{where} = {value!r} has no effect on target {target_env.name!r}; it interprets only "
            f"{sorted(supported)} (leave it at its default and list it in difficulty.frozen)"
            for where, value in moved if where.rpartition(".")[2] not in supported]


def fixed_knobs(target_env: Environment) -> frozenset[str]:
    """The difficulty knobs the target does not interpret: the calibrator leaves them alone."""
    return frozenset(k for k in KNOBS if k not in target_hook(target_env, "synthesis_knobs")())


# ---- loading, hashing, normalised views --------------------------------------------------------


def validate_spec(spec: dict[str, Any], target_env: Environment) -> dict[str, Any]:
    """A deep copy of ``spec`` when it passes the schema and fidelity; else ``SpecError``."""
    problems = schema_errors(spec)
    if not problems:
        problems = fidelity(spec, target_env)
    if problems:
        raise SpecError(problems)
    return copy.deepcopy(spec)


def load_spec(source: str | Path | dict[str, Any], target_env: Environment) -> dict[str, Any]:
    """Read (a path or a JSON string) and validate a spec. Never evaluates anything in it."""
    if isinstance(source, dict):
        data = source
    else:
        is_json = isinstance(source, str) and source.lstrip().startswith("{")
        text = source if is_json else Path(source).read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError([f"not JSON: {exc}"]) from exc
    if not isinstance(data, dict):
        raise SpecError(["a spec must be a JSON object"])
    return validate_spec(data, target_env)


def spec_hash(spec: dict[str, Any]) -> str:
    """The data version of a spec: sha256 of its canonical JSON (16 hex characters)."""
    return stable_hash(spec, 16)


def difficulty_of(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's difficulty block with defaults filled in."""
    return {**copy.deepcopy(DEFAULT_DIFFICULTY), **copy.deepcopy(spec.get("difficulty") or {})}


def scenario_of(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's scenario slot distributions with defaults filled in."""
    return {**DEFAULT_SCENARIO, **(spec.get("tasks", {}).get("scenario") or {})}


def fill_text(text: str, slots: dict[str, str]) -> str:
    """``$slot`` substitution limited to :data:`TEXT_SLOTS`; everything else stays literal text."""
    return Template(text).safe_substitute({k: str(v) for k, v in slots.items() if k in TEXT_SLOTS})
