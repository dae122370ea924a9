"""A certificate-gated KV cache: head-level exact repair, written back once per request.

:class:`GatedCache` is a :class:`kvlib.hf_cache.KVFormatCache` that keeps an exact copy of every
K/V it is given (the paper's fp16 backup "off-GPU"; here in ``backup_dtype`` on ``backup_device``)
and, inside the attention hook of :mod:`kvlib.model` (``observe_query``, called with the real
post-RoPE query *before* the attention is computed), certifies the last query row of every query
head against the layer's stored keys. When a (layer, query head) certificate exceeds ``tau``, the
KV head of that GQA group is repaired: its K and V at every position so far are copied from the
exact copy into the float store the attention reads (the write-back), and the head stays exact for
the rest of the request (new positions are stored exact too). The step's attention therefore uses
the repaired values; nothing is recomputed. A head is paged in at most once per request, and only
that transfer counts as ``bytes_moved`` (measured from the copied tensors).

Which certificate (``kind``):

* ``"dither"`` / ``"sr"`` (dither-int8, sr-int8 keys): the WitCert probabilistic certificate
  (:meth:`KVFormatCache.certify`, sub-Gaussian radius, request-level ``delta_loc``, outlier
  bypass included).
* ``"deterministic"`` (fp8-e4m3, rtn-int8, kivi2 keys): the theorem does not apply to these formats
  (their error is a deterministic function of the key, not an independent dither), so no
  probabilistic radius is sound. The excerpt of the paper we have does not say how its fp8 and KIVI
  gates decide; the closest honest gate is a *worst-case* certificate: the same bound
  ``TV <= 1 - 1/A^2`` with a deterministic radius ``u_t = sm_scale * sum_c |q_c| E_{t,c}``, where
  ``E`` bounds the storage error elementwise from the packed data alone (fp8: half an e4m3 ulp
  relative plus the subnormal step; rtn-int8: half a step; kivi2: half a 2-bit step plus the fp16
  rounding of its input, fp16 rounding for the residual window), plus fp32 dot-product slack. It is
  sound with probability one, but conservative: expect it to flag far more than the dithered gate.

A certificate is a bound on a total variation, which never exceeds 1, so a vacuous (``+inf``/NaN)
certificate is read as 1: it is over every ``tau < 1``, and ``tau >= 1`` never repairs.
At prefill only the last query row is certified (the row that produces the first generated token);
the repair then makes every row of that layer exact. The exact copy is of the keys and values the
layer was given, which in a compressed run depend on earlier layers' compressed attention, as
the paper's backup does.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import torch

from kvlib.certificate import FP16_REL, FP16_SUB, certificate_from_scores
from kvlib.hf_cache import PROXY_OF_FORMAT, KVFormatCache, _is_stateful, make_cache

__all__ = ["DETERMINISTIC_FORMATS", "GatedCache", "gate_kind", "make_gated_cache", "key_error_bound"]

#: key formats the gate certifies with a deterministic (worst-case) radius
DETERMINISTIC_FORMATS = ("fp8-e4m3", "rtn-int8", "kivi2")
_FP32_REL = 2.0**-22  # generous relative slack of a few fp32 operations (divide, multiply, add)
_E4M3_HALF_ULP = 2.0**-4  # half an ulp of a 3-bit mantissa, relative to the magnitude
_E4M3_SUB_HALF = 2.0**-10  # half the e4m3 subnormal spacing 2^-9


def gate_kind(format_name: str) -> str:
    """``"dither"``/``"sr"`` (probabilistic certificate) or ``"deterministic"`` for a key format."""
    if format_name in PROXY_OF_FORMAT:
        return PROXY_OF_FORMAT[format_name]
    if format_name in DETERMINISTIC_FORMATS:
        return "deterministic"
    raise ValueError(f"format {format_name!r} has no certificate for the gate; gateable key formats: "
                     f"{', '.join(sorted(PROXY_OF_FORMAT) + list(DETERMINISTIC_FORMATS))}")


def key_error_bound(format_name: str, packed: Any, k_hat: torch.Tensor) -> torch.Tensor:
    """Elementwise bound ``E [S, d]`` (float64) on ``|k_hat - k|`` from one head's packed keys.

    ``k_hat [S, d]`` is the dequantised key (what the attention reads). Deterministic formats only.
    """
    kh = k_hat.to(torch.float64).abs()
    if format_name in ("fp8-e4m3", "rtn-int8"):
        g = packed.group
        s = packed.scales.to(torch.float64).repeat_interleave(g, dim=-1)  # [S, d]
        y = torch.where(s > 0, kh / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(kh))
        if format_name == "rtn-int8":
            step = torch.full_like(y, 0.5)  # |x/s| <= 127.5 (scales amax/127, bumped): clamp error <= 1/2
        else:  # RNE to e4m3 (clamp at 448 included: |x/s| <= 448.5)
            step = (_E4M3_HALF_ULP * y + _E4M3_SUB_HALF) / (1.0 - _E4M3_HALF_ULP)
        return s * step * (1.0 + _FP32_REL) + _FP32_REL * kh
    if format_name == "kivi2":
        n_q, d = packed.codes.shape[0], k_hat.shape[-1]
        e = kh * FP16_REL + FP16_SUB  # residual window: fp16 rounding
        if n_q:
            half = 0.5 * packed.scale.to(torch.float64).repeat_interleave(packed.group, dim=0)[:, :d]  # [n_q, d]
            zero = packed.zero.to(torch.float64).abs().repeat_interleave(packed.group, dim=0)[:, :d]
            quant = half * (1.0 + _FP32_REL) + _FP32_REL * (kh[:n_q] + zero)  # 2-bit step of the fp16 input
            e = e.clone()
            e[:n_q] = quant + (kh[:n_q] + half) * FP16_REL + FP16_SUB  # plus the input's fp16 rounding
        return e
    raise ValueError(f"format_name: no deterministic error bound for {format_name!r}; "
                     f"known: {', '.join(DETERMINISTIC_FORMATS)}")


class GatedCache(KVFormatCache):
    """KV format cache with a certificate gate and head-level exact repair; see the module doc.

    Extra options: ``backup_dtype`` (exact copy dtype; default: the dtype the model hands over, so
    the copy is exact), ``backup_device`` (default ``"cpu"``, the paper's off-GPU copy), ``gate``
    (False: keep the copy and the records but never repair, i.e. a flag-only observer).
    """

    def __init__(self, key_format: Any, value_format: Any, config: Any, *, tau: float = 0.2,
                 backup_dtype: torch.dtype | None = None, backup_device: str | torch.device = "cpu",
                 gate: bool = True, **options: Any) -> None:
        if options.get("telemetry"):
            raise ValueError("telemetry: a GatedCache records its own certificates (gate_summary); "
                             "pass telemetry=False")
        if not (isinstance(tau, (int, float)) and tau >= 0 and not math.isnan(tau)):
            raise ValueError(f"tau must be a non-negative number, got {tau!r}")
        if backup_dtype is not None and not isinstance(backup_dtype, torch.dtype):
            raise TypeError(f"backup_dtype must be a torch.dtype or None, got {type(backup_dtype).__name__}")
        self.kind = gate_kind(key_format.name)
        super().__init__(key_format, value_format, config, tau=tau, **options)
        if self.kind != "deterministic":
            self.proxy = self.kind  # the base class certifies dithered keys with this proxy
        self.gate_on = bool(gate)
        self.backup_dtype = backup_dtype
        self.backup_device = torch.device(backup_device)
        n_layers = len(self.layers)
        self._exact: list[list[torch.Tensor | None]] = [[None, None] for _ in range(n_layers)]
        self.repaired: list[torch.Tensor | None] = [None] * n_layers  # bool [B, Hkv] per layer
        self.bytes_moved = 0
        self.n_certs = 0
        self.n_over = 0
        self.n_overflow = 0
        self.max_cert = -math.inf
        self.forward_steps = 0
        self.gate_seconds = 0.0
        self.events: list[dict[str, Any]] = []  # one per repair: layer, row, kv head, tokens, bytes, cert

    # -- the exact copy -------------------------------------------------------------------------
    def _append_exact(self, layer_idx: int, side: int, x: torch.Tensor, start: int) -> None:
        dtype = self.backup_dtype or x.dtype
        buf = self._exact[layer_idx][side]
        n_new = x.shape[-2]
        if buf is None or buf.shape[-2] < start + n_new:
            cap = max(start + n_new, 2 * (0 if buf is None else buf.shape[-2]), 64)
            grown = torch.empty((*x.shape[:2], cap, x.shape[-1]), dtype=dtype, device=self.backup_device)
            if buf is not None:
                grown[:, :, :start] = buf[:, :, :start]
            self._exact[layer_idx][side] = buf = grown
        buf[:, :, start:start + n_new] = x.detach().to(device=self.backup_device, dtype=dtype)

    def exact_nbytes(self) -> int:
        """Bytes of the exact copy held aside (filled positions only), measured from its tensors."""
        total = 0
        for i, layer in enumerate(self.layers):
            for buf in self._exact[i]:
                if buf is not None:
                    n = layer.cumulative_length
                    total += buf[:, :, :n].numel() * buf.element_size()
        return total

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        start = layer.cumulative_length if layer.is_initialized else 0
        self._append_exact(layer_idx, 0, key_states, start)
        self._append_exact(layer_idx, 1, value_states, start)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.repaired[layer_idx] is None:
            self.repaired[layer_idx] = torch.zeros(keys.shape[0], keys.shape[1], dtype=torch.bool)
        rep = self.repaired[layer_idx]
        if bool(rep.any()):
            n = layer.cumulative_length
            for side, out in ((0, keys), (1, values)):
                # the float store of a stateless format persists (only new rows need the exact copy);
                # a stateful format's is re-read from its packed form each step, so re-apply all rows
                s0 = 0 if _is_stateful(layer.formats[side]) else start
                src = self._exact[layer_idx][side]
                for b, h in rep.nonzero().tolist():
                    out[b, h, s0:n] = src[b, h, s0:n].to(device=out.device, dtype=out.dtype)
        return keys, values

    # -- certificates ---------------------------------------------------------------------------
    def certify(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """Certificates ``[B, Hq]`` (float64) for queries ``q [B, Hq, d]``; deterministic radius where needed."""
        if self.kind != "deterministic":
            return super().certify(layer_idx, q)
        layer = self.layers[layer_idx]
        g = self.n_heads // self.n_kv
        sm = self.head_dim ** -0.5
        gamma = (self.head_dim + 2) * 2.0**-24  # fp32 dot-product rounding, relative to sum |q||k|
        out = torch.empty(q.shape[0], self.n_heads, dtype=torch.float64, device=q.device)
        for b in range(q.shape[0]):
            k_hat = layer.keys[b].double()  # [Hkv, S, d]
            err = torch.stack([key_error_bound(self.key_format.name, p, k_hat[h])
                               for h, p in enumerate(layer.packed[0][b])])  # [Hkv, S, d]
            qh = q[b].double().view(self.n_kv, g, self.head_dim)
            z_hat = torch.einsum("hgd,hsd->hgs", qh, k_hat) * sm
            qa = qh.abs()
            u = sm * (torch.einsum("hgd,hsd->hgs", qa, err) + gamma * torch.einsum("hgd,hsd->hgs", qa, k_hat.abs()))
            c = certificate_from_scores(z_hat, u)
            out[b] = (c.tv_bound if self.two_sided else c.tv_bound_one).reshape(-1)
        return out

    def observe_query(self, layer_idx: int, query: torch.Tensor) -> None:
        """The gate: certify the step's last query rows, repair over-threshold KV heads before attention."""
        t0 = time.perf_counter()
        rep = self.repaired[layer_idx]
        if layer_idx == 0:
            self.forward_steps += 1
        if rep is None or bool(rep.all()):
            return
        g = self.n_heads // self.n_kv
        cert = self.certify(layer_idx, query[:, :, -1, :]).cpu()  # [B, Hq]
        live = ~rep.repeat_interleave(g, dim=1)  # query heads of not-yet-repaired KV heads
        c = cert[live]
        fin = torch.isfinite(c)
        eff = torch.where(torch.isnan(cert), torch.ones_like(cert), cert.clamp(max=1.0))  # TV <= 1 always
        over = (eff > self.tau) & live
        self.n_certs += int(c.numel())
        self.n_overflow += int((~fin).sum())
        self.n_over += int(over.sum())
        if bool(fin.any()):
            self.max_cert = max(self.max_cert, float(c[fin].max()))
        if self.gate_on:
            heads = over.view(over.shape[0], self.n_kv, g).any(-1)
            for b, h in heads.nonzero().tolist():
                self._repair(layer_idx, b, h, float(cert[b, h * g:(h + 1) * g].max()))
        self.gate_seconds += time.perf_counter() - t0

    def _repair(self, layer_idx: int, b: int, h: int, cert: float) -> None:
        """Page KV head ``h`` of row ``b`` in from the exact copy and write it into the attention's store."""
        layer = self.layers[layer_idx]
        n = layer.cumulative_length
        moved = 0
        for side, dst in ((0, layer.keys), (1, layer.values)):
            src = self._exact[layer_idx][side][b, h, :n]
            dst[b, h, :n] = src.to(device=dst.device, dtype=dst.dtype)  # in place: the tensor attention gets
            moved += src.numel() * src.element_size()
        self.repaired[layer_idx][b, h] = True
        self.bytes_moved += moved
        self.events.append(dict(layer=layer_idx, row=b, kv_head=h, tokens=n, bytes=moved, cert=cert,
                                step=self.forward_steps))

    def gate_summary(self) -> dict[str, Any]:
        """Per-request record: flagged, heads repaired, bytes moved, certificate maxima and counts."""
        rows = self.repaired[0].shape[0] if self.repaired[0] is not None else 0
        heads_repaired = sum(int(r.sum()) for r in self.repaired if r is not None)
        return {
            "kind": self.kind,
            "tau": self.tau,
            "flagged": int(self.n_over > 0),
            "n_certs": self.n_certs,
            "n_over": self.n_over,
            "overflow": self.n_overflow,
            "max_cert": self.max_cert if self.n_certs else float("nan"),
            "heads_repaired": heads_repaired,
            "heads_total": len(self.layers) * rows * self.n_kv,
            "bytes_moved": self.bytes_moved,
            "gate_seconds": self.gate_seconds,
            "steps": self.forward_steps,
        }


def make_gated_cache(format: str, config: Any, *, tau: float = 0.2, backup_dtype: torch.dtype | None = None,
                     backup_device: str | torch.device = "cpu", gate: bool = True, **options: Any) -> GatedCache:
    """:func:`kvlib.hf_cache.make_cache` with the certificate gate (``tau``, exact-copy options).

    See :class:`GatedCache`; every other option goes to ``make_cache``.
    """
    cls = functools.partial(GatedCache, backup_dtype=backup_dtype, backup_device=backup_device, gate=gate)
    return make_cache(format, config, cache_class=cls, tau=tau, **options)
