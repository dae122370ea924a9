"""WitCert certificate, torch reference (float64): score radius, A, B, TV bounds (the variance proxy is the
format layer's, :func:`kvlib.formats.base.variance_proxy`, re-exported here).

The theorem (``book/witcert_certificate/theorem.md``): with subtractive dither the score error
``delta_t = sm_scale * sum_c q_c s_{c,t} eps_{c,t}`` is sub-Gaussian with proxy
``varsigma_t^2 = (sm_scale^2 / 12) sum_c q_c^2 s_{c,t}^2``. With ``u_t`` the radius below, with
probability at least ``1 - delta`` every ``|delta_t| <= u_t`` and then

    TV(p, p_tilde) <= 1 - B/A <= 1 - 1/A^2,   A = sum_t p_tilde_t e^{u_t},  B = sum_t p_tilde_t e^{-u_t}.

The Triton decode kernel (:mod:`kvlib.kernels.int8.decode`) computes the same quantities in fp32
inside the attention pass; this module is the reference it is tested against.

Radius, exactly as implemented (both here and in the kernel)::

    u_t = varsigma_t * radius_multiplier(n, delta, d) + bypass_t
    radius_multiplier = sqrt(2 ln(2n/delta)) + sqrt(12 d) * rounding_slack(d, impl)
    rounding_slack(d, 'fma') = 2^-25 + 127.5 * (d + 2) * 2^-24      (fp32 kernel)
    rounding_slack(d, 'tc')  = 2^-25 + 2^-13 + 127.5 * (d + 16) * 2^-24   (tensor-core kernel)
    rounding_slack(d, 'h10') = 2^-11 + 2 * 127.5 * (d + 16) * 2^-24     (h10-layout tensor-core kernel; 2^-9 on h8)
    bypass_t = sm_scale * sum_{c in outliers} |q_c| (|k_hat_c| * (2^-11/(1-2^-11) + (d+2) 2^-24) + 2^-25)

The small second term of the multiplier covers the dither's mean (at most ``2^-25 s`` per channel on
the 24-bit grid, ``2^-11 s`` on the h10 layout's 10-bit grid, ``2^-9 s`` on h8's 8-bit grid,
:data:`kvlib.core.philox.DITHER_BIAS`) and
the fp32 rounding of the kernel's dequantisation and dot product, both bounded through Cauchy-Schwarz
by a multiple of ``varsigma_t``; ``bypass_t`` is the deterministic fp16 rounding of the outlier
channels (plus their fp32 dot rounding). Pass ``slack=False`` for the bare
``sqrt(2 ln(2n/delta))`` of the paper.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlib.core.checks import check_open_unit, check_positive_int, check_tensor
from kvlib.core.fp16 import FP16_REL, FP16_SUB
from kvlib.formats.base import outlier_index as _outlier_index
from kvlib.formats.base import variance_proxy  # noqa: F401  (its public name here is kept)

#: largest finite float32: a kernel's A beyond this has overflowed
FP32_MAX = float(torch.finfo(torch.float32).max)
CODE_MAX = 127.5  # |c - xi| <= 127 + 1/2 for int8 codes clamped to [-127, 127]


def rounding_gamma(d: int) -> float:
    """Relative fp32 error of one dequantise-and-dot over ``d`` channels, ``(d + 2) 2^-24``."""
    return (d + 2) * 2.0**-24


#: kernel rounding models the slack can cover: ``fma`` (fp32 dequantise + fp32 dot), ``tc``
#: (tensor-core dots: codes and the fp16-rounded dither as fp16 operands, fp32 accumulation) and
#: ``h10`` (tensor-core dots over the h10 dither layout, whose dither is exact in fp16)
IMPLS = ("fma", "tc", "h10")


def rounding_slack(d: int, impl: str = "fma", layout: str = "w24") -> float:
    """Per-channel deterministic error bound of the computed score, in units of ``|q_c| s_c``.

    Every form starts with the dither layout's mean bound (:data:`kvlib.core.philox.DITHER_BIAS`:
    ``2^-25`` for ``w24``, ``2^-11`` for ``h10``).
    ``fma``: plus fp32 dequantise-and-dot rounding ``127.5 (d+2) 2^-24``.
    ``tc``: plus the dither rounded to fp16 (``|xi - fp16(xi)| <= 2^-13`` for ``|xi| < 1/2``), and
    tensor-core accumulation modelled pessimistically as one truncation (``2^-23`` of the sum of
    magnitudes) per 16-deep step over at most ``4d`` products plus the fp32 group scaling and sums:
    ``127.5 (d + 16) 2^-24``.
    ``h10`` (layouts ``h10`` and ``h8``): the dither is exact in fp16 (``1 + (v >> 6) 2^-10``, or
    ``4 + b 2^-8`` for h8, and a constant); per group the kernel sums three dots (codes x query hi and lo,
    dither x query hi) whose magnitudes stay below ``(127 + 2 + 1.5) |q_c|`` (h8: ``(127 + 5 + 4.5) |q_c|``),
    so twice the ``tc`` accumulation term covers them.
    """
    from kvlib.core.philox import DITHER_BIAS, check_layout

    bias = DITHER_BIAS[check_layout(layout)]
    if impl == "fma":
        return bias + CODE_MAX * rounding_gamma(d)
    if impl == "tc":
        if layout != "w24":
            raise ValueError("impl='tc' reads the w24 dither layout only")
        return bias + 2.0**-13 + CODE_MAX * (d + 16) * 2.0**-24
    if impl == "h10":
        if layout not in ("h10", "h8"):
            raise ValueError("impl='h10' reads the h10 and h8 dither layouts only")
        return bias + 2.0 * CODE_MAX * (d + 16) * 2.0**-24
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def radius_multiplier(n: int | torch.Tensor, delta: float, d: int, *, slack: bool = True,
                      impl: str = "fma", layout: str = "w24") -> torch.Tensor | float:
    """The factor multiplying ``varsigma_t``: ``sqrt(2 ln(2n/delta))`` (+ dither-mean and rounding slack).

    ``n`` is the union-bound count (tokens in the row); a tensor ``n`` (one per batch row) gives a
    tensor, so a kernel launch needs no host synchronisation. The slack bounds a per-channel error
    ``e |q_c| s_c`` (:func:`rounding_slack`) through Cauchy-Schwarz: ``sum_c |q_c| s_c e <=
    sqrt(12 d) e varsigma_t / sm_scale``, so it enters as ``sqrt(12 d) e`` in the multiplier.
    """
    delta = check_open_unit("delta", delta)
    extra = math.sqrt(12.0 * d) * rounding_slack(d, impl, layout) if slack else 0.0
    if isinstance(n, torch.Tensor):
        return torch.sqrt(2.0 * torch.log(2.0 * n.to(torch.float64) / delta)) + extra
    check_positive_int("n", n)
    return math.sqrt(2.0 * math.log(2.0 * n / delta)) + extra


def request_delta(delta_req: float, *, layers: int, heads: int, steps: int) -> float:
    """Request-level allocation ``delta_loc = delta_req / (L * H * T)`` (union over layers, heads, steps)."""
    delta_req = check_open_unit("delta_req", delta_req)
    for name, v in (("layers", layers), ("heads", heads), ("steps", steps)):
        check_positive_int(name, v)
    return delta_req / (layers * heads * steps)


#: the tc kernel computes the radius sums (q^2 s^2, |q_o| |k_o|) with tf32 dots of nonnegative terms
#: (each operand rounded by <= 2^-10) and scales them up by this factor to stay an upper bound
TC_RADIUS_INFLATE = 1.0 + 2.0**-8


def bypass_radius(
    q: torch.Tensor, outliers: torch.Tensor, outlier_channels: torch.Tensor, *, sm_scale: float,
    inflate: float = 1.0,
) -> torch.Tensor:
    """Deterministic score error bound of the fp16 outlier channels, ``[..., S]`` float64.

    ``outliers`` ``[S, m]`` or ``[..., S, m]`` are the stored fp16 values, ``outlier_channels``
    ``[m]`` or ``[..., m]`` their channel indices.
    """
    d = q.shape[-1]
    oc = _outlier_index(outlier_channels, d)
    check_tensor("outliers", outliers, floating=True)
    if outliers.shape[-1] != oc.shape[-1]:
        raise ValueError(f"outliers last dim {outliers.shape[-1]} != number of outlier_channels {oc.shape[-1]}")
    q64 = q.to(torch.float64)
    lead = torch.broadcast_shapes(q64.shape[:-1], oc.shape[:-1])
    qo = torch.gather(q64.expand(lead + (d,)), -1, oc.expand(lead + oc.shape[-1:])).abs()  # [..., m]
    if inflate != 1.0:  # the tc kernel's bypass dot takes |q_o| rounded up to fp16
        q16 = qo.to(torch.float16)
        up = torch.nextafter(q16, torch.tensor(math.inf, dtype=torch.float16))
        qo = torch.where(q16.to(torch.float64) < qo, up, q16).to(torch.float64)
    o = outliers.to(torch.float64).abs()  # [..., S, m]
    rel = FP16_REL + rounding_gamma(d)
    return sm_scale * ((qo.unsqueeze(-2) * o).sum(-1) * (rel * inflate) + qo.sum(-1, keepdim=True) * FP16_SUB)


def score_radius(
    q: torch.Tensor,
    scales: torch.Tensor,
    *,
    sm_scale: float,
    n: int,
    delta: float,
    group: int = 32,
    outlier_channels: torch.Tensor | None = None,
    outliers: torch.Tensor | None = None,
    proxy: str = "dither",
    slack: bool = True,
    impl: str = "fma",
    layout: str = "w24",
) -> torch.Tensor:
    """Radius ``u`` ``[..., S]`` (float64) with ``P(exists t: |z_hat_t - z_t| > u_t) <= delta``.

    ``n`` is the union-bound count (normally ``S``); ``delta`` the per-row failure probability
    (use :func:`request_delta` for the request-level allocation). See the module docstring for the
    exact formula, including the fp16 outlier term when ``outliers`` are given. ``layout`` is the
    dither layout of the stored keys (:data:`kvlib.core.philox.DITHER_LAYOUTS`).
    """
    delta = check_open_unit("delta", delta)
    check_positive_int("n", n)
    # channels leave the variance proxy; without their fp16 values the bypass term would be missing (a radius too
    # small). An empty channel set drops nothing, so it needs no values.
    if outliers is None and outlier_channels is not None and outlier_channels.numel():
        raise ValueError("outlier_channels and outliers go together, got only outlier_channels: the channels leave "
                         "the variance proxy and their fp16 values set the bypass term")
    if outliers is not None and outlier_channels is None:
        raise ValueError("outlier_channels and outliers go together, got only outliers: which channels they hold "
                         "is needed for the bypass term")
    var = variance_proxy(q, scales, sm_scale=sm_scale, group=group, outlier_channels=outlier_channels, proxy=proxy)
    inflate = TC_RADIUS_INFLATE if impl in ("tc", "h10") else 1.0
    u = (var * inflate).sqrt() * radius_multiplier(n, delta, q.shape[-1], slack=slack, impl=impl, layout=layout)
    if outliers is not None and outlier_channels is not None and outlier_channels.numel():
        u = u + bypass_radius(q, outliers, outlier_channels, sm_scale=sm_scale, inflate=inflate)
    return u


@dataclass
class Certificate:
    """``A``, ``B`` and both TV bounds per row (float64). ``vacuous`` rows carry ``+inf``."""

    A: torch.Tensor
    B: torch.Tensor
    tv_bound: torch.Tensor  # 1 - B/A (two accumulators), +inf when vacuous
    tv_bound_one: torch.Tensor  # 1 - 1/A^2 (one accumulator), +inf when vacuous
    vacuous: torch.Tensor  # bool: A non-finite, above the fp32 range, or B non-finite

    def coverage(self, tau: float = 0.2, *, one: bool = False) -> float:
        return coverage(self.tv_bound_one if one else self.tv_bound, tau)

    def summary(self, tau: float = 0.2, *, one: bool = False) -> dict:
        return summarize(self.tv_bound_one if one else self.tv_bound, tau)


def bounds_from_AB(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tv_bound, tv_bound_one, vacuous)`` from accumulators; overflow or NaN gives ``+inf``."""
    A = A.to(torch.float64)
    B = B.to(torch.float64)
    vac = ~torch.isfinite(A) | ~torch.isfinite(B) | (A > FP32_MAX) | (A <= 0)
    inf = torch.full_like(A, math.inf)
    safe_a = torch.where(vac, torch.ones_like(A), A)
    two = torch.where(vac, inf, (1.0 - B / safe_a).clamp_min(0.0))
    one = torch.where(vac, inf, (1.0 - safe_a.pow(-2)).clamp_min(0.0))
    return two, one, vac


