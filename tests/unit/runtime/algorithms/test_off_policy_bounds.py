"""The policy losses stay finite off-policy: dual-clip, the log ratio's clamp before exp(), k3's
clamp, and a property test over every registered policy loss."""

import math

import pytest
import torch

from rldock.runtime.algorithms import POLICY_LOSSES, get_policy_loss, kl_penalty
from rldock.runtime.algorithms.kl import kl_clamp_fraction
from rldock.runtime.algorithms.losses import MAX_LOG_RATIO, clipped_policy_loss

# Each registered policy loss with the knobs its recipe passes (a new loss must be added here, so
# the property test covers it).
LOSS_KWARGS = {
    "clipped": {"clip_ratio": 0.2, "clip_ratio_c": 3.0},
    "clipped_sequence_mean": {"clip_ratio": 0.2, "clip_ratio_c": 3.0},
    "decoupled_clip": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0},
    "gspo": {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},  # no dual-clip: a sequence ratio
}


def test_every_registered_policy_loss_is_in_the_property_test():
    assert set(POLICY_LOSSES) == set(LOSS_KWARGS)


@pytest.mark.parametrize("name", sorted(LOSS_KWARGS))
@pytest.mark.parametrize("dual_clip", [True, False])
@pytest.mark.parametrize("per_token_advantage", [False, True])
@pytest.mark.parametrize(
    "aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
)
def test_every_policy_loss_is_finite_for_any_log_ratio(name, dual_clip, per_token_advantage, aggregation):
    """Random log ratios in [-100, 100], random masks (empty rows included), advantages of either
    sign: the loss and every gradient are finite."""
    fn = get_policy_loss(name)
    kwargs = dict(LOSS_KWARGS[name])
    if not dual_clip and "clip_ratio_c" in kwargs:
        kwargs["clip_ratio_c"] = None
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        num_rows, num_tokens = torch.randint(1, 9, (2,), generator=generator).tolist()
        old = -torch.rand(num_rows, num_tokens, generator=generator) * 5  # (B, T) logprobs <= 0
        log_ratio = torch.rand(num_rows, num_tokens, generator=generator) * 200 - 100  # (B, T) in [-100, 100]
        logprobs = (old + log_ratio).requires_grad_(True)
        mask = (torch.rand(num_rows, num_tokens, generator=generator) < 0.6).float()  # (B, T)
        shape = (num_rows, num_tokens) if per_token_advantage else (num_rows,)
        advantages = torch.randn(shape, generator=generator) * 3  # either sign
        out = fn(logprobs, old, advantages, mask, aggregation=aggregation, norm_length=num_tokens, **kwargs)
        out.loss.backward()
        assert torch.isfinite(out.loss), (name, log_ratio, advantages)
        assert torch.isfinite(logprobs.grad).all(), (name, log_ratio, advantages)
        assert all(math.isfinite(value) for value in out.metrics.values())


def _verl_dual_clip_token_losses(log_ratio, advantages, *, clip_low, clip_high, clip_ratio_c):
    """verl's `compute_policy_loss` (clip_ratio_c=3) written out from its formula, per token:

        r    = exp(clamp(log_ratio, -20, 20))
        L1   = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))    (PPO's pessimistic bound)
        L    = min(L1, -A c)   if A < 0                             (dual-clip)
             = L1              otherwise

    and the metrics: clipfrac = mean over tokens of [-A clip(r) > -A r]; clipfrac_lower = mean of
    [L1 > -A c and A < 0]."""
    r = torch.exp(log_ratio.clamp(-20.0, 20.0))
    l_unclipped, l_clipped = -advantages * r, -advantages * r.clamp(1 - clip_low, 1 + clip_high)
    l1 = torch.maximum(l_unclipped, l_clipped)
    l3 = -advantages * clip_ratio_c
    losses = torch.where(advantages < 0, torch.minimum(l1, l3), l1)
    return losses, (l_clipped > l_unclipped).float(), ((l1 > l3) & (advantages < 0)).float()


