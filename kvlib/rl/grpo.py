"""The GRPO learner's objective, piece by piece (KV4-RL Section 3, Eqs. 3.1-3.5; Appendix, Table A1).

Every function is pure torch on ``[B, T]`` per-token tensors (``B`` responses, ``T`` response
positions, ``mask`` 1 on valid response tokens) and says its formula. Log-probabilities are natural
logs of the probability of the *sampled* token. The composition used by the loop is
:func:`grpo_loss`::

    loss = (1 / N_tok) * sum_{i,j} mask_ij * ( c_ij * l^clip_ij + beta * k3_ij )

with ``c_ij`` the TIS weight (Eq. 3.5), ``l^clip`` the dual-clipped PPO surrogate (Eq. 3.2 with the
dual clip of the appendix's training setup), ``k3`` the KL-to-reference estimator and ``N_tok`` the number of valid
response tokens of the whole batch (DAPO token-mean). This is the same composition as TRL's
``GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py L3054-3141 at f2cd577): TIS multiplies
the policy term only, the KL term is added after.
"""

from __future__ import annotations

from typing import Any

import torch


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"tensors must share one shape, got {shapes}")


def group_advantages(rewards: torch.Tensor, group_size: int, *, delta: float = 1e-6,
                     unbiased: bool = True) -> torch.Tensor:
    """Group-normalised advantage (KV4-RL Eq. 3.1; GRPO, Shao et al. 2024).

    ``A_i = (R_i - mean_g R) / (s_g + delta)`` for response ``i`` of group ``g`` (``rewards`` is
    ``[n_groups * group_size]``, groups contiguous), where ``s_g`` is the group's standard deviation
    (``unbiased=True``: the ``n - 1`` form that torch.std, verl and TRL use; the paper does not say).

    Zero-std groups (all responses right, or all wrong) get ``A_i = 0 / delta = 0`` exactly: this is
    the paper's ``delta > 0`` form, and what verl/TRL do (TRL adds 1e-4, grpo_trainer.py L2707).
    Such groups then contribute no policy gradient but their tokens still count in ``N_tok``
    (and in the KL term). DAPO instead *drops* them by dynamic sampling (over-sample until every
    group has ``s_g > 0``); :func:`informative_groups` gives the mask for that, and the loop reports
    the fraction without filtering (the paper's Eq. 3.1 behaviour).
    """
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
    if delta <= 0:
        raise ValueError(f"delta must be > 0, got {delta!r}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.float64).view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, unbiased=unbiased)
    return ((r - mean) / (std + delta)).view(-1).to(torch.float32)


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per-group bool: the group's rewards are not all equal (DAPO dynamic sampling keeps these)."""
    if not isinstance(group_size, int) or group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"rewards ({rewards.numel()}) must split into groups of group_size={group_size!r} >= 2")
    r = rewards.view(-1, group_size)
    return (r != r[:, :1]).any(dim=1)


