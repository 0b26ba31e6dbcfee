"""Capabilities and labels: the vocabulary of Step 1.

Capability names come from an analyst (possibly an LLM) and become Dagster partition keys and path
parts, so ``safe_capability_name`` is the single gate every name passes through: it normalises
what can be normalised (case, spaces, dashes, accents) and rejects the rest (path traversal,
empty or over-long names, non-latin scripts, collisions with another capability, names the router
and report reserve, and OS device names). ``checked_partition_key`` applies the same gate where a
partition key is about to become a path: a key added by hand (UI, API) is not trusted.

Text limits (description, failure modes) are the EnvSpec schema's, so a capability the dictionary
accepts is always one a synthesizer can write a spec for.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from trace_assets.route.router import BASE_NAME
from trace_assets.hashing import stable_hash

LABELS = ("NA", "PRESENT", "LACKING")
NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]{1,47}$")
MAX_CAPABILITIES = 10
RESERVED_NAMES = frozenset({BASE_NAME}) | frozenset(
    {"con", "prn", "aux", "nul"} | {f"{dev}{i}" for dev in ("com", "lpt") for i in range(1, 10)}
)
"""``base`` means "no adapter" to the router and the report; the others are Windows device names,
which cannot be files or folders there."""


def _capability_text_limits() -> tuple[int, int, int]:
    props = json.loads(resources.files("trace_assets.schemas").joinpath("envspec.schema.json").read_text(encoding="utf-8"))
    props = props["properties"]["capability"]["properties"]
    return (props["description"]["maxLength"], props["failure_modes"]["items"]["maxLength"],
            props["failure_modes"]["maxItems"])


MAX_DESCRIPTION_CHARS, MAX_FAILURE_MODE_CHARS, MAX_FAILURE_MODES = _capability_text_limits()


class CapabilityNameError(ValueError):
    """A capability name that cannot be made safe, with the reason."""


def safe_capability_name(raw: str, existing: set[str] | frozenset[str] = frozenset()) -> str:
    """Normalise ``raw`` to a snake_case identifier or raise ``CapabilityNameError``.

    Normalisation: NFKD-decompose and drop combining accents, lowercase, turn runs of spaces,
    dashes and dots into ``_``. Rejected: anything with ``/``, ``\\`` or ``..``, characters outside
    ``[a-z0-9_]`` after normalisation (other scripts, emoji, punctuation), names not starting with a
    letter, longer than 48 characters, or equal to a name in ``existing``.
    """
    if not isinstance(raw, str) or not raw.strip():
        raise CapabilityNameError("empty capability name")
    if "/" in raw or "\\" in raw or ".." in raw or "\x00" in raw:
        raise CapabilityNameError(f"capability name {raw!r} looks like a path")
    text = unicodedata.normalize("NFKD", raw.strip())
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).lower()
    text = re.sub(r"[\s\-.]+", "_", text).strip("_")
    if not NAME_PATTERN.fullmatch(text):
        raise CapabilityNameError(
            f"capability name {raw!r} is not a safe identifier (normalised {text!r}; "
            f"need {NAME_PATTERN.pattern})"
        )
    if text in RESERVED_NAMES:
        raise CapabilityNameError(f"capability name {raw!r} is reserved (normalised {text!r}): "
                                  f"{BASE_NAME!r} means the base model, the others are OS device names")
    if text in existing:
        raise CapabilityNameError(f"capability name {raw!r} collides with existing {text!r}")
    return text


def checked_partition_key(key: str) -> str:
    """``key`` itself if it is a valid capability name exactly as given, else ``CapabilityNameError``.

    Call it where a capability partition key becomes a path part: Dagster accepts any string in
    ``add_dynamic_partitions`` (``../x``, newlines, 300 characters), so creation-time checks are not
    enough. Unlike ``safe_capability_name`` nothing is normalised: a key that would need it is not one
    this pipeline created.
    """
    if not isinstance(key, str):
        raise CapabilityNameError(f"partition key {key!r} is not a string")
    try:
        name = safe_capability_name(key)
    except CapabilityNameError as exc:
        raise CapabilityNameError(f"partition key {key[:100]!r} is not a valid capability name: {exc}") from None
    if name != key:
        raise CapabilityNameError(f"partition key {key[:100]!r} is not a valid capability name "
                                  f"(it is not in normal form {name!r})")
    return key


@dataclass(frozen=True)
class Capability:
    """One entry of the capability dictionary."""

    name: str
    description: str
    failure_modes: list[str] = field(default_factory=list)
    example_trajectory_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Capability":
        return cls(
            name=data["name"], description=data["description"],
            failure_modes=list(data.get("failure_modes", [])),
            example_trajectory_ids=list(data.get("example_trajectory_ids", [])),
        )

    def spec(self) -> dict[str, Any]:
        """What Step 2 synthesizes from: the data version of this capability's ``capability_spec``.

        Example ids are lineage, not spec: new examples must not make a trained adapter stale.
        """
        return {"name": self.name, "description": self.description, "failure_modes": sorted(self.failure_modes)}


def validate_dictionary(raw: list[dict[str, Any]]) -> list[Capability]:
    """Capabilities with safe, unique names; raises ``CapabilityNameError`` naming the culprit."""
    if len(raw) > MAX_CAPABILITIES:
        raise CapabilityNameError(f"{len(raw)} capabilities; at most {MAX_CAPABILITIES} are allowed")
    seen: set[str] = set()
    out = []
    for item in raw:
        name = safe_capability_name(item["name"], seen)
        _check_text_limits(name, item)
        seen.add(name)
        out.append(Capability.from_dict({**item, "name": name}))
    return out


def _check_text_limits(name: str, item: dict[str, Any]) -> None:
    description = item.get("description") or ""
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise CapabilityNameError(f"capability {name!r}: description has {len(description):,} characters; "
                                  f"at most {MAX_DESCRIPTION_CHARS} (the EnvSpec limit)")
    modes = item.get("failure_modes") or []
    if len(modes) > MAX_FAILURE_MODES:
        raise CapabilityNameError(f"capability {name!r}: {len(modes)} failure modes; at most {MAX_FAILURE_MODES}")
    for i, mode in enumerate(modes):
        if len(str(mode)) > MAX_FAILURE_MODE_CHARS:
            raise CapabilityNameError(f"capability {name!r}: failure mode {i} has {len(str(mode)):,} characters; "
                                      f"at most {MAX_FAILURE_MODE_CHARS} (the EnvSpec limit)")


def dictionary_version(capabilities: list[Capability]) -> str:
    """The content hash that versions a dictionary (and keys its labels)."""
    return stable_hash(sorted((c.to_dict() for c in capabilities), key=lambda d: d["name"]))


@dataclass(frozen=True)
class Label:
    """One analyst judgement of one (trajectory, capability) pair in one labelling run."""

    trajectory_id: str
    capability: str
    run: int
    label: str
    rationale: str = ""
    step: int | None = None
    """For a LACKING label, the index in the trajectory's ``messages`` of the assistant turn where the
    capability was lacking (the decision point that ``synthesize.prefix`` cuts before); None where
    the analyst named none. Always None for NA and PRESENT."""

    def __post_init__(self) -> None:
        if self.label not in LABELS:
            raise ValueError(f"label {self.label!r} for {self.trajectory_id}/{self.capability} is not one of {LABELS}")
        if self.step is not None and (self.label != "LACKING" or isinstance(self.step, bool) or not isinstance(self.step, int)
                                      or self.step < 0):
            raise ValueError(f"step {self.step!r} for {self.trajectory_id}/{self.capability} ({self.label}): a step is "
                             "a message index >= 0, given only for LACKING")
