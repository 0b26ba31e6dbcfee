"""Episodes per second with the scripted experts: tau2_airline through its MCP server against the
in-process retail environment, measured in one run (machines differ; the ratio is what travels).

Each side plays its scripted expert over its tasks (airline: the gold-replay expert on the official
train + test tasks; retail: the retail expert on the same number of seeded tasks), so every
episode does real tool calls and is graded. Airline time is split into the episodes (reset, tool
calls, user turns, reading the final state) and the one-off gold-database replays, which the
environment caches per task.

Then the same for Step 2's episodes (``--synthetic N``): the full expert on N decision-point tasks
of each target's ``confirm_before_writing`` environment (the template spec; its prefix, the
agent's window and the rubric), through ``SyntheticEnv`` over each target.

    .venv/bin/python benchmarks/mcp_throughput.py [--episodes 50] [--synthetic 20]
"""

from __future__ import annotations

import argparse
import time

from trace_assets.envs import get_environment
from trace_assets.envs.retail.expert import demonstrate as retail_demonstrate
from trace_assets.envs.splits import make_splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--synthetic", type=int, default=20, help="decision-point episodes per target (0: skip)")
    args = parser.parse_args()

    airline = get_environment("tau2_airline")
    tasks = (airline.splits["train"] + airline.splits["test"])[: args.episodes]
    start = time.perf_counter()
    airline.tool_schemas()
    t_start = time.perf_counter() - start
    start = time.perf_counter()
    for task in tasks:
        airline.gold_db_hash(task)
    t_gold = time.perf_counter() - start
    start = time.perf_counter()
    calls = ok = 0
    for task in tasks:
        messages, result = airline.demonstrate(task)
        calls += sum(1 for m in messages if m["role"] == "tool")
        ok += result.success
    t_air = time.perf_counter() - start
    synthetic = {"tau2_airline": _synthetic_rate(airline, args.synthetic)} if args.synthetic else {}
    airline.close()

    retail = get_environment("retail")
    per_family = max(1, -(-len(tasks) // len(retail.families())))
    rtasks = make_splits(retail, demo_per_family=0, train_per_family=per_family, test_per_family=0, seed=0)["train"][: len(tasks)]
    start = time.perf_counter()
    rcalls = rok = 0
    for task in rtasks:
        messages, result = retail_demonstrate(retail, task)
        rcalls += sum(1 for m in messages if m["role"] == "tool")
        rok += result.success
    t_ret = time.perf_counter() - start

    print(f"server start + tools/list: {t_start:.2f} s; gold replays: {len(tasks)} tasks in {t_gold:.1f} s")
    print(f"tau2_airline via MCP: {len(tasks)} episodes, {calls} tool calls, {ok} at reward 1, {t_air:.1f} s "
          f"-> {len(tasks) / t_air:.2f} episodes/s, {1000 * t_air / max(calls, 1):.0f} ms per tool call (episode cost included)")
    print(f"retail in-process:    {len(rtasks)} episodes, {rcalls} tool calls, {rok} at reward 1, {t_ret:.2f} s "
          f"-> {len(rtasks) / t_ret:.1f} episodes/s")
    print(f"ratio retail/airline (episodes/s): {(len(rtasks) / t_ret) / (len(tasks) / t_air):.0f}x")
    if synthetic:
        synthetic["retail"] = _synthetic_rate(retail, args.synthetic)
        for name, (n, seconds, calls, ok) in synthetic.items():
            print(f"E_confirm_before_writing over {name}: {n} decision-point episodes, {calls} tool calls "
                  f"(prefix included), {ok} at reward 1, {seconds:.2f} s -> {n / seconds:.2f} episodes/s")
        (na, sa, _, _), (nr, sr, _, _) = synthetic["tau2_airline"], synthetic["retail"]
        print(f"ratio retail/airline (decision-point episodes/s): {(nr / sr) / (na / sa):.0f}x")


def _synthetic_rate(target, n: int) -> tuple[int, float, int, int]:
    """(episodes, seconds, tool calls, at reward 1) of the full expert on ``n`` tasks of the
    target's template ``confirm_before_writing`` environment (spec and tasks built before timing)."""
    from trace_assets.envs.base import target_hook
    from trace_assets.identify.heuristic import RULES
    from trace_assets.synthesize import SyntheticEnv, template_spec

    rule = RULES["confirm_before_writing"]
    env = SyntheticEnv(template_spec({"name": rule.name, "description": rule.description}, target), target)
    tasks = env.sample_tasks(n)
    expert = target_hook(target, "expert")
    start = time.perf_counter()
    calls = ok = 0
    for task in tasks:
        messages, result = expert(task, via=env)
        calls += sum(1 for m in messages if m["role"] == "tool")
        ok += result.reward == 1.0
    return len(tasks), time.perf_counter() - start, calls, ok


if __name__ == "__main__":
    main()