def certificate(p_tilde: torch.Tensor, u: torch.Tensor) -> Certificate:
    """Certificate of rows of computed weights ``p_tilde`` ``[..., S]`` with radii ``u`` ``[..., S]``.

    Non-finite inputs give a vacuous (``+inf``) certificate, never a small number.
    """
    check_tensor("p_tilde", p_tilde, floating=True)
    check_tensor("u", u, floating=True)
    if p_tilde.ndim < 1:
        raise ValueError("p_tilde must have shape [..., S]")
    try:
        shape = torch.broadcast_shapes(p_tilde.shape, u.shape)
    except RuntimeError:
        raise ValueError(f"p_tilde {tuple(p_tilde.shape)} and u {tuple(u.shape)} must broadcast") from None
    if shape[-1] != p_tilde.shape[-1]:
        raise ValueError(f"u's last dim must match p_tilde's S={p_tilde.shape[-1]}, got {tuple(u.shape)}")
    p = p_tilde.to(torch.float64)
    uu = u.to(torch.float64)
    finite_row = torch.isfinite(p).all(-1)
    if bool(finite_row.any()):
        pf = p[finite_row] if p.ndim > 1 else p
        if float(pf.min()) < -1e-6 or float((pf.sum(-1) - 1).abs().max()) > 1e-3:
            raise ValueError("p_tilde must be probabilities (>= 0, summing to one over the last dim)")
    A = (p * torch.exp(uu)).sum(-1)
    B = (p * torch.exp(-uu)).sum(-1)
    A = torch.where(finite_row, A, torch.full_like(A, math.nan))
    two, one, vac = bounds_from_AB(A, B)
    return Certificate(A=A, B=B, tv_bound=two, tv_bound_one=one, vacuous=vac)


