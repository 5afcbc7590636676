"""Goodput under faults: the suite's `llama-finetune` on 3 replicas, one killed a third of the way in and relaunched.

    python -m benchmarks.bench_faults --output_dir runs/faults                 # 4 rows x 4 seeds, resumable
    python -m benchmarks.bench_faults --max_steps 24 --sync_every 4 --step_seconds 1 --relaunch_delay 2 --seeds 0 \
        --rows no-fault,grpo-torchft --output_dir /tmp/f --results_dir /tmp/f/results           # a smoke run
    python -m benchmarks.bench_faults --report                                 # the table from the result files

What it measures: the suite's `llama-finetune` task (`benchmarks/tasks.py`: the same pre-trained tiny Llama, data,
learning rate, cosine schedule and 120 steps as the suite's rows) trained by R = 3 replicas with the sync every 32 steps
(the suite's `sync32`: `GRPOConfig(grpo_sync_every=32)` and GRPOConfig's other defaults; torchft's DiLoCo at the same H,
outer lr 1, no momentum: the suite's `torchft-diloco-h32`). The batch is 15 sequences per step, 5 per replica (the
suite's 16 do not split over 3). In every faulty row the replica with id 2 SIGKILLs itself at the end of step
`max_steps // 3` (40: between the syncs after steps 32 and 64), and is relaunched `--relaunch_delay` seconds after
its exit. Every row runs in processes of its own, one thread each, side by side on this machine.

Rows:

- `no-fault`: GRPO between fault-tolerant replica groups (`grpo_fault_tolerance=True`, torchft, one process per group,
  the lighthouse in this process), nobody killed. The baseline of the ratios.
- `restart`: GRPO today, without fault tolerance: the 3 replicas are the ranks of one `torchrun` job (DDP + the sync),
  a checkpoint every 32 steps (`save_steps`, at the syncs). Rank 2's death makes torchrun's agent stop the job; after
  the delay the whole job is launched again with `resume_from_checkpoint="last"` (what `torchrun --max-restarts 1`
  does, with the delay for the lost machine to come back). Every rank loses the steps since the last checkpoint.
- `grpo-torchft`: `no-fault` with the kill: the survivors go on (their sync at step 64 fails, is retried over the two
  of them and kept); the relaunched group heals from a live one at the next interval and trains on from its step.
  The live groups train the batches the killed group lost or missed (`grpo_ft_take_over`, the default: while it is
  away, its batch of each step by one survivor in turn; its batches of the window its death lost, over the next
  window, by every member).
- `grpo-torchft-drop`: `grpo-torchft` with `grpo_ft_take_over=False`: the lost group's batches are not trained (as
  in torchft's DiLoCo).
- `torchft-diloco`: torchft's own `DiLoCo` (`benchmarks/peers.py`'s callback, in a plain `Trainer`) with the same kill,
  one process per replica, the lighthouse in this process, `min_replica_size=1`. The relaunched replica rejoins
  through torchft's own healing: before its first step it asks the lighthouse for a quorum, which forms at the live
  replicas' next sync; the Manager sends it a live replica's model, inner optimizer, `θ_global` and outer optimizer
  (what DiLoCo and the callback register), and the Trainer's step and scheduler (registered here, as torchtitan
  registers its train state); it then takes part in that sync (with the live replica's Δ: torchft's "some replicas
  will get the same copy of the model" in `local_sgd.py`) and trains on from the live replicas' step, skipping the
  batches of the steps it did not train, as GRPO's healed group does.

Columns (each row against `no-fault` on the same seed): wall time, from the first launch to the last training
process's exit (imports and the relaunch delay included, the evaluation not); steps lost, the optimizer steps a replica trained that
are not in the final model, summed over the replicas (`restart`: every rank's steps since the checkpoint it resumed
from; torchft rows: the killed replica's steps since its last kept sync, plus every step of an interval whose sync was
discarded, on every replica); batches in the final model out of `3 x max_steps` (a replica's batch of one step, trained
by that replica or, taken over, by another); syncs discarded (`grpo/sync/
discarded`; DiLoCo's `should_commit()` that came back False); bytes per replica over the whole run, by the suite's
ring model (GRPO's `grpo/comm/bytes_sent`; torchft's counted by `benchmarks/peers.py`; the heal's transfer of a
checkpoint is counted by neither); the held-out perplexity of the final model and its ratio: replica 0's final model
(every process that finishes records a digest of its model: `replicas_identical` in the result files) evaluated by
the suite's `Trainer.evaluate()` on its held-out split, in one process of its own, the same way for every row. The report gives the geometric mean over
seeds and the worst seed of each ratio, and writes `benchmarks/results/faults/faults.md`.

Hardware notes: 3 or 4 processes on 2 shared CPU cores (gloo over loopback): wall times are this machine's, and a
relaunched process's imports (about 10 s here) are part of what a lost machine costs. `--step_seconds S` stands for a
larger model's compute: a process sleeps `S` for every batch it trains in a step (its own and those it takes over), so
that taking over costs the time it would.
"""

