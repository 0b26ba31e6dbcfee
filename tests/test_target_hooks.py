"""The target's optional hooks (envs.base.TargetHooks) and the retail tool declarations.

Generic code (the warm-start, synthetic environments) reaches the target only through these hooks;
a target without one gets an error naming the environment and the hook.
"""

from __future__ import annotations

import pytest

from trace_assets.envs import get_environment
from trace_assets.envs.base import target_hook
from trace_assets.envs.retail import tools
from trace_assets.envs.retail.expert import demonstrate
from trace_assets.envs.retail.tasks import replay_actions
from trace_assets.synthesize import SyntheticEnv, template_spec

ENV = get_environment("retail")


class _Bare:
    """The protocol only, no hooks."""

    name = "bare"

    def __getattr__(self, attr):
        if attr in ("tool_schemas", "system_prompt", "families", "make_task", "start"):
            return getattr(ENV, attr)
        raise AttributeError(attr)


def test_retail_hooks_are_the_retail_internals():
    task = ENV.make_task(ENV.families()[0], 3)
    assert target_hook(ENV, "expert")(task, confirm=False) == demonstrate(ENV, task, confirm=False)
    assert target_hook(ENV, "tool_classes")() == {"auth": tools.AUTH_TOOLS, "write": tools.WRITE_TOOLS,
                                                  "account": tools.ACCOUNT_TOOLS}
    db = target_hook(ENV, "generate_db")(task.seed)
    assert target_hook(ENV, "replay_state")(db, task.gold_actions) == task.expected_state_hash
    assert replay_actions(ENV.generate_db(task.seed), task.gold_actions).state_hash() == task.expected_state_hash


def test_a_target_without_hooks_is_named_in_the_error():
    with pytest.raises(NotImplementedError, match=r"'bare' does not provide the target hook expert\(\)"):
        target_hook(_Bare(), "expert")
    with pytest.raises(AttributeError, match="not a target hook"):
        target_hook(ENV, "make_task")
    spec = template_spec({"name": "confirm_before_writing", "description": "Confirms.", "failure_modes": ["x"]}, ENV)
    synthetic = SyntheticEnv(spec, ENV)
    synthetic.target = _Bare()  # a synthetic environment over a target that lacks the hooks
    with pytest.raises(NotImplementedError, match=r"'bare' does not provide the target hook tool_classes\(\)"):
        synthetic.make_task(synthetic.families()[0], synthetic.seed_range[0])


def test_each_tool_is_declared_once_beside_its_handler():
    assert list(tools._TOOLS) == tools.TOOL_NAMES == [s["function"]["name"] for s in tools.TOOL_SCHEMAS]
    assert all(t.handler.__name__ == f"_{t.name}" for t in tools._TOOLS.values())
    with pytest.raises(ValueError, match="declared twice"):
        tools.tool("get_order_details", "Again.", order_id={"type": "string"})(lambda session, args: None)
    assert tools._TOOLS["get_order_details"].schema["function"]["description"] == "Order status, items, total."
