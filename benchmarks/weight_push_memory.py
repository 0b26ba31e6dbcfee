"""Resident memory of a vLLM engine across GRPO-style weight pushes: push, generate, repeat.

GRPO's rollouts come from one vLLM engine whose weights are overwritten after every optimizer step
(``VLLMEngine.push_weights``, ``sync="weights"``). Each round here changes the LoRA's ``B`` (as a
step does), pushes the merged weights and generates 16 sampled completions of a 1,000-token prompt
(GRPO's group). RSS is read from ``/proc/self/statm`` after ``gc.collect`` and ``malloc_trim(0)``,
so what is left is held, not merely freed-but-mapped. A ``--rounds`` of generations without any
push, on the same engine first, is the baseline measured in the same run. Printed last: the growth per push-free round, the
first push's (a one-time cost) and each later push's. ``--vary`` gives every round a prompt of
another length, as GRPO's episodes have.

    .venv/bin/python benchmarks/weight_push_memory.py [--rounds 6] [--eager] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rss_gb() -> float:
    """This process's RSS in GiB, once what is freed has gone back to the OS."""
    from trace_assets.agent.model import release_memory

    release_memory()
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--eager", action="store_true", help="skip torch.compile (the tests' engines)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-gb", type=float, default=2.0)
    ap.add_argument("--vary", action="store_true",
                    help="a prompt of another length every round, as GRPO's episodes have (new kernel shapes)")
    args = ap.parse_args()

    import torch

    from trace_assets.agent.backends import SamplingParams
    from trace_assets.agent.lora import add_lora, lora_config
    from trace_assets.agent.model import ensure_demo_model, load_model
    from trace_assets.agent.vllm_backend import VLLMEngine, VLLMOptions

    path = str(ensure_demo_model())
    model, _ = load_model(path)
    peft_model = add_lora(model, lora_config(), seed=0)
    engine = VLLMEngine.shared(path, VLLMOptions(dtype=args.dtype, enforce_eager=args.eager, kv_cache_gb=args.kv_gb, enable_lora=False))
    def prompt(r: int) -> list[list[int]]:
        n = 1000 + (37 * r) % 400 if args.vary else 1000
        return [[(7 * i) % 4000 + 100 for i in range(n)]] * 16

    params = lambda r: SamplingParams(temperature=0.7, max_new_tokens=48, seed=r)  # noqa: E731
    engine.generate(prompt(0), params(0))
    rows = [("engine started, one generation", rss_gb(), 0.0)]
    for r in range(args.rounds):
        start = time.perf_counter()
        engine.generate(prompt(r + 1), params(r + 1))
        rows.append((f"no push, round {r + 1}", rss_gb(), time.perf_counter() - start))
    for r in range(args.rounds):
        with torch.no_grad():  # a step's worth of change: small, as training makes them
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn_like(p) * 1e-3)
        start = time.perf_counter()
        engine.push_weights(f"step{r + 1}", peft_model)
        engine.generate(prompt(100 + r), params(100 + r), weights=f"step{r + 1}")
        rows.append((f"push + generate, round {r + 1}", rss_gb(), time.perf_counter() - start))
    for name, value, seconds in rows:
        print(f"{name:34s} {value:6.2f} GB  {seconds:5.1f} s")
    n = args.rounds
    still = (rows[n][1] - rows[0][1]) / n
    first = rows[n + 1][1] - rows[n][1]
    later = (rows[2 * n][1] - rows[n + 1][1]) / max(n - 1, 1)
    print(f"growth per round: without a push {still * 1024:+.0f} MB; the first push {first * 1024:+.0f} MB "
          f"(the base's and the current weights, kept for exact restores), each later push {later * 1024:+.0f} MB")


if __name__ == "__main__":
    main()
