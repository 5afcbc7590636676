"""A soak of the faults clusters have: the suite's `llama-finetune` on 3 fault-tolerant replica groups, run long, under
a schedule of faults drawn from a seed, beside the same run without faults.

    python -m benchmarks.bench_soak_faults --output_dir runs/soak_faults       # 4 seeds, resumable
    python -m benchmarks.bench_soak_faults --episodes exchange,checkpoint,lighthouse --max_steps 160 \
        --step_seconds 0.1 --seeds 0 --output_dir /tmp/soak --results_dir /tmp/soak/results   # a smoke run (3 faults)
    python -m benchmarks.bench_soak_faults --report                          # the table from the result files

What runs: `benchmarks/bench_faults.py`'s `grpo-torchft` row (its worker, task, batch, data and GRPOConfig: the
suite's `llama-finetune`, 15 sequences a step, 5 per group, `grpo_ft_take_over` on), longer (`--max_steps`, 960: the
cosine schedule stretched over it, the data read for 7.5 epochs), with the sync every `--sync_every` steps (8, after
GRPO's ramp 1, 3, 7), a checkpoint every `--save_steps` (twice the interval, the last two kept) and
`grpo_ft_min_replicas=1`. The lighthouse is a process of its own (torchft's `torchft_lighthouse` with
`--min_replicas` `--lighthouse_min_replicas`, 1 as `grpo_ft_min_replicas`, as docs/engines.md advises; the join timeout
3 x `grpo_ft_timeout`) on a fixed port, so that it can be killed and started again there. Each seed runs twice:
`no-fault` (the same launches, hooks and checkpoints, nobody hurt) and `soak`. A result file is kept, and its row and
seed skipped, once written (a run that failed too: delete its file to run it again).

The schedule (`draw_schedule`, `random.Random(seed)`) is a list of episodes of one or two faults: every kind below
once, then episodes drawn at random until at least `--min_faults` (20) faults, shuffled, and `last-sync` at the end.
Each episode waits until the run has settled (the three groups alive, none frozen, the lighthouse up, each group
through a kept sync of all three since the last fault) and until its share of the run (episode `i` of `n` not before
step `i / n` of the way to the last intervals: the faults spread over the run), then `gap` (0 or 1) more intervals;
its faults fall at drawn offsets (1 to H - 2 steps) into the interval that follows. Killed groups are relaunched `--relaunch_delay` seconds
after their exit with the same command (no resume: they heal from a live group at its next quorum). No episode but
`last-sync` starts in the last `3 x sync_every` steps (a group killed then could not come back before the end); one
that would is recorded as not injected.

How each fault is timed. The injector is this process; every fault is a real signal from it (SIGKILL, SIGSTOP and
SIGCONT to a group's process; SIGKILL to the lighthouse), keyed on what the groups write, never on a guessed time:
each step's progress file (`bench_faults.Progress`: the step, its time, each sync's participants, the batches taken
over) and, for a fault inside an event, a marker. The injector arms a group (`arm-r<id>.json` names an event and
the step from which it counts); the group's process (`FaultHooks`, installed by `install_fault_hooks`) writes the
marker `at-<episode>-r<id>.json` when it reaches that event and holds there (at most `HOLD_S`) until the signal
comes, so that the SIGKILL lands inside the event.

| episode | faults |
|---|---|
| `kill` | SIGKILL of a group when it reaches a drawn step inside an interval |
| `exchange` | SIGKILL inside the exchange of the interval's sync (its first collective started) |
| `checkpoint` | SIGKILL while `checkpoint-*` is written (the model written, not yet the optimizer or trainer state) |
| `heal-healer` | `kill`, then its relaunch killed right after the quorum that healed it (the state received) |
| `heal-source` | `kill`, then the live group that sends its relaunch the state, killed while it sends it |
| `take-over` | `kill` (its relaunch held back), then a live group killed at a step where it trains the lost group's batch |
| `two` | two groups killed at two steps of one interval, keyed on the third (one left: `grpo_ft_min_replicas=1`) |
| `stop` | SIGSTOP of a group at a drawn step for `--stop_seconds` (2.5 x `grpo_ft_timeout`), then SIGCONT |
| `lighthouse` | the lighthouse killed at a drawn step, started again on its port 1 or 2 intervals later |
| `last-sync` | SIGKILL inside the exchange of the very last sync; relaunched, it must stop saying the run is over |

What is reported, per seed, beside `no-fault` of the same seed: faults injected (by kind) and survived (the run
settled after it; the last episode: every group that lived to the end finished, bit-identical, nothing else exited),
wall time (first launch to the last exit of a group that trained to the end) and its ratio, the time the groups a
fault did not hurt waited (their steps' excess over the run's median step, from the fault to the next), steps lost
(`bench_faults.aggregate`), every batch (one group's batch of one step) in the final model once (each micro-batch
trained is recorded with the unit it came from and its data's digest, a unit to take over whose batches were no longer
kept as dropped; it is kept when the sync that closed its window kept its process, as the process recorded it or, for
one killed right after that sync, as the survivors recorded the sync's kept members: `count_units`), lost by a
discarded sync, or lost in the last window (a catch-up after the last step: `last-sync`'s victim's), syncs discarded,
the final model's perplexity (`bench_faults.evaluate`) and its ratio, whether the groups that trained to the end are
bit-identical, and every exit that was not a kill or the end (with its error line). The bars (`bars`) are printed as
met or MISSED; a run that failed (a hang past `--timeout`, too many crashes) says so in its row.

Hardware notes: 3 groups (4 processes during a relaunch) on 2 shared CPU cores, gloo over loopback; `--step_seconds`
(0.25) stands for a larger model's compute, as in `bench_faults`; a relaunch's imports take 10 to 20 s here. Short
runs here (2026-12-07, the machine shared with other jobs) took 0.5 to 0.8 s a step, and the drawn schedule about 21
steps a fault (its 20 odd faults about 500 steps, without the spread): expect 8 to 13 minutes for `no-fault` and a
quarter more for `soak` per seed, 1 h 15 min to 2 h for the 4 seeds.
"""

import contextlib
import hashlib
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]

from benchmarks import bench_faults  # noqa: E402
from benchmarks.bench_faults import JOB_ENV, REPLICAS, TASK, Launches, aggregate, training_task  # noqa: E402
from benchmarks.revision import commit  # noqa: E402
from benchmarks.suite import result_path  # noqa: E402


ROWS = ("no-fault", "soak")
# episode kind -> its faults' kinds, in order
EPISODES = {
    "kill": ("kill",),
    "exchange": ("exchange",),
    "checkpoint": ("checkpoint",),
    "heal-healer": ("kill", "heal-healer"),
    "heal-source": ("kill", "heal-source"),
    "take-over": ("kill", "take-over"),
    "two": ("two", "two"),
    "stop": ("stop",),
    "lighthouse": ("lighthouse",),
    "last-sync": ("last-sync",),
}
FAULT_KINDS = ("kill", "exchange", "checkpoint", "heal-healer", "heal-source", "take-over", "two", "stop", "lighthouse",
               "last-sync")  # fmt: skip
HOLD_S = 15.0  # how long a group holds at an armed event for the launcher's signal (below a heal's 2 x timeout)
TICK_S = 0.05  # the injector's poll
RESERVE_INTERVALS = 3  # no episode but `last-sync` starts in the run's last intervals
SETTLE_TIMEOUT_S = 300.0  # an episode waits this long for the run to settle, then goes on (the fault is not survived)
STOP_MESSAGE = "finished the run without replica group"  # a group relaunched after the others' last sync
BEHIND_MESSAGE = "is behind the other groups"  # a frozen group, woken: it stops, and heals when relaunched
MAX_UNEXPECTED = 6  # unexpected exits (crashes) before a run is given up