def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """DAPO token-level aggregation (Yu et al.; KV4-RL Section 3): ``sum_ij m_ij x_ij / sum_ij m_ij``.

    One mean over *all* valid tokens of the batch, so a long response weighs in proportion to its
    length (GRPO's original per-sequence mean would weigh each response equally). An all-zero mask
    gives 0 (the denominator is clamped at 1, as TRL does).
    """
    _check_same_shape(values=values, mask=mask)
    m = mask.to(values.dtype)
    return (values * m).sum() / m.sum().clamp(min=1.0)


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
                      eps_low: float = 0.2, eps_high: float = 0.28, dual_clip: float = 3.0) -> torch.Tensor:
    """Per-token PPO clipped surrogate *loss* with dual clipping (KV4-RL Eq. 3.2; dual clip: appendix, training setup).

    With ``r = exp(logp - old_logp)`` (``old_logp`` is pi_old, the frozen pre-update learner)::

        l   = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)        (PPO; clip-higher as in DAPO)
        l   = min(l, -c A)   where A < 0                              (dual clip, Ye et al. 2020)

    The dual clip caps the loss of a negative-advantage token at ``c |A|`` however large ``r`` grows
    (the paper uses ``c = 3.0``; ``c > 1`` is required, as verl asserts; it acts beyond the PPO clip
    only when ``c > 1 + eps_high``).
    ``advantages`` is ``[B]`` (broadcast over tokens) or ``[B, T]``. Returns ``[B, T]``; aggregate
    with :func:`token_mean`. This equals verl's ``compute_policy_loss`` with ``clip_ratio_c`` and,
    for ``A < 0``, TRL's ``delta`` two-sided clip with ``delta = c`` (grpo_trainer.py L3084-3091).
    """
    _check_same_shape(logp=logp, old_logp=old_logp)
    if not (0 < eps_low < 1 and eps_high > 0):
        raise ValueError(f"need 0 < eps_low < 1 and eps_high > 0, got eps_low={eps_low!r}, eps_high={eps_high!r}")
    if not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip!r}")
    adv = advantages.to(logp.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    if adv.shape[0] != logp.shape[0] or adv.dim() != 2:
        raise ValueError(f"advantages must be [B] or [B, T] with B={logp.shape[0]}, got {tuple(advantages.shape)}")
    ratio = torch.exp(logp - old_logp)
    loss_unclipped = -ratio * adv
    loss_clipped = -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = torch.maximum(loss_unclipped, loss_clipped)
    return torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL penalty toward the fixed initial policy: Schulman's k3 estimator.

    ``k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1 >= 0`` at the sampled token; an unbiased
    estimator of ``KL(pi_theta || pi_ref)`` when tokens come from ``pi_theta``, with lower variance
    than ``logp - ref_logp``. The paper names "KL regularisation toward a fixed initial policy"
    (Section 3) without the estimator in our text of it; k3 is verl's ``low_var_kl`` (its GRPO
    recipes' ``kl_loss_type``) and TRL's only form (grpo_trainer.py L3070-3072), so we use it.
    """
    _check_same_shape(logp=logp, ref_logp=ref_logp)
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def tis_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """Token-level truncated importance sampling weight (KV4-RL Eq. 3.5; Yao et al. 2025).

    ``c_ij = min(pi_old(y_ij | h_ij) / q_ij, C) = min(exp(old_logp - sampler_logp), C)``, with ``q``
    the probability the rollout sampler recorded when it drew the token and ``C >= 1``. Detached
    (stop-gradient): it corrects the sampling distribution, it is not optimised. TRL's
    ``vllm_importance_sampling_mode="token_truncate"`` computes the same (grpo_trainer.py L2579-2601).
    """
    _check_same_shape(old_logp=old_logp, sampler_logp=sampler_logp)
    if not cap >= 1.0:
        raise ValueError(f"cap (C) must be >= 1, got {cap!r}")
    return torch.exp(old_logp.detach() - sampler_logp.detach()).clamp(max=cap)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None,
              sampler_logp: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor, *,
              eps_low: float = 0.2, eps_high: float = 0.28, dual_clip: float = 3.0, tis_cap: float | None = 2.0,
              beta: float = 1e-3) -> tuple[torch.Tensor, dict[str, Any]]:
    """The full token-mean objective (module docstring): returns ``(loss, stats)``.

    ``sampler_logp=None`` or ``tis_cap=None`` disables TIS (``c = 1``); ``ref_logp=None`` or
    ``beta=0`` disables the KL term. ``stats`` holds detached scalars for logging: the policy and KL
    parts, the clip fraction, and the TIS weights' mean/max/fraction truncated.
    """
    _check_same_shape(logp=logp, old_logp=old_logp, mask=mask)
    surrogate = clipped_surrogate(logp, old_logp, advantages, eps_low=eps_low, eps_high=eps_high,
                                  dual_clip=dual_clip)
    m = mask.bool()
    stats: dict[str, Any] = {}
    if sampler_logp is not None and tis_cap is not None:
        c = tis_weights(old_logp, sampler_logp, tis_cap)
        raw = torch.exp(old_logp.detach() - sampler_logp.detach())
        stats.update(tis_mean=float(c[m].mean()) if m.any() else 0.0,
                     tis_max=float(c[m].max()) if m.any() else 0.0,
                     tis_truncated=float((raw[m] > tis_cap).float().mean()) if m.any() else 0.0)
        surrogate = c * surrogate
    policy = token_mean(surrogate, mask)
    loss = policy
    if ref_logp is not None and beta:
        kl = token_mean(kl_k3(logp, ref_logp), mask)
        loss = loss + beta * kl
        stats["kl_ref_k3"] = float(kl.detach())
    ratio = torch.exp(logp.detach() - old_logp.detach())
    clipped = (ratio < 1 - eps_low) | (ratio > 1 + eps_high)
    stats.update(policy_loss=float(policy.detach()), loss=float(loss.detach()),
                 clip_fraction=float(clipped[m].float().mean()) if m.any() else 0.0)
    return loss, stats
