"""
One fault-tolerant replica group of `GRPOTrainer` (`grpo_fault_tolerance=True`, torchft, gloo on the CPU), run by
tests/test_fault_tolerance.py: one process per group, the lighthouse in the test's process.

It trains a tiny Llama with the sync every H steps and writes, at the end, what the test compares across groups:
`θ_global`, outer momentum and parameters (their raw bytes), the trainer's step, the participants of every sync, the
heals, and the steps it took itself. A kill is real: `--kill_at_step K` sends this process SIGKILL after step K (between
syncs), `--kill_in_exchange K` in the middle of the exchange of the sync at step K (after its first collective
started). `--step_seconds S` slows every step down so that a relaunched group can catch the others. Every micro-batch
a process trains is appended as it is trained (a killed process's too) to `trained-replica<id>-<pid>.txt`: the step, the
unit it belongs to (the group whose batch it is, and that group's step; `grpo_hf/replica_shares.py`) and its digest.

Usage: python fault_tolerant.py OUT_DIR REPLICA_ID [--kill_at_step K] [--kill_in_exchange K] [--step_seconds S]
       [--replicas R] [--max_steps N] [--every H] [--tag NAME] [--lr LR] [--wait_for FILE]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist
from _common import random_tokens, tensor_digest, worker_config
from testing_utils import end_worker, tiny_test_llama
from transformers import TrainerCallback

from grpo_hf import GRPOTrainer
from grpo_hf.compression.torchft_group import TorchFTCommunicator
from grpo_hf.optim.moments import local_tensor


class Record(TrainerCallback):
    """The steps this process took, the participants after each step, and the kills."""

    def __init__(self, trainer, options):
        self.trainer, self.options = trainer, options
        self.steps, self.participants, self.first_step, self.step_times = [], {}, None, {}

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first_step is None:
            self.first_step = state.global_step
        if self.options.step_seconds:
            time.sleep(self.options.step_seconds)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)
        self.step_times[state.global_step] = time.time()
        progress = os.path.join(self.options.out_dir, f"progress-replica{self.options.replica_id}.txt")
        partial = f"{progress}.{os.getpid()}"
        with open(partial, "w") as f:
            f.write(str(state.global_step))
        os.replace(partial, progress)
        comm = self.trainer.grpo_comm_state.communicator
        self.participants[state.global_step] = comm.world_size
        if state.global_step == self.options.kill_at_step and self.options.kill_rank in (-1, args.process_index):
            os.kill(os.getpid(), signal.SIGKILL)
        if state.global_step == self.options.stop_at_step:  # frozen; a process of its own wakes it up
            subprocess.Popen(["sh", "-c", f"sleep {self.options.stop_seconds}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)


def record_trained(trainer, path):
    """Append `step source source_step digest` for every micro-batch `trainer` trains (the own unit first, then the
    units taken over, in the order `training_step` trains them), flushed at once."""
    original = trainer.compute_loss
    seen = {"step": None, "index": 0}
    out = open(path, "a", buffering=1)

    def compute_loss(model, inputs, *args, **kwargs):
        step = trainer.state.global_step + 1
        seen["index"] = seen["index"] + 1 if seen["step"] == step else 0
        seen["step"] = step
        shares = trainer.grpo_replica_shares
        units = [(trainer.grpo_fault_tolerance.replica_id, step)] + (shares.extras_at(step) if shares else [])
        source, source_step = units[seen["index"]]
        out.write(f"{step} {source} {source_step} {tensor_digest([inputs['input_ids']])}\n")
        return original(model, inputs, *args, **kwargs)

    trainer.compute_loss = compute_loss


def kill_in_exchange(step_to_kill, state):
    """SIGKILL this process once the sync of step `step_to_kill` has started its first all-gather."""
    original = TorchFTCommunicator._all_gather_into

    def gather_then_die(self, out, mine, tag):
        works = original(self, out, mine, tag)
        if state.step == step_to_kill:
            os.kill(os.getpid(), signal.SIGKILL)
        return works

    TorchFTCommunicator._all_gather_into = gather_then_die


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("replica_id", type=int)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--max_steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--kill_at_step", type=int, default=-1)
    parser.add_argument("--kill_in_exchange", type=int, default=-1)
    parser.add_argument("--stop_at_step", type=int, default=-1)
    parser.add_argument("--stop_seconds", type=float, default=0.0)
    parser.add_argument("--kill_rank", type=int, default=-1, help="the rank of the group that --kill_at_step kills")
    parser.add_argument("--step_seconds", type=float, default=0.0)
    parser.add_argument("--tag", default="run")
    parser.add_argument("--bits", default="4")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--ddp", action="store_true", help="no fault tolerance: the ranks of one torchrun job instead")
    parser.add_argument("--wait_for", default=None, help="a file whose existence starts the training (a late join)")
    options = parser.parse_args()

    args = worker_config(
        os.path.join(options.out_dir, f"replica{options.replica_id}"),
        max_steps=options.max_steps,
        logging_steps=4,
        grpo_min_compress_numel=256,
        grpo_sync_every=options.every,
        grpo_sync_bits=options.bits,
        learning_rate=options.lr,
        **(
            {}
            if options.ddp
            else dict(
                grpo_fault_tolerance=True,
                grpo_ft_replica_id=options.replica_id,
                grpo_ft_replicas=options.replicas,
                grpo_ft_timeout=10,
                grpo_ft_quorum_timeout=120,
            )
        ),
    )
    model, data = tiny_test_llama(seed=0), random_tokens(512, 16)
    sharded = not options.ddp and int(os.environ.get("WORLD_SIZE", 1)) > 1
    if sharded:  # a replica group of several processes: FSDP2 over them, the launch being one replica
        from grpo_hf import shard_replica_groups

        if not dist.is_initialized():  # (the arguments' Accelerate state may have started it)
            dist.init_process_group("gloo")
        model = shard_replica_groups(model, replicas=1)
    while options.wait_for and not os.path.exists(options.wait_for):  # imported and ready: joins the moment it is told
        time.sleep(0.1)
    trainer = GRPOTrainer(model=model, args=args, train_dataset=data)
    record = Record(trainer, options)
    trainer.add_callback(record)
    if not options.ddp:
        rank = int(os.environ.get("RANK", 0))
        name = f"trained-replica{options.replica_id}" + (f"-rank{rank}" if sharded else "") + f"-{os.getpid()}.txt"
        record_trained(trainer, os.path.join(options.out_dir, name))
    state = trainer.grpo_comm_state
    if options.kill_in_exchange >= 0:
        kill_in_exchange(options.kill_in_exchange, state)
    trainer.train()
    rank = int(os.environ.get("RANK", 0))
    if options.ddp:
        options.replica_id = rank
    comm = state.communicator
    fragments = state.fragments
    result = {
        "replica_id": options.replica_id,
        "global_step": trainer.state.global_step,
        "first_step": record.first_step,
        "steps": record.steps,
        "step_times": record.step_times,
        "participants": record.participants,
        "heals": getattr(comm, "heals", 0),
        "sync_participants": state.participants,
        "totals": state.totals(),
        "global": tensor_digest([t for f in fragments for t in f.theta]),
        "momentum": tensor_digest([t for f in fragments for t in (f.momentum or [])]),
        "params": tensor_digest([local_tensor(p) for p in state.params.values()]),
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }
    name = f"{options.tag}-replica{options.replica_id}" + (f"-rank{rank}" if sharded else "")
    path = os.path.join(options.out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print(f"replica {options.replica_id} done at step {trainer.state.global_step}", flush=True)
    end_worker(barrier=options.ddp)  # (a replica group's peer may have been killed: no barrier there)


if __name__ == "__main__":
    sys.exit(main())
