"""
The peers that run their own code against GRPO's rows of the same algorithm (run by tests/test_peers.py).

Each row goes through the comm suite's own `run_row` (`benchmarks/suite.py`), on a tiny task built here so that no
corpus is read: a Llama of 0.1M parameters with untied embeddings, fine-tuned 14 steps on synthetic sequences (a
noisy Markov chain over 256 tokens), 2 gloo ranks, H = 4 (syncs after steps 4, 8 and 12, and the final one after step
14: off the grid, so that the peers' end of training is exercised). Rank 0 writes `results.json`: the groups below
and, per row, its eval loss, training losses and bytes.

Groups of rows that run the same algorithm (`GROUPS`):

- plain fp32 averaging every 4 steps: GRPO's `localsgd-h4`, torchft's `DiLoCo` at outer lr 1 without momentum,
  accelerate's `LocalSGD`;
- DiLoCo's outer step (lr 0.7, Nesterov 0.9) on fp32 Δ: GRPO's `sync4-fp32-noramp-lr0.7-m0.9` and torchft's;
- two fragments syncing in turn (Streaming DiLoCo without overlap): GRPO's `sync4-fp32-f2-noramp-lr1-m0` and
  torchft's.

Usage: torchrun --nproc_per_node 2 peers_agreement.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset
from testing_utils import end_worker

from benchmarks import suite
from benchmarks.tasks import Task


GROUPS = {
    "plain averaging": ["localsgd-h4", "torchft-diloco-h4-lr1-m0", "accelerate-localsgd-h4"],
    "DiLoCo's outer step": ["sync4-fp32-noramp-lr0.7-m0.9", "torchft-diloco-h4-lr0.7-m0.9"],
    "fragments": ["sync4-fp32-f2-noramp-lr1-m0", "torchft-diloco-h4-f2-lr1-m0"],
}
VOCAB, SEQ_LEN = 256, 32
TASK = Task(
    "peers-tiny", "lm", "tiny-llama", False, max_steps=14, batch_size=8, seq_len=SEQ_LEN, learning_rate=3e-3,
    warmup_steps=2, shape={"hidden_size": 32, "layers": 2, "heads": 4, "vocab_size": VOCAB, "tie": False},
)  # fmt: skip
INFO = {"vocab_size": VOCAB, "eos_token_id": 0, "pad_token_id": 1}


def markov_tokens(rows: int, seed: int) -> Dataset:
    """Sequences of a noisy Markov chain: each token is `(5 x + 3 + e) mod 256` of the one before, `e` in {0, 1, 2}."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.empty(rows, SEQ_LEN, dtype=torch.long)
    ids[:, 0] = torch.randint(0, VOCAB, (rows,), generator=gen)
    for t in range(1, SEQ_LEN):
        ids[:, t] = (5 * ids[:, t - 1] + 3 + torch.randint(0, 3, (rows,), generator=gen)) % VOCAB
    ids = ids.tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * SEQ_LEN] * rows, "labels": ids})


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train, evaluation = markov_tokens(TASK.max_steps * TASK.batch_size, seed=1), markov_tokens(64, seed=2)
    results = {}
    for rows in GROUPS.values():
        for name in rows:
            record = suite.run_row(TASK, INFO, suite.parse_row("comm", name), 0, train, evaluation, out_dir, 2)
            results[name] = {
                "eval_loss": record["eval_loss"],
                "train_loss": record["train_loss"],
                "bytes": sum(step["bytes"] for step in record["per_step"]),
            }
    if dist.get_rank() == 0:
        Path(out_dir, "results.json").write_text(json.dumps({"groups": GROUPS, "rows": results}, indent=1))
    end_worker()


if __name__ == "__main__":
    main(sys.argv[1])
