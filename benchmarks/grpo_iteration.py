"""Time of one GRPO iteration, split into generation and optimization; bf16 vs fp32 (measured).

One process, so the numbers are comparable on a shared machine: the G x K episodes are generated
once (``gen``), then the same samples are optimized once with bf16 autocast and once in fp32
(``opt``; one optimizer step each). The reward is replaced by an alternating 0/1 so that every
sequence has a non-zero advantage and is trained (real rewards often tie inside a group, and tied
groups are skipped), i.e. this is the worst case for the optimization time.

    .venv/bin/python benchmarks/grpo_iteration.py --model tiny
    .venv/bin/python benchmarks/grpo_iteration.py --model demo --groups 2 --samples 4 --max-steps 4
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trace_assets.agent.model import load_model  # noqa: E402
from trace_assets.envs import get_environment  # noqa: E402
from trace_assets.synthesize import SyntheticEnv, template_spec  # noqa: E402
from trace_assets.train.grpo import DEMO, GRPOTrainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny | demo | an HF id or folder")
    ap.add_argument("--capability", default="confirm_before_writing")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    args = ap.parse_args()

    target = get_environment("retail")
    env = SyntheticEnv(template_spec({"name": args.capability, "description": args.capability}, target), target)
    config = replace(DEMO, groups=args.groups, samples_per_group=args.samples, max_steps=args.max_steps,
                     max_new_tokens=args.max_new_tokens, micro_batch_size=args.micro_batch, iterations=1)
    model, tokenizer = load_model(args.model)
    counter = itertools.count()
    with tempfile.TemporaryDirectory() as out:
        trainer = GRPOTrainer(model, tokenizer, env, config, out, reward_fn=lambda r: float(next(counter) % 2))
        start = time.perf_counter()
        rollouts, samples = trainer.collect(1)
        gen = time.perf_counter() - start
        timings = {}
        for name, bf16 in (("bf16", True), ("fp32", False)):
            trainer.bf16 = bf16
            start = time.perf_counter()
            stats = trainer.optimize(samples, 1)
            timings[name] = time.perf_counter() - start
    generated = sum(r.n_generated for r in rollouts)
    trained = sum(len(s.token_ids) for s in samples)
    report = {
        "model": args.model, "episodes": len(rollouts), "generated_tokens": generated,
        "trained_sequence_tokens": trained, "loss_tokens": int(stats["loss_tokens"]),
        "gen_s": round(gen, 2), "opt_bf16_s": round(timings["bf16"], 2), "opt_fp32_s": round(timings["fp32"], 2),
        "fp32_over_bf16": round(timings["fp32"] / timings["bf16"], 2),
        "gen_tokens_per_s": round(generated / gen, 1),
        "opt_bf16_tokens_per_s": round(trained / timings["bf16"], 1),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