@dataclass
class SoakArguments:
    output_dir: str = field(
        default="runs/soak_faults", metadata={"help": "Scratch: tokenized data, runs, logs, checkpoints, markers."}
    )
    results_dir: str = field(
        default="benchmarks/results/soak_faults",
        metadata={"help": "One JSON file per row and seed (kept and skipped when present), and soak_faults.md."},
    )
    data_dir: str = field(default="", metadata={"help": "The tokenized data (default <output_dir>/data)."})
    seeds: str = field(
        default="0,1,2,3", metadata={"help": "Comma-separated seeds (of the training and the schedule)."}
    )
    rows: str = field(default=",".join(ROWS), metadata={"help": f"Comma-separated rows: {', '.join(ROWS)}."})
    max_steps: int = field(default=960, metadata={"help": "Optimizer steps of every run."})
    sync_every: int = field(default=8, metadata={"help": "H of the sync (after GRPO's ramp 1, 3, 7, ...)."})
    save_steps: int = field(default=0, metadata={"help": "Checkpoint interval (0: twice sync_every)."})
    min_faults: int = field(default=20, metadata={"help": "Faults of the drawn schedule, at least."})
    episodes: str = field(
        default="",
        metadata={
            "help": f"Smoke runs: these episodes, in this order, instead of the drawn ones ({', '.join(EPISODES)})."
        },
    )
    ft_timeout: float = field(default=10.0, metadata={"help": "grpo_ft_timeout (the lighthouse's join timeout: 3x)."})
    stop_seconds: float = field(
        default=0.0, metadata={"help": "How long `stop` freezes a group (0: 2.5 x ft_timeout)."}
    )
    step_seconds: float = field(default=0.25, metadata={"help": "Sleep per batch trained (a larger model's compute)."})
    lighthouse_min_replicas: int = field(
        default=1,
        metadata={"help": "The lighthouse's --min_replicas (1: as grpo_ft_min_replicas; 2: a lone group waits)."},
    )
    relaunch_delay: float = field(
        default=2.0, metadata={"help": "Seconds between a killed group's exit and relaunch."}
    )
    event_timeout: float = field(
        default=240.0, metadata={"help": "Seconds an armed fault waits for its event (a heal, a save, ...)."}
    )
    timeout: int = field(default=7200, metadata={"help": "Seconds before a run is killed and recorded as hung."})
    report: bool = field(default=False, metadata={"help": "Only print and write the table of the result files."})


# ----------------------------------------------------------------------------------------------------------------
# The schedule
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Episode:
    kind: str
    targets: list[int]  # the groups it hurts, in order (none for `lighthouse`; `heal-source`: the group lost first)
    gap: int  # intervals after the run settled (0 or 1)
    offsets: list[int]  # steps into the interval where its step-keyed faults fall
    down: int  # `lighthouse`: intervals without it


def draw_schedule(seed: int, every: int, min_faults: int, kinds: list[str] | None = None) -> list[Episode]:
    """The episodes of `seed`: every kind once, more drawn until `min_faults` faults, shuffled, `last-sync` last (or
    `kinds` in their order)."""
    rng = random.Random(seed)
    if kinds is None:
        kinds = [kind for kind in EPISODES if kind != "last-sync"]
        extra = [kind for kind in kinds if kind != "lighthouse"]
        while sum(len(EPISODES[k]) for k in kinds) + 1 < min_faults:
            kinds.append(rng.choice(extra))
        rng.shuffle(kinds)
        kinds.append("last-sync")
    unknown = [kind for kind in kinds if kind not in EPISODES]
    if unknown:
        raise ValueError(f"unknown episodes {unknown}; use {', '.join(EPISODES)}.")
    episodes = []
    for kind in kinds:
        victims = {"lighthouse": 0, "two": 2, "take-over": 2}.get(kind, 1)
        episodes.append(Episode(kind, rng.sample(range(REPLICAS), victims), gap=rng.randint(0, 1),
                                offsets=sorted(rng.sample(range(1, every - 1), 2)), down=rng.randint(1, 2)))  # fmt: skip
    return episodes


def planned_faults(episodes: list[Episode]) -> int:
    return sum(len(EPISODES[e.kind]) for e in episodes)


# ----------------------------------------------------------------------------------------------------------------
# Worker side: the hooks a group's process holds at when armed, and the record of what it trained
# ----------------------------------------------------------------------------------------------------------------


class FaultHooks:
    """
    In a group's process: at each event the launcher may arm (`exchange`, `heal`, `heal-source`, `checkpoint`,
    `take-over`), read `arm-r<replica>.json`; when it names this event (at step `min_step` or later), write the marker
    `at-<episode>-r<replica>.json` and hold until the launcher's signal arrives (at most `HOLD_S`).
    """

    def __init__(self, run_dir: Path, replica: int):
        self.run_dir, self.replica = run_dir, replica
        self.arm = run_dir / f"arm-r{replica}.json"

    def reached(self, event: str, step: int) -> None:
        try:
            arm = json.loads(self.arm.read_text())
        except (OSError, ValueError):  # not armed (or being replaced)
            return
        if arm["event"] != event or step < arm.get("min_step", 0):
            return
        marker = {"replica": self.replica, "pid": os.getpid(), "event": event, "step": step, "time": time.time()}
        _write_json(self.run_dir / f"at-{arm['id']}-r{self.replica}.json", marker)
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline:  # the SIGKILL lands here
            time.sleep(0.01)
        marker["released"] = time.time()  # no signal came: the launcher records the fault as not injected
        _write_json(self.run_dir / f"at-{arm['id']}-r{self.replica}.json", marker)


def install_fault_hooks(trainer, job: dict) -> None:
    """`bench_faults.worker`'s `setup`: the events of `FaultHooks`; every micro-batch trained and each sync's kept
    members recorded."""
    from transformers import TrainerCallback

    import grpo_hf.fault_tolerance as fault_tolerance_module
    from grpo_hf.compression.fragment import Fragment
    from grpo_hf.compression.torchft_group import TorchFTCommunicator

    run_dir, replica = Path(job["run_dir"]), job["replica"]
    hooks = FaultHooks(run_dir, replica)
    state = trainer.grpo_comm_state
    flags = {"exchange": False}

    exchange, start = Fragment.exchange, TorchFTCommunicator._start

    def exchange_marked(self, *args, **kwargs):  # a fragment's exchange: its first collective is the event
        flags["exchange"] = True
        try:
            return exchange(self, *args, **kwargs)
        finally:
            flags["exchange"] = False

    def start_marked(self, call):
        works = start(self, call)
        if flags["exchange"]:
            flags["exchange"] = False
            hooks.reached("exchange", state.step)
        return works

    take_received = TorchFTCommunicator._take_received

    def take_received_marked(self):  # the healer, right after the quorum that healed it
        if self.received:
            hooks.reached("heal", trainer.state.global_step)
        return take_received(self)

    heal_state = fault_tolerance_module.trainer_heal_state

    def heal_state_marked(live):  # a live group, asked for what a healing one receives
        hooks.reached("heal-source", live.state.global_step)
        return heal_state(live)

    save_model = trainer.save_model

    def save_model_marked(output_dir=None, _internal_call=False):  # a checkpoint: the model is in, the rest not yet
        save_model(output_dir, _internal_call)
        if _internal_call:
            hooks.reached("checkpoint", trainer.state.global_step)

    class TakeOver(TrainerCallback):
        def on_step_begin(self, args, control_state, control, **kwargs):
            shares = trainer.grpo_replica_shares
            if shares is not None and shares.extras_at(control_state.global_step + 1):
                hooks.reached("take-over", control_state.global_step + 1)

    Fragment.exchange, TorchFTCommunicator._start = exchange_marked, start_marked
    TorchFTCommunicator._take_received = take_received_marked
    fault_tolerance_module.trainer_heal_state = heal_state_marked
    trainer.save_model = save_model_marked
    trainer.add_callback(TakeOver())
    trainer.add_callback(_record_kept_members(trainer, run_dir / f"kept-r{replica}-a{job['attempt']}.txt"))
    _record_trained(trainer, run_dir / f"trained-r{replica}-a{job['attempt']}.txt")


