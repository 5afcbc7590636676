"""
Perplexity from token negative log-likelihoods, as an `evaluate` metric that downloads nothing.

    mean_nll   = sum_i nll_i / sum_i n_i
    perplexity = exp(mean_nll)

where `nll_i` is the summed negative log-likelihood (natural log) of the `n_i` predicted tokens of example (or
batch) `i`. Weighting by token counts makes the result independent of how the tokens were split into batches; the
mean of per-batch perplexities is not.
"""

import math

import datasets
import evaluate


_DESCRIPTION = """
Perplexity of a causal language model computed from the losses the model already produced: `exp` of the mean
negative log-likelihood per token, the mean taken over tokens, not over examples. Unlike the Hub's `perplexity`
metric it runs no model.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[float]`):
        Summed negative log-likelihood (nats) of the predicted tokens of each example or batch. With
        `reduction="mean"`, the mean NLL per token of each example or batch (e.g. a model's `loss`).
    references (`list[int]`):
        Number of predicted tokens of each example or batch (for a causal LM with labels, the labels that are not
        `-100` after the shift).
    reduction (`str`, *optional*, defaults to `"sum"`):
        `"sum"` or `"mean"`: how `predictions` are reduced over tokens.
Returns:
    perplexity (`float`): `exp(mean_nll)` (`inf` if it overflows).
    mean_nll (`float`): `sum(nll) / sum(tokens)`.
    num_tokens (`int`): `sum(tokens)`.
Examples:
    >>> from grpo_hf.harness.compare import load_metric
    >>> perplexity = load_metric("perplexity")
    >>> perplexity.compute(predictions=[2.0, 4.0], references=[1, 2])
    {'perplexity': 7.38905609893065, 'mean_nll': 2.0, 'num_tokens': 3}
    >>> perplexity.compute(predictions=[2.0, 2.0], references=[1, 2], reduction="mean")["mean_nll"]
    2.0
"""

_CITATION = """
@article{jelinek1977perplexity,
  title={Perplexity - a measure of the difficulty of speech recognition tasks},
  author={Jelinek, Fred and Mercer, Robert L and Bahl, Lalit R and Baker, James K},
  journal={The Journal of the Acoustical Society of America},
  volume={62},
  number={S1},
  pages={S63--S63},
  year={1977}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("int64")}
            ),
            reference_urls=["https://huggingface.co/docs/transformers/perplexity"],
        )

    def _compute(self, predictions, references, reduction="sum"):
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}.")
        for nll, count in zip(predictions, references, strict=True):
            if not (math.isfinite(nll) and nll >= 0):
                raise ValueError(f"Negative log-likelihoods must be finite and >= 0, got {nll}.")
            if count < 0:
                raise ValueError(f"Token counts must be >= 0, got {count}.")
        num_tokens = sum(int(count) for count in references)
        if num_tokens == 0:
            raise ValueError("No tokens: the token counts (references) sum to 0.")
        if reduction == "sum":
            total_nll = math.fsum(predictions)
        else:
            total_nll = math.fsum(nll * count for nll, count in zip(predictions, references, strict=True))
        mean_nll = total_nll / num_tokens
        try:
            perplexity = math.exp(mean_nll)
        except OverflowError:
            perplexity = math.inf
        return {"perplexity": perplexity, "mean_nll": mean_nll, "num_tokens": num_tokens}
