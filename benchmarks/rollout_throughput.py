"""Rollout throughput vs raw batched generation (measured, not asserted).

Runs N episodes through the batched multi-turn runner (the built-in ``retail`` environment when
importable, else a small fake one) and compares generated tokens/s with a plain batched
``generate`` over N sequences with the same ``max_new_tokens`` and no environment. The ratio shows
what the multi-turn loop costs: growing contexts re-prefilled every turn (no KV-cache reuse across
turns), shrinking batches as episodes finish, and the environment/tokenizer work.

    .venv/bin/python benchmarks/rollout_throughput.py --model tiny --episodes 8
    .venv/bin/python benchmarks/rollout_throughput.py --model demo --episodes 32
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trace_assets.agent.backends import Generation, SamplingParams, TransformersBackend  # noqa: E402
from trace_assets.agent.model import load_model  # noqa: E402
from trace_assets.agent.rollout import RolloutConfig, run_rollouts  # noqa: E402
from trace_assets.envs.base import EpisodeResult, Task  # noqa: E402


class _EchoEpisode:
    """A tiny fallback environment: one ``lookup`` tool and a user who asks twice, then leaves."""

    def __init__(self, task: Task) -> None:
        self.task, self.turns = task, 0

    def initial_messages(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": "You are a lookup assistant. Use the lookup tool."},
                {"role": "user", "content": self.task.instruction}]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        return json.dumps({"name": name, "arguments": arguments, "value": 42}) if name == "lookup" else f"Error: unknown tool {name}"

    def malformed_call(self, raw: str, error: str) -> str:
        return f"Error: {error}"

    def user_reply(self, assistant_text: str) -> tuple[str, bool]:
        self.turns += 1
        return ("Anything else?", self.turns >= 2)

    def result(self) -> EpisodeResult:
        return EpisodeResult(0.0, False, {})


class _EchoEnv:
    name = "echo"

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": "lookup", "description": "Look up a key.",
                 "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]

    def system_prompt(self) -> str:
        return "You are a lookup assistant."

    def families(self) -> list[str]:
        return ["lookup"]

    def make_task(self, family: str, seed: int) -> Task:
        return Task(f"echo-{seed}", "echo", family, seed, f"Please look up key k{seed}.", {}, [], [], "")

    def start(self, task: Task) -> _EchoEpisode:
        return _EchoEpisode(task)


class _TimedBackend:
    """Wraps a backend to separate generation time from the runner's own overhead."""

    def __init__(self, inner: TransformersBackend) -> None:
        self.inner, self.name, self.seconds, self.calls, self.prefill = inner, inner.name, 0.0, 0, 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        start = time.perf_counter()
        out = self.inner.generate(prompts, params)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.prefill += sum(len(p) for p in prompts)  # whole conversations are re-prefilled each turn
        return out


def _environment(name: str) -> Any:
    if name == "fake":
        return _EchoEnv()
    try:
        from trace_assets.envs import get_environment

        return get_environment(name)
    except Exception as exc:  # the retail env may not exist yet in a partial checkout
        print(f"(environment {name!r} unavailable: {exc}; using the fake one)")
        return _EchoEnv()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", help="demo, tiny, an HF id or a path")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--env", default="retail", help="retail (default) or fake")
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model)
    load_s = time.perf_counter() - t0
    env = _environment(args.env)
    families = env.families()
    tasks = [env.make_task(families[i % len(families)], 1000 + i) for i in range(args.episodes)]
    backend = _TimedBackend(TransformersBackend(model, tokenizer, batch_size=args.batch_size))
    config = RolloutConfig(max_steps=args.max_steps, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, seed=0)

    t0 = time.perf_counter()
    rollouts = run_rollouts(env, tasks, backend, tokenizer, config)
    roll_s = time.perf_counter() - t0
    roll_tokens = sum(r.n_generated for r in rollouts)
    steps = sum(r.steps for r in rollouts)
    ctx = max(len(r.token_ids) for r in rollouts)
    first_prompt = sum(r.prompt_len for r in rollouts) / max(1, len(rollouts))

    # Raw: one plain batched generate over the same first prompts, no environment.
    prompts = [r.token_ids[: r.prompt_len] for r in rollouts if r.prompt_len]
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0)
    raw_backend = TransformersBackend(model, tokenizer, batch_size=args.batch_size)
    t0 = time.perf_counter()
    raw = raw_backend.generate(prompts, params)
    raw_s = time.perf_counter() - t0
    raw_tokens = sum(len(g.token_ids) for g in raw)

    roll_tps, raw_tps = roll_tokens / roll_s, raw_tokens / raw_s
    reasons: dict[str, int] = {}
    for r in rollouts:
        reasons[r.stop_reason] = reasons.get(r.stop_reason, 0) + 1
    print(f"model={args.model} env={env.name} episodes={args.episodes} max_steps={args.max_steps} "
          f"max_new_tokens={args.max_new_tokens} T={args.temperature} threads={torch.get_num_threads()} "
          f"(load {load_s:.1f}s)")
    print(f"first prompt ~{first_prompt:.0f} tokens; longest conversation {ctx} tokens; {steps} turns; "
          f"{backend.calls} generate calls; stop reasons {reasons}")
    rows = [
        ("rollouts (multi-turn)", backend.prefill, roll_tokens, roll_s, roll_tps),
        ("raw batched generate", sum(len(p) for p in prompts), raw_tokens, raw_s, raw_tps),
    ]
    print(f"{'':24}{'prefill':>9}{'generated':>11}{'seconds':>9}{'gen tok/s':>11}")
    for name, prefill, tokens, secs, tps in rows:
        print(f"{name:24}{prefill:>9}{tokens:>11}{secs:>9.1f}{tps:>11.1f}")
    overhead = roll_s - backend.seconds
    print(f"ratio rollout/raw = {roll_tps / raw_tps:.2f}; runner+env overhead {overhead:.2f}s "
          f"({100 * overhead / roll_s:.1f}% of rollout time)")


if __name__ == "__main__":
    main()
