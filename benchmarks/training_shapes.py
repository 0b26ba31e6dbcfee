"""Resident memory of a LoRA training process across optimizer steps: shape buckets against
exact lengths, each in a fresh process.

Each child loads the demo model with a LoRA (gradient checkpointing, bf16 autocast where the CPU
has it, as GRPO trains) and runs ``--steps`` optimizer steps of 4 micro-batches of 2 rows, every
micro-batch a new length between 200 and 900 tokens, as GRPO's episodes are. After each step it
reads its RSS after ``gc.collect`` and ``malloc_trim(0)``: what is left is held, not merely freed.
``bucket 1`` is the lengths as they come (``SHAPE_BUCKET`` patched to 1), the baseline measured
in the same run, then each other bucket of ``--buckets``. Printed: each child's RSS per step, its growth per
step after the first, and the time ratio.

    .venv/bin/python benchmarks/training_shapes.py [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def child(bucket: int, steps: int) -> None:
    import torch

    from trace_assets.agent import lora
    from trace_assets.agent.lora import add_lora, autocast, bf16_supported, enable_gradient_checkpointing, lora_config
    from benchmarks.weight_push_memory import rss_gb
    from trace_assets.agent.model import ensure_demo_model, load_model

    lora.SHAPE_BUCKET = bucket
    model, _ = load_model(str(ensure_demo_model()))
    peft_model = add_lora(model, lora_config(), seed=0)
    enable_gradient_checkpointing(peft_model)
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for step in range(steps):
        start = time.perf_counter()
        for micro in range(4):
            n = 200 + (97 * (step * 4 + micro)) % 700
            ids = torch.randint(100, 4000, (2, n), generator=generator)
            target = torch.zeros_like(ids)
            target[:, n // 2:] = 1
            with autocast(bf16_supported()):
                loss = -lora.token_logprobs(peft_model, ids, torch.ones_like(ids), target).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        rows.append({"rss_gb": round(rss_gb(), 3), "seconds": round(time.perf_counter() - start, 1)})
    print(json.dumps(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--buckets", default="1,64,128", help="the first is the baseline of the time ratios")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return child(args.child, args.steps)
    results = {}
    buckets = [int(b) for b in args.buckets.split(",")]
    for bucket in buckets:
        out = subprocess.run([sys.executable, __file__, "--child", str(bucket), "--steps", str(args.steps)],
                             check=True, capture_output=True, text=True).stdout
        results[bucket] = json.loads(out.strip().splitlines()[-1])
    for bucket, rows in results.items():
        growth = (rows[-1]["rss_gb"] - rows[0]["rss_gb"]) / max(len(rows) - 1, 1)
        print(f"bucket {bucket:3d}: RSS by step {[r['rss_gb'] for r in rows]} GB, "
              f"growth per step after the first {growth * 1024:+.0f} MB, {sum(r['seconds'] for r in rows):.0f} s")
    base = sum(r["seconds"] for r in results[buckets[0]])
    for bucket in buckets[1:]:
        print(f"time, bucket {bucket} / bucket {buckets[0]}: {sum(r['seconds'] for r in results[bucket]) / base:.2f}")


if __name__ == "__main__":
    main()
