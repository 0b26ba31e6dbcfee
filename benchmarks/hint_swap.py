"""Is the hint swap worth keeping? GRPO with and without it, at the same rollouts, train side only.

One synthetic environment (a heuristic capability's template, ``hint_share`` raised so that half the
episodes are hinted), the demo's GRPO recipe, two arms that differ only in ``swap_hints``: with the
swap (hinted episodes re-tokenized with the plain prompt, trained by the truncated-IS estimator
``grpo.hint_swap_loss``) and without (hinted episodes trained as sampled). Both are measured greedy
on the same held-out synthetic seeds (never the test split), against the untrained base, with the
same seeds and rollouts. ``GRPOConfig.swap_hints`` defaults to off unless this shows the swap ahead.

    .venv/bin/python benchmarks/hint_swap.py [--model PATH] [--capability confirm_before_writing]
        [--iterations 4] [--hint-share 0.5] [--eval-tasks 16] [--seeds 0,1] [--backend vllm|transformers]

Generation goes through the pipeline's own path (``ModelResource.policy_backend_factory``: vLLM
with weight sync where available, in ``[generation] vllm_dtype``). Each training seed is a pair of
runs (swap, no swap) with the same seed; the gain is reported per seed and as the mean.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from trace_assets.agent.model import load_model
    from trace_assets.cli import served_base_model
    from trace_assets.envs import get_environment
    from trace_assets.synthesize import SyntheticEnv, template_spec
    from trace_assets.train.heldout import EvalConfig, compare_base_and_adapter
    from trace_assets.settings import DEMO_GRPO as DEMO
    from trace_assets.train.grpo import GRPOTrainer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="agent folder (default: the latest base_agent, else the demo model)")
    parser.add_argument("--capability", default="confirm_before_writing")
    parser.add_argument("--iterations", type=int, default=DEMO.iterations)
    parser.add_argument("--hint-share", type=float, default=0.5)
    parser.add_argument("--eval-tasks", type=int, default=16)
    parser.add_argument("--seeds", default="0,1", help="training seeds (GRPO sampling and LoRA init)")
    parser.add_argument("--backend", default="auto", choices=["auto", "vllm", "transformers"])
    args = parser.parse_args()

    from resources.models import ModelResource
    from trace_assets.settings import load_settings

    console = Console(width=150)
    path = args.model or served_base_model()
    target = get_environment("retail")
    spec = template_spec({"name": args.capability, "description": args.capability.replace("_", " ")}, target)
    spec["difficulty"]["hint_share"] = args.hint_share
    env = SyntheticEnv(spec, target)
    generation = load_settings().generation
    models = ModelResource(generation_backend=args.backend, vllm_dtype=generation.vllm_dtype)
    factory = models.policy_backend_factory(path)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        config = replace(DEMO, iterations=args.iterations, seed=seed)
        for swap in (True, False):
            model, tokenizer = load_model(path)
            start = time.perf_counter()
            trainer = GRPOTrainer(model, tokenizer, env, replace(config, swap_hints=swap), tempfile.mkdtemp(prefix="hint-swap-"),
                                  backend_factory=factory,
                                  progress=lambda m: console.print(f"seed={seed} swap={swap} {m.line()}"))
            result = trainer.train(resume=False)
            train_s = time.perf_counter() - start
            report = compare_base_and_adapter(trainer.model, tokenizer, env,
                                              EvalConfig.from_limits(config, n_tasks=args.eval_tasks), backend_factory=factory)
            rows.append((seed, swap, report["base"], report["adapter"],
                         len(result.history) * config.groups * config.samples_per_group,
                         sum(m.hinted for m in result.history), train_s))

    table = Table(title=f"hint swap vs none, {args.capability}, hint_share {args.hint_share}, {path}")
    for column in ("seed", "swap_hints", "rollouts", "hinted", "held-out success base", "after", "held-out reward base", "after", "train s"):
        table.add_column(column, justify="right")
    for seed, swap, base, after, rollouts, hinted, secs in rows:
        table.add_row(str(seed), str(swap), str(rollouts), str(hinted), f"{base.success_rate:.3f}", f"{after.success_rate:.3f}",
                      f"{base.mean_reward:.3f}", f"{after.mean_reward:.3f}", f"{secs:.0f}")
    console.print(table)
    for arm in (True, False):
        gains = [after.success_rate - base.success_rate for _, swap, base, after, *_ in rows if swap is arm]
        console.print(f"swap_hints={arm}: success gain per seed {', '.join(f'{g:+.3f}' for g in gains)}, "
                      f"mean {sum(gains) / len(gains):+.3f}")
    console.print(f"(same seeds and rollouts per arm; {args.eval_tasks} held-out synthetic seeds, greedy; one held-out "
                  f"task is {1 / args.eval_tasks:.3f} of success)")


if __name__ == "__main__":
    main()