import contextlib
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import Trainer, TrainerCallback


ROOT = Path(__file__).resolve().parents[1]

from benchmarks import peers  # noqa: E402
from benchmarks.revision import commit  # noqa: E402
from benchmarks.suite import _typed, ratio_stats, result_path, sync_row  # noqa: E402
from benchmarks.tasks import TASKS, Task, build_model, prepare  # noqa: E402


TASK = "llama-finetune"
REPLICAS = 3
BATCH_SIZE = 15  # sequences per step over the 3 replicas (the suite's 16 do not split over 3)
KILLED = 2  # the replica id (or rank) that is killed
SYNC_EVERY = 32  # the suite's `sync32` (GRPOConfig's defaults with grpo_sync_every=32) and `torchft-diloco-h32`
ROWS = ("no-fault", "restart", "grpo-torchft", "grpo-torchft-drop", "torchft-diloco")
BASELINE = "no-fault"
JOB_ENV = "GRPO_FAULTS_JOB"
# seconds a group waits at a quorum (a relaunched one waits for the live ones' next sync)
FT_QUORUM_TIMEOUT = 1200
# seconds the relaunched replica may run after the survivors' exit: one that healed ends with them; one that did not
# (it came back after the live replicas' last sync) would wait at its quorum
REJOIN_GRACE_S = 120


@dataclass
class FaultArguments:
    output_dir: str = field(
        default="runs/faults", metadata={"help": "Scratch: tokenized data, jobs, logs, checkpoints, progress files."}
    )
    results_dir: str = field(
        default="benchmarks/results/faults",
        metadata={"help": "One JSON file per row and seed (rows whose file exists are skipped), and faults.md."},
    )
    data_dir: str = field(default="", metadata={"help": "The tokenized data (default <output_dir>/data)."})
    rows: str = field(default=",".join(ROWS), metadata={"help": f"Comma-separated rows: {', '.join(ROWS)}."})
    seeds: str = field(default="0,1,2,3", metadata={"help": "Comma-separated seeds."})
    max_steps: int = field(default=0, metadata={"help": "Optimizer steps (0: the task's 120; smoke runs)."})
    relaunch_delay: float = field(
        default=5.0, metadata={"help": "Seconds between the killed process's exit and its relaunch."}
    )
    sync_every: int = field(
        default=SYNC_EVERY,
        metadata={
            "help": "H of the sync (GRPO's `sync<H>`, torchft's `torchft-diloco-h<H>`, the restart row's save_steps). "
            "Smoke runs only: a relaunched replica must come back before the live ones' last sync."
        },
    )
    ft_timeout: float = field(
        default=10.0,
        metadata={
            "help": "grpo_ft_timeout of the GRPO rows: seconds before a collective or a heal gives a peer up (the "
            "lighthouse's join timeout is 3 times it). A survivor of a kill waits this long only for a peer that falls "
            "silent without closing its connections; a killed process's close fails the exchange at once."
        },
    )
    step_seconds: float = field(
        default=0.0,
        metadata={"help": "Smoke runs only: every step of every replica sleeps this long (a slower model's step)."},
    )
    timeout: int = field(default=3600, metadata={"help": "Seconds before one row and seed is killed."})
    report: bool = field(default=False, metadata={"help": "Only print and write the table of the result files."})


# ----------------------------------------------------------------------------------------------------------------
# Worker: one replica (a fault-tolerant group or a DiLoCo replica, one process) or one rank of the restart row's job
# ----------------------------------------------------------------------------------------------------------------


def training_task(max_steps: int) -> Task:
    """The suite's task with this benchmark's batch (and `max_steps` for smoke runs)."""
    task = TASKS[TASK]
    return Task(**{**task.__dict__, "batch_size": BATCH_SIZE, "max_steps": max_steps or task.max_steps})


