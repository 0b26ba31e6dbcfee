"""The HF backend and the batched multi-turn rollout runner (tiny model, fake environment)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from trace_assets.agent.backends import Generation, GenerationBackend, SamplingParams, TransformersBackend
from trace_assets.agent.rollout import Rollout, RolloutConfig, rollout_to_record, run_rollouts
from trace_assets.envs.base import Environment, Episode, EpisodeResult, Task

# ---------------------------------------------------------------- a small fake environment

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up the value of x.",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        },
    },
    {"type": "function", "function": {"name": "explode", "description": "Env bug.", "parameters": {"type": "object", "properties": {}}}},
]


@dataclass
class FakeEpisode:
    task: Task
    calls: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    said: list[str] = field(default_factory=list)

    def initial_messages(self):
        return [
            {"role": "system", "content": "You look things up. Policy: be brief."},
            {"role": "user", "content": self.task.instruction},
        ]

    def call_tool(self, name, arguments):
        if name == "explode":
            raise RuntimeError("environment bug")
        if name != "lookup":
            self.errors.append(f"unknown tool {name}")
            return f"Error: unknown tool {name!r}"
        x = arguments.get("x")
        if not isinstance(x, int):
            self.errors.append("bad x")
            return "Error: x must be an integer"
        self.calls.append({"name": name, "arguments": arguments, "ok": True})
        return json.dumps({"x": x, "value": 2 * x})

    def malformed_call(self, raw, error):
        self.errors.append(error)
        return f"Error: malformed tool call ({error})"

    def user_reply(self, assistant_text):
        self.said.append(assistant_text)
        if "done" in assistant_text.lower():
            return "Thanks, bye.", True
        return "Please continue.", False

    def result(self):
        ok = any(c["arguments"] == {"x": self.task.scenario["x"]} for c in self.calls)
        reward = 1.0 if ok and any("done" in s.lower() for s in self.said) else 0.0
        return EpisodeResult(reward, reward == 1.0, {"state_match": ok, "tool_errors": list(self.errors)})


class FakeEnv:
    name = "fake"

    def tool_schemas(self):
        return TOOLS

    def system_prompt(self):
        return "You look things up. Policy: be brief."

    def families(self):
        return ["lookup"]

    def make_task(self, family, seed):
        return Task(
            task_id=f"fake-{family}-{seed}", env="fake", family=family, seed=seed,
            instruction=f"What is the value of {seed}?" + " Please." * (seed % 3),
            scenario={"x": seed}, gold_actions=[{"name": "lookup", "arguments": {"x": seed}}],
            required_info=[str(2 * seed)], expected_state_hash="",
        )

    def start(self, task):
        return FakeEpisode(task)


def test_fake_env_implements_the_protocol():
    env = FakeEnv()
    assert isinstance(env, Environment)
    assert isinstance(env.start(env.make_task("lookup", 1)), Episode)


class ScriptedBackend:
    """Returns ``script[turn]`` for every prompt of the turn-th call (or per-prompt callables)."""

    name = "scripted"

    def __init__(self, tokenizer, script, *, stop=True):
        self.tok, self.script, self.stop, self.calls = tokenizer, script, stop, 0

    def generate(self, prompts, params):
        text = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        out = []
        for _ in prompts:
            ids = self.tok.encode(text + ("<|im_end|>" if self.stop else ""), add_special_tokens=False)
            out.append(Generation(ids, self.tok.decode(ids), [-0.5] * len(ids), "stop" if self.stop else "length"))
        return out


# ---------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    from trace_assets.agent.model import load_model

    torch.set_num_threads(2)
    return load_model(str(tiny_model_path))


def _tasks(n, start=1):
    env = FakeEnv()
    return env, [env.make_task("lookup", s) for s in range(start, start + n)]


def _render(tok, messages, gen=False):
    return tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=gen, tokenize=False)


def _raw_view(r: Rollout) -> list[dict]:
    """Messages with each assistant message replaced by the text the model actually produced."""
    texts = iter(r.assistant_texts)
    out = []
    for m in r.messages:
        if m["role"] == "assistant":
            raw = next(texts)
            out.append({"role": "assistant", "content": raw.removesuffix("<|im_end|>")})
        else:
            out.append(m)
    return out


def _check_bookkeeping(r: Rollout, tok) -> None:
    n = len(r.token_ids)
    assert len(r.env_mask) == n == len(r.logprobs)
    assert sum(r.env_mask) == r.n_generated
    assert r.env_mask[: r.prompt_len] == [0] * r.prompt_len and r.env_mask[r.prompt_len] == 1
    # The first prompt is exactly the template's tokenization.
    first = _render(tok, r.messages[:2], gen=True)
    assert r.token_ids[: r.prompt_len] == tok.encode(first, add_special_tokens=False)
    # Masked-in tokens are exactly the generated turns, in order.
    generated = [t for t, m in zip(r.token_ids, r.env_mask) if m]
    expected = [t for text in r.assistant_texts for t in tok.encode(text, add_special_tokens=False)]
    assert tok.decode(generated) == tok.decode(expected)
    assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.env_mask) if not m)
    # Token/text consistency: the tokens decode to the template's rendering of the conversation.
    assert tok.decode(r.token_ids) == _render(tok, _raw_view(r))


# ---------------------------------------------------------------- backend


def _prompts(tok, n=6):
    msgs = [[{"role": "user", "content": "hello " * (k + 1)}] for k in range(n)]
    return [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False) for m in msgs]


def test_backend_greedy_is_reproducible_and_batch_invariant(tiny):
    model, tok = tiny
    prompts = _prompts(tok)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    batched = TransformersBackend(model, tok, batch_size=4)
    assert isinstance(batched, GenerationBackend)
    a, b = batched.generate(prompts, params), batched.generate(prompts, params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    single = [TransformersBackend(model, tok, batch_size=1).generate([p], params)[0] for p in prompts]
    # Left padding + attention mask: greedy tokens agree exactly for the tiny fp32 model; the
    # log-probs differ only by float noise from the padded matmuls.
    assert [g.token_ids for g in a] == [g.token_ids for g in single]
    for x, y in zip(a, single):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
        assert x.finish_reason == ("stop" if x.token_ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") else "length")
        assert len(x.token_ids) <= 12 and x.text == tok.decode(x.token_ids)


def test_backend_logprobs_match_a_forward_pass(tiny):
    model, tok = tiny
    prompt = _prompts(tok, 1)[0]
    for temperature in (0.0, 0.7):
        gen = TransformersBackend(model, tok).generate([prompt], SamplingParams(temperature=temperature, max_new_tokens=8, seed=1))[0]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen.token_ids])).logits[0].float()
        scaled = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        ref = [scaled[len(prompt) - 1 + i, t].item() for i, t in enumerate(gen.token_ids)]
        assert gen.logprobs == pytest.approx(ref, abs=1e-4)


def test_backend_seeded_sampling_is_reproducible(tiny):
    model, tok = tiny
    prompts = _prompts(tok, 4)
    backend = TransformersBackend(model, tok, batch_size=4)
    p = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, seed=7)
    state = torch.random.get_rng_state()
    a, b = backend.generate(prompts, p), backend.generate(prompts, p)
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is untouched
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    c = backend.generate(prompts, SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=10, seed=8))
    assert [g.token_ids for g in a] != [g.token_ids for g in c]


def test_logged_progress_logs_about_ten_times_and_at_the_end():
    from trace_assets.agent.rollout import logged_progress

    lines = []
    progress = logged_progress(lines.append, "base on the test split")
    for done in range(91):
        progress(done, 90)
    assert lines[-1] == "base on the test split: 90/90 episodes finished"
    assert 10 <= len(lines) <= 12 and "base on the test split: 9/90 episodes finished" in lines


# ---------------------------------------------------------------- rollouts with the tiny model


def test_tiny_rollouts_bookkeeping_and_limits(tiny):
    model, tok = tiny
    env, tasks = _tasks(5)
    backend = TransformersBackend(model, tok, batch_size=4)
    seen = []
    config = RolloutConfig(max_steps=3, max_new_tokens=8)
    rollouts = run_rollouts(env, tasks, backend, tok, config, progress=lambda d, t: seen.append((d, t)))
    assert [r.task.task_id for r in rollouts] == [t.task_id for t in tasks]
    assert seen[-1] == (5, 5) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    for r in rollouts:
        assert r.error is None, r.error
        assert 1 <= r.steps <= 3
        # A random model rarely stops within 8 tokens: two cut turns in a row end the episode.
        assert r.stop_reason in {"user_done", "max_steps", "length"}
        assert r.truncated == (r.stop_reason == "length")
        assert r.messages[0]["role"] == "system" and r.messages[1]["role"] == "user"
        _check_bookkeeping(r, tok)

    one = run_rollouts(env, tasks[:2], backend, tok, RolloutConfig(max_steps=1, max_new_tokens=8))
    assert all(r.steps == 1 and r.stop_reason == "max_steps" for r in one)


def test_tiny_rollouts_are_seed_reproducible(tiny):
    model, tok = tiny
    env, tasks = _tasks(3)
    backend = TransformersBackend(model, tok, batch_size=4)
    for temperature in (0.0, 1.0):
        cfg = RolloutConfig(max_steps=2, max_new_tokens=6, temperature=temperature, seed=3)
        a = run_rollouts(env, tasks, backend, tok, cfg)
        b = run_rollouts(env, tasks, backend, tok, cfg)
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
    other = run_rollouts(env, tasks, backend, tok, RolloutConfig(max_steps=2, max_new_tokens=6, temperature=1.0, seed=4))
    assert [r.token_ids for r in a] != [r.token_ids for r in other]


def test_context_limit_truncates(tiny):
    model, tok = tiny
    env, tasks = _tasks(2)
    backend = TransformersBackend(model, tok)
    first = run_rollouts(env, tasks, backend, tok, RolloutConfig(max_steps=1, max_new_tokens=4))[0]
    limit = first.prompt_len + 4 + 10  # room for the first turn, not the second
    rs = run_rollouts(env, tasks, backend, tok, RolloutConfig(max_steps=5, max_new_tokens=4, max_context_tokens=limit))
    r = rs[0]
    assert r.steps == 1 and r.stop_reason == "context" and r.truncated
    tiny_limit = run_rollouts(env, tasks, backend, tok, RolloutConfig(max_context_tokens=10))
    assert all(x.steps == 0 and x.stop_reason == "context" and x.n_generated == 0 for x in tiny_limit)


# ---------------------------------------------------------------- the full loop, scripted


CANON = '<tool_call>\n{"name": "lookup", "arguments": {"x": 1}}\n</tool_call>'


def test_scripted_tool_call_and_user_loop(tokenizer):
    env, tasks = _tasks(2)
    backend = ScriptedBackend(tokenizer, ['<tool_call>{"name":"lookup","arguments":{"x":1}}</tool_call>', "The value is 2. done"])
    rs = run_rollouts(env, tasks, backend, tokenizer, RolloutConfig(max_new_tokens=64))
    r = rs[0]
    assert [m["role"] for m in r.messages] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert r.messages[2] == {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"x": 1}}}]}
    assert json.loads(r.messages[3]["content"]) == {"x": 1, "value": 2}
    assert r.messages[5] == {"role": "user", "content": "Thanks, bye."}
    assert r.steps == 2 and r.stop_reason == "user_done" and not r.truncated and r.result.success
    assert rs[1].result.reward == 0.0  # task 2 wanted x=2
    _check_bookkeeping(r, tokenizer)
    assert r.logprobs[r.prompt_len] == -0.5

    rec = rollout_to_record(r, policy="base", source="test", split="train")
    assert set(rec) == {"trajectory_id", "task_id", "env", "split", "policy", "messages", "reward", "success", "info", "source",
                        "created_at", "agent_id"}
    assert len(rec["trajectory_id"]) == 16 and rec["reward"] == 1.0 and rec["success"] is True
    assert rec["info"]["family"] == "lookup" and rec["info"]["steps"] == 2 and rec["info"]["state_match"] is True
    assert rec["info"]["n_generated"] == r.n_generated and rec["info"]["truncated"] is False
    json.dumps(rec)
    assert rollout_to_record(r, policy="base", source="x", split="test")["trajectory_id"] == rec["trajectory_id"]
    assert rollout_to_record(r, policy="adapter", source="x", split="test")["trajectory_id"] != rec["trajectory_id"]


def test_canonical_turns_tokenize_exactly_like_the_template(tokenizer):
    env, tasks = _tasks(1)
    backend = ScriptedBackend(tokenizer, [CANON, "Checking.\n" + CANON + "\n" + CANON.replace("lookup", "nope"), "done"])
    r = run_rollouts(env, tasks, backend, tokenizer, RolloutConfig(max_new_tokens=64))[0]
    assert r.stop_reason == "user_done"
    text = _render(tokenizer, r.messages)
    assert tokenizer.decode(r.token_ids) == text
    # ChatML splits at <|im_start|>/<|im_end|>, so segment-wise tokenization equals the whole.
    assert r.token_ids == tokenizer.encode(text, add_special_tokens=False)
    # Two tool calls in one turn -> two tool messages grouped in one user turn.
    assert [m["role"] for m in r.messages[4:7]] == ["assistant", "tool", "tool"]
    assert r.messages[6]["content"].startswith("Error: unknown tool")


def test_malformed_output_becomes_an_error_observation(tokenizer):
    env, tasks = _tasks(1)
    backend = ScriptedBackend(tokenizer, ['Hmm <tool_call>{"name": "lookup", "arguments": {x: 1}}</tool_call>', CANON, "done"])
    r = run_rollouts(env, tasks, backend, tokenizer, RolloutConfig(max_new_tokens=64))[0]
    assert r.messages[2] == {"role": "assistant", "content": "Hmm"}
    assert r.messages[3]["role"] == "tool" and r.messages[3]["content"].startswith("Error: malformed tool call (invalid JSON")
    assert r.result.success and r.result.info["tool_errors"]
    _check_bookkeeping(r, tokenizer)


def test_length_cut_twice_ends_and_max_steps(tokenizer):
    env, tasks = _tasks(1)
    r = run_rollouts(env, tasks, ScriptedBackend(tokenizer, ["blah blah"], stop=False), tokenizer, RolloutConfig())[0]
    assert r.steps == 2 and r.stop_reason == "length" and r.truncated
    _check_bookkeeping(r, tokenizer)
    r = run_rollouts(env, tasks, ScriptedBackend(tokenizer, ["keep going"]), tokenizer, RolloutConfig(max_steps=4))[0]
    assert r.steps == 4 and r.stop_reason == "max_steps" and not r.truncated
    assert [m["role"] for m in r.messages].count("assistant") == 4


def test_max_errors_ends_a_stuck_episode_and_successes_reset_nothing(tokenizer):
    env, tasks = _tasks(1)
    bad = '<tool_call>{"name": "lookup", "arguments": {"x": "one"}}</tool_call>'
    r = run_rollouts(env, tasks, ScriptedBackend(tokenizer, [bad]), tokenizer, RolloutConfig(max_errors=3))[0]
    assert r.steps == 3 and r.stop_reason == "max_errors" and not r.truncated
    assert sum(m["role"] == "tool" and m["content"].startswith("Error:") for m in r.messages) == 3
    _check_bookkeeping(r, tokenizer)
    # Errors count over the whole episode (tau2-bench), and 0 disables the rule.
    script = [bad, CANON, bad, CANON, bad, "done"]
    r = run_rollouts(env, tasks, ScriptedBackend(tokenizer, script), tokenizer, RolloutConfig(max_errors=3))[0]
    assert r.stop_reason == "max_errors" and r.steps == 5
    r = run_rollouts(env, tasks, ScriptedBackend(tokenizer, [bad]), tokenizer, RolloutConfig(max_steps=12, max_errors=0))[0]
    assert r.stop_reason == "max_steps" and r.steps == 12


def test_garbage_and_env_bugs_never_crash(tokenizer):
    env, tasks = _tasks(2)
    garbage = ["<tool_call><tool_call>{{{</tool_call>\x00\ufffd<|endoftext|>", "</tool_call>", "<tool_call>", ""]
    r = run_rollouts(env, tasks, ScriptedBackend(tokenizer, garbage), tokenizer, RolloutConfig(max_steps=6))[0]
    assert r.error is None and r.steps == 6
    _check_bookkeeping(r, tokenizer)
    boom = run_rollouts(env, tasks, ScriptedBackend(tokenizer, ['<tool_call>{"name": "explode", "arguments": {}}</tool_call>']), tokenizer)
    assert all(x.stop_reason == "error" and "environment bug" in x.error for x in boom)
    assert all(isinstance(x.result, EpisodeResult) for x in boom)


class BoundedCache:
    """A backend with a KV cache of ``capacity`` tokens (as vLLM reports it), recording every call."""

    name = "bounded"

    def __init__(self, inner, capacity):
        self.inner, self.kv_capacity_tokens, self.calls = inner, capacity, []

    def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        return self.inner.generate(prompts, params)


def test_admission_keeps_each_round_within_the_kv_cache_and_changes_no_greedy_rollout(tiny):
    from trace_assets.agent.rollout import KV_FILL, _common_prefix_length

    model, tok = tiny
    env, tasks = _tasks(6)
    config = RolloutConfig(max_steps=4, max_new_tokens=12, temperature=0.0)
    unbounded = BoundedCache(TransformersBackend(model, tok, batch_size=1), None)
    reference = run_rollouts(env, tasks, unbounded, tok, config)
    first = unbounded.calls[0]  # every episode's first prompt
    shared = _common_prefix_length(first)

    def demand(prompts):
        return shared + sum(len(p) - shared + config.max_new_tokens for p in prompts)

    # Room for the first two episodes' prompts: more rounds, never more tokens in a round than the cache holds.
    capacity = int(demand(first[:2]) / KV_FILL) + 1
    bounded = BoundedCache(TransformersBackend(model, tok, batch_size=1), capacity)
    rollouts = run_rollouts(env, tasks, bounded, tok, config)
    assert [r.token_ids for r in rollouts] == [r.token_ids for r in reference]
    assert [r.stop_reason for r in rollouts] == [r.stop_reason for r in reference]
    assert max(map(len, bounded.calls)) < len(tasks) and len(bounded.calls) > len(unbounded.calls)
    assert all(len(c) == 1 or demand(c) <= capacity * KV_FILL for c in bounded.calls)
    # A cache that holds every episode changes nothing: the same batches as no bound at all.
    roomy = BoundedCache(TransformersBackend(model, tok, batch_size=1), 10**9)
    run_rollouts(env, tasks, roomy, tok, config)
    assert roomy.calls == unbounded.calls
    # One episode larger than the cache still plays, alone.
    small = BoundedCache(TransformersBackend(model, tok, batch_size=1), 1)
    assert [r.token_ids for r in run_rollouts(env, tasks, small, tok, config)] == [r.token_ids for r in reference]
    assert set(map(len, small.calls)) == {1}
