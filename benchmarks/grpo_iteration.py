"""Time of one GRPO iteration, split into generation and optimization; bf16 vs fp32 (measured).

One process, so the numbers are comparable on a shared machine: the G x K episodes are generated
once (``gen``), then the same samples are optimized with bf16 autocast (micro-batches grouped by
task, ``prefix_micro_batches``, the default), with bf16 sorted by length alone (the previous
layout), and in fp32 (``opt``; one optimizer step each); the ratios are printed. The reward is replaced by an alternating 0/1 so that every
sequence has a non-zero advantage and is trained (real rewards often tie inside a group, and tied
groups are skipped), i.e. this is the worst case for the optimization time.

``--backends transformers,vllm,vllm-lora`` repeats the iteration per generation backend (same
seeds) and then generates iteration 2, after the optimizer step, which on vLLM includes pushing the
new policy into the running engine: ``vllm`` writes the merged weights ``W + BA`` into the base
engine (``sync="weights"``, the pipeline's choice), ``vllm-lora`` hot-loads the adapter as a new
LoRA request (``sync="lora"``). It prints the generation time per backend and the ratio to the first.

    .venv/bin/python benchmarks/grpo_iteration.py --model tiny
    .venv/bin/python benchmarks/grpo_iteration.py --model demo --groups 2 --samples 4 --max-steps 4
    .venv/bin/python benchmarks/grpo_iteration.py --model demo --backends transformers,vllm,vllm-lora
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
from trace_assets.settings import DEMO_GRPO as DEMO  # noqa: E402
from trace_assets.train.grpo import GRPOTrainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny | demo | an HF id or folder")
    ap.add_argument("--capability", default="confirm_before_writing")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--backends", default="transformers", help="comma list of: transformers, vllm, vllm-lora")
    ap.add_argument("--vllm-eager", action="store_true")
    args = ap.parse_args()

    from trace_assets.agent.model import resolve_model

    target = get_environment("retail")
    env = SyntheticEnv(template_spec({"name": args.capability, "description": args.capability}, target), target)
    config = replace(DEMO, groups=args.groups, samples_per_group=args.samples, max_steps=args.max_steps,
                     max_new_tokens=args.max_new_tokens, micro_batch_size=args.micro_batch, iterations=2)
    rows = []
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        factory = None
        if backend in ("vllm", "vllm-lora"):
            from trace_assets.agent.vllm_backend import VLLMBackend, VLLMEngine, VLLMOptions

            lora = backend == "vllm-lora"
            engine = VLLMEngine.shared(resolve_model(args.model), VLLMOptions(enforce_eager=args.vllm_eager, enable_lora=lora))
            sync = "lora" if lora else "weights"
            factory = lambda peft_model, tok, sync=sync: VLLMBackend(engine, peft_model=peft_model, sync=sync)  # noqa: E731
        model, tokenizer = load_model(args.model)
        counter = itertools.count()
        with tempfile.TemporaryDirectory() as out:
            trainer = GRPOTrainer(model, tokenizer, env, config, out, reward_fn=lambda r: float(next(counter) % 2),
                                  backend_factory=factory)
            start = time.perf_counter()
            rollouts, samples = trainer.collect(1)
            gen = time.perf_counter() - start
            timings = {}
            variants = (("bf16", True, True), ("bf16_length_sorted", True, False), ("fp32", False, True))
            for name, bf16, grouped in variants if not rows else variants[:1]:
                trainer.bf16 = bf16
                trainer.config = replace(config, prefix_micro_batches=grouped)
                start = time.perf_counter()
                stats = trainer.optimize(samples, 1)
                timings[name] = time.perf_counter() - start
            start = time.perf_counter()
            rollouts2, _ = trainer.collect(2)  # after the optimizer step: vLLM hot-loads the adapter
            gen2 = time.perf_counter() - start
        generated = sum(r.n_generated for r in rollouts)
        trained = int(stats["sequence_tokens"])  # the trained samples' tokens, prompts included
        report = {
            "backend": backend, "model": args.model, "episodes": len(rollouts), "generated_tokens": generated,
            "trained_sequence_tokens": trained, "loss_tokens": int(stats["loss_tokens"]),
            "gen_s": round(gen, 2), "gen_tokens_per_s": round(generated / gen, 1),
            "gen_iter2_s": round(gen2, 2), "gen_iter2_tokens_per_s": round(sum(r.n_generated for r in rollouts2) / gen2, 1),
            "opt_bf16_s": round(timings["bf16"], 2), "opt_bf16_tokens_per_s": round(trained / timings["bf16"], 1),
        }
        if "fp32" in timings:
            report.update(opt_fp32_s=round(timings["fp32"], 2), fp32_over_bf16=round(timings["fp32"] / timings["bf16"], 2),
                          opt_bf16_length_sorted_s=round(timings["bf16_length_sorted"], 2),
                          length_sorted_over_prefix_grouped=round(timings["bf16_length_sorted"] / timings["bf16"], 2))
        if backend.startswith("vllm"):
            report["adapter_syncs"] = trainer.backend.syncs
        rows.append(report)
        print(json.dumps(report, indent=1), flush=True)
    if len(rows) > 1:
        first = rows[0]
        for row in rows[1:]:
            print(f"generation tok/s {row['backend']} vs {first['backend']}: iteration 1 "
                  f"x{row['gen_tokens_per_s'] / first['gen_tokens_per_s']:.2f}, iteration 2 (after the step) "
                  f"x{row['gen_iter2_tokens_per_s'] / first['gen_iter2_tokens_per_s']:.2f}")


if __name__ == "__main__":
    main()