def _record_trained(trainer, path: Path) -> None:
    """
    Append a line `step source source_step digest` for every micro-batch `trainer` trains, labelled with the unit it
    came from, as `tests/distributed/fault_tolerant.py` does; and `step source source_step dropped` for each unit the
    group was to take over at that step whose batches were no longer kept (it trains nothing of it).

    The labels are those of the micro-batches [`~grpo_hf.replica_shares.SharedBatches.batches`] gave the step (each
    unit still kept, in the order of `extras_at(step)`, as many micro-batches as it holds), recorded as it gives
    them; `training_step` trains the step's first own micro-batch, then those, then its other own ones. Labelling by
    the position in `extras_at(step)` alone would shift every later label of the step past a unit left out.

    Args:
        trainer ([`~grpo_hf.GRPOTrainer`]): a fault-tolerant group's trainer (`grpo_ft_take_over` or not).
        path (`Path`): the record, appended to a line at a time (`trained-r<replica>-a<attempt>.txt`).
    """
    from grpo_hf.replica_shares import SharedBatches

    compute_loss, seen = trainer.compute_loss, {"step": None, "index": 0, "taken": (None, [])}
    out = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life, a line at a time)
    batches = SharedBatches.batches

    def batches_recorded(self, units):  # in `get_batch_samples`, before the step's first micro-batch is trained
        step, taken = trainer.state.global_step + 1, []
        for unit in units:
            if unit in self.kept:
                taken += [tuple(unit)] * len(self.kept[unit])
            else:
                out.write(f"{step} {unit[0]} {unit[1]} dropped\n")
        seen["taken"] = (step, taken)
        return batches(self, units)

    def compute_loss_recorded(model, inputs, *args, **kwargs):
        step = trainer.state.global_step + 1
        seen["index"] = seen["index"] + 1 if seen["step"] == step else 0
        seen["step"] = step
        taken_step, taken = seen["taken"]
        units = [(trainer.grpo_fault_tolerance.replica_id, step)] + (taken if taken_step == step else [])
        source, source_step = units[seen["index"]] if seen["index"] < len(units) else units[0]  # its own, after
        digest = hashlib.sha256(inputs["input_ids"].cpu().numpy().tobytes()).hexdigest()[:16]
        out.write(f"{step} {source} {source_step} {digest}\n")
        return compute_loss(model, inputs, *args, **kwargs)

    SharedBatches.batches = batches_recorded
    trainer.compute_loss = compute_loss_recorded


def _record_kept_members(trainer, path: Path):
    """
    A callback that appends `step participants members` after each sync of `trainer` (and the quorum that follows
    it): the replica ids whose local steps the sync kept, comma-separated (`-`: it was discarded; `?`: not known).
    A group killed right after a sync (in the quorum that follows it, a heal's for instance) never writes its own
    progress record of that sync: the survivors' lines say whether its window is in the global model.

    Args:
        trainer ([`~grpo_hf.GRPOTrainer`]): a fault-tolerant group's trainer.
        path (`Path`): the record (`kept-r<replica>-a<attempt>.txt`).
    """
    from transformers import TrainerCallback

    comm = trainer.grpo_comm_state
    out = open(path, "a", buffering=1)  # noqa: SIM115 (open for the process's life, a line at a time)

    class KeptMembers(TrainerCallback):
        seen = 0

        def on_step_end(self, args, state, control, **kwargs):  # after GRPOCallback's: the sync and its quorum
            events = getattr(comm, "participants", [])  # as `bench_faults.worker`'s `syncs` reads them
            for participants in events[self.seen :]:
                members = getattr(comm, "kept_members", None)
                names = "?" if members is None and participants else ",".join(map(str, members or ())) or "-"
                out.write(f"{state.global_step} {participants} {names}\n")
            self.seen = len(events)

    return KeptMembers()


def read_kept_members(path: Path) -> list[list]:
    """
    The lines of [`_record_kept_members`] as `[step, members]`: the kept replica ids (`[]`: the sync was discarded;
    `None`: not known).
    """
    kept = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = line.split()
        if len(parts) != 3:  # the last line of a killed process may be cut
            continue
        step, participants, names = parts
        discarded, known = names == "-" or participants == "0", names != "?"
        members = [] if discarded else list(map(int, names.split(","))) if known else None
        kept.append([int(step), members])
    return kept


def _last_error(log: Path) -> str:
    """The last line of a process's log that names an exception (`GRPOError: ...`), or ''."""
    lines = log.read_text(errors="replace")[-20000:].splitlines() if log.exists() else []
    return next((line.strip()[:300] for line in reversed(lines) if re.match(r"^[\w.]*(Error|Exception): ", line)), "")


def _write_json(path: Path, value) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(value))
    os.replace(partial, path)


# ----------------------------------------------------------------------------------------------------------------
# Launcher side: the lighthouse, the groups, the injector
# ----------------------------------------------------------------------------------------------------------------


