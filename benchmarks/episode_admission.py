"""Greedy episodes with and without KV-cache admission (measured, not asserted).

``run_rollouts`` admits no more episodes than the backend's KV cache holds (``agent.rollout``,
"Admission"). This plays the same greedy base-agent episodes on one vLLM engine twice: every
episode at once (the runner before admission; the backend's capacity hidden from it) and admitted.
It prints wall time, generated tokens/s, the prompt tokens prefilled against those found in the
prefix cache, and whether both variants played token-identical episodes, with the ratio of their
wall times measured in this run. Train-side tasks only (never test).

Each variant's figures also go into ``<data>/reports/episode_admission.json`` (one entry per agent,
dtype, cache size, episode count and variant; a new run replaces its own entries and keeps the
others), from which ``trace readme`` generates the README's table. ``--budget-s`` stops a variant
at the first round after that many seconds; the entry then says it did not finish.

    .venv/bin/python benchmarks/episode_admission.py [--model PATH] [--per-family 6] [--kv-gb 2] [--dtype auto]
        [--order unbounded,admitted] [--budget-s SECONDS]
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table


class _Unbounded:
    """The same engine with its capacity hidden: every episode plays every round."""

    def __init__(self, backend):
        self.backend, self.name = backend, backend.name

    def generate(self, prompts, params):
        return self.backend.generate(prompts, params)


class _OverBudget(Exception):
    """A variant ran past ``--budget-s``; raised before its next round."""


def main() -> None:
    from trace_assets.agent.rollout import _common_prefix_length, run_rollouts
    from trace_assets.agent.vllm_backend import VLLMBackend, VLLMEngine, VLLMOptions
    from resources.models import ModelResource
    from trace_assets import reports
    from trace_assets.hashing import stable_hash
    from vllm_dtype import greedy_train_workload

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="agent folder (default: the latest base_agent)")
    parser.add_argument("--per-family", type=int, default=None, help="train tasks per family (default: the demo's)")
    parser.add_argument("--kv-gb", type=float, default=None, help="KV cache in GiB (default: the settings')")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--order", default="unbounded,admitted", help="variants, in the order they run")
    parser.add_argument("--budget-s", type=float, default=None, help="stop a variant after this many seconds")
    args = parser.parse_args()

    settings, path, env, tasks, tokenizer, config = greedy_train_workload(args.model, args.per_family)
    dtype = ModelResource(vllm_dtype=args.dtype).resolved_vllm_dtype()
    kv_gb = args.kv_gb or settings.generation.vllm_kv_cache_gb
    start = time.perf_counter()
    engine = VLLMEngine(path, VLLMOptions(enable_lora=False, dtype=dtype, kv_cache_gb=kv_gb))
    console = Console(width=200)
    console.print(f"engine: {dtype}, {kv_gb} GiB KV = {engine.kv_capacity_tokens:,} tokens, started in "
                  f"{time.perf_counter() - start:.1f} s; {len(tasks)} train tasks, {path}")
    rows, tokens_of = {}, {}
    for variant in args.order.split(","):
        engine.llm.reset_prefix_cache()
        engine.prompt_tokens = engine.cached_tokens = 0
        backend = VLLMBackend(engine)
        calls = []

        began = time.perf_counter()

        def record(prompts, params, _generate=backend.generate):
            if args.budget_s is not None and time.perf_counter() - began > args.budget_s:
                raise _OverBudget
            shared = _common_prefix_length(prompts)
            calls.append((len(prompts), shared + sum(len(p) - shared for p in prompts)))
            return _generate(prompts, params)

        backend.generate = record
        runner = backend if variant == "admitted" else _Unbounded(backend)
        try:
            rollouts = run_rollouts(env, tasks, runner, tokenizer, config)
        except _OverBudget:
            rollouts = None
        wall = time.perf_counter() - began
        entry = {"agent": str(path), "dtype": dtype, "kv_gb": kv_gb, "kv_tokens": engine.kv_capacity_tokens,
                 "episodes": len(tasks), "variant": variant, "finished": rollouts is not None,
                 "wall_s": round(wall, 1), "rounds": len(calls), "most_in_a_round": max(n for n, _ in calls),
                 "peak_round_tokens": max(t for _, t in calls), "prompt_tokens": engine.prompt_tokens,
                 "cached_tokens": engine.cached_tokens}
        if rollouts is None:
            console.print(f"{variant}: not finished after {wall:.1f} s (--budget-s {args.budget_s:g})")
        else:
            tokens_of[variant] = [r.token_ids for r in rollouts]
            generated = sum(r.n_generated for r in rollouts)
            entry |= {"generated": generated, "successes": sum(r.result.success for r in rollouts),
                      "episodes_hash": stable_hash(tokens_of[variant])}
            rows[variant] = entry
            console.print(f"{variant}: {wall:.1f} s")
        out = reports.record_admission(entry)
        console.print(f"recorded in {out}")
    if not rows:
        return
    first = next(iter(tokens_of.values()))
    table = Table(title=f"greedy base-agent episodes, {len(tasks)} train tasks, vLLM {dtype}, KV {engine.kv_capacity_tokens:,} tokens")
    for column in ("variant", "wall (s)", "generated", "tok/s", "prompt tokens", "prefilled", "cache hits",
                   "rounds", "most in a round", "peak prompt tokens", "success", "same episodes", "wall / first"):
        table.add_column(column, justify="right")
    base_wall = next(iter(rows.values()))["wall_s"]
    for variant, e in rows.items():
        prompt, cached = e["prompt_tokens"], e["cached_tokens"]
        table.add_row(variant, f"{e['wall_s']:.1f}", str(e["generated"]), f"{e['generated'] / e['wall_s']:.1f}",
                      f"{prompt:,}", f"{prompt - cached:,}", f"{cached / max(prompt, 1):.1%}", str(e["rounds"]),
                      str(e["most_in_a_round"]), f"{e['peak_round_tokens']:,}", f"{e['successes']}/{e['episodes']}",
                      "yes" if tokens_of[variant] == first else "no", f"{e['wall_s'] / base_wall:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
