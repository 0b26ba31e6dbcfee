"""Cost per rollout: a decision-point synthetic episode vs a full target episode (measured, not asserted).

Two measurements, in one process:

1. **Tokens per rollout, real tokenizer.** For every catalogue capability, the scripted expert's
   own turns are replayed through the real batched rollout runner (a backend that emits the
   expert's next turn as text), on
   * ``target``: the built-in retail environment, whole episodes from the first turn;
   * ``E_c v1-style``: the capability's template environment without ``start``/``end`` (what
     Step 2 built before: the whole target episode with a shaped reward);
   * ``E_c``: the decision-point environment (schema v2).
   Per rollout: ``prompt`` = tokens of the first prompt (system, tools, opening and, for E_c, the
   expert prefix; ``prompt_len``), ``generated`` = tokens the policy writes (``env_mask`` 1; the
   tokens GRPO trains on), ``total`` = the whole sequence, ``turns`` = generation rounds.
2. **Rollouts per second** (``--model tiny`` | ``demo`` (the raw SmolLM2-135M-Instruct) | a path):
   the default transformers backend at T = 1 on the same tasks, target vs E_c. The tiny random model
   never closes a turn, so every episode ends after two cut turns in both environments and only the
   prompt cost differs; the raw demo model answers in plain text (no valid tool calls), so the target
   plays up to ``--max-steps`` turns while E_c's horizon ends after a few: that shows the horizon's
   effect. The token counts of part 1 are the figure of the expert's episode lengths.

    .venv/bin/python benchmarks/decision_point_cost.py --tasks 8
    .venv/bin/python benchmarks/decision_point_cost.py --tasks 8 --skip-model
    .venv/bin/python benchmarks/decision_point_cost.py --tasks 4 --model demo --max-new-tokens 48 \
        --capabilities confirm_before_writing,communicate_results
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trace_assets.agent.backends import Generation  # noqa: E402
from trace_assets.agent.rollout import RolloutConfig, run_rollouts  # noqa: E402
from trace_assets.envs import get_environment  # noqa: E402
from trace_assets.envs.retail.expert import demonstrate  # noqa: E402
from trace_assets.identify.heuristic import CATALOGUE  # noqa: E402
from trace_assets.synthesize import SyntheticEnv, template_spec  # noqa: E402


def turn_text(message: dict[str, Any]) -> str:
    """An assistant message as the model would write it (the runner parses it back)."""
    if message.get("tool_calls"):
        fn = message["tool_calls"][0]["function"]
        return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": fn["arguments"]}) + "\n</tool_call>"
    return message["content"]


class ScriptBackend:
    """Returns the next scripted turn for the single episode it serves."""

    name = "script"

    def __init__(self, tokenizer: Any, script: list[str]) -> None:
        self.tok, self.script, self.calls = tokenizer, script, 0

    def generate(self, prompts, params):
        text = (self.script[self.calls] if self.calls < len(self.script) else "Goodbye.") + "<|im_end|>"
        self.calls += 1
        ids = self.tok.encode(text, add_special_tokens=False)
        return [Generation(ids, self.tok.decode(ids), [0.0] * len(ids), "stop") for _ in prompts]


def expert_rollout(env: Any, task: Any, tokenizer: Any, config: RolloutConfig) -> Any:
    opening = len(env.start(task).initial_messages())
    messages, result = demonstrate(env, task)
    script = [turn_text(m) for m in messages[opening:] if m["role"] == "assistant"]
    rollout = run_rollouts(env, [task], ScriptBackend(tokenizer, script), tokenizer, config)[0]
    if rollout.result.reward != result.reward:
        raise RuntimeError(f"{task.task_id}: replay reward {rollout.result.reward} != expert {result.reward}")
    return rollout


def summarize(rollouts: list[Any]) -> dict[str, float]:
    return {
        "prompt": mean(r.prompt_len for r in rollouts),
        "generated": mean(sum(r.env_mask) for r in rollouts),
        "total": mean(len(r.token_ids) for r in rollouts),
        "turns": mean(r.steps for r in rollouts),
        "reward": mean(r.result.reward for r in rollouts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=8, help="tasks per environment")
    parser.add_argument("--model", default="tiny", help="'tiny' or a model path, for rollouts/s")
    parser.add_argument("--skip-model", action="store_true", help="token counts only")
    parser.add_argument("--max-steps", type=int, default=12, help="turns per episode (the demo's GRPO profile)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--capabilities", default="", help="comma-separated subset for rollouts/s (default: all)")
    args = parser.parse_args()

    from trace_assets.agent.model import ensure_tiny_model, load_model, load_tokenizer
    from trace_assets.paths import models_dir

    source = {"tiny": lambda: str(ensure_tiny_model()), "demo": lambda: str(Path(models_dir()) / "smollm2-135m-instruct")}.get(
        args.model, lambda: args.model)()
    tokenizer = load_tokenizer(source)
    config = RolloutConfig(max_steps=50, max_new_tokens=256, max_context_tokens=16384)
    target = get_environment("retail")

    rows = []
    for rule in CATALOGUE:
        spec = template_spec({"name": rule.name, "description": rule.description}, target)
        env = SyntheticEnv(spec, target)
        whole = SyntheticEnv({k: v for k, v in spec.items() if k not in ("start", "end")}, target)
        tasks = env.sample_tasks(args.tasks)
        for label, e, ts in (("target", target, [target.make_task(t.family, t.seed) for t in tasks]),
                             ("E_c v1-style", whole, tasks), ("E_c", env, tasks)):
            rows.append({"capability": rule.name, "env": label, **summarize([expert_rollout(e, t, tokenizer, config) for t in ts])})

    print(f"tokens per expert rollout (real tokenizer, {args.tasks} tasks per environment, same families and seeds)\n")
    print("| capability | env | prompt | generated | total | turns | expert reward |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['capability']} | {r['env']} | {r['prompt']:.0f} | {r['generated']:.0f} | {r['total']:.0f} | {r['turns']:.1f} | {r['reward']:.2f} |")
    for label in ("target", "E_c v1-style", "E_c"):
        sel = [r for r in rows if r["env"] == label]
        print(f"\nmean over capabilities, {label}: prompt {mean(r['prompt'] for r in sel):.0f}, generated "
              f"{mean(r['generated'] for r in sel):.0f}, total {mean(r['total'] for r in sel):.0f}, turns {mean(r['turns'] for r in sel):.1f}")

    if args.skip_model:
        return
    from trace_assets.agent.backends import TransformersBackend

    model, _ = load_model(source)
    backend = TransformersBackend(model, tokenizer)
    sampled = RolloutConfig(max_steps=args.max_steps, max_new_tokens=args.max_new_tokens, temperature=1.0,
                            max_context_tokens=4096, seed=1)
    print(f"\nrollouts per second ({args.model}, transformers backend, T=1, {args.tasks} episodes batched, "
          f"max_steps {args.max_steps}, max_new_tokens {args.max_new_tokens})\n")
    print("| capability | env | rollouts/s | generated tokens/rollout | turns |")
    print("|---|---|---|---|---|")
    wanted = [c for c in args.capabilities.split(",") if c] or [rule.name for rule in CATALOGUE]
    for rule in [r for r in CATALOGUE if r.name in wanted]:
        env = SyntheticEnv(template_spec({"name": rule.name, "description": rule.description}, target), target)
        tasks = env.sample_tasks(args.tasks)
        for label, e, ts in (("target", target, [target.make_task(t.family, t.seed) for t in tasks]), ("E_c", env, tasks)):
            start = time.perf_counter()
            out = run_rollouts(e, ts, backend, tokenizer, sampled)
            seconds = time.perf_counter() - start
            print(f"| {rule.name} | {label} | {len(out) / seconds:.2f} | {mean(r.n_generated for r in out):.0f} | "
                  f"{mean(r.steps for r in out):.1f} |")


if __name__ == "__main__":
    main()
