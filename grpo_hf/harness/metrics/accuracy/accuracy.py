"""
Accuracy as an `evaluate` metric that needs neither the Hub nor scikit-learn.

    accuracy = sum_i w_i · [prediction_i == reference_i] / sum_i w_i      (normalize=True)
             = sum_i w_i · [prediction_i == reference_i]                  (normalize=False)

with `w_i = 1` unless `sample_weight` is given. Under the `"multilabel"` config each example is a list of labels and
counts as correct only if the whole list matches (subset accuracy, as scikit-learn's `accuracy_score`).
"""

import math

import datasets
import evaluate


_DESCRIPTION = """
Accuracy is the proportion of correct predictions among all examples (weighted by `sample_weight` if given).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[int]`, or `list[list[int]]` under the `"multilabel"` config):
        Predicted labels.
    references (`list[int]`, or `list[list[int]]` under the `"multilabel"` config):
        Ground-truth labels.
    normalize (`bool`, *optional*, defaults to `True`):
        If `False`, return the (weighted) number of correct examples instead of the fraction.
    sample_weight (`list[float]`, *optional*):
        Weight of each example.
Returns:
    accuracy (`float`): the fraction (or, with `normalize=False`, the number) of correct examples.
Examples:
    >>> from grpo_hf.harness.compare import load_metric
    >>> accuracy = load_metric("accuracy")
    >>> accuracy.compute(predictions=[0, 1, 2, 1], references=[0, 1, 1, 1])
    {'accuracy': 0.75}
    >>> accuracy.compute(predictions=[0, 1, 2, 1], references=[0, 1, 1, 1], normalize=False)
    {'accuracy': 3.0}
"""

_CITATION = """
@article{scikit-learn,
  title={Scikit-learn: Machine Learning in {P}ython},
  author={Pedregosa, F. and Varoquaux, G. and Gramfort, A. and Michel, V. and Thirion, B. and Grisel, O. and
          Blondel, M. and Prettenhofer, P. and Weiss, R. and Dubourg, V. and Vanderplas, J. and Passos, A. and
          Cournapeau, D. and Brucher, M. and Perrot, M. and Duchesnay, E.},
  journal={Journal of Machine Learning Research},
  volume={12},
  pages={2825--2830},
  year={2011}
}
"""

_List = getattr(datasets, "List", None) or datasets.Sequence


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        if self.config_name == "multilabel":
            features = {"predictions": _List(datasets.Value("int64")), "references": _List(datasets.Value("int64"))}
        else:
            features = {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(features),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.accuracy_score.html"],
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        if len(predictions) == 0:
            raise ValueError("Accuracy of no examples is undefined.")
        if sample_weight is None:
            sample_weight = [1.0] * len(predictions)
        elif len(sample_weight) != len(predictions):
            raise ValueError(f"sample_weight has {len(sample_weight)} entries for {len(predictions)} examples.")
        correct = math.fsum(
            float(weight)
            for prediction, reference, weight in zip(predictions, references, sample_weight, strict=True)
            if list(_as_list(prediction)) == list(_as_list(reference))
        )
        if not normalize:
            return {"accuracy": correct}
        total = math.fsum(float(weight) for weight in sample_weight)
        if total == 0:
            raise ValueError("The sample weights sum to 0.")
        return {"accuracy": correct / total}


def _as_list(value):
    return value if isinstance(value, (list, tuple)) else [value]