class LighthouseProcess:
    """torchft's lighthouse as a process of its own on a fixed port: killed, and started again on that port."""

    def __init__(self, run_dir: Path, join_timeout_s: float, min_replicas: int):
        from tests.testing_utils import free_port

        self.port, self.join_timeout_s, self.min_replicas, self.process = (
            free_port(),
            join_timeout_s,
            min_replicas,
            None,
        )
        self.log = run_dir / "log-lighthouse.txt"

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def up(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        from grpo_hf.compression.torchft_group import lighthouse_status

        binary = Path(sys.executable).parent / "torchft_lighthouse"
        command = [str(binary), "--bind", f"[::]:{self.port}", "--min_replicas", str(self.min_replicas), "--join_timeout_ms",
                   str(int(self.join_timeout_s * 1000)), "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "2000"]  # fmt: skip
        with open(self.log, "a") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                            env={**os.environ, "RUST_LOG": "error"}, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 30
        while lighthouse_status(self.address, timeout=1) is None:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the lighthouse did not start on port {self.port}:\n{self.log.read_text()[-2000:]}"
                )
            time.sleep(0.2)

    def kill(self) -> None:
        if self.up:
            self.process.kill()
            self.process.wait()


@dataclass
class Wait:
    """What an episode waits for: `until()` truthy (its value is sent back), or `timeout` seconds (None is sent)."""

    until: object
    timeout: float | None = None
    started: float = field(default_factory=time.monotonic)

    def expired(self) -> bool:
        return self.timeout is not None and time.monotonic() - self.started > self.timeout


class RunFailed(RuntimeError):
    """A run that hung past `--timeout`, or whose groups crashed too often: recorded in its result as `failed`."""


class Injector:
    """
    One run's launching process: the lighthouse, the three groups' processes (relaunched after each death), and the
    episodes of the schedule, each a generator that yields what it waits for (`Wait`) and sends the signals.
    """

    def __init__(self, launches: Launches, lighthouse: LighthouseProcess, args: SoakArguments, max_steps: int):
        from grpo_hf.compression.schedule import fragments_due, ramp_points

        self.launches, self.lighthouse, self.args, self.max_steps = launches, lighthouse, args, max_steps
        self.run_dir, self.every = launches.run_dir, args.sync_every
        self.syncs = [s for s in range(1, max_steps + 1) if fragments_due(s, self.every)]
        self.ramp_end = max(ramp_points(self.every), default=0)  # faults fall in intervals of H steps
        self.procs: dict[int, subprocess.Popen] = {}
        self.attempts = dict.fromkeys(range(REPLICAS), -1)
        self.exited: set[int] = set()  # pids whose exit was handled
        self.killed: set[int] = set()  # pids this process killed
        self.relaunch_at: dict[int, float] = {}  # replica -> when (monotonic)
        self.held: set[int] = set()  # killed replicas whose relaunch waits for the episode
        self.stopped: set[int] = set()  # replicas frozen now
        self.frozen: set[int] = set()  # pids ever frozen
        self.faults: list[dict] = []
        self.exits: list[dict] = []
        self.episode_log: list[dict] = []
        self.mark_step = 0  # the leader's step at the last fault (the run settles after a kept sync of 3 beyond it)
        self.cache: dict[Path, tuple] = {}
        self.started = time.time()

    # --- the groups ---
    def launch(self, replica: int) -> None:
        self.attempts[replica] += 1
        attempt = self.attempts[replica]
        job = {**self.launches.job, "kind": "grpo-ft", "replica": replica, "attempt": attempt, "kill_step": -1}
        self.procs[replica] = self.launches.start(f"r{replica}-a{attempt}", [sys.executable, "-m", __spec__.name], job,
                                                  {"TORCHFT_LIGHTHOUSE": self.lighthouse.address})  # fmt: skip

    def record(self, replica: int) -> dict | None:
        """The progress record of `replica`'s current process (None before its first step)."""
        path = self.run_dir / f"progress-r{replica}-a{self.attempts[replica]}.json"
        try:
            stat = path.stat()
        except FileNotFoundError:
            return None
        key = (stat.st_mtime_ns, stat.st_size)
        if self.cache.get(path, (None,))[0] != key:
            with contextlib.suppress(ValueError):
                self.cache[path] = (key, json.loads(path.read_text()))
        return self.cache.get(path, (None, None))[1]

    def alive(self, replica: int) -> bool:
        proc = self.procs.get(replica)
        return proc is not None and proc.poll() is None

    def step(self, replica: int) -> int:
        record = self.record(replica) if self.alive(replica) else None
        return record["last_step"] if record else -1

    def leader(self) -> int:
        return max(self.step(r) for r in range(REPLICAS))

    def settled(self) -> bool:
        """The three groups alive, none frozen, the lighthouse up, and each through a sync of all three since the
        last fault."""
        if self.stopped or self.relaunch_at or self.held or not self.lighthouse.up:
            return False
        for replica in range(REPLICAS):
            record = self.record(replica) if self.alive(replica) else None
            if not record or not any(p == REPLICAS and at > self.mark_step for at, p in record["syncs"]):
                return False
        return True

    def interval_after(self, step: int) -> int:
        """The sync step that opens the first interval starting at `step` or later."""
        return next((s for s in self.syncs if s >= step), self.max_steps)

    # --- signals ---
    def arm(self, replica: int, event: str, episode: int, min_step: int = 0) -> None:
        _write_json(self.run_dir / f"arm-r{replica}.json", {"event": event, "id": episode, "min_step": min_step})

    def disarm(self, replica: int) -> None:
        (self.run_dir / f"arm-r{replica}.json").unlink(missing_ok=True)

    def marker(self, episode: int) -> dict | None:
        for path in sorted(self.run_dir.glob(f"at-{episode}-r*.json")):
            with contextlib.suppress(ValueError, OSError):
                marker = json.loads(path.read_text())
                proc = self.procs.get(marker["replica"])
                if (
                    "released" not in marker
                    and proc is not None
                    and proc.pid == marker["pid"]
                    and self.alive(marker["replica"])
                ):
                    return marker
        return None

    def fault(self, kind: str, episode: int, replica: int | None, **detail) -> dict:
        record = {"kind": kind, "episode": episode, "replica": replica, "time": time.time(), "step": self.leader(),
                  "injected": True, **detail}  # fmt: skip
        self.faults.append(record)
        self.mark_step = max(self.mark_step, record["step"])
        print(f"  [{time.time() - self.started:7.1f} s] {kind} of "
              f"{'the lighthouse' if replica is None else f'group {replica}'} at step {record['step']}", flush=True)  # fmt: skip
        return record

    def missed(self, kind: str, episode: int, why: str) -> None:
        self.faults.append({"kind": kind, "episode": episode, "replica": None, "time": time.time(),
                            "step": self.leader(), "injected": False, "why": why})  # fmt: skip
        print(f"  [{time.time() - self.started:7.1f} s] {kind} NOT injected: {why}", flush=True)

    def kill(self, replica: int, kind: str, episode: int, hold: bool = False, **detail) -> None:
        self.disarm(replica)
        proc = self.procs[replica]
        with contextlib.suppress(ProcessLookupError):  # it died on its own an instant before: its exit says how
            os.kill(proc.pid, signal.SIGKILL)
        self.killed.add(proc.pid)
        if hold:
            self.held.add(replica)
        self.fault(kind, episode, replica, pid=proc.pid, **detail)

    def release(self, replica: int) -> None:
        self.held.discard(replica)
        if not self.alive(replica):
            self.relaunch_at.setdefault(replica, time.monotonic() + self.args.relaunch_delay)

    # --- the loop ---
    def poll(self) -> None:
        """Exits (each recorded; a killed or crashed group relaunched after the delay), due relaunches."""
        now = time.monotonic()
        for replica, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or proc.pid in self.exited:
                continue
            self.exited.add(proc.pid)
            log = self.launches.logs[[p.pid for p in self.launches.procs].index(proc.pid)]
            error = _last_error(log)
            if code == 0:
                how = "finished"
            elif proc.pid in self.killed and code == -signal.SIGKILL:
                how = "killed"
            elif STOP_MESSAGE in error:
                how = "late"  # relaunched after the others' last sync: the run is over
            elif proc.pid in self.frozen and BEHIND_MESSAGE in error:
                how = "woke-and-stopped"  # the frozen group itself, after SIGCONT, as documented
            else:
                how = "unexpected"
            self.exits.append({"replica": replica, "attempt": self.attempts[replica], "pid": proc.pid, "code": code,
                               "time": time.time(), "how": how, "error": error, "log": log.name})  # fmt: skip
            if how in ("unexpected", "woke-and-stopped"):
                print(f"  [{time.time() - self.started:7.1f} s] group {replica} exited with {code} ({how}, "
                      f"{log.name}): {error}", flush=True)  # fmt: skip
            if sum(1 for e in self.exits if e["how"] == "unexpected") > MAX_UNEXPECTED:
                raise RunFailed(f"{MAX_UNEXPECTED} unexpected exits")
            if how in ("killed", "woke-and-stopped", "unexpected") and replica not in self.held:
                self.relaunch_at[replica] = now + self.args.relaunch_delay
        for replica, when in list(self.relaunch_at.items()):
            if now >= when:
                del self.relaunch_at[replica]
                self.launch(replica)

    def done(self) -> bool:
        return not self.relaunch_at and not self.held and not any(self.alive(r) for r in range(REPLICAS))

    def run(self, episodes: list[Episode]) -> None:
        deadline = time.monotonic() + self.args.timeout
        self.lighthouse.start()
        for replica in range(REPLICAS):
            self.launch(replica)
        script = self.script(episodes)
        wait = next(script, None)
        while True:
            if time.monotonic() > deadline:
                raise RunFailed(f"still running after {self.args.timeout} s (--timeout)")
            self.poll()
            while wait is not None:
                value = wait.until()
                if not value and not wait.expired():
                    break
                try:
                    wait = script.send(value or None)
                except StopIteration:
                    wait = None
            if wait is None and self.done():
                return
            time.sleep(TICK_S)

    # --- the episodes ---
    def script(self, episodes: list[Episode]):
        """The episodes one after the other: each once the run settled, and not before its share of the run (the
        episodes spread evenly over the steps before the last intervals), then `gap` intervals more."""
        last_start = self.max_steps - RESERVE_INTERVALS * self.every
        share = (last_start - self.ramp_end) / max(1, sum(1 for e in episodes if e.kind != "last-sync"))
        skipping = False
        for index, episode in enumerate(episodes):
            settled = yield Wait(self.settled, SETTLE_TIMEOUT_S)
            if episode.kind != "last-sync":
                not_before = self.ramp_end + int(index * share)
                yield Wait(lambda step=not_before: self.leader() >= step)
            self.episode_log.append({"episode": index, "kind": episode.kind, "settled_before": bool(settled),
                                     "leader": self.leader(), "time": time.time()})  # fmt: skip
            base = self.interval_after(max(self.leader() + episode.gap * self.every, self.ramp_end))
            if episode.kind != "last-sync" and (skipping or base + episode.offsets[-1] > last_start):
                skipping = True  # too close to the end: not started (reported as not injected)
                for kind in EPISODES[episode.kind]:
                    self.missed(kind, index, "the run ended before its turn")
                continue
            yield from getattr(self, "_" + episode.kind.replace("-", "_"))(episode, index, base)
        self.episode_log.append(
            {"episode": len(episodes), "kind": "end", "leader": self.leader(), "time": time.time()}
        )

    def at_step(self, replica: int, step: int) -> Wait:
        return Wait(lambda: self.step(replica) >= step, self.args.event_timeout)

    def event(self, episode: int) -> Wait:
        return Wait(lambda: self.marker(episode), self.args.event_timeout)

    def _step_kill(self, replica: int, step: int, kind: str, index: int, **kwargs):
        reached = yield self.at_step(replica, step)
        if not reached or not self.alive(replica):
            return self.missed(kind, index, f"group {replica} did not reach step {step}")
        self.kill(replica, kind, index, **kwargs)

    def _marked_kill(self, kind: str, index: int, armed: list[int]):
        marker = yield self.event(index)
        for replica in armed:
            self.disarm(replica)
        if marker is None:
            return self.missed(kind, index, "its event did not come")
        self.kill(marker["replica"], kind, index, event=marker["event"], event_step=marker["step"])
        return marker

    def _kill(self, episode, index, base):
        yield from self._step_kill(episode.targets[0], base + episode.offsets[0], "kill", index)

    def _exchange(self, episode, index, base):
        self.arm(episode.targets[0], "exchange", index, min_step=base + 1)
        yield from self._marked_kill("exchange", index, episode.targets)

    def _last_sync(self, episode, index, base):
        self.arm(episode.targets[0], "exchange", index, min_step=self.max_steps)
        marker = yield Wait(lambda: self.marker(index), self.args.timeout)
        self.disarm(episode.targets[0])
        if marker is None:
            return self.missed("last-sync", index, "the last sync did not come")
        self.kill(marker["replica"], "last-sync", index, event=marker["event"], event_step=marker["step"])

    def _checkpoint(self, episode, index, base):
        replica = episode.targets[0]
        self.arm(replica, "checkpoint", index, min_step=base + 1)
        marker = yield self.event(index)
        self.disarm(replica)
        if marker is None:
            return self.missed("checkpoint", index, "no checkpoint was written")
        folder = self.run_dir / f"replica{replica}" / f"checkpoint-{marker['step']}"
        written = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
        self.kill(replica, "checkpoint", index, event_step=marker["step"], written=written,
                  partial="trainer_state.json" not in written)  # fmt: skip

    def _heal_healer(self, episode, index, base):
        replica = episode.targets[0]
        yield from self._step_kill(replica, base + episode.offsets[0], "kill", index)
        self.arm(replica, "heal", index)  # read by its relaunch
        yield from self._marked_kill("heal-healer", index, [replica])

    def _heal_source(self, episode, index, base):
        lost = episode.targets[0]
        yield from self._step_kill(lost, base + episode.offsets[0], "kill", index)
        live = [r for r in range(REPLICAS) if r != lost]
        for replica in live:
            self.arm(replica, "heal-source", index)
        yield from self._marked_kill("heal-source", index, live)

    def _take_over(self, episode, index, base):
        lost, taker = episode.targets
        yield from self._step_kill(lost, base + episode.offsets[0], "kill", index, hold=True)
        self.arm(taker, "take-over", index)
        yield from self._marked_kill("take-over", index, [taker])
        self.release(lost)

    def _two(self, episode, index, base):
        first, second = episode.targets
        (witness,) = set(range(REPLICAS)) - {first, second}  # the one left: the faults are keyed on its steps
        for replica, offset in zip((first, second), episode.offsets):
            reached = yield self.at_step(witness, base + offset)
            if not reached or not self.alive(replica):
                self.missed("two", index, f"group {witness} did not reach step {base + offset}")
                continue
            self.kill(replica, "two", index)

    def _stop(self, episode, index, base):
        replica = episode.targets[0]
        reached = yield self.at_step(replica, base + episode.offsets[0])
        if not reached or not self.alive(replica):
            return self.missed("stop", index, f"group {replica} did not reach its step")
        pid = self.procs[replica].pid
        os.kill(pid, signal.SIGSTOP)
        self.stopped.add(replica)
        self.frozen.add(pid)
        record = self.fault("stop", index, replica, pid=pid, seconds=self.args.stop_seconds)
        yield Wait(lambda: False, self.args.stop_seconds)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        self.stopped.discard(replica)
        record["continued"] = time.time()
        self.mark_step = max(self.mark_step, self.leader())

    def _lighthouse(self, episode, index, base):
        down_at = base + episode.offsets[0]
        reached = yield Wait(lambda: self.leader() >= down_at, self.args.event_timeout)
        if not reached:
            return self.missed("lighthouse", index, f"no group reached step {down_at}")
        self.lighthouse.kill()
        record = self.fault("lighthouse", index, None, down_intervals=episode.down)
        yield Wait(lambda: self.leader() >= down_at + episode.down * self.every, self.args.event_timeout)
        self.lighthouse.start()
        record["restarted"] = time.time()
        self.mark_step = max(self.mark_step, self.leader())

    def stop_all(self) -> None:
        for replica in list(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[replica].pid, signal.SIGCONT)
        self.launches.stop()
        self.lighthouse.kill()


# ----------------------------------------------------------------------------------------------------------------
# One run, and what it measured
# ----------------------------------------------------------------------------------------------------------------


def run_one(row: str, seed: int, args: SoakArguments, info: dict, out: Path) -> dict:
    """Train `row` of `seed` end to end (its schedule when `soak`); returns its result."""
    import shutil

    max_steps = training_task(args.max_steps).max_steps
    kinds = args.episodes.split(",") if args.episodes else None
    episodes = draw_schedule(seed, args.sync_every, args.min_faults, kinds)
    run_dir = out / "runs" / f"{row}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a run is whole or not at all
    run_dir.mkdir(parents=True)
    job = {"row": row, "seed": seed, "info": info, "max_steps": max_steps, "run_dir": str(run_dir),
           "sync_every": args.sync_every, "step_seconds": args.step_seconds, "ft_timeout": args.ft_timeout,
           "save_steps": args.save_steps, "every_final": True}  # fmt: skip
    launches = Launches(run_dir, job, time.monotonic() + args.timeout + 600)
    injector = Injector(
        launches, LighthouseProcess(run_dir, 3 * args.ft_timeout, args.lighthouse_min_replicas), args, max_steps
    )
    settings = {k: getattr(args, k) for k in ("sync_every", "save_steps", "ft_timeout", "stop_seconds",
                                               "step_seconds", "relaunch_delay", "min_faults", "episodes", "lighthouse_min_replicas")}  # fmt: skip
    result = {"row": row, "seed": seed, "max_steps": max_steps, "replicas": REPLICAS, **settings,
              "schedule": [asdict(e) for e in episodes] if row == "soak" else [],
              "planned_faults": planned_faults(episodes) if row == "soak" else 0,
              "commit": commit(), "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    start = time.time()
    try:
        injector.run(episodes if row == "soak" else [])
    except RunFailed as err:
        result["failed"] = str(err)
    finally:
        injector.stop_all()
    result.update(faults=injector.faults, exits=injector.exits, episode_log=injector.episode_log,
                  end_s=time.time() - start)  # fmt: skip
    finished = [e["time"] for e in injector.exits if e["code"] == 0]
    result["wall_s"] = (max(finished) - start) if finished else None
    instances = {p.stem.removeprefix("progress-"): json.loads(p.read_text()) for p in run_dir.glob("progress-*.json")}
    for key, record in instances.items():  # each sync's kept members (the unit accounting reads the survivors')
        record["kept"] = read_kept_members(run_dir / f"kept-{key}.txt")
    eval_loss = None
    final = next((f"final-r{e['replica']}.pt" for e in injector.exits if e["how"] == "finished"), None)
    if final is not None and "failed" not in result:  # the first group that trained to the end: its model
        launches.deadline = time.monotonic() + 600
        eval_job = {**job, "kind": "eval", "final": final}
        if launches.wait(launches.start("eval", [sys.executable, "-m", __spec__.name], eval_job)) == 0:
            eval_loss = json.loads((run_dir / "eval.json").read_text())["eval_loss"]
    result.update(aggregate("soak", instances, max_steps, eval_loss if eval_loss is not None else math.nan))
    result["row"] = row
    result["heals"] = sum(1 for r in instances.values() if (r.get("first_step") or 0) > 0)  # processes that healed
    for fault in (f for f in injector.faults if f["kind"] == "stop" and f["injected"]):
        after = next((e for e in injector.exits if e["pid"] == fault["pid"]), None)
        fault["after"] = "went on" if after is None or after["how"] != "woke-and-stopped" else after["error"]
    if eval_loss is None:
        result["perplexity"] = None
    result["units"] = unit_accounting(run_dir, instances, max_steps, injector.syncs)
    result["waits"] = fault_waits(result) if row == "soak" else []
    result["logs"] = str(run_dir)
    for folder in run_dir.glob("replica*"):
        shutil.rmtree(folder, ignore_errors=True)  # checkpoints
    for path in run_dir.glob("final-r*.pt"):
        path.unlink()
    return result


def _fate(record: dict | None, step: int) -> str:
    """What became of a micro-batch trained at `step` by a process (its progress record), as that record says: `kept`
    when the first sync at or after `step` was kept (or the process finished: its last step syncs), `discarded`, or
    `lost` when the record ends before that sync (the process died: [`_survivors_fate`] may still find it kept)."""
    if record is None:  # killed before its first step ended
        return "lost"
    sync = next((p for at, p in record["syncs"] if at >= step), None)
    if sync is None:
        return "kept" if record.get("done") else "lost"
    return "kept" if sync else "discarded"


def _survivors_fate(key: str, instances: dict, sync: int, reached: bool) -> str | None:
    """
    What the processes other than `key` recorded of the sync at step `sync`: `discarded` when one recorded it
    discarded, `kept` when `key`'s replica is among the kept members one recorded and `key` trained step `sync` itself
    (`reached`: a process killed before it took no part), else `None`.

    Args:
        key (`str`): the process, `r<replica>-a<attempt>`.
        instances (`dict`): every process's progress record, with `kept` (`[step, members]` each,
            [`read_kept_members`]) where recorded.
        sync (`int`): the step of the sync that closed the window.
        reached (`bool`): whether `key` trained step `sync`.
    """
    replica = int(key[1:].split("-")[0])
    fate = None
    for other, record in instances.items():
        if other == key or record is None:
            continue
        if any(at == sync and not p for at, p in record["syncs"]):
            return "discarded"
        if reached and any(at == sync and members and replica in members for at, members in record.get("kept", [])):
            fate = "kept"
    return fate


def read_trained(run_dir: Path) -> dict[str, list[tuple[int, tuple[int, int], str]]]:
    """
    Every process's record of what it trained ([`_record_trained`]), by process (`r<replica>-a<attempt>`): `(step,
    unit, digest)` per line, the digest `dropped` for a unit it was to take over but no longer held.
    """
    trained = {}
    for path in run_dir.glob("trained-r*-a*.txt"):
        lines = []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) != 4 or not (parts[3] == "dropped" or len(parts[3]) == 16):  # a killed process's cut line
                continue
            lines.append((int(parts[0]), (int(parts[1]), int(parts[2])), parts[3]))
        trained[path.stem.removeprefix("trained-")] = lines
    return trained


def unit_accounting(run_dir: Path, instances: dict, max_steps: int, syncs: list[int]) -> dict:
    """[`count_units`] over the records of the run in `run_dir` (`trained-r<replica>-a<attempt>.txt`)."""
    return count_units(read_trained(run_dir), instances, max_steps, syncs)


def count_units(trained: dict, instances: dict, max_steps: int, syncs: list[int]) -> dict:
    """
    Every batch of the run (a unit: one group's batch of one step) in the final model once? A micro-batch a process
    trained is in it when the sync that closed its window kept that process's local steps ([`_fate`]: its own
    record of the sync, or, when it died before recording it, the kept members the survivors recorded). The units in
    no final model split into lost by a discarded sync, lost in the last window (a catch-up would fall after the last
    step), and unexplained (of those, `no_longer_kept`: a group was to take it over, but its batches were no longer
    kept); a unit trained twice must be the same data (its digest).

    Args:
        trained (`dict`): [`read_trained`]'s lines, by process.
        instances (`dict`): every process's progress record, by process (`r<replica>-a<attempt>`), with `kept`.
        max_steps (`int`): the run's last step.
        syncs (`list[int]`): the steps that sync (the last step syncs too).
    """
    kept, fates, digests, dropped = Counter(), defaultdict(set), defaultdict(set), set()
    last_window = _last_window(syncs, max_steps)
    for key, lines in trained.items():
        record, survivors = instances.get(key), {}
        reached = {step for step, _, digest in lines if digest != "dropped"}
        for step, unit, digest in lines:
            if digest == "dropped":  # no longer kept: not trained here
                dropped.add(unit)
                continue
            digests[unit].add(digest)
            fate = _fate(record, step)
            if fate == "lost":  # its record ends before the sync that closed the window: the survivors' record of it
                sync = next((s for s in syncs if s >= step), max_steps)
                if sync not in survivors:
                    survivors[sync] = _survivors_fate(key, instances, sync, sync in reached)
                fate = survivors[sync] or "lost"
            if fate == "kept":
                kept[unit] += 1
            else:
                fates[unit].add("discarded" if fate == "discarded" else ("last" if step > last_window else "lost"))
    planned = [(r, s) for r in range(REPLICAS) for s in range(1, max_steps + 1)]
    missing = [u for u in planned if kept[u] == 0]
    discarded = [u for u in missing if "discarded" in fates[u]]
    last = [u for u in missing if u not in discarded and "last" in fates[u]]
    unexplained = sorted(set(missing) - set(discarded) - set(last))
    not_kept = [u for u in unexplained if u in dropped]
    twice = sorted(u for u in planned if kept[u] > 1)
    mismatched = sorted(u for u, found in digests.items() if len(found) > 1)
    return {"planned": len(planned), "once": sum(1 for u in planned if kept[u] == 1), "discarded": len(discarded),
            "last_window": len(last), "unexplained": len(unexplained), "no_longer_kept": len(not_kept),
            "twice": len(twice), "mismatched": len(mismatched),
            "examples": {"unexplained": unexplained[:10], "no_longer_kept": not_kept[:10], "twice": twice[:10],
                         "mismatched": mismatched[:10]}}  # fmt: skip


def _last_window(syncs: list[int], max_steps: int) -> int:
    """The step that opens the run's last interval (its last sync before the final step's)."""
    return max((s for s in syncs if s < max_steps), default=0)


def _gaps(record: dict) -> dict[int, float]:
    """Seconds each step of a process took, from its end to the previous step's end (its first step has none)."""
    steps = range(record["first_step"] + 1, record["last_step"] + 1) if record.get("first_step") is not None else []
    times = dict(zip(steps, record.get("times", [])))
    return {s: times[s] - times[s - 1] for s in steps if s - 1 in times}


def _typical_gaps(result: dict) -> tuple[float, float]:
    """The median step, and the median step that ends with a sync, over a run's processes."""
    syncs = {at for record in result["instances"].values() for at, _ in record["syncs"]}
    plain, synced = [], []
    for record in result["instances"].values():
        extras = {s for s, _ in record.get("taken_over", [])}
        for step, gap in _gaps(record).items():
            if step not in extras:
                (synced if step in syncs else plain).append(gap)
    return (statistics.median(plain) if plain else math.nan, statistics.median(synced) if synced else math.nan)


def fault_waits(result: dict) -> list[dict]:
    """
    Per fault injected: the seconds the groups it did not hurt lost, from it to the next fault (or the end): the sum
    of their steps' excess over the typical step (the run's own medians, which most steps, far from a fault, set: a
    step, a step that syncs, and a step that trains batches taken over as that many steps), averaged over those groups.
    The run's own, not the fault-free run's: on shared cores the load moves between the two runs.
    """
    plain, synced = _typical_gaps(result)
    faults = sorted((f for f in result["faults"] if f["injected"]), key=lambda f: f["time"])
    by_replica = defaultdict(list)
    for key, record in result["instances"].items():  # `r<replica>-a<attempt>`
        extras = dict((s, n) for s, n in record.get("taken_over", []))
        syncs = {at for at, _ in record["syncs"]}
        steps = (
            range(record["first_step"] + 1, record["last_step"] + 1) if record.get("first_step") is not None else []
        )
        times = dict(zip(steps, record.get("times", [])))
        for step, gap in _gaps(record).items():
            typical = (synced if step in syncs else plain) + plain * extras.get(step, 0)
            by_replica[int(key[1:].split("-")[0])].append((times[step], max(0.0, gap - typical)))
    waits = []
    for index, fault in enumerate(faults):
        end = faults[index + 1]["time"] if index + 1 < len(faults) else math.inf
        hurt = {fault["replica"]} | {f["replica"] for f in faults if f["episode"] == fault["episode"]}
        lost = [sum(x for t, x in excess if fault["time"] < t <= end) for replica, excess in by_replica.items()
                if replica not in hurt]  # fmt: skip
        waits.append({"kind": fault["kind"], "episode": fault["episode"], "waited_s": statistics.fmean(lost) if lost
                      else 0.0})  # fmt: skip
    return waits


# ----------------------------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------------------------


def _injected(run: dict) -> list[dict]:
    return [f for f in run.get("faults", []) if f["injected"]]


def survived(run: dict) -> int:
    """
    Faults after which the run settled again with no exit but the injector's kills meanwhile: the next episode found
    the run settled, and no group crashed from the episode's first fault to then; the last episode's: every group
    that lived to the end finished bit-identical, and nothing crashed after its first fault.
    """
    log = run.get("episode_log", [])
    starts = {e["episode"]: e.get("time", math.inf) for e in log}
    settled = {e["episode"] - 1 for e in log if e.get("settled_before")}
    end = max((e["episode"] for e in log), default=0) - 1
    first = {}
    for fault in _injected(run):
        first.setdefault(fault["episode"], fault["time"])
    crashes = [e["time"] for e in _unexpected(run)]

    def clean(episode: int) -> bool:
        until = starts.get(episode + 1, math.inf) if episode != end else math.inf
        return not any(first[episode] <= t <= until for t in crashes)

    whole = "failed" not in run and bool(run.get("replicas_identical"))
    return sum(1 for f in _injected(run) if clean(f["episode"]) and (f["episode"] in settled or (f["episode"] == end
                                                                                                   and whole)))  # fmt: skip


def _exits(run: dict, how: str) -> list[dict]:
    return [e for e in run.get("exits", []) if e["how"] == how]


def _unexpected(run: dict) -> list[dict]:
    return _exits(run, "unexpected")


def _finished(run: dict) -> int:
    return len(_exits(run, "finished"))


def bars(run: dict, base: dict | None) -> dict[str, bool]:
    """The issue's bars for one seed: True met, False missed."""
    units = run.get("units", {})
    last_sync = [f for f in _injected(run) if f["kind"] == "last-sync"]
    late = _exits(run, "late")
    identical = bool(run.get("replicas_identical")) and "failed" not in run
    identical = identical and (_finished(run) == REPLICAS or (_finished(run) == REPLICAS - len(last_sync)
                                                              and len(late) == len(last_sync)))  # fmt: skip
    ratio = _ratios(run, base)
    planned = run.get("planned_faults", 0)
    return {
        "every fault of the schedule injected (at least --min_faults, unless --episodes)": len(_injected(run))
        >= planned
        and (bool(run.get("episodes")) or planned >= run.get("min_faults", 0)),
        "every fault survived": survived(run) == len(_injected(run)) and "failed" not in run,
        "the groups bit-identical at the end (the last sync's victim, relaunched, stopped)": identical,
        "every batch trained once (or lost by a discarded sync, or in the last window)": bool(units)
        and units["unexplained"] == 0
        and units["twice"] == 0
        and units["mismatched"] == 0
        and (units["last_window"] == 0 or bool(last_sync)),
        "no survivor restarted (every exit: a kill, the end, a woken group's documented stop)": not _unexpected(run)
        and "failed" not in run,
        "perplexity within 1.02x the fault-free run": ratio["perplexity"] is not None and ratio["perplexity"] <= 1.02,
        "wall time within 1.5x the fault-free run": ratio["wall_s"] is not None and ratio["wall_s"] <= 1.5,
    }


def _ratios(run: dict, base: dict | None) -> dict:
    out = {}
    for key in ("wall_s", "perplexity"):
        a, b = run.get(key), (base or {}).get(key)
        out[key] = a / b if a and b and not (math.isnan(a) or math.isnan(b)) else None
    return out


def _num(value, fmt: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def load_results(results_dir: Path) -> dict[str, dict[int, dict]]:
    results: dict = {}
    for row in ROWS:
        for path in sorted(results_dir.glob(f"{row}-seed*.json")):
            record = json.loads(path.read_text())
            results.setdefault(record["row"], {})[record["seed"]] = record
    return results


def markdown(results: dict[str, dict[int, dict]]) -> str:
    soak, base = results.get("soak", {}), results.get("no-fault", {})
    lines = [
        "| seed | faults injected (by kind) | survived | wall s: soak / fault-free (ratio) | steps lost | batches "
        "trained once | lost: discarded sync / last window / unexplained; twice | syncs discarded | perplexity: "
        "soak / fault-free (ratio) | groups bit-identical | processes healed | frozen groups that went on after "
        "SIGCONT |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for seed in sorted(set(soak) | set(base)):
        run, ref = soak.get(seed), base.get(seed)
        if run is None:
            lines.append(
                f"| {seed} | (no soak run yet) |  | – / {_num((ref or {}).get('wall_s'), '.0f')} |" + " |" * 7
            )
            continue
        kinds = Counter(f["kind"] for f in _injected(run))
        by_kind = ", ".join(f"{kinds[k]} {k}" for k in FAULT_KINDS if kinds[k])
        missed = len(run["faults"]) - len(_injected(run))
        faults = f"**{len(_injected(run))}** of {run['planned_faults']}: {by_kind}" + (f" ({missed} not)" if missed
                                                                                       else "")  # fmt: skip
        if run.get("failed"):
            faults += f" — **run failed: {run['failed']}**"
        ratio = _ratios(run, ref)
        units = run.get("units", {})
        identical = f"{'yes' if run.get('replicas_identical') else '**no**'} ({_finished(run)} finished)"
        cells = [str(seed), faults, f"{survived(run)} / {len(_injected(run))}",
                 f"{_num(run.get('wall_s'), '.0f')} / {_num((ref or {}).get('wall_s'), '.0f')} "
                 f"({_num(ratio['wall_s'], '.3f')})", str(run.get("steps_lost", "–")),
                 f"{units.get('once', '–')} / {units.get('planned', '–')}",
                 f"{units.get('discarded', '–')} / {units.get('last_window', '–')} / {units.get('unexplained', '–')}"
                 + (f" ({units['no_longer_kept']} no longer kept)" if units.get("no_longer_kept") else "")
                 + f"; {units.get('twice', '–')}", str(run.get("syncs_discarded", "–")),
                 f"{_num(run.get('perplexity'), '.3f')} / {_num((ref or {}).get('perplexity'), '.3f')} "
                 f"({_num(ratio['perplexity'], '.4f')})", identical, str(run.get("heals", "–"))]  # fmt: skip
        stops = [f for f in _injected(run) if f["kind"] == "stop"]
        cells.append(f"{sum(1 for f in stops if f.get('after') == 'went on')} / {len(stops)}")
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for seed in sorted(soak):
        for exit in soak[seed].get("exits", []):
            if exit["how"] in ("unexpected", "woke-and-stopped"):
                who = "a frozen group, woken," if exit["how"] == "woke-and-stopped" else "**unasked**:"
                notes.append(f"- seed {seed}: group {exit['replica']} (`{exit['log']}`) {who} exited with "
                             f"{exit['code']}: `{exit['error'] or 'no error line'}`")  # fmt: skip
    if notes:
        lines += ["", "Exits that were not the injector's kills or the end of the run:", "", *notes]
    waits = defaultdict(list)
    for run in soak.values():
        for wait in run.get("waits", []):
            waits[wait["kind"]].append(wait["waited_s"])
    if waits:
        lines += ["", "| fault kind | faults (all seeds) | time waited per fault by the others: mean s | worst s |",
                  "|---|---:|---:|---:|"]  # fmt: skip
        for kind in [k for k in FAULT_KINDS if k in waits]:
            lines.append(f"| `{kind}` | {len(waits[kind])} | {statistics.fmean(waits[kind]):.1f} | "
                         f"{max(waits[kind]):.1f} |")  # fmt: skip
    if soak:
        seeds = sorted(soak)
        verdicts = {seed: bars(soak[seed], base.get(seed)) for seed in seeds}
        names = list(next(iter(verdicts.values())))
        lines += ["", "| bar | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
        for name in names:
            cells = ["met" if verdicts[s].get(name) else "**MISSED**" for s in seeds]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        any_run = soak[seeds[0]]
        lines += [
            "",
            f"{TASK}, {any_run['max_steps']} steps, {REPLICAS} fault-tolerant replica groups, the sync every "
            f"{any_run['sync_every']} steps, a checkpoint every {any_run['save_steps']} steps, "
            f"{any_run['step_seconds']:g} s of sleep per batch trained, grpo_ft_timeout {any_run['ft_timeout']:g} s, "
            f"`stop` {any_run['stop_seconds']:g} s, relaunch {any_run['relaunch_delay']:g} s after a death, the "
            f"lighthouse's --min_replicas {any_run.get('lighthouse_min_replicas', 1)}"
            + (f", episodes `{any_run['episodes']}`" if any_run.get("episodes") else "")
            + ". Wall time from the first launch to the last exit of a group that trained to the end; steps lost "
            "summed over the processes; a batch is one group's batch of one step, in the final model when the process "
            "that trained it kept the sync after it; time waited: the step time of the groups a fault did not hurt "
            "beyond the run's median step, from the fault to the next. `benchmarks/bench_soak_faults.py` says how "
            "each fault is timed.",
        ]
    return "\n".join(lines)


def report(results_dir: Path) -> str:
    text = markdown(load_results(results_dir))
    (results_dir / "soak_faults.md").write_text(text + "\n")
    return text


def main() -> None:
    from transformers import HfArgumentParser

    from benchmarks.tasks import TASKS, prepare

    (args,) = HfArgumentParser(SoakArguments).parse_args_into_dataclasses()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM: the groups and lighthouse go too
    args.save_steps = args.save_steps or 2 * args.sync_every
    args.stop_seconds = args.stop_seconds or 2.5 * args.ft_timeout
    results_dir = Path(args.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    if args.report:
        print(report(results_dir))
        return
    if args.sync_every < 4:
        raise ValueError(
            f"--sync_every {args.sync_every}: use 4 or more (faults fall 1 to H - 2 steps into an interval)."
        )
    rows = args.rows.split(",")
    if set(rows) - set(ROWS):
        raise ValueError(f"unknown rows {sorted(set(rows) - set(ROWS))}; use {', '.join(ROWS)}.")
    draw_schedule(0, args.sync_every, args.min_faults, args.episodes.split(",") if args.episodes else None)  # checked
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = prepare(TASKS[TASK], Path(args.data_dir or out / "data"), REPLICAS)  # the suite's data and model
    for seed in (int(s) for s in args.seeds.split(",")):
        for row in [r for r in ROWS if r in rows]:
            path = result_path(results_dir, row, seed)
            if path.exists():
                continue
            print(f"[{row} seed {seed}] started", flush=True)
            result = run_one(row, seed, args, info, out)
            path.write_text(json.dumps(result, indent=1))
            print(f"[{row} seed {seed}] {_num(result['wall_s'], '.1f')} s  ppl {_num(result['perplexity'], '.3f')}  "
                  f"faults {len(_injected(result))}  survived {survived(result)}  lost {result['steps_lost']}  "
                  f"discarded {result['syncs_discarded']}  identical {result['replicas_identical']}"
                  + (f"  FAILED: {result['failed']}" if result.get("failed") else ""), flush=True)  # fmt: skip
    print(report(results_dir))


if __name__ == "__main__":
    if os.environ.get(JOB_ENV):
        from tests.testing_utils import end_worker

        bench_faults.worker(os.environ[JOB_ENV], setup=install_fault_hooks)
        end_worker()
    else:
        main()
