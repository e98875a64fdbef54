"""Advantages, surrogate, KL and aggregation against values computed by hand."""

import math

import pytest
import torch

from specroll.rl.losses import (
    LossConfig,
    aggregate,
    clipped_surrogate,
    group_advantages,
    group_stats,
    kl_k3,
    policy_loss,
    token_weights,
    zero_variance_groups,
)

NAN = float("nan")


def test_group_advantages_scale_group():
    # group 1: [1, 0, 0, 1] mean .5, unbiased std sqrt(1/3); group 2: [2, 2, 2, 5] mean 2.75, std 1.5
    r = torch.tensor([1.0, 0, 0, 1, 2, 2, 2, 5])
    adv = group_advantages(r, 4, "group", eps=0.0)
    s1 = math.sqrt(1 / 3)
    want = [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1, -0.75 / 1.5, -0.75 / 1.5, -0.75 / 1.5, 2.25 / 1.5]
    torch.testing.assert_close(adv, torch.tensor(want))


def test_group_advantages_scale_batch_and_none():
    r = torch.tensor([1.0, 0, 0, 1, 2, 2, 2, 5])
    torch.testing.assert_close(group_advantages(r, 4, "none"), torch.tensor([.5, -.5, -.5, .5, -.75, -.75, -.75, 2.25]))
    # batch std of the 8 values: mean 13/8; unbiased variance computed by hand = 2.5536
    m = 13 / 8
    var = sum((x - m) ** 2 for x in [1, 0, 0, 1, 2, 2, 2, 5]) / 7
    adv = group_advantages(r, 4, "batch", eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([.5, -.5, -.5, .5, -.75, -.75, -.75, 2.25]) / math.sqrt(var))


