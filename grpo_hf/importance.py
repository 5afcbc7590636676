"""Importance scores -> learning-rate multipliers (pure functions) and the state that carries them across steps.

Per optimizer step and group g:

1. `score_g = ||grad_g||_2 * ln(update_count_g + 1)` (the article's formula, `kind="article"`), or with the
   per-element RMS `||grad_g||_2 / sqrt(numel_g)` in place of the norm (`kind="rms"`), so that a large group does
   not win by size alone, or the cosine between the group's gradient and its optimizer momentum (`kind="coherence"`,
   floored at 0.05): a group whose gradients keep their direction gets more learning rate, a noisy one less.
2. The scores are smoothed with an EMA (first value taken as is, no zero bias).
3. Multipliers `m_g = clip(c * ema_g, lo_g, hi_g)`, with the one constant `c` (found by bisection in float64) that
   makes the parameter-weighted mean of the multipliers exactly 1 (up to 1e-12): the total learning-rate budget is
   unchanged, only its distribution moves. Groups whose importance scaling is off keep `m_g = 1`.
4. The caller applies `lr_g = scheduler_lr_g * ratio_g * m_g` (`ratio_g` a fixed per-group factor, see
   [`~grpo_hf.grouping.lr_ratios`]) for the optimizer step only and restores the scheduler's value
   afterwards, so multipliers never compound, whatever the scheduler.

Everything is computed in float64 from gradients that are identical on every rank (after communication), so every
rank computes bit-identical multipliers.
"""

import math

import torch


SCORE_KINDS = ("article", "rms", "coherence")
COHERENCE_FLOOR = 0.05  # a group whose gradient opposes its momentum still keeps a small positive score


def group_scores(
    grad_norms: torch.Tensor,
    numels: torch.Tensor,
    update_counts: torch.Tensor,
    kind: str = "article",
    coherence: torch.Tensor | None = None,
) -> torch.Tensor:
    """
    Importance score of each group.

    Args:
        grad_norms (`torch.Tensor`): L2 norm of each group's gradient, shape `(G,)`.
        numels (`torch.Tensor`): number of elements of each group, shape `(G,)`.
        update_counts (`torch.Tensor`): optimizer steps in which each group received a non-zero gradient.
        kind (`str`, *optional*, defaults to `"article"`): `"article"`, `"rms"` or `"coherence"` (see the module
            docstring).
        coherence (`torch.Tensor`, *optional*): cosine between each group's gradient and its optimizer momentum
            (needed by `"coherence"`).
    """
    if kind == "article":
        signal = grad_norms.double()
    elif kind == "rms":
        signal = grad_norms.double() / numels.double().sqrt()
    elif kind == "coherence":
        if coherence is None:
            raise ValueError("the 'coherence' score needs each group's gradient-momentum cosine.")
        signal = coherence.double().clamp(min=COHERENCE_FLOOR)
    else:
        raise ValueError(f"unknown importance score kind {kind!r}; use one of {SCORE_KINDS}.")
    return signal * torch.log(update_counts.double() + 1)


def normalised_multipliers(
    scores: torch.Tensor,
    weights: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    scaled: torch.Tensor | None = None,
    iterations: int = 100,
) -> torch.Tensor:
    """
    Bounded multipliers proportional to `scores` whose `weights`-weighted mean is 1.

    Solves `sum_g w_g * clip(c * s_g, lo_g, hi_g) = sum_g w_g` for `c` by bisection (the left side is monotone in
    `c`). Groups with `scaled[g] == False` get exactly 1 and are left out of the balance. If every score is 0 the
    multipliers are all 1. If the bounds make a mean of 1 unreachable (e.g. only tiny groups have a non-zero score),
    the closest reachable solution is returned.

    Example:

    ```python
    >>> normalised_multipliers(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.5]),
    ...                        torch.tensor([2.0, 2.0]))
    tensor([0.5000, 1.5000], dtype=torch.float64)
    ```
    """
    scores, weights = scores.double(), weights.double()
    lower, upper = lower.double(), upper.double()
    scaled = torch.ones_like(scores, dtype=torch.bool) if scaled is None else scaled.bool()
    multipliers = torch.ones_like(scores)
    active = scaled & (weights > 0)
    if not active.any() or not (scores[active] > 0).any():
        return multipliers
    s, w, lo, hi = scores[active], weights[active], lower[active], upper[active]
    target = w.sum()

    def mean_gap(c: float) -> float:
        return float((w * torch.minimum(torch.maximum(c * s, lo), hi)).sum() - target)

    low_c, high_c = 0.0, 1.0
    positive = s > 0
    high_c = float((hi[positive] / s[positive]).max())  # at this c every positive group sits at its upper bound
    if mean_gap(high_c) <= 0:
        c = high_c
    else:
        for _ in range(iterations):
            mid = 0.5 * (low_c + high_c)
            if mean_gap(mid) < 0:
                low_c = mid
            else:
                high_c = mid
        c = 0.5 * (low_c + high_c)
    multipliers[active] = torch.minimum(torch.maximum(c * s, lo), hi)
    return multipliers


