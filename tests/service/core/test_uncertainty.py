"""Known answers for the uncertainty fields computed from member logits (B, M, C)."""

from __future__ import annotations

import math

import pytest
import torch

from service.core.uncertainty import entropy, ood_flag, ood_score, summarize

BIG = 50.0  # a logit gap that makes a member's softmax one-hot to float precision


def _onehot_logits(classes: list[int], C: int) -> torch.Tensor:
    """One input whose members are confident in ``classes[m]``: (1, M, C)."""
    x = torch.zeros(1, len(classes), C)
    for m, c in enumerate(classes):
        x[0, m, c] = BIG
    return x


def test_agreeing_members_have_zero_mutual_information():
    s = summarize(_onehot_logits([2, 2, 2], 4))
    assert s["mutual_information"].item() == pytest.approx(0.0, abs=1e-6)
    assert s["disagreement"].item() == 0.0
    assert s["msp"].item() == pytest.approx(1.0, abs=1e-6)
    assert s["prediction"].item() == 2


def test_two_confident_members_that_disagree_have_mi_ln2():
    s = summarize(_onehot_logits([0, 1], 3))
    assert s["entropy"].item() == pytest.approx(math.log(2), abs=1e-6)
    assert s["expected_entropy"].item() == pytest.approx(0.0, abs=1e-6)
    assert s["mutual_information"].item() == pytest.approx(math.log(2), abs=1e-6)
    assert s["msp"].item() == pytest.approx(0.5, abs=1e-6)
    assert s["disagreement"].item() == pytest.approx(0.5)  # one of two members differs from the argmax


def test_uniform_member_gives_entropy_log_c_and_no_mi():
    s = summarize(torch.zeros(2, 3, 5))
    torch.testing.assert_close(s["entropy"], torch.full((2,), math.log(5)))
    torch.testing.assert_close(s["mutual_information"], torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(s["probs"], torch.full((2, 5), 0.2))


def test_summary_matches_direct_formulas_and_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 3, 4, generator=g) * 3
    T = 1.7
    s = summarize(logits, temperature=T)
    mp = torch.softmax(logits / T, -1)
    p = mp.mean(1)
    ent = -(p * p.log()).sum(-1)
    exp_ent = -(mp * mp.log()).sum(-1).mean(1)
    torch.testing.assert_close(s["probs"], p)
    torch.testing.assert_close(s["entropy"], ent)
    torch.testing.assert_close(s["expected_entropy"], exp_ent)
    torch.testing.assert_close(s["mutual_information"], (ent - exp_ent).clamp_min(0))
    torch.testing.assert_close(s["msp"], p.max(-1).values)
    assert torch.all(s["mutual_information"] >= 0)


def test_entropy_handles_zero_probabilities():
    assert entropy(torch.tensor([1.0, 0.0, 0.0])).item() == 0.0


def test_ood_flag_directions():
    scores = torch.tensor([0.2, 0.5, 0.9])
    assert ood_flag(scores, "msp", 0.5).tolist() == [True, False, False]  # low confidence -> OOD
    assert ood_flag(scores, "entropy", 0.5).tolist() == [False, False, True]  # high entropy -> OOD
    assert ood_flag(scores, "mutual_information", 0.5).tolist() == [False, False, True]
    s = summarize(torch.zeros(1, 2, 3))
    assert ood_score(s, "entropy") is s["entropy"]
    assert ood_flag(scores, "mahalanobis", 0.5).tolist() == [False, False, True]  # an outlier score: high -> OOD
    with pytest.raises(ValueError, match="not a summary field"):  # energy comes from service.core.ood, not a summary
        ood_score(s, "energy")
    with pytest.raises(ValueError, match="unknown OOD score"):
        ood_flag(scores, "nope", 0.5)


def test_bad_shapes_and_temperature_are_refused():
    with pytest.raises(ValueError, match=r"\(B, M, C\)"):
        summarize(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="temperature"):
        summarize(torch.zeros(1, 2, 3), temperature=0.0)