def kill_step(max_steps: int) -> int:
    """The step after which the killed replica dies: a third of the way in."""
    return max(1, max_steps // 3)


class Progress(TrainerCallback):
    """
    What one process trained, written after every step (a killed process leaves its last one): its first and last
    step, the time each step ended (`times`, wall-clock seconds), the bytes it sent, each sync's participants; after
    step `kill_at`, SIGKILL.
    """

    def __init__(self, path: Path, kill_at: int, sent, syncs, step_seconds: float = 0.0, taken_over=None):
        self.path, self.kill_at, self.sent, self.syncs, self.step_seconds = path, kill_at, sent, syncs, step_seconds
        self.taken_over = taken_over or (lambda step: 0)  # batches of other replicas trained at a step
        self.record = {"first_step": None, "last_step": None, "steps": 0, "bytes_start": 0.0, "bytes": 0.0,
                       "syncs": [], "taken_over": [], "times": [], "pid": os.getpid()}  # fmt: skip
        self._seen = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.record["bytes_start"] = self.sent(start=True)  # after a resume or a heal: the restored totals
        self.update_syncs(state.global_step)  # a healed DiLoCo replica's first sync, at the live replicas' step

    def on_step_begin(self, args, state, control, **kwargs):
        extra = self.taken_over(state.global_step + 1)
        if extra:
            self.record["taken_over"].append([state.global_step + 1, extra])
        if self.step_seconds:
            time.sleep(self.step_seconds * (1 + extra))

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        record = self.record
        if record["first_step"] is None:
            record["first_step"] = step - 1
        record["last_step"], record["steps"], record["bytes"] = step, record["steps"] + 1, self.sent()
        record["times"].append(time.time())  # of steps first_step + 1, ..., last_step
        self.update_syncs(step)
        self.write()
        if step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def update_syncs(self, step: int) -> None:
        """Each sync since the last call: `[step, participants]`, 0 participants for a discarded one."""
        events = self.syncs()
        for participants in events[self._seen :]:
            self.record["syncs"].append([step, participants])
        self._seen = len(events)

    def write(self) -> None:
        partial = self.path.with_suffix(f".{os.getpid()}")
        partial.write_text(json.dumps(self.record))
        os.replace(partial, self.path)


def worker(job_path: str, setup=None) -> None:
    """
    One process of a row (the job file at `job_path`). `setup(trainer, job)`, when given, is called on a
    fault-tolerant group's trainer before it trains (`benchmarks/bench_soak_faults.py` installs its fault hooks so).
    Optional job keys: `save_steps` (a fault-tolerant group writes checkpoints, the last two kept), `every_final`
    (each replica that finishes saves its model as `final-r<replica>.pt`, not replica 0 alone as `final.pt`).
    """
    import torch
    from datasets import load_from_disk
    from transformers import TrainingArguments, set_seed

    from grpo_hf import GRPOConfig, GRPOTrainer

    job = json.loads(Path(job_path).read_text())
    torch.set_num_threads(1)
    if job["kind"] == "eval":
        return evaluate(job)
    kind, seed, attempt = job["kind"], job["seed"], job["attempt"]
    replica = job.get("replica")
    if kind == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")  # Accelerate takes it over
        replica = dist.get_rank()
    task = training_task(job["max_steps"])
    info = job["info"]
    train, evaluation = load_from_disk(info["train_path"]), load_from_disk(info["eval_path"])
    run_dir = Path(job["run_dir"])
    common = dict(output_dir=str(run_dir / ("job" if kind == "ddp" else f"replica{replica}")),
                  **task.training_arguments(REPLICAS), logging_steps=max(1, task.max_steps // 4), report_to=[],
                  save_strategy="no", use_cpu=True, seed=seed, data_seed=seed, disable_tqdm=True,
                  dataloader_num_workers=0)  # fmt: skip
    model = build_model(task, info, seed)
    set_seed(seed)
    kwargs = dict(model=model, train_dataset=train, eval_dataset=evaluation)
    every = job["sync_every"]
    sync = _typed(sync_row(f"sync{every}"))
    diloco = None
    if kind == "grpo-ft":
        saves = {}
        if job.get("save_steps"):
            saves = {"save_strategy": "steps", "save_steps": job["save_steps"], "save_total_limit": 2}
        args = GRPOConfig(**{**common, **saves}, grpo_importance=False, **sync,
                          grpo_fault_tolerance=True,
                          grpo_ft_replica_id=replica, grpo_ft_replicas=REPLICAS, grpo_ft_timeout=job["ft_timeout"],
                          grpo_ft_quorum_timeout=FT_QUORUM_TIMEOUT,
                          grpo_ft_take_over=job["row"] != "grpo-torchft-drop")  # fmt: skip
        trainer = GRPOTrainer(args=args, **kwargs)
    elif kind == "ddp":
        args = GRPOConfig(**{**common, "save_strategy": "steps"}, save_steps=sync["grpo_sync_every"],
                          grpo_importance=False, **sync)  # fmt: skip
        trainer = GRPOTrainer(args=args, **kwargs)
    else:
        trainer = ReplicaTrainer(replica, args=TrainingArguments(**common), **kwargs)
        name = f"torchft-diloco-h{every}"
        diloco = RejoiningDiLoCoCallback(trainer, {**peers.peer_row(name), "name": name}, REPLICAS,
                                         peers.PeerTraffic(), replica, rejoin=attempt > 0)  # fmt: skip
        trainer.add_callback(diloco)
    comm = getattr(trainer, "grpo_comm_state", None)

    def sent(start=False):
        if diloco is not None:
            return 0.0 if start else diloco.traffic.bytes  # counted from 0 in each process, the heal's sync included
        return comm.totals()["bytes_sent"]  # after a resume or a heal: the restored totals

    def syncs():
        if diloco is not None:
            return [participants if committed else 0 for committed, participants in diloco.sync_log]
        return list(getattr(comm, "participants", []))

    kill_at = job["kill_step"] if replica == KILLED else -1

    def taken_over(step):
        shares = getattr(trainer, "grpo_replica_shares", None)
        return len(shares.extras_at(step)) if shares is not None else 0

    progress = Progress(run_dir / f"progress-r{replica}-a{attempt}.json", kill_at, sent, syncs, job["step_seconds"],
                        taken_over)  # fmt: skip
    trainer.add_callback(progress)
    if setup is not None and kind == "grpo-ft":
        setup(trainer, job)
    start = time.perf_counter()
    trainer.train(**({"resume_from_checkpoint": "last"} if kind == "ddp" else {}))
    train_s = time.perf_counter() - start
    progress.update_syncs(trainer.state.global_step)  # the sync after the last step (GRPO's `finish()`)
    record = progress.record
    record.update(bytes=sent(), train_s=train_s, global_step=trainer.state.global_step, done=True)
    if comm is not None:
        record["totals"] = comm.totals()
        record["heals"] = getattr(comm.communicator, "heals", 0)
    if diloco is not None:
        record.update(heals=int(diloco.healed_step is not None), commits=diloco.commits, errors=diloco.errors)
    state = {name: p.detach().clone() for name, p in trainer.model.state_dict().items()}
    record["digest"] = hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes()
                                               for t in state.values())).hexdigest()[:16]  # fmt: skip
    if job.get("every_final"):  # the launcher evaluates one that finished
        torch.save(state, run_dir / f"final-r{replica}.pt")
    elif replica == 0:  # every replica ends on the same model (`digest`): replica 0's is evaluated
        torch.save(state, run_dir / "final.pt")
    progress.write()
    if kind == "ddp":
        dist.barrier()
        dist.destroy_process_group()