def certificate_from_scores(z_hat: torch.Tensor, u: torch.Tensor) -> Certificate:
    """Certificate from computed scores ``z_hat`` (log-domain, no overflow of ``e^u`` before the fp32 check)."""
    z = z_hat.to(torch.float64)
    uu = u.to(torch.float64)
    lse = torch.logsumexp(z, -1)
    A = torch.exp(torch.logsumexp(z + uu, -1) - lse)
    B = torch.exp(torch.logsumexp(z - uu, -1) - lse)
    bad = ~torch.isfinite(z).all(-1) | torch.isnan(uu).any(-1)
    A = torch.where(bad, torch.full_like(A, math.nan), A)
    two, one, vac = bounds_from_AB(A, B)
    return Certificate(A=A, B=B, tv_bound=two, tv_bound_one=one, vacuous=vac)


def tv_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total variation ``0.5 * sum |p - q|`` over the last dim (float64)."""
    return 0.5 * (p.to(torch.float64) - q.to(torch.float64)).abs().sum(-1)


def coverage(cert: torch.Tensor, tau: float = 0.2) -> float:
    """Fraction of certificates ``<= tau``; ``+inf``/NaN (vacuous) count as over threshold."""
    if cert.numel() == 0:
        raise ValueError("cert is empty")
    ok = torch.isfinite(cert) & (cert <= tau)
    return float(ok.to(torch.float64).mean())


def summarize(cert: torch.Tensor, tau: float = 0.2) -> dict:
    """Coverage at ``tau``, overflow fraction, and mean/median/max over the finite certificates."""
    c = cert.to(torch.float64).flatten()
    fin = torch.isfinite(c)
    cf = c[fin]
    return {
        "n": int(c.numel()),
        "coverage": coverage(c, tau),
        "tau": tau,
        "overflow_count": int((~fin).sum()),
        "overflow_frac": float((~fin).to(torch.float64).mean()) if c.numel() else math.nan,
        "mean_finite": float(cf.mean()) if cf.numel() else math.nan,
        "median_finite": float(cf.median()) if cf.numel() else math.nan,
        "max_finite": float(cf.max()) if cf.numel() else math.nan,
    }


# ----------------------------------------------------------------------------------------------
# experiments: synthetic keys, repeated dither draws, the stochastic-rounding comparison
def synthetic_keys(family: str, S: int, d: int, *, generator: torch.Generator, massive: float = 30.0,
                   n_massive_pairs: int = 4) -> torch.Tensor:
    """Keys ``[S, d]`` float32: ``"gaussian"``, ``"heavy"`` (Student t, 3 dof, unit scale) or
    ``"massive"`` (Gaussian with ``n_massive_pairs`` rotate-half RoPE pairs scaled by ``massive``)."""
    if family == "gaussian":
        return torch.randn(S, d, generator=generator)
    if family == "heavy":
        z = torch.randn(S, d, generator=generator)
        chi = torch.randn(S, d, 3, generator=generator).square().sum(-1)
        return z / torch.sqrt(chi / 3)
    if family == "massive":
        k = torch.randn(S, d, generator=generator)
        pairs = torch.arange(n_massive_pairs)
        k[:, torch.cat([pairs, pairs + d // 2])] *= massive
        return k
    raise ValueError(f"family must be 'gaussian', 'heavy' or 'massive', got {family!r}")


def sr_quantize(x: torch.Tensor, scales: torch.Tensor, *, group: int = 32, generator: torch.Generator) -> torch.Tensor:
    """Stochastic rounding read-back ``s * floor(x/s + U)`` (no subtraction at read), float64 ``[S, d]``."""
    s = scales.to(torch.float64).repeat_interleave(group, dim=-1)
    y = x.to(torch.float64) / torch.where(s > 0, s, torch.ones_like(s))
    u = torch.rand(y.shape, generator=generator, dtype=torch.float64)
    return torch.where(s > 0, s * torch.floor(y + u).clamp(-127, 127), torch.zeros_like(s))


def certify_trials(
    k: torch.Tensor, q: torch.Tensor, *, trials: int, deltas: tuple[float, ...] = (1e-2,), seed0: int = 0,
    group: int = 32, outlier_channels: torch.Tensor | None = None, scheme: str = "dither", n: int | None = None,
    layout: str = "w24",
) -> dict[str, torch.Tensor]:
    """Redraw the key quantisation ``trials`` times (keys and queries fixed) and certify every row.

    ``scheme``: ``"dither"`` (the WitCert write path, fresh seed per trial, dither ``layout`` of
    :data:`kvlib.core.philox.DITHER_LAYOUTS`, whose mean the radius carries) or ``"sr"`` (stochastic
    rounding with the same fp16 scales, SR proxy). ``n`` is the union-bound count (default ``S``;
    pass ``S / delta_loc * delta`` style counts through ``deltas`` instead). Returns float64 tensors
    ``tv [trials, rows]``, ``cert``/``cert_one``/``event`` ``[len(deltas), trials, rows]`` where
    ``event`` flags rows with some ``|z_hat_t - z_t| > u_t``.
    """
    from kvlib.formats.dither_int8 import dither_dequantize, dither_quantize

    if scheme not in ("dither", "sr"):
        raise ValueError(f"scheme must be 'dither' or 'sr', got {scheme!r}")
    check_positive_int("trials", trials)
    S, d = k.shape
    sm = 1.0 / math.sqrt(d)
    q64 = q.to(torch.float64)
    z = sm * q64 @ k.to(torch.float64).T
    p = torch.softmax(z, -1)
    g = torch.Generator().manual_seed(seed0)
    tv, cert, one, event = [], [], [], []
    for i in range(trials):
        qt = dither_quantize(k, layer=0, kv_head=0, slots=torch.arange(S), seed=seed0 + i, group=group,
                             outlier_channels=outlier_channels, dither_layout=layout)
        if scheme == "dither":
            k_hat = dither_dequantize(qt).to(torch.float64)
        else:
            k_hat = sr_quantize(k, qt.scales, group=group, generator=g)
            if qt.outlier_channels is not None:
                k_hat[:, qt.outlier_channels] = qt.outliers.to(torch.float64)
        z_hat = sm * q64 @ k_hat.T
        tv.append(tv_distance(p, torch.softmax(z_hat, -1)))
        proxy = "sr" if scheme == "sr" else "dither"
        sd = variance_proxy(q64, qt.scales, sm_scale=sm, group=group, outlier_channels=qt.outlier_channels,
                            proxy=proxy).sqrt()
        byp = 0.0
        if qt.outliers is not None:
            byp = bypass_radius(q64, qt.outliers, qt.outlier_channels, sm_scale=sm)
        err = (z_hat - z).abs()
        c_i, o_i, e_i = [], [], []
        for delta in deltas:
            u = sd * radius_multiplier(n or S, delta, d, layout=layout) + byp  # = score_radius(...), variance once
            c = certificate_from_scores(z_hat, u)
            c_i.append(c.tv_bound)
            o_i.append(c.tv_bound_one)
            e_i.append((err > u).any(-1).to(torch.float64))
        cert.append(torch.stack(c_i))
        one.append(torch.stack(o_i))
        event.append(torch.stack(e_i))
    return {"tv": torch.stack(tv), "cert": torch.stack(cert, 1), "cert_one": torch.stack(one, 1),
            "event": torch.stack(event, 1)}