def test_group_advantages_missing_rewards_and_constant_group():
    # None rewards (NaN) are excluded from the stats and get advantage 0; a constant group gives 0
    r = torch.tensor([1.0, NAN, 0.0, 3.0, 3.0, 3.0])
    adv = group_advantages(r, 3, "group", eps=0.0)
    s = math.sqrt(0.5)  # [1, 0]: mean .5, unbiased std sqrt(.5)
    torch.testing.assert_close(adv, torch.tensor([0.5 / s, 0.0, -0.5 / s, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_groups_of_equal_rewards_get_exactly_zero_advantage(scale):
    """Equal rewards that are not exact in binary (0.3, 0.1, 1/3, a weighted sum's 1.1): a plain float32 mean of
    the group is off by ~1e-8, and dividing by std + 1e-4 made that same-sign advantages of up to ~3e-4, so the
    trainer forwarded rows ``zero_variance_groups`` calls signal-free and took an AdamW step on rounding error."""
    for v in (0.3, 0.1, 1 / 3, 1.1, -0.7, 123.456):
        for G in (2, 3, 8, 16):
            r = torch.full((2 * G,), v)
            r[G:] = torch.linspace(0, 1, G)  # and a normal group beside it
            r[G - 1] = NAN if G > 2 else v  # a missing reward does not break it
            adv = group_advantages(r, G, scale)
            assert zero_variance_groups(r, G).tolist() == [True, False]
            assert adv[:G].eq(0).all(), (v, G, adv[:G])
            assert adv[G:].ne(0).sum() >= G - 1  # the other group still learns


def test_group_stats_mean_is_the_plain_mean_otherwise():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(64, generator=g) * 10 - 3
    r[::7] = NAN
    mean, std, n = group_stats(r, 8)
    x = r.double().view(-1, 8)
    for i in range(8):
        v = x[i][~torch.isnan(x[i])]
        assert int(n[i]) == v.numel()
        assert abs(float(mean[i]) - float(v.mean())) < 1e-5 and abs(float(std[i]) - float(v.std())) < 1e-5
    assert group_stats(torch.full((4,), NAN), 2)[0].tolist() == [0.0, 0.0]  # no valid reward: mean 0


def test_adv_eps_is_added_to_the_std_at_the_trainers_default():
    """``LossConfig.adv_eps`` (what the trainer passes) is added to the std: A = (r - mean) / (std + eps). The
    tests above use eps = 0, where every placement agrees; at the default 1e-4 the placement matters for a
    group whose std is itself ~1e-4 (near-constant continuous rewards): dividing by sqrt(std^2 + eps) instead
    would shrink those advantages ~50x. Group 2 (binary rewards) shows eps barely moves ordinary groups."""
    eps = LossConfig().adv_eps
    assert eps == 1e-4
    g1, g2 = [0.0, 0.0, 0.0, 2e-4], [1.0, 0.0, 0.0, 1.0]
    r = torch.tensor(g1 + g2)
    m1 = 0.5e-4
    s1 = math.sqrt(sum((x - m1) ** 2 for x in g1) / 3)  # 1e-4
    s2 = math.sqrt(1 / 3)
    want = [(x - m1) / (s1 + eps) for x in g1] + [(x - 0.5) / (s2 + eps) for x in g2]
    torch.testing.assert_close(group_advantages(r, 4, "group", eps=eps), torch.tensor(want), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(group_advantages(r, 4, "group"), torch.tensor(want), rtol=1e-4, atol=1e-6)  # default
    # batch scale: the same placement, around the std of all eight rewards
    mean = [m1] * 4 + [0.5] * 4
    ms = sum(g1 + g2) / 8
    bstd = math.sqrt(sum((x - ms) ** 2 for x in g1 + g2) / 7)
    want = [(x - m) / (bstd + eps) for x, m in zip(g1 + g2, mean)]
    torch.testing.assert_close(group_advantages(r, 4, "batch", eps=eps), torch.tensor(want), rtol=1e-4, atol=1e-6)


def test_group_size_mismatch_raises():
    with pytest.raises(ValueError, match="multiple of the group size"):
        group_advantages(torch.zeros(5), 2)


def test_zero_variance_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, NAN, 2.0, NAN, NAN])
    assert zero_variance_groups(r, 2).tolist() == [True, False, True, True]


def test_clipped_surrogate_hand_values():
    # ratios: e^0 = 1, e^0.5 = 1.6487, e^-0.5 = 0.6065 with eps_low .2, eps_high .28
    logp = torch.tensor([[0.0, 0.5, -0.5], [0.0, 0.5, -0.5]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([2.0, -1.0])
    loss, clipped = clipped_surrogate(logp, old, adv, 0.2, 0.28)
    r1, r2 = math.exp(0.5), math.exp(-0.5)
    # A > 0: min(r A, clip(r) A): r=1.6487 -> 1.28*2 (clipped); r=.6065 -> .6065*2 (unclipped, smaller)
    # A < 0: min(-r, -clip(r)): r=1.6487 -> -1.6487 (unclipped); r=.6065 -> -0.8 (clipped)
    want = -torch.tensor([[2.0, 1.28 * 2, r2 * 2], [-1.0, -r1, -0.8]])
    torch.testing.assert_close(loss, want)
    assert clipped.tolist() == [[False, True, False], [False, False, True]]


def test_kl_k3_hand_values():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-1.0, -1.0, -1.5])
    # d = ref - logp = [0, 1, -1]; k3 = e^d - d - 1
    want = torch.tensor([0.0, math.e - 2, math.exp(-1)])
    torch.testing.assert_close(kl_k3(logp, ref), want)
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
LOSS = torch.tensor([[1.0, 3.0, 9.0, 9.0], [2.0, 2.0, 2.0, 6.0], [5.0, 5.0, 5.0, 5.0]])


def test_aggregation_grpo():
    # per-sequence means (2, 3); the empty row is not a sequence -> (2 + 3) / 2
    assert aggregate(LOSS, MASK, "grpo", 8).item() == pytest.approx(2.5)


def test_aggregation_dapo():
    # token mean over 6 tokens: (1 + 3 + 2 + 2 + 2 + 6) / 6
    assert aggregate(LOSS, MASK, "dapo", 8).item() == pytest.approx(16 / 6)


def test_aggregation_dr_grpo():
    # sum / (rows * max_len) = 16 / (3 * 8)
    assert aggregate(LOSS, MASK, "dr_grpo", 8).item() == pytest.approx(16 / 24)


@pytest.mark.parametrize("kind", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_sum_to_batch_loss(kind):
    # weights computed once over the batch make micro-batch losses add up to the batch loss
    torch.manual_seed(0)
    mask = (torch.rand(6, 5) > 0.3).float()
    loss = torch.randn(6, 5)
    w = token_weights(mask, kind, 5)
    parts = sum((w[i : i + 2] * loss[i : i + 2]).sum() for i in range(0, 6, 2))
    torch.testing.assert_close(parts, aggregate(loss, mask, kind, 5))


def test_policy_loss_gradient_is_advantage_weighted_logprob_at_ratio_one():
    # at ratio 1 (logp == old) the surrogate's gradient wrt logp is -A * w
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    adv = torch.tensor([1.5, -0.5])
    cfg = LossConfig(type="dapo")
    w = token_weights(torch.ones(2, 2), "dapo", 2)
    loss, stats = policy_loss(logp, logp.detach(), adv, w, cfg)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv[:, None].expand(2, 2) / 4)
    assert stats["clip"].item() == 0


def test_policy_loss_kl_term():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.0, -1.0]])
    cfg = LossConfig(type="dapo", beta=0.1)
    w = token_weights(torch.ones(1, 2), "dapo", 2)
    loss, stats = policy_loss(logp, logp, torch.tensor([0.0]), w, cfg, ref_logp=ref)
    # advantage 0: only beta * mean k3 = 0.1 * (0 + e - 2) / 2
    assert loss.item() == pytest.approx(0.1 * (math.e - 2) / 2, rel=1e-5)
    assert stats["kl"].item() == pytest.approx((math.e - 2) / 2, rel=1e-5)


@pytest.mark.parametrize("field,value,msg", [
    ("type", "ppo", "loss.type"), ("scale_rewards", "std", "loss.scale_rewards"),
    ("eps_low", 1.5, "loss.eps_low"), ("beta", -1.0, "loss.beta"),
])
def test_loss_config_rejects_bad_values(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        LossConfig(**{field: value})
