"""Peak RSS and time of the warm-start SFT under its memory options, each in a fresh process.

Same demos, same seed, same batch (one optimizer step per ``--batch-size`` demos): only
``micro_batch_size`` and ``gradient_checkpointing`` vary, so the loss curves must agree (they are
printed side by side). Peak RSS is the child's own ``ru_maxrss`` (model, data and training).

Variant ``trl`` runs the same SFT on TRL's ``SFTTrainer`` for comparison (``pip install
trl==1.16.0`` first; it is not a dependency): the same tokenized demos with their assistant masks
(``assistant_masks`` column, so the loss is on assistant tokens only), the same LoRA init, data
order (sequential over our shuffled order), AdamW (weight decay 0.01, as torch's default),
constant lr, grad-norm clip 1.0, bf16 autocast where we use it, and batch 4 as 1 x 4 gradient
accumulation (its lean setting).

    .venv/bin/python benchmarks/warmstart_memory.py [--model demo] [--demos 8] [--epochs 1] [--variants micro4,trl]
    .venv/bin/python benchmarks/warmstart_memory.py --longest --variants micro4+ckpt,micro2+ckpt   # the peak batches
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

VARIANTS = {  # name: (micro_batch_size, gradient_checkpointing)
    "micro4": (4, False),
    "micro1": (1, False),
    "micro4+ckpt": (4, True),
    "micro2+ckpt": (2, True),
    "micro1+ckpt": (1, True),
}


def demo_tasks(settings, env, n: int, longest: bool, max_length: int) -> list:
    """The first ``n`` of the profile's warm-start demo tasks, or (``longest``) the ``n`` whose expert
    demonstrations tokenize longest: the demo's heaviest batches, where its peak comes from."""
    from trace_assets.agent.model import load_tokenizer, resolve_model
    from trace_assets.agent.warmstart import demonstrations, tokenize_demo
    from trace_assets.envs.splits import make_splits

    tasks = make_splits(env, demo_per_family=settings.tasks.demo_per_family, train_per_family=0, test_per_family=0,
                        seed=settings.tasks.seed)["demo"]
    if not longest:
        return tasks[:n]
    tokenizer = load_tokenizer(resolve_model(settings.base_model))
    demos = demonstrations(env, tasks, confirm_rate=settings.warmstart.confirm_rate, seed=0)
    lengths = [len(tokenize_demo(tokenizer, d, env.tool_schemas(), max_length)[0]) for d in demos]
    return [t for _, t in sorted(zip(lengths, tasks), key=lambda x: -x[0])[:n]]


def child(model: str, demos: int, epochs: int, batch_size: int, micro: int, ckpt: bool, max_length: int,
          longest: bool) -> None:
    import resource

    from trace_assets.agent.warmstart import train_warmstart
    from trace_assets.envs import get_environment
    from trace_assets.settings import load_settings

    settings = load_settings()
    env = get_environment(settings.tasks.env)
    tasks = demo_tasks(settings, env, demos, longest, max_length)
    warm = settings.warmstart
    with tempfile.TemporaryDirectory() as out:
        report = train_warmstart(model, env, tasks, Path(out), epochs=epochs, lr=warm.lr,
                                 lora_r=warm.lora_r, lora_alpha=warm.lora_alpha, batch_size=batch_size,
                                 micro_batch_size=micro, confirm_rate=warm.confirm_rate, max_length=max_length,
                                 gradient_checkpointing=ckpt)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"train_time_s": report.train_time_s, "peak_rss_mb": round(peak_mb), "losses": report.losses,
                      "n_tokens": report.n_tokens, "n_target_tokens": report.n_target_tokens}))


def child_trl(model_source: str, demos: int, epochs: int, batch_size: int, max_length: int, longest: bool) -> None:
    import random
    import resource
    import time

    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from trace_assets.agent.lora import add_lora, bf16_supported, lora_config
    from trace_assets.agent.model import load_model, resolve_model
    from trace_assets.agent.warmstart import demonstrations, tokenize_demo
    from trace_assets.envs import get_environment
    from trace_assets.settings import load_settings

    settings = load_settings()
    env = get_environment(settings.tasks.env)
    tasks = demo_tasks(settings, env, demos, longest, max_length)
    warm, seed = settings.warmstart, 0
    torch.manual_seed(seed)  # as train_warmstart: same LoRA init
    model, tokenizer = load_model(resolve_model(model_source))
    examples = [tokenize_demo(tokenizer, d, env.tool_schemas(), max_length)
                for d in demonstrations(env, tasks, confirm_rate=warm.confirm_rate, seed=seed)]
    peft_model = add_lora(model, lora_config(r=warm.lora_r, alpha=warm.lora_alpha))
    rng, order = random.Random(seed), []
    for _ in range(epochs):  # train_warmstart's order, epoch by epoch
        epoch = list(range(len(examples)))
        rng.shuffle(epoch)
        order += epoch
    data = Dataset.from_list([{"input_ids": examples[i][0], "assistant_masks": examples[i][1]} for i in order])
    with tempfile.TemporaryDirectory() as out:
        config = SFTConfig(output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=batch_size,
                           num_train_epochs=1, learning_rate=warm.lr, lr_scheduler_type="constant", weight_decay=0.01,
                           max_grad_norm=1.0, optim="adamw_torch", bf16=bf16_supported(), use_cpu=True,
                           train_sampling_strategy="sequential", logging_steps=1, report_to=[], save_strategy="no",
                           max_length=max_length, dataloader_num_workers=0, seed=seed)
        trainer = SFTTrainer(model=peft_model, args=config, train_dataset=data, processing_class=tokenizer)
        start = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - start
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"train_time_s": round(train_s, 1), "peak_rss_mb": round(peak_mb), "losses": losses,
                      "n_tokens": sum(len(i) for i, _ in examples), "n_target_tokens": sum(sum(m) for _, m in examples)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--demos", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=3072)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--longest", action="store_true", help="the longest demos, not the first ones")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "trl":
        child_trl(args.model, args.demos, args.epochs, args.batch_size, args.max_length, args.longest)
        return
    if args.child:
        micro, ckpt = VARIANTS[args.child]
        child(args.model, args.demos, args.epochs, args.batch_size, micro, ckpt, args.max_length, args.longest)
        return
    rows = {}
    for name in args.variants.split(","):
        out = subprocess.run([sys.executable, __file__, "--child", name, "--model", args.model, "--demos", str(args.demos),
                              "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
                              "--max-length", str(args.max_length), *(["--longest"] if args.longest else [])],
                             check=True, stdout=subprocess.PIPE, text=True).stdout
        rows[name] = row = json.loads(out.strip().splitlines()[-1])
        first = next(iter(rows.values()))  # the baseline of the ratios, measured in this run
        print(f"{name:12s} peak RSS {row['peak_rss_mb']:6d} MB ({row['peak_rss_mb'] / first['peak_rss_mb']:.2f}x)  "
              f"train {row['train_time_s']:6.1f} s ({row['train_time_s'] / first['train_time_s']:.2f}x)  "
              f"losses {row['losses']}", flush=True)
    print(f"{first['n_tokens']} tokens, {first['n_target_tokens']} assistant tokens")


if __name__ == "__main__":
    main()
