"""
A tiny Llama with untied input embeddings trained under 2-process gloo DDP with GRPOTrainer's defaults, next to the
same run with compression off (run by tests/test_distributed.py under torchrun).

The layout of most Llama, Mistral and Qwen models above 1B: the input embedding rows of tokens absent from a batch
get no gradient, so their error-feedback residuals decay step after step (the codec once made NaN of them after
about 15 steps, and every later step was skipped). The vocabulary is 8 times a step's tokens, and the tokens follow a
Zipf law, so that most rows are seen once in a while. Each rank writes, per run: whether DDP wrapped the model, the
hook's calls, the steps skipped as non-finite, the eval loss.

Usage: torchrun --nproc_per_node 2 untied_llama.py OUT_DIR [STEPS]
"""

import math
import os
import sys

import torch
import torch.distributed as dist
from _common import same_on_all_ranks, write_result
from datasets import Dataset
from testing_utils import end_worker, tiny_test_llama
from torch.nn.parallel import DistributedDataParallel

from grpo_hf import GRPOConfig, GRPOTrainer


VOCAB, SEQ_LEN, BATCH = 2048, 32, 4  # a step: 2 ranks x 4 x 32 = 256 tokens, an eighth of the vocabulary


def zipf_sequences(rows: int, seed: int) -> Dataset:
    """Learnable sequences (each token the previous one plus 1 or 2) starting at Zipf-distributed tokens."""
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    starts = torch.multinomial(weights, rows, replacement=True, generator=generator).view(rows, 1)
    steps = torch.randint(1, 3, (rows, SEQ_LEN - 1), generator=generator)
    ids = (torch.cat([starts, starts + steps.cumsum(1)], dim=1) % VOCAB).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def train(out_dir: str, name: str, steps: int, **grpo) -> dict:
    model = tiny_test_llama(seed=0, vocab_size=VOCAB, max_position_embeddings=SEQ_LEN, tie_word_embeddings=False)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    args = GRPOConfig(
        output_dir=os.path.join(out_dir, name), use_cpu=True, max_steps=steps, per_device_train_batch_size=BATCH,
        learning_rate=3e-3, warmup_steps=5, logging_steps=10, save_strategy="no", report_to=[], seed=0,
        disable_tqdm=True, dataloader_num_workers=0, per_device_eval_batch_size=32, **grpo,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, args=args, train_dataset=zipf_sequences(4096, seed=1),
                          eval_dataset=zipf_sequences(256, seed=2))  # fmt: skip
    trainer.train()
    comm = trainer.grpo_comm_state
    record = {
        "is_ddp": isinstance(trainer.model_wrapped, DistributedDataParallel),
        "compression": trainer.grpo_compression,
        "hook_calls": comm.hook_calls if comm is not None else 0,
        "compressed_steps": comm.totals()["steps"] - comm.totals()["dense_steps"] if comm is not None else 0,
        "skipped_steps": trainer.grpo_callback.nonfinite_steps,
        "global_step": trainer.state.global_step,
        "eval_loss": trainer.evaluate()["eval_loss"],
        "identical": same_on_all_ranks(torch.cat([p.detach().reshape(-1) for p in model.parameters()])),
    }
    trainer.accelerator.free_memory()
    return record


def main(out_dir: str, steps: int) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result = {
        "world_size": dist.get_world_size(),
        "dense": train(out_dir, "dense", steps, grpo_compression="none"),
        "default": train(out_dir, "default", steps),  # GRPOTrainer's defaults: 8-bit codes under DDP
    }
    result["ppl_ratio"] = math.exp(result["default"]["eval_loss"] - result["dense"]["eval_loss"])
    write_result(out_dir, result)
    end_worker(barrier=False)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 80)