def evaluate(job: dict) -> None:
    """The final model's held-out loss (replica 0's, saved at its end, or the job's `final` file): the suite's
    `Trainer.evaluate()`, one process, the same for every row."""
    import torch
    from datasets import load_from_disk
    from transformers import TrainingArguments

    task, info, run_dir = training_task(job["max_steps"]), job["info"], Path(job["run_dir"])
    model = build_model(task, info, job["seed"])
    model.load_state_dict(torch.load(run_dir / job.get("final", "final.pt"), weights_only=True))
    args = TrainingArguments(output_dir=str(run_dir / "eval"), **task.training_arguments(REPLICAS), report_to=[],
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)  # fmt: skip
    trainer = Trainer(model=model, args=args, eval_dataset=load_from_disk(info["eval_path"]))
    (run_dir / "eval.json").write_text(json.dumps(trainer.evaluate()))


def _replica_data(replica: int):
    """The data loader of replica `replica` of 3: the batches a 3-rank DDP run gives that rank (GRPO's split)."""
    from grpo_hf.compression.torchft_group import FaultTolerance
    from grpo_hf.fault_tolerance import replica_data

    return replica_data(FaultTolerance(lighthouse="", replica_id=replica, replicas=REPLICAS))


class ReplicaTrainer(Trainer):
    """
    The plain `Trainer` of one DiLoCo replica (one process): it reads its own part of the data, and after a heal its
    first epoch skips the batches of the steps it did not train (as a resume does; GRPOTrainer's heal does the same,
    through the same private method: transformers < 5.30).
    """

    def __init__(self, replica: int, **kwargs):
        super().__init__(**kwargs)
        self.replica, self.healed_step = replica, None

    def get_train_dataloader(self):
        with _replica_data(self.replica):
            return super().get_train_dataloader()

    def _run_epoch(self, *args, **kwargs):
        if self.healed_step is not None and kwargs.get("resume_from_checkpoint") is None:
            kwargs.update(resume_from_checkpoint="<healed from a live DiLoCo replica>", epochs_trained=kwargs["epoch"],
                          steps_trained_in_current_epoch=self.healed_step * self.args.gradient_accumulation_steps)  # fmt: skip
        return super()._run_epoch(*args, **kwargs)


