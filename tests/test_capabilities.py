"""Capability names become partition keys and path parts: the gate must hold."""

from __future__ import annotations

import pytest

from trace_assets.identify.capabilities import (
    Capability, CapabilityNameError, Label, dictionary_version, safe_capability_name, validate_dictionary,
)


@pytest.mark.parametrize("raw, expected", [
    ("confirm_before_writing", "confirm_before_writing"),
    ("Confirm Before Writing", "confirm_before_writing"),
    ("ground-arguments", "ground_arguments"),
    ("  résumé handling ", "resume_handling"),
    ("multi.step", "multi_step"),
])
def test_normalised(raw, expected):
    assert safe_capability_name(raw) == expected


@pytest.mark.parametrize("raw", [
    "../../etc/passwd", "a/b", "..", "a\\b", "", "   ", "授权", "auth🔥", "1st_step", "x" * 60, "drop;table", "a\x00b",
])
def test_rejected(raw):
    with pytest.raises(CapabilityNameError):
        safe_capability_name(raw)


def test_collision_with_existing_name():
    with pytest.raises(CapabilityNameError, match="collides"):
        safe_capability_name("Confirm-Before-Writing", {"confirm_before_writing"})
    with pytest.raises(CapabilityNameError, match="collides"):
        validate_dictionary([{"name": "auth", "description": "d"}, {"name": "AUTH", "description": "d"}])


def test_dictionary_limits_and_version():
    with pytest.raises(CapabilityNameError, match="at most 10"):
        validate_dictionary([{"name": f"cap_{i}", "description": "d"} for i in range(11)])
    a = [Capability("aa", "x"), Capability("bb", "y")]
    assert dictionary_version(a) == dictionary_version(list(reversed(a)))
    assert dictionary_version(a) != dictionary_version([Capability("aa", "x"), Capability("bb", "z")])


def test_spec_ignores_examples():
    a = Capability("aa", "x", ["m2", "m1"], ["t1"])
    b = Capability("aa", "x", ["m1", "m2"], ["t9", "t8"])
    assert a.spec() == b.spec()


def test_label_values():
    with pytest.raises(ValueError):
        Label("t", "c", 0, "MAYBE", "")