def test_dual_clip_equals_verls_compute_policy_loss_with_c_3():
    generator = torch.Generator().manual_seed(1)
    old = -torch.rand(6, 5, generator=generator) * 3  # (B, T)
    log_ratio = torch.randn(6, 5, generator=generator) * 2  # ratios from e^-6 to e^6: every branch
    log_ratio[0, 0], log_ratio[1, 1] = 30.0, -30.0  # past the clamp
    mask = (torch.rand(6, 5, generator=generator) < 0.8).float()
    advantages = torch.randn(6, generator=generator)  # (B,) either sign
    token_adv = advantages.unsqueeze(1).expand(6, 5)  # verl's (B, T) advantages

    logprobs = (old + log_ratio).requires_grad_(True)
    ours = clipped_policy_loss(logprobs, old, advantages, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    ours.loss.backward()

    theirs_logprobs = (old + log_ratio).requires_grad_(True)
    losses, clipfrac, clipfrac_lower = _verl_dual_clip_token_losses(
        theirs_logprobs - old, token_adv, clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0
    )
    theirs = (losses * mask).sum() / mask.sum()  # verl's token-mean
    theirs.backward()

    assert ours.loss.item() == pytest.approx(theirs.item(), abs=1e-6)
    assert torch.allclose(logprobs.grad, theirs_logprobs.grad, atol=1e-7)
    assert ours.clip_fraction.item() == pytest.approx(((clipfrac * mask).sum() / mask.sum()).item())
    assert ours.dual_clip_fraction.item() == pytest.approx(((clipfrac_lower * mask).sum() / mask.sum()).item())
    assert ours.dual_clip_fraction.item() > 0  # the test covers the dual-clip branch


def test_dual_clip_caps_a_negative_advantage_at_c():
    # A = -1, ratio e^4 = 54.6: PPO's bound is -A r = 54.6 and grows with r; dual-clip caps it at
    # -A c = 3 with no gradient.
    logprobs = torch.tensor([[4.0]], requires_grad=True)
    out = clipped_policy_loss(
        logprobs, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), clip_ratio=0.2, clip_ratio_c=3.0
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(3.0)
    assert logprobs.grad.item() == 0.0
    assert out.dual_clip_fraction.item() == 1.0
    unbounded = clipped_policy_loss(
        torch.tensor([[4.0]]),
        torch.zeros(1, 1),
        torch.tensor([-1.0]),
        torch.ones(1, 1),
        clip_ratio=0.2,
        clip_ratio_c=None,
    )
    assert unbounded.loss.item() == pytest.approx(math.exp(4), rel=1e-6)


def test_dual_clip_leaves_positive_advantages_and_small_ratios_alone():
    logprobs = torch.tensor([[4.0, 0.1]])
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    for advantage in (1.0, -1.0):
        with_c = clipped_policy_loss(
            logprobs[:, 1:], old[:, 1:], torch.tensor([advantage]), mask[:, 1:], clip_ratio=0.2, clip_ratio_c=3.0
        )
        without = clipped_policy_loss(
            logprobs[:, 1:], old[:, 1:], torch.tensor([advantage]), mask[:, 1:], clip_ratio=0.2, clip_ratio_c=None
        )
        assert with_c.loss.item() == without.loss.item()
    positive = clipped_policy_loss(logprobs, old, torch.tensor([1.0]), mask, clip_ratio=0.2, clip_ratio_c=3.0)
    assert positive.dual_clip_fraction.item() == 0.0


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_log_ratio_of_100_on_one_token_stays_finite(advantage):
    logprobs = torch.tensor([[100.0, 0.0]], requires_grad=True)
    out = clipped_policy_loss(
        logprobs, torch.zeros(1, 2), torch.tensor([advantage]), torch.ones(1, 2), clip_ratio=0.2, clip_ratio_c=None
    )
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(logprobs.grad).all()
    assert out.log_ratio_clamp_fraction.item() == 0.5
    # the clamped token's ratio is e^MAX_LOG_RATIO; with A = -1 its loss is that (no dual-clip here)
    if advantage < 0:
        assert out.loss.item() == pytest.approx((math.exp(MAX_LOG_RATIO) + 1) / 2, rel=1e-5)


def test_k3_is_clamped_at_max_kl():
    # ref - logprob = 25: k3 = e^25 - 26 ~ 7.2e10 unclamped (e^20 - 21 ~ 4.9e8 after the log-ratio
    # clamp); verl's bound is 10.
    logprobs = torch.tensor([[-25.0, 0.0]], requires_grad=True)
    ref, mask = torch.zeros(1, 2), torch.ones(1, 2)
    per_token = kl_penalty(logprobs, ref, estimator="k3")
    assert per_token[0, 0].item() == 10.0
    assert per_token[0, 1].item() == 0.0
    per_token.sum().backward()
    assert logprobs.grad[0, 0].item() == 0.0
    assert kl_clamp_fraction(per_token, mask, 10.0).item() == 0.5
    unclamped = kl_penalty(logprobs.detach(), ref, estimator="k3", max_kl=None)
    assert unclamped[0, 0].item() == pytest.approx(math.exp(20) - 21, rel=1e-6)
    assert kl_penalty(logprobs.detach(), ref, mask, estimator="k3", max_kl=5.0).item() == pytest.approx(2.5)
