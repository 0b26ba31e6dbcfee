"""Episodes per second with the scripted experts: tau2_airline through its MCP server against the
in-process retail environment, measured in one run (machines differ; the ratio is what travels).

Each side plays its scripted expert over its tasks (airline: the gold-replay expert on the official
train + test tasks; retail: the retail expert on the same number of seeded tasks), so every
episode does real tool calls and is graded. Airline time is split into the episodes (reset, tool
calls, user turns, reading the final state) and the one-off gold-database replays, which the
environment caches per task.

    .venv/bin/python benchmarks/mcp_throughput.py [--episodes 50]
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


if __name__ == "__main__":
    main()
