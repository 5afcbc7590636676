"""
A worker killed in the middle of a checkpoint save, and the restart that resumes the run (run by
tests/test_reliability.py under `torchrun --nproc_per_node 2 --max-restarts 1`).

Two runs with the same checkpoint schedule (every 4 of 12 steps), both started with `resume_from_checkpoint="last"`
as `grpo-hf train --resume_from_checkpoint last` would start them:

- `straight`: never interrupted (after the restart it resumes from its own final checkpoint and trains 0 steps);
- `killed`: in the first attempt, rank 1 SIGKILLs itself while saving checkpoint-8, after the Trainer's files and
  before its GRPO state file. torchrun stops rank 0 and restarts both; `"last"` skips the incomplete checkpoint-8 and
  resumes from checkpoint-4.

Each rank writes, per run, the checkpoint it resumed from, the restart count and digests of its parameters and
compression residuals; rank 0 saves the final parameters of both runs for `torch.equal` on the pytest side.

Usage: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node 2 --max-restarts 1 --rdzv-backend c10d \
    --rdzv-endpoint 127.0.0.1:PORT killed_worker.py OUT_DIR   (see the test for why)
"""

import gc
import os
import signal
import sys

import torch
import torch.distributed as dist
from _common import tensor_digest, write_result
from datasets import Dataset
from testing_utils import end_worker, tiny_test_llama
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.checkpoints import resolve_resume_checkpoint


SEQ_LEN = 16
KILL_AT_SAVE = 8
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
SYNC_EVERY = int(os.environ.get("GRPO_TEST_SYNC_EVERY", "1"))  # > 1: the sync every H steps, in 2 fragments
SYNC_DELAY = int(os.environ.get("GRPO_TEST_SYNC_DELAY", "0"))  # > 0: the exchange runs behind (step 8 starts one)


class KillDuringSave(TrainerCallback):
    """Rank 1, first attempt only: SIGKILL at the save of step `KILL_AT_SAVE`, before GRPOCallback writes its file."""

    def on_save(self, args, state, control, **kwargs):
        if RESTART == 0 and dist.get_rank() == 1 and state.global_step == KILL_AT_SAVE:
            os.kill(os.getpid(), signal.SIGKILL)


def random_tokens(n=256):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (n, SEQ_LEN), generator=gen).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def run(out_dir, name, callbacks=()):
    args = GRPOConfig(
        output_dir=os.path.join(out_dir, name),
        use_cpu=True,  # required: without it both ranks train alone, without DDP
        max_steps=12,
        save_strategy="steps",
        save_steps=4,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        logging_steps=4,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        grpo_compression="quantize",
        grpo_min_compress_numel=256,
        grpo_importance=True,  # the multipliers are applied, so replicas could drift
        grpo_lr_scale_warmup_steps=2,
        grpo_sync_every=SYNC_EVERY,
        grpo_sync_fragments=2 if SYNC_EVERY > 1 else 1,
        grpo_sync_delay=SYNC_DELAY,
    )
    model = tiny_test_llama(seed=0, max_position_embeddings=SEQ_LEN)
    # callbacks passed here run before GRPOCallback (added by GRPOTrainer after the Trainer's own)
    trainer = GRPOTrainer(model=model, args=args, train_dataset=random_tokens(), callbacks=list(callbacks))
    resumed_from = resolve_resume_checkpoint(args.output_dir, "last")
    trainer.train(resume_from_checkpoint="last")
    comm = trainer.grpo_comm_state
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    record = {
        "is_ddp": isinstance(trainer.model_wrapped, DistributedDataParallel),
        "resumed_from": os.path.basename(resumed_from) if resumed_from else None,
        "global_step": trainer.state.global_step,
        "restart": RESTART,
        "digest": tensor_digest(params.values()),
        "residual_digest": tensor_digest([v for _, v in sorted(comm.state_dict()["residuals"].items())]),  # by name
        "hook_steps": comm.step,
    }
    trainer.accelerator.free_memory()
    del trainer
    gc.collect()
    return record, params


def main():
    out_dir = sys.argv[1]
    straight, straight_params = run(out_dir, "straight")
    killed, killed_params = run(out_dir, "killed", callbacks=[KillDuringSave()])
    if dist.get_rank() == 0:
        torch.save({"straight": straight_params, "killed": killed_params}, os.path.join(out_dir, "params.pt"))
    write_result(out_dir, {"straight": straight, "killed": killed, "world_size": dist.get_world_size()})
    end_worker()


if __name__ == "__main__":
    main()
