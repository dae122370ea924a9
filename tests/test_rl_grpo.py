"""The GRPO objective's pieces against cases worked out by hand (kvlib.rl.grpo)."""

import math

import pytest
import torch

from kvlib.rl import grpo


def test_group_advantages_hand_case_and_zero_std_group():
    # group 0: rewards (1, 0, 0): mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    # group 1: rewards (1, 1, 1): std 0 -> A = 0 / delta = 0 (the paper's delta form)
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    a = grpo.group_advantages(r, 3, delta=1e-6)
    s = math.sqrt(1 / 3)
    want = torch.tensor([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0, 0.0, 0.0])
    torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(a[3:], torch.zeros(3))
    assert grpo.informative_groups(r, 3).tolist() == [True, False]


def test_group_advantages_pairs_and_population_std():
    # group (0, 1): mean 1/2; unbiased std sqrt(0.5) -> +-0.7071; population std 0.5 -> +-1
    r = torch.tensor([0.0, 1.0, 3.0, 1.0])
    torch.testing.assert_close(grpo.group_advantages(r, 2),
                               torch.tensor([-1, 1, 1, -1]) / math.sqrt(2.0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grpo.group_advantages(r, 2, unbiased=False),
                               torch.tensor([-1.0, 1.0, 1.0, -1.0]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs", [{"group_size": 1}, {"group_size": 4}, {"group_size": 3, "delta": 0.0}])
def test_group_advantages_bad_input(kwargs):
    with pytest.raises(ValueError):
        grpo.group_advantages(torch.zeros(6), **kwargs)


def test_token_mean_is_over_all_batch_tokens():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # DAPO: (1 + 2 + 4) / 3 tokens; a per-sequence mean would give (1.5 + 4) / 2 = 2.75 instead
    assert float(grpo.token_mean(x, m)) == pytest.approx(7 / 3)
    assert float(grpo.token_mean(x, torch.zeros_like(m))) == 0.0
    with pytest.raises(ValueError):
        grpo.token_mean(x, m[:, :2])


def test_clipped_surrogate_hand_cases_with_dual_clip():
    # (ratio r, advantage A) -> loss, eps_low 0.2, eps_high 0.28, c = 3
    cases = [
        (1.5, 1.0, -1.28),   # A > 0, r above 1 + eps_high: clipped, -1.28 A
        (0.5, 1.0, -0.5),    # A > 0, r below 1 - eps_low: min(rA, 0.8A) = 0.5 (unclipped)
        (1.1, 1.0, -1.1),    # inside the trust region
        (0.5, -1.0, 0.8),    # A < 0, r low: max(0.5, 0.8) |A| = 0.8 (clipped)
        (2.0, -1.0, 2.0),    # A < 0, r high: max(2, 1.28) = 2 < c |A| = 3: not dual-clipped
        (5.0, -1.0, 3.0),    # A < 0, r = 5: 5 |A| capped at c |A| = 3
        (10.0, -2.0, 6.0),   # A = -2, r = 10: 20 capped at 3 * 2
    ]
    r = torch.tensor([[c[0] for c in cases]], dtype=torch.float64)
    adv = torch.tensor([[c[1] for c in cases]], dtype=torch.float64)
    old = torch.zeros_like(r)
    logp = torch.log(r).requires_grad_(True)
    loss = grpo.clipped_surrogate(logp, old, adv, eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    torch.testing.assert_close(loss.detach(), torch.tensor([[c[2] for c in cases]], dtype=torch.float64))
    loss.sum().backward()
    # d loss / d logp = -r A where the unclipped term is active, 0 where a clip (PPO or dual) holds
    want_grad = torch.tensor([[0.0, -0.5, -1.1, 0.0, 2.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, want_grad)


def test_clipped_surrogate_bad_input():
    z = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dual_clip"):
        grpo.clipped_surrogate(z, z, torch.ones(1), dual_clip=1.0)
    with pytest.raises(ValueError, match="eps_low"):
        grpo.clipped_surrogate(z, z, torch.ones(1), eps_low=0.0)
    with pytest.raises(ValueError, match="advantages"):
        grpo.clipped_surrogate(z, z, torch.ones(3))


def test_kl_k3_hand_case():
    # p = 0.5, p_ref = 0.25: d = log(1/2): 1/2 - log(1/2) - 1 = log 2 - 1/2
    k = grpo.kl_k3(torch.log(torch.tensor([0.5, 0.3])), torch.log(torch.tensor([0.25, 0.3])))
    torch.testing.assert_close(k, torch.tensor([math.log(2) - 0.5, 0.0]))
    assert (grpo.kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_tis_weights_hand_case_truncated_and_detached():
    old = torch.log(torch.tensor([[0.3, 0.9, 0.5]])).requires_grad_(True)
    q = torch.log(torch.tensor([[0.6, 0.3, 0.5]]))
    c = grpo.tis_weights(old, q, cap=2.0)
    torch.testing.assert_close(c, torch.tensor([[0.5, 2.0, 1.0]]))  # 0.3/0.6; 0.9/0.3 = 3 -> C = 2; 1
    assert not c.requires_grad
    with pytest.raises(ValueError, match="cap"):
        grpo.tis_weights(old, q, cap=0.5)


def test_grpo_loss_toy_batch_by_hand():
    # two responses of T = 2, second has one valid token; pi_theta = pi_old (ratio 1)
    mask = torch.tensor([[1, 1], [1, 0]])
    logp = torch.log(torch.tensor([[0.3, 0.9], [0.5, 0.5]]))
    q = torch.log(torch.tensor([[0.6, 0.3], [0.5, 0.1]]))  # TIS weights 0.5, 3 -> 2, 1
    adv = torch.tensor([1.0, -1.0])
    # per token: -c A = -0.5, -2 | +1  -> token mean (-0.5 - 2 + 1) / 3 = -0.5
    loss, st = grpo.grpo_loss(logp, logp, None, q, adv, mask, beta=0.0, tis_cap=2.0)
    assert float(loss) == pytest.approx(-0.5)
    assert st["tis_max"] == pytest.approx(2.0) and st["tis_truncated"] == pytest.approx(1 / 3)
    # no TIS: (-1 - 1 + 1) / 3
    loss, _ = grpo.grpo_loss(logp, logp, None, None, adv, mask, beta=0.0)
    assert float(loss) == pytest.approx(-1 / 3)
    # KL term: reference 0.25 where policy 0.5 on the second response's valid token -> log 2 - 1/2
    ref = logp.clone()
    ref[1, 0] = math.log(0.25)
    loss, st = grpo.grpo_loss(logp, logp, ref, q, adv, mask, beta=0.1, tis_cap=2.0)
    assert float(loss) == pytest.approx(-0.5 + 0.1 * (math.log(2) - 0.5) / 3, rel=1e-6)
    assert st["kl_ref_k3"] == pytest.approx((math.log(2) - 0.5) / 3, rel=1e-6)