class RejoiningDiLoCoCallback(peers.TorchftDiLoCoCallback):
    """
    `benchmarks/peers.py`'s torchft `DiLoCo` callback for one replica in a process of its own (no torchrun): the
    lighthouse's address from `TORCHFT_LIGHTHOUSE`, `min_replica_size=1` (the survivors of a kill go on), each sync's
    outcome recorded (`sync_log`: `(committed, participants)`) instead of raised, and, on a relaunched replica
    (`rejoin=True`), torchft's heal before the first step (see the module docstring).
    """

    def __init__(self, trainer, row, world_size, traffic, replica: int, rejoin: bool = False):
        super().__init__(trainer, row, world_size, traffic)
        self.replica, self.rejoin = replica, rejoin
        self.min_replicas = 1
        self.sync_log: list[tuple[bool, int]] = []
        self.healed, self.healed_step, self.errors = None, None, []

    def _local_model(self):
        self._no_sync = contextlib.nullcontext()
        return self.trainer.model

    def _lighthouse_address(self, rank: int) -> str:
        return os.environ["TORCHFT_LIGHTHOUSE"]

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        super().on_train_begin(args, state, control, model=model, optimizer=optimizer, **kwargs)
        self.lr_scheduler = lr_scheduler
        manager, should_commit = self.manager, self.manager.should_commit

        def recorded(*a, **kw):
            committed = should_commit(*a, **kw)
            self.sync_log.append((bool(committed), manager.num_participants()))
            return committed

        manager.should_commit = recorded
        # what a relaunched replica receives beside torchft's own (model, optimizer, θ_global, outer optimizer)
        manager.register_state_dict_fn("trainer", self._load_trainer, self._save_trainer)
        if self.rejoin:
            self._heal(state)

    def _save_trainer(self) -> dict:
        # torchft takes a sync's quorum inside the optimizer step: the step in flight is global_step + 1, and the
        # scheduler has not stepped for it yet
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        return {"global_step": self.trainer.state.global_step + 1, "epoch": self.trainer.state.epoch,
                "scheduler": scheduler.state_dict()}  # fmt: skip

    def _load_trainer(self, saved: dict) -> None:
        self.healed = saved

    def _heal(self, state) -> None:
        """A relaunched replica: a quorum at the live replicas' next sync (torchft heals it there), then that sync."""
        self.manager.start_quorum()  # waits for the live replicas' next sync; heals (the registered load functions)
        if self.healed is None:
            raise RuntimeError(f"{self.row['name']}: the relaunched replica {self.replica} did not heal.")
        fragment = self.diloco._fragments[self.diloco._current_fragment()]  # torchft has no public call for it
        fragment.prepare_sync()
        fragment.perform_sync()
        self.traffic.syncs += 1
        step = int(self.healed["global_step"])
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        scheduler.load_state_dict(self.healed["scheduler"])
        scheduler.step()  # the step the live replicas are finishing
        state.global_step, state.epoch = step, self.healed["epoch"]
        self.trainer.healed_step = self.healed_step = step
        self._expected_commits = self.manager.current_step()

    def _final_sync(self, step: int) -> None:
        try:
            super()._final_sync(step)
        except RuntimeError as err:  # a discarded sync: recorded (`sync_log`), the row goes on
            self.errors.append(str(err))

    def _close(self) -> None:
        self.diloco.__exit__(None, None, None)
        self.diloco = None
        self.manager.shutdown(wait=False)


# ----------------------------------------------------------------------------------------------------------------
# Launcher: one row and seed
# ----------------------------------------------------------------------------------------------------------------


