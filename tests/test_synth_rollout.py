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
    """The episode opens at the decision point: the expert's prefix is prompt (env_mask 0), the agent
    makes the decisive move, and the horizon ends the episode at the reply that follows the write."""
    spec = template_spec({"name": "confirm_before_writing", "description": RULES["confirm_before_writing"].description}, ENV)
    spec["difficulty"]["hint_share"] = 1.0
    env = SyntheticEnv(spec, ENV)
    task = env.make_task("cancel_pending", env.seed_range[0] + 2)
    auth, lookup, write = task.gold_actions
    total = task.required_info[0]
    script = []
    if confirm:
        script.append(f"I will cancel order {write['arguments']['order_id']} and refund {total}. Do you confirm? (yes/no)")
    script += [_call(write["name"], **write["arguments"]), f"Order {write['arguments']['order_id']} is cancelled.",
               "never reached"]
    rollouts = run_rollouts(env, [task], TurnScript(tokenizer, script), tokenizer,
                            RolloutConfig(max_steps=8, max_new_tokens=128, max_context_tokens=8192))
    r = rollouts[0]
    # The user is done with that reply too ("That is all"): either end is the horizon's, and the
    # last scripted turn is never played.
    assert r.error is None and r.stop_reason in ("env_done", "user_done"), (r.stop_reason, r.error, r.messages[-3:])
    assert r.steps == len(script) - 1 and "never reached" not in json.dumps(r.messages)
    assert r.messages[0]["content"].startswith(ENV.system_prompt()) and "Hint: " in r.messages[0]["content"]
    # The prefix: identity asked and given, authenticated, order looked up; all of it is prompt.
    prefix = env.start(task).prefix
    assert r.messages[2:2 + len(prefix)] == prefix and [m["role"] for m in prefix] == [
        "assistant", "user", "assistant", "tool", "assistant", "tool"]
    prompt = tokenizer.decode(r.token_ids[:r.prompt_len])
    assert prefix[-1]["content"] in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert set(r.env_mask[:r.prompt_len]) == {0} and r.env_mask[r.prompt_len] == 1
    generated = tokenizer.decode([t for t, m in zip(r.token_ids, r.env_mask) if m])
    assert lookup["arguments"]["order_id"] not in generated.split("cancel_pending_order")[0] or confirm
    assert r.result.info["hinted"] is True and r.result.info["capability"] == "confirm_before_writing"
    assert r.result.info["decision_point"]["prefix_messages"] == len(prefix) and r.result.info["decision_point"]["finished"]
    if confirm:
        assert r.result.reward == 1.0 and r.result.success
        assert RULES["confirm_before_writing"].judge(r.result.info)[0] == "PRESENT"
    else:
        # Only the write itself is paid (shaping: it keeps the agent writing, and is never success).
        paid = [c for c in r.result.info["rubric"] if c["applicable"] and c["passed"]]
        assert [(c["id"], c["shaping"]) for c in paid] == [("wrote", True)] and not r.result.success
        assert 0 < r.result.reward < 0.25
        assert RULES["confirm_before_writing"].judge(r.result.info)[0] == "LACKING"
    assert task.scenario["user_id"] in json.dumps(r.messages)


def test_hint_swap_keeps_the_expert_prefix_as_prompt(tokenizer):
    """GRPO re-renders a hinted episode's opening with the plain system prompt: with an expert prefix
    the opening runs up to the first *generated* assistant message, and the prefix stays unmasked 0."""
    from trace_assets.train.grpo import swap_system_prompt

    spec = template_spec({"name": "communicate_results", "description": RULES["communicate_results"].description}, ENV)
    spec["difficulty"]["hint_share"] = 1.0
    env = SyntheticEnv(spec, ENV)
    task = env.make_task("order_status", env.seed_range[0] + 1)
    rollout = run_rollouts(env, [task], TurnScript(tokenizer, ["Order status: see above."]), tokenizer,
                           RolloutConfig(max_steps=4, max_new_tokens=64, max_context_tokens=8192))[0]
    assert rollout.stop_reason == "env_done" and rollout.steps == 1
    swapped = swap_system_prompt(rollout, tokenizer, env.tool_schemas(), ENV.system_prompt())
    assert swapped.messages[0]["content"] == ENV.system_prompt() and "Hint: " not in tokenizer.decode(swapped.token_ids)
    prefix = env.start(task).prefix
    assert swapped.messages[2:2 + len(prefix)] == prefix
    plain_prompt = tokenizer.decode(swapped.token_ids[:swapped.prompt_len])
    assert prefix[-1]["content"] in plain_prompt and set(swapped.env_mask[:swapped.prompt_len]) == {0}
    assert swapped.token_ids[swapped.prompt_len:] == rollout.token_ids[rollout.prompt_len:]
    assert sum(swapped.env_mask) == sum(rollout.env_mask) > 0
