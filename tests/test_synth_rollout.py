"""A SyntheticEnv through the real batched rollout runner, with a scripted generation backend."""

from __future__ import annotations

import json

import pytest

from trace_assets.agent.backends import Generation
from trace_assets.agent.rollout import RolloutConfig, run_rollouts
from trace_assets.envs import get_environment
from trace_assets.identify.heuristic import RULES
from trace_assets.synthesize import SyntheticEnv, template_spec

ENV = get_environment("retail")


class TurnScript:
    """Returns ``script[turn]`` for every prompt of the turn-th generate call."""

    name = "scripted"

    def __init__(self, tokenizer, script):
        self.tok, self.script, self.calls = tokenizer, script, 0

    def generate(self, prompts, params):
        text = self.script[min(self.calls, len(self.script) - 1)] + "<|im_end|>"
        self.calls += 1
        ids = self.tok.encode(text, add_special_tokens=False)
        return [Generation(ids, self.tok.decode(ids), [-0.5] * len(ids), "stop") for _ in prompts]


def _call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.mark.parametrize("confirm", [True, False])
def test_synthetic_env_through_the_rollout_runner(tokenizer, confirm):
    spec = template_spec({"name": "confirm_before_writing", "description": RULES["confirm_before_writing"].description}, ENV)
    spec["difficulty"]["hint_share"] = 1.0
    env = SyntheticEnv(spec, ENV)
    task = env.make_task("cancel_pending", env.seed_range[0] + 2)
    s = task.scenario
    auth, lookup, write = task.gold_actions
    total = task.required_info[0]
    script = [_call(auth["name"], **auth["arguments"]), _call(lookup["name"], **lookup["arguments"])]
    if confirm:
        script.append(f"I will cancel order {write['arguments']['order_id']} and refund {total}. Do you confirm? (yes/no)")
    script += [_call(write["name"], **write["arguments"]),
               f"Order {write['arguments']['order_id']} is cancelled; {total} will be refunded. Anything else I can help with?"]
    rollouts = run_rollouts(env, [task], TurnScript(tokenizer, script), tokenizer,
                            RolloutConfig(max_steps=8, max_new_tokens=128, max_context_tokens=8192))
    r = rollouts[0]
    assert r.error is None and r.stop_reason == "user_done", (r.stop_reason, r.error, r.messages[-3:])
    assert r.messages[0]["content"].startswith(ENV.system_prompt()) and "Hint: " in r.messages[0]["content"]
    assert r.result.info["hinted"] is True and r.result.info["capability"] == "confirm_before_writing"
    assert r.result.info["target_reward"] == 1.0  # the target does not require confirmation for reward
    if confirm:
        assert r.result.reward == 1.0 and r.result.success
        assert RULES["confirm_before_writing"].judge(r.result.info)[0] == "PRESENT"
    else:
        assert r.result.reward < 1.0 and not r.result.success
        assert RULES["confirm_before_writing"].judge(r.result.info)[0] == "LACKING"
    assert s["user_id"] in json.dumps(r.messages)
