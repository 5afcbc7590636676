"""Quality benchmark of importance-based LR scaling: plain `Trainer` vs `GRPOTrainer` (no compression).

    python -m benchmarks.bench_importance --output_dir runs/bench_importance            # ~6 min on 2 CPU cores
    python -m benchmarks.bench_importance --max_steps 20 --seeds 0 --output_dir /tmp/b  # smoke run

Same tiny Llama (trained from scratch), same data (the Python standard library's source, hash split), same seeds
and steps for every row. Rows: the plain Trainer, and GRPOTrainer with each importance score (`article`, `rms`)
and multiplier bounds. Prints one markdown table of held-out loss and perplexity (mean over seeds) and the ratio
to the Trainer's, and writes `results.json`. The defaults of GRPOConfig are the best row we measured; the
README and CHANGELOG quote this script's output.
"""

import gc
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import HfArgumentParser, Trainer, TrainingArguments, set_seed

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.harness.corpus import build_lm_datasets, load_stdlib_texts, train_bpe_tokenizer
from grpo_hf.harness.models import tiny_llama


@dataclass
class BenchArguments:
    output_dir: str = field(default="runs/bench_importance", metadata={"help": "Where results.json goes."})
    max_steps: int = field(default=150, metadata={"help": "Optimizer steps per run."})
    seeds: str = field(default="0,1", metadata={"help": "Comma-separated seeds; figures are means over seeds."})
    learning_rate: float = field(default=2e-3, metadata={"help": "Peak learning rate (cosine, 10 warm-up steps)."})
    batch_size: int = field(default=16, metadata={"help": "Sequences per step."})
    seq_len: int = field(default=128, metadata={"help": "Tokens per sequence."})
    vocab_size: int = field(default=4096, metadata={"help": "Byte-level BPE vocabulary trained on the corpus."})
    hidden_size: int = field(default=128, metadata={"help": "Width of the tiny Llama."})
    layers: int = field(default=4, metadata={"help": "Layers of the tiny Llama."})
    eval_tokens: int = field(default=65536, metadata={"help": "Held-out tokens for perplexity."})
    variants: str = field(
        default="article:0.9:1.1,article:0.5:2.0,rms:0.5:2.0,article:0.8:1.25,rms:0.8:1.25",
        metadata={"help": "GRPO rows as score:lr_scale_min:lr_scale_max, comma-separated."},
    )


def run_one(bench: BenchArguments, tokenizer, train, evaluation, seed: int, variant: str | None) -> dict:
    common = dict(
        output_dir=os.path.join(bench.output_dir, "tmp"),
        max_steps=bench.max_steps,
        learning_rate=bench.learning_rate,
        per_device_train_batch_size=bench.batch_size,
        per_device_eval_batch_size=32,
        lr_scheduler_type="cosine",
        warmup_steps=10,
        weight_decay=0.1,
        logging_steps=min(25, bench.max_steps),
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=seed,
        data_seed=seed,
        disable_tqdm=True,
    )
    model = tiny_llama(
        len(tokenizer),
        hidden_size=bench.hidden_size,
        layers=bench.layers,
        seq_len=bench.seq_len,
        seed=seed,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    set_seed(seed)
    if variant is None:
        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=train, eval_dataset=evaluation)
    else:
        score, low, high = variant.split(":")
        args = GRPOConfig(
            **common,
            grpo_importance=True,  # off by default: without it the multipliers would be computed but never applied
            grpo_importance_score=score,
            grpo_lr_scale_min=float(low),
            grpo_lr_scale_max=float(high),
            grpo_compression="none",
            grpo_log_groups=True,  # the row reads grpo/lr_scale/<group>
        )
        trainer = GRPOTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    eval_loss = trainer.evaluate()["eval_loss"]
    row = {"variant": variant or "Trainer", "seed": seed, "eval_loss": eval_loss, "seconds": seconds}
    if variant is not None:
        last = [h for h in trainer.state.log_history if "loss" in h][-1]
        row["lr_scale"] = {k.split("/")[-1]: v for k, v in last.items() if k.startswith("grpo/lr_scale/")}
        row["load_balance_std"] = last["grpo/load_balance_std"]
    del trainer, model
    gc.collect()
    return row


def main():
    (bench,) = HfArgumentParser(BenchArguments).parse_args_into_dataclasses()
    seeds = [int(s) for s in bench.seeds.split(",")]
    tokenizer = train_bpe_tokenizer(load_stdlib_texts(split="train"), vocab_size=bench.vocab_size)
    tokens = bench.max_steps * bench.batch_size * bench.seq_len
    train, evaluation, info = build_lm_datasets(
        tokenizer, seq_len=bench.seq_len, max_train_tokens=tokens, max_eval_tokens=bench.eval_tokens
    )
    rows = []
    for seed in seeds:
        for variant in [None, *bench.variants.split(",")]:
            row = run_one(bench, tokenizer, train, evaluation, seed, variant)
            print(f"seed {seed} {row['variant']:<20} eval_loss {row['eval_loss']:.4f} ({row['seconds']:.0f} s)")
            rows.append(row)
    summary = {}
    for row in rows:
        summary.setdefault(row["variant"], []).append(row["eval_loss"])
    baseline_ppl = math.exp(sum(summary["Trainer"]) / len(summary["Trainer"]))
    lines = ["| run | eval loss | perplexity | ratio to Trainer |", "|---|---|---|---|"]
    for variant, losses in summary.items():
        loss = sum(losses) / len(losses)
        lines.append(f"| {variant} | {loss:.4f} | {math.exp(loss):.2f} | {math.exp(loss) / baseline_ppl:.3f} |")
    table = "\n".join(lines)
    print(f"\n{bench.max_steps} steps, seeds {seeds}, corpus {info}\n\n{table}")
    Path(bench.output_dir).mkdir(parents=True, exist_ok=True)
    result = {"arguments": vars(bench), "corpus": info, "rows": rows, "table": table}
    Path(bench.output_dir, "results.json").write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
