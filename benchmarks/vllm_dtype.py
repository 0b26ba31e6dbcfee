"""Greedy rollouts of the base agent in vLLM fp32 and bf16, as the pipeline plays them.

The train split's tasks (never test), greedy, up to 50 steps: what ``base_trajectories`` does. One
fresh engine per dtype (engine start reported apart); prints wall time, generated tokens, success,
and the bf16 / fp32 speed ratio measured in this run. ``--model`` defaults to the latest
``base_agent`` materialization of the instance (``make demo`` first), else the raw demo model.

    .venv/bin/python benchmarks/vllm_dtype.py [--model PATH] [--per-family 6]
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table


def greedy_train_workload(model: str | None, per_family: int | None):
    """``(settings, agent folder, env, train tasks, tokenizer, greedy rollout config)``: what
    ``base_trajectories`` plays on the train split (never test), for the rollout benchmarks."""
    from trace_assets.agent.model import load_tokenizer
    from trace_assets.cli import served_base_model
    from trace_assets.envs import get_environment
    from trace_assets.envs.splits import configured_splits
    from trace_assets.route.evaluation import greedy_rollout_config
    from trace_assets.settings import load_settings

    settings = load_settings()
    path = model or served_base_model()
    env = get_environment(settings.tasks.env)
    tasks = configured_splits(env, settings.tasks, train_per_family=per_family or settings.tasks.train_per_family)["train"]
    return settings, path, env, tasks, load_tokenizer(path), greedy_rollout_config(settings)


def main() -> None:
    from trace_assets.agent.rollout import run_rollouts
    from trace_assets.agent.vllm_backend import VLLMBackend, VLLMEngine, VLLMOptions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="agent folder (default: the latest base_agent)")
    parser.add_argument("--per-family", type=int, default=None, help="train tasks per family (default: the demo's)")
    args = parser.parse_args()

    settings, path, env, tasks, tokenizer, config = greedy_train_workload(args.model, args.per_family)
    rows = {}
    for dtype in ("float32", "bfloat16"):
        start = time.perf_counter()
        engine = VLLMEngine(path, VLLMOptions(enable_lora=False, dtype=dtype, kv_cache_gb=settings.generation.vllm_kv_cache_gb))
        started = time.perf_counter()
        rollouts = run_rollouts(env, tasks, VLLMBackend(engine), tokenizer, config)
        wall = time.perf_counter() - started
        tokens = sum(r.n_generated for r in rollouts)
        rows[dtype] = (started - start, wall, tokens, sum(r.result.success for r in rollouts), len(rollouts))
        del engine

    table = Table(title=f"greedy base-agent rollouts, {len(tasks)} train tasks, {path}")
    for column in ("dtype", "engine start (s)", "rollouts (s)", "generated tokens", "tok/s", "success"):
        table.add_column(column, justify="right")
    for dtype, (start_s, wall, tokens, wins, n) in rows.items():
        table.add_row(dtype, f"{start_s:.1f}", f"{wall:.1f}", str(tokens), f"{tokens / wall:.0f}", f"{wins}/{n}")
    console = Console()
    console.print(table)
    ratio = rows["float32"][1] / rows["bfloat16"][1]
    console.print(f"bf16 vs fp32 wall time: {ratio:.2f}x faster (same tasks, same run)")


if __name__ == "__main__":
    main()