def weighted_std(values: torch.Tensor, weights: torch.Tensor) -> float:
    """Parameter-weighted standard deviation (the load-balance metric applied to the multipliers)."""
    values, weights = values.double(), weights.double()
    mean = (weights * values).sum() / weights.sum()
    return math.sqrt(float((weights * (values - mean) ** 2).sum() / weights.sum()))


class ImportanceState:
    r"""
    Per-group importance bookkeeping: update counts, smoothed scores and the current multipliers.

    Args:
        names (`list[str]`): group names, in optimizer order.
        numels (`list[int]`): elements per group (the weights of the normalization).
        lower (`list[float]`), upper (`list[float]`): bounds of each multiplier.
        scaled (`list[bool]`): whether importance scaling applies to each group.
        kind (`str`, *optional*, defaults to `"article"`): score kind, see [`group_scores`].
        ema (`float`, *optional*, defaults to `0.9`): smoothing factor in [0, 1).
        warmup_steps (`int`, *optional*, defaults to `10`): steps during which multipliers stay at 1.
    """

    def __init__(self, names, numels, lower, upper, scaled, kind="article", ema=0.9, warmup_steps=10):
        self.names = list(names)
        self.numels = torch.tensor(numels, dtype=torch.float64)
        self.lower = torch.tensor(lower, dtype=torch.float64)
        self.upper = torch.tensor(upper, dtype=torch.float64)
        self.scaled = torch.tensor(scaled, dtype=torch.bool)
        self.kind, self.ema, self.warmup_steps = kind, ema, warmup_steps
        size = len(self.names)
        self.update_counts = torch.zeros(size, dtype=torch.int64)
        self.smoothed = torch.zeros(size, dtype=torch.float64)
        self.multipliers = torch.ones(size, dtype=torch.float64)
        self.last_scores = torch.zeros(size, dtype=torch.float64)
        self.last_grad_norms = torch.zeros(size, dtype=torch.float64)
        self.steps = 0

    def update(self, grad_norms: torch.Tensor, coherence: torch.Tensor | None = None) -> torch.Tensor:
        """
        Account one optimizer step with the given per-group gradient norms (and, for the `"coherence"` score, each
        group's gradient-momentum cosine); return the new multipliers.

        A step whose norms are not all finite (fp16 overflow, a diverging run) changes nothing and keeps the previous
        multipliers, so a skipped optimizer step cannot poison the scores.
        """
        grad_norms = grad_norms.double()
        if not torch.isfinite(grad_norms).all() or (coherence is not None and not torch.isfinite(coherence).all()):
            return self.multipliers
        updated = grad_norms > 0
        self.update_counts += updated.long()
        scores = group_scores(grad_norms, self.numels, self.update_counts, self.kind, coherence)
        first = updated & (self.update_counts == 1)  # a group seen for the first time takes its score as is
        self.smoothed = torch.where(first, scores, self.ema * self.smoothed + (1 - self.ema) * scores)
        self.steps += 1
        self.last_scores, self.last_grad_norms = scores, grad_norms
        if self.steps > self.warmup_steps:
            self.multipliers = normalised_multipliers(self.smoothed, self.numels, self.lower, self.upper, self.scaled)
        return self.multipliers

    def shared_scores(self) -> torch.Tensor:
        """The smoothed scores, which ranks that train apart between syncs (replica groups) average at each sync."""
        return self.smoothed.clone()

    def set_shared_scores(self, smoothed: torch.Tensor) -> None:
        """Take the smoothed scores averaged over the replicas at a sync; past the warm-up the multipliers follow them,
        the same on every rank."""
        self.smoothed = smoothed.double().clone()
        if self.steps > self.warmup_steps:
            self.multipliers = normalised_multipliers(self.smoothed, self.numels, self.lower, self.upper, self.scaled)

    def load_balance_std(self) -> float:
        """Parameter-weighted std of the multipliers; the article's target for load balance is < 0.15."""
        return weighted_std(self.multipliers, self.numels)

    def state_dict(self) -> dict:
        return {
            "names": list(self.names),
            "update_counts": self.update_counts.clone(),
            "smoothed": self.smoothed.clone(),
            "multipliers": self.multipliers.clone(),
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict) -> None:
        if list(state["names"]) != self.names:
            raise ValueError(
                f"the checkpoint's GRPO groups {state['names']} differ from this run's {self.names}; resume with the "
                "same model, trainable parameters and grpo_groups as the run that wrote the checkpoint."
            )
        self.update_counts = state["update_counts"].clone()
        self.smoothed = state["smoothed"].clone()
        self.multipliers = state["multipliers"].clone()
        self.steps = int(state["steps"])