def _env(extra: dict) -> dict:
    from tests.testing_utils import WORKER_ENV

    env = {**os.environ, **WORKER_ENV, "RUST_LOG": "error", "GLOO_SOCKET_IFNAME": "lo", **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


class Launches:
    """The processes of one row and seed: their jobs, logs, exit codes and wall time; killed all together on a timeout."""

    def __init__(self, run_dir: Path, job: dict, deadline: float):
        self.run_dir, self.job, self.deadline = run_dir, job, deadline
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def start(self, name: str, command: list[str], job: dict, env: dict | None = None) -> subprocess.Popen:
        job_path = self.run_dir / f"job-{name}.json"
        job_path.write_text(json.dumps(job, indent=1))
        log = self.run_dir / f"log-{name}.txt"
        self.logs.append(log)
        with open(log, "w") as out:
            proc = subprocess.Popen(command, env=_env({JOB_ENV: str(job_path), **(env or {})}), cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.procs.append(proc)
        return proc

    def wait(self, proc: subprocess.Popen, within: float | None = None) -> int:
        """`proc`'s exit code; past the row's deadline (or `within` seconds), every process is killed and it raises."""
        limit = self.deadline - time.monotonic() if within is None else min(within, self.deadline - time.monotonic())
        try:
            return proc.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            self.stop()
            why = "timed out" if within is None else f"a process still ran {within:g} s after the others had finished"
            raise RuntimeError(f"{self.job['row']} seed {self.job['seed']}: {why}.\n{self.output()}") from None

    def stop(self) -> None:
        """Kill what is still running of this row's processes (each its own session: the process and its children)."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def output(self) -> str:
        return "\n".join(f"--- {log.name}\n" + log.read_text()[-3000:] for log in self.logs if log.exists())


def _replica_command() -> list[str]:
    return [sys.executable, "-m", "benchmarks.bench_faults"]


def run_replicas(launches: Launches, kind: str, fault: bool, delay: float, timeout: float) -> list[int]:
    """3 single-process replicas around a lighthouse in this process; replica 2 killed and relaunched if `fault`."""
    from torchft.coordination import LighthouseServer

    # the join timeout well above the groups' collective timeout (3x, as tests/test_fault_tolerance.py): the survivors
    # of a kill reach the retry's quorum up to that far apart (when one waits out the timeout on a silent peer) and
    # must meet in it; with the two equal, a survivor was left out and waited at its quorum (smoke run, 2026-12-06)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=int(3 * timeout * 1000),
                                  quorum_tick_ms=50, heartbeat_timeout_ms=2000)  # fmt: skip
    env = {"TORCHFT_LIGHTHOUSE": lighthouse.address()}
    job = launches.job
    try:
        procs = [
            launches.start(f"r{r}-a0", _replica_command(), {**job, "kind": kind, "replica": r, "attempt": 0,
                                                              "kill_step": job["kill_step"] if fault else -1}, env)
            for r in range(REPLICAS)
        ]  # fmt: skip
        codes = [None] * REPLICAS
        if fault:
            codes[KILLED] = launches.wait(procs[KILLED])
            if codes[KILLED] != -signal.SIGKILL:
                launches.stop()
                raise RuntimeError(f"replica {KILLED} exited with {codes[KILLED]}, not SIGKILL:\n{launches.output()}")
            time.sleep(delay)
            procs[KILLED] = launches.start(f"r{KILLED}-a1", _replica_command(),
                                           {**job, "kind": kind, "replica": KILLED, "attempt": 1, "kill_step": -1}, env)  # fmt: skip
        final = [launches.wait(proc) for proc in procs[:KILLED]]
        final.append(launches.wait(procs[KILLED], REJOIN_GRACE_S if fault else None))
    finally:
        launches.stop()
        lighthouse.shutdown()
    if any(final):
        raise RuntimeError(f"{job['row']} seed {job['seed']}: exit codes {final}.\n{launches.output()}")
    return [c for c in codes if c is not None]


def run_restart(launches: Launches, delay: float) -> list[int]:
    """One 3-rank torchrun job; rank 2 killed; after the delay the whole job again, resuming its last checkpoint."""
    from tests.testing_utils import free_port

    def torchrun(attempt: int) -> int:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(REPLICAS), "--master_addr",
                   "127.0.0.1", "--master_port", str(free_port()), str(Path(__file__).resolve())]  # fmt: skip
        job = {**launches.job, "kind": "ddp", "attempt": attempt,
               "kill_step": launches.job["kill_step"] if attempt == 0 else -1}  # fmt: skip
        return launches.wait(launches.start(f"job-a{attempt}", command, job))

    first = torchrun(0)
    log = launches.logs[-1].read_text()
    if first == 0 or not re.search(r"exitcode\s*:\s*-9\b", log):
        raise RuntimeError(
            f"restart: the first job ended with {first}, without a rank killed by SIGKILL:\n{log[-3000:]}"
        )
    time.sleep(delay)
    second = torchrun(1)
    if second != 0:
        raise RuntimeError(f"restart: the resumed job failed ({second}):\n{launches.output()}")
    return [-signal.SIGKILL]


def run_one(row: str, seed: int, args: FaultArguments, info: dict, out: Path) -> dict:
    """Train one row and seed end to end; returns its result (see `aggregate`)."""
    import shutil

    max_steps = training_task(args.max_steps).max_steps
    run_dir = out / "runs" / f"{row}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a row is run whole or not at all
    run_dir.mkdir(parents=True)
    job = {"row": row, "seed": seed, "info": info, "max_steps": max_steps, "kill_step": kill_step(max_steps),
           "run_dir": str(run_dir), "sync_every": args.sync_every, "step_seconds": args.step_seconds,
           "ft_timeout": args.ft_timeout}  # fmt: skip
    launches = Launches(run_dir, job, time.monotonic() + args.timeout)
    start = time.perf_counter()
    if row == "restart":
        codes = run_restart(launches, args.relaunch_delay)
    else:
        kind = "diloco" if row == "torchft-diloco" else "grpo-ft"
        codes = run_replicas(
            launches, kind, fault=row != "no-fault", delay=args.relaunch_delay, timeout=args.ft_timeout
        )
    wall_s = time.perf_counter() - start
    if launches.wait(launches.start("eval", _replica_command(), {**job, "kind": "eval"})) != 0:
        raise RuntimeError(f"{row} seed {seed}: the evaluation failed.\n{launches.output()}")
    instances = {p.stem.removeprefix("progress-"): json.loads(p.read_text()) for p in run_dir.glob("progress-*.json")}
    result = aggregate(row, instances, max_steps, json.loads((run_dir / "eval.json").read_text())["eval_loss"])
    result.update(seed=seed, wall_s=wall_s, kill_codes=codes, relaunch_delay=args.relaunch_delay,
                  sync_every=args.sync_every, step_seconds=args.step_seconds, ft_timeout=args.ft_timeout,
                  kill_step=job["kill_step"] if row != "no-fault" else None, commit=commit(),
                  date=time.strftime("%Y-%m-%d"))  # fmt: skip
    shutil.rmtree(run_dir / "job", ignore_errors=True)  # the restart row's checkpoints
    return result


def _taken_over_kept(record: dict) -> int:
    """Batches of other replicas this process trained that its replica's final model holds: each counts when the first
    sync at or after its step kept this process's local steps (a finished process's last step syncs)."""
    kept = 0
    for step, count in record.get("taken_over", []):
        sync = next((participants for at, participants in record["syncs"] if at >= step), None)
        if sync or (sync is None and record.get("done")):
            kept += count
    return kept


def _lost_since_sync(record: dict, until: int) -> int:
    """
    Steps this process trained that its replica's final model does not hold: those of intervals whose sync was
    discarded, and those after its last kept sync up to step `until` (its last: a finished process's last step ends
    with a sync, a killed process's does not).
    """
    lost, kept = 0, record["first_step"]
    for step, participants in record["syncs"]:
        if participants:
            kept = step
        else:
            lost += step - kept  # the interval is thrown away: the parameters restart from θ_global
            kept = step
    return lost + max(0, until - kept)


def aggregate(row: str, instances: dict[str, dict], max_steps: int, eval_loss: float) -> dict:
    """
    One row and seed from its processes' records (`r<replica>-a<attempt>`): steps lost, replica-steps in the final
    model, syncs discarded, bytes per replica, the final model's evaluation loss.
    """
    lost = 0
    if row == "restart":  # every rank loses the steps since the checkpoint the job resumed from
        for replica in range(REPLICAS):
            killed, resumed = instances[f"r{replica}-a0"], instances[f"r{replica}-a1"]
            lost += killed["last_step"] - resumed["first_step"]
        discarded = None
    else:
        lost = sum(_lost_since_sync(record, record["last_step"]) for record in instances.values())
        discarded = max(sum(1 for _, p in r["syncs"] if not p) for r in instances.values())
    trained = sum(r["steps"] for r in instances.values())
    taken_over = sum(_taken_over_kept(r) for r in instances.values()) if row != "restart" else 0
    sent = [sum(r["bytes"] - r["bytes_start"] for key, r in instances.items() if key.startswith(f"r{i}-"))
            for i in range(REPLICAS)]  # fmt: skip
    finished = [r for r in instances.values() if r.get("done")]
    heals = sum(int(r.get("heals", 0)) for r in instances.values())
    return {
        "row": row,
        "max_steps": max_steps,
        "replicas": REPLICAS,
        "eval_loss": eval_loss,
        "perplexity": math.exp(eval_loss),
        "replicas_identical": len({r["digest"] for r in finished}) == 1,  # every finished process ends on one model
        "steps_lost": lost,
        "replica_steps_trained": trained,
        "replica_steps_in_model": trained - lost,
        "batches_in_model": trained - lost + taken_over,
        "syncs_discarded": discarded,
        "bytes_per_replica": sum(sent) / REPLICAS,
        "heals": heals,
        "instances": instances,
    }


# ----------------------------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------------------------


def load_results(results_dir: Path) -> dict[str, dict[int, dict]]:
    results: dict = {}
    for path in sorted(results_dir.glob("*-seed*.json")):
        record = json.loads(path.read_text())
        results.setdefault(record["row"], {})[record["seed"]] = record
    return results


def _mean(runs: list[dict], key: str) -> float:
    return sum(r[key] for r in runs) / len(runs)


def _ratio(by_seed: dict[int, dict], base: dict[int, dict], key: str) -> str:
    """`key` against the baseline's on the seeds both ran: geometric mean (worst seed)."""
    paired = [by_seed[s][key] / base[s][key] for s in sorted(by_seed) if s in base]
    if not paired:
        return "–"
    stats = ratio_stats(paired)
    return f"{stats['geomean']:.3f} ({stats['worst']:.3f})"


def markdown(results: dict[str, dict[int, dict]]) -> str:
    """The table: per row, its figures (mean over seeds) and its ratios to `no-fault` (geometric mean, worst seed)."""
    base = results.get(BASELINE, {})
    apart = False
    lines = [
        f"| row | seeds | wall s | wall / {BASELINE}: geomean (worst) | steps lost: mean (worst seed) | batches in the "
        f"model | syncs discarded: mean (worst) | bytes per replica | perplexity | ppl / {BASELINE}: geomean (worst) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in [r for r in ROWS if r in results] + sorted(set(results) - set(ROWS)):
        by_seed = results[row]
        runs = [by_seed[s] for s in sorted(by_seed)]
        lost = [r["steps_lost"] for r in runs]
        discarded = [r["syncs_discarded"] for r in runs]
        discarded = "–" if None in discarded else f"{sum(discarded) / len(runs):.1f} ({max(discarded)})"
        in_model = [r.get("batches_in_model", r["replica_steps_in_model"]) for r in runs]
        in_model = f"{sum(in_model) / len(runs):.0f} / {runs[0]['replicas'] * runs[0]['max_steps']}"
        wall = _ratio(by_seed, base, "wall_s")
        if not {r.get("commit") for r in runs} & {r.get("commit") for r in base.values()}:  # not run beside it
            wall, apart = f"{wall} †", True
        cells = [f"`{row}`", str(len(runs)), f"{_mean(runs, 'wall_s'):.1f}", wall,
                 f"{sum(lost) / len(runs):.1f} ({max(lost)})", in_model, discarded,
                 f"{_mean(runs, 'bytes_per_replica') / 1e6:,.2f} MB", f"{_mean(runs, 'perplexity'):.3f}",
                 _ratio(by_seed, base, "perplexity")]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    any_run = next((r for by_seed in results.values() for r in by_seed.values()), None)
    if any_run is not None:
        lines += [
            "",
            f"{TASK}, {any_run['max_steps']} steps, {REPLICAS} replicas, the sync every {any_run['sync_every']} steps"
            + (f", {any_run['step_seconds']:g} s of sleep per batch trained" if any_run["step_seconds"] else "")
            + f", grpo_ft_timeout {any_run['ft_timeout']:g} s; replica {KILLED} "
            f"killed (SIGKILL) after step {any_run['max_steps'] // 3} and relaunched {any_run['relaunch_delay']:g} s "
            "after its exit. Wall time from the first launch to the last training process's exit (the relaunch "
            "delay and imports included); steps lost summed over the replicas; bytes by the suite's ring model (the "
            "heal's checkpoint transfer not counted). `benchmarks/bench_faults.py` says what each row runs.",
        ]
    if apart:
        lines.append(
            f"\n† run at another commit, in another session, than `{BASELINE}`'s files: its wall time was not measured "
            "side by side with them (the machine's load differs), so that ratio is not a comparison; its perplexity "
            "ratio is (`benchmarks/LOG.md` has the session's own ratios)."
        )
    return "\n".join(lines)


def report(results_dir: Path) -> str:
    text = markdown(load_results(results_dir))
    (results_dir / "faults.md").write_text(text + "\n")
    return text


def main() -> None:
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(FaultArguments).parse_args_into_dataclasses()
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    if args.report:
        print(report(results_dir))
        return
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; use {', '.join(ROWS)}.")
    missing = peers.missing_package(f"torchft-diloco-h{args.sync_every}")
    if missing and any(r != "restart" for r in rows):
        raise SystemExit(f"{missing}: the torchft rows need it.")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = prepare(
        TASKS[TASK], Path(args.data_dir or out / "data"), REPLICAS
    )  # the suite's data and pre-trained model
    for seed in (int(s) for s in args.seeds.split(",")):
        for row in rows:
            path = result_path(results_dir, row, seed)
            if path.exists():
                continue
            result = run_one(row, seed, args, info, out)
            path.write_text(json.dumps(result, indent=1))
            print(f"[{row} seed {seed}] {result['wall_s']:6.1f} s  ppl {result['perplexity']:8.3f}  lost "
                  f"{result['steps_lost']}  discarded {result['syncs_discarded']}  bytes/replica "
                  f"{result['bytes_per_replica'] / 1e6:.2f} MB  heals {result['heals']}", flush=True)  # fmt: skip
    print(report(results_dir))


if __name__ == "__main__":
    if os.environ.get(JOB_ENV):
        from tests.testing_utils import end_worker

        worker(os.environ[JOB_ENV])
        end_worker()  # (skips the interpreter's teardown, where a gloo run now and then aborts)
    else:
        main()
