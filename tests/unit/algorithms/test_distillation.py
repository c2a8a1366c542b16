"""On-policy distillation's per-token advantages against a loop written here from
docs/algorithms.md: A_t = λ_rl·A + λ_opd·Σ_{k≥t} γ^(k−t)·m_k·(logp_T − logp_behav)_k."""

from __future__ import annotations

import pytest
import torch

from streamrl.algorithms.distillation import OPDConfig, distillation_returns, opd_metric_sums
from streamrl.config.loading import load_config


def reference_returns(teacher, behaviour, mask, gamma):
    n, t_len = mask.shape
    out = torch.zeros(n, t_len, dtype=torch.float64)
    for i in range(n):
        for t in range(t_len):
            if not mask[i, t]:
                continue
            out[i, t] = sum(
                gamma ** (k - t) * float(mask[i, k]) * float(teacher[i, k] - behaviour[i, k])
                for k in range(t, t_len)
            )
    return out


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    teacher = -torch.rand(3, 9, generator=g) * 3
    behaviour = -torch.rand(3, 9, generator=g) * 3
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[0, 2:7] = True  # one response
    mask[1, 1:8] = True
    mask[1, 4:6] = False  # environment tokens inside a multi-turn response
    # row 2: a response without loss tokens
    return teacher, behaviour, mask


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
def test_the_returns_are_the_discounted_sums_of_the_gaps_over_loss_tokens(gamma):
    teacher, behaviour, mask = batch()
    got = distillation_returns(teacher, behaviour, mask, gamma)
    want = reference_returns(teacher, behaviour, mask, gamma)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    assert (got[~mask] == 0).all()
    assert (got[2] == 0).all()


def test_environment_tokens_add_nothing_but_count_in_the_discount():
    teacher, behaviour, mask = batch()
    got = distillation_returns(teacher, behaviour, mask, 0.5)
    gaps = teacher - behaviour
    # Token 3 of row 1 is followed by two environment tokens, then tokens 6, 7.
    want = gaps[1, 3] + 0.5**3 * gaps[1, 6] + 0.5**4 * gaps[1, 7]
    assert got[1, 3].item() == pytest.approx(want.item(), abs=1e-6)


def test_the_advantage_weighs_the_outcome_and_the_teacher():
    teacher, behaviour, mask = batch(1)
    outcome = torch.randn(3, 9, generator=torch.Generator().manual_seed(2)) * mask
    opd = OPDConfig(lambda_rl=0.3, lambda_opd=2.0, gamma=0.9)
    got = opd.advantages(outcome, teacher, behaviour, mask)
    want = 0.3 * outcome.double() + 2.0 * reference_returns(teacher, behaviour, mask, 0.9)
    torch.testing.assert_close(got.double(), want * mask, atol=1e-5, rtol=0)
    pure = OPDConfig(lambda_rl=0.0).advantages(outcome, teacher, behaviour, mask)
    torch.testing.assert_close(pure, ((teacher - behaviour) * mask).float())


def test_the_metric_sums_are_the_reverse_kl_and_the_teacher_log_prob_over_loss_tokens():
    teacher, behaviour, mask = batch(3)
    gap, teacher_sum, tokens = opd_metric_sums(teacher, behaviour, mask).tolist()
    assert tokens == mask.sum().item()
    assert gap / tokens == pytest.approx((behaviour - teacher)[mask].double().mean().item())
    assert teacher_sum / tokens == pytest.approx(teacher[mask].double().mean().item())


def test_the_opd_preset_distils_only_and_gspo_refuses_it_naming_gspo_token():
    teacher = "scorers.teacher.model=tiny-qwen2"
    config = load_config(["opd", "tiny-cpu"], overrides=[teacher])
    assert config.algorithm.opd is not None
    assert config.algorithm.opd.lambda_rl == 0.0
    assert config.algorithm.policy_loss.kind == "ppo_clip"
    with pytest.raises(Exception, match="gspo_token"):
        load_config(
            ["gspo", "tiny-cpu"],
            overrides=["algorithm.opd.lambda_rl=0.5", "generator.teacher=teacher", teacher],
        )
    ok = load_config(
        ["gspo", "tiny-cpu"],
        overrides=[
            "algorithm.opd.lambda_rl=0.5",
            "algorithm.policy_loss.kind=gspo_token",
            "generator.teacher=teacher",
            teacher,
        ],
    )
    assert ok.algorithm.opd.lambda_rl == 0.5
    with pytest.raises(Exception, match=r"generator\.teacher is not set"):
        load_config(["dapo", "tiny-cpu"], overrides=["algorithm.opd.lambda_rl=0.5"])
    with pytest.raises(Exception, match="nothing would train on it"):
        load_config(["dapo", "tiny-cpu"], overrides=["generator.teacher=teacher", teacher])
    with pytest.raises(Exception, match="names no scorer"):
        load_config(["opd", "tiny-cpu"], overrides=["generator.teacher=judge", teacher])
    with pytest.raises(Exception, match=r"scorers\.teacher\.model"):
        load_config(["opd", "tiny-cpu"])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("generator.temperature=0.7",), "generator.temperature=1.0"),
        (("algorithm.dynamic_sampling=true",), "algorithm.dynamic_sampling=false"),
        (("scorers.teacher.max_model_len=100",), "cannot hold a whole sequence"),
    ],
)
def test_a_distillation_that_would_be_biased_or_cut_is_refused(overrides, match):
    teacher = "scorers.teacher.model=tiny-qwen2"
    with pytest.raises(Exception, match=match):
        load_config(["opd", "tiny-cpu"], overrides=[teacher, *overrides])
    served = load_config(["opd", "tiny-cpu"], overrides=[teacher])
    assert served.scorer_context("teacher") == served.model.max_model_len + 1
