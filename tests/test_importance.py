import math

import pytest
import torch

from grpo_hf.importance import ImportanceState, group_scores, normalised_multipliers, weighted_std


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_article_score_formula():
    scores = group_scores(t(3.0, 4.0), t(9, 16), torch.tensor([1, 3]), "article")
    assert scores.tolist() == [3.0 * math.log(2), 4.0 * math.log(4)]


def test_rms_score_divides_by_sqrt_numel():
    scores = group_scores(t(3.0, 4.0), t(9, 16), torch.tensor([1, 1]), "rms")
    assert scores.tolist() == [1.0 * math.log(2), 1.0 * math.log(2)]
    with pytest.raises(ValueError, match="unknown importance score"):
        group_scores(t(1.0), t(1), torch.tensor([1]), "nope")


def test_multipliers_are_proportional_when_inside_bounds():
    m = normalised_multipliers(t(1.0, 3.0), t(1, 1), t(0.1, 0.1), t(10, 10))
    torch.testing.assert_close(m, t(0.5, 1.5), rtol=0, atol=1e-12)


def test_multipliers_clip_and_keep_weighted_mean_one():
    # weights 1, 1, 2: the proportional solution (2/3, 2/3, 8/3) breaks the upper bound; with groups 0 and 1 at
    # their lower bound 0.5, c = 0.375 balances the budget: 0.5 + 0.5 + 2 * 1.5 = 4
    m = normalised_multipliers(t(1.0, 1.0, 4.0), t(1, 1, 2), t(0.5, 0.5, 0.5), t(2, 2, 2))
    torch.testing.assert_close(m, t(0.5, 0.5, 1.5), rtol=0, atol=1e-12)
    m = normalised_multipliers(t(1.0, 2.0, 8.0), t(3, 3, 1), t(0.5, 0.5, 0.5), t(2, 2, 2))
    assert m[2] == 2.0
    assert abs(float((m * t(3, 3, 1)).sum() / 7) - 1) < 1e-12
    torch.testing.assert_close(m[:2], t(5 / 9, 10 / 9), rtol=0, atol=1e-12)  # 3c + 6c + 2 = 7 -> c = 5/9


def test_unscaled_groups_stay_at_one_and_zero_scores_give_ones():
    m = normalised_multipliers(
        t(1.0, 3.0, 100.0), t(1, 1, 1), t(0.1, 0.1, 0.1), t(10, 10, 10), torch.tensor([1, 1, 0])
    )
    torch.testing.assert_close(m, t(0.5, 1.5, 1.0), rtol=0, atol=1e-12)
    assert normalised_multipliers(t(0.0, 0.0), t(1, 1), t(0.5, 0.5), t(2, 2)).tolist() == [1.0, 1.0]


def test_weighted_std():
    assert weighted_std(t(1.0, 1.0), t(1, 5)) == 0.0
    assert weighted_std(t(0.5, 1.5), t(1, 1)) == 0.5


def make_state(**kwargs):
    defaults = dict(names=["a", "b"], numels=[4, 4], lower=[0.5, 0.5], upper=[2, 2], scaled=[True, True])
    return ImportanceState(**{**defaults, **kwargs})


def test_state_warmup_ema_and_counts():
    state = make_state(kind="article", ema=0.5, warmup_steps=1)
    assert state.update(t(1.0, 0.0)).tolist() == [1.0, 1.0]  # warm-up step
    assert state.update_counts.tolist() == [1, 0]
    assert state.smoothed.tolist() == [math.log(2), 0.0]
    m = state.update(t(1.0, 2.0))
    assert state.update_counts.tolist() == [2, 1]
    # a: 0.5 * ln2 + 0.5 * ln3 ; b is seen for the first time: takes 2 * ln2 as is
    assert state.smoothed.tolist() == [0.5 * math.log(2) + 0.5 * math.log(3), 2 * math.log(2)]
    expected = normalised_multipliers(state.smoothed, t(4, 4), t(0.5, 0.5), t(2, 2))
    assert torch.equal(m, expected) and abs(float(m.mean()) - 1) < 1e-12


def test_nonfinite_step_changes_nothing():
    state = make_state(warmup_steps=0)
    before = state.update(t(1.0, 2.0)).clone()
    counts = state.update_counts.clone()
    after = state.update(t(float("inf"), 1.0))
    assert torch.equal(before, after) and torch.equal(counts, state.update_counts) and state.steps == 1


def test_state_dict_round_trip_and_mismatch():
    state = make_state(warmup_steps=0)
    for norms in (t(1.0, 2.0), t(3.0, 0.5)):
        state.update(norms)
    restored = make_state(warmup_steps=0)
    restored.load_state_dict(state.state_dict())
    assert torch.equal(restored.update(t(2.0, 2.0)), state.update(t(2.0, 2.0)))
    with pytest.raises(ValueError, match="differ from this run"):
        make_state(names=["a", "c"]).load_state_dict(state.state_dict())


def test_coherence_scores_are_floored_cosines_times_the_log_count():
    from grpo_hf.importance import COHERENCE_FLOOR

    scores = group_scores(
        torch.tensor([1.0, 2.0, 3.0]),
        torch.tensor([10.0, 10.0, 10.0]),
        torch.tensor([1, 3, 7]),
        kind="coherence",
        coherence=torch.tensor([0.5, -0.2, 1.0]),
    )
    expected = torch.tensor([0.5 * math.log(2), COHERENCE_FLOOR * math.log(4), 1.0 * math.log(8)], dtype=torch.float64)
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="cosine"):
        group_scores(torch.ones(1), torch.ones(1), torch.ones(1), kind="coherence")
