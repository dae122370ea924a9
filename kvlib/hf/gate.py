"""A certificate-gated KV cache: head- or block-level exact repair, written back once per request.

:class:`GatedCache` is a :class:`kvlib.hf.cache.KVFormatCache` that keeps an exact copy of every
K/V it is given (the paper's fp16 backup "off-GPU"; here in ``backup_dtype`` on ``backup_device``)
and, inside the attention hook of :mod:`kvlib.hf.model` (``observe_query``, called with the real
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

Repair granularity (``level``):

* ``"head"``: the whole KV head is paged in (every position so far) and stays exact.
* ``"block"``: the positions of the KV head are cut in blocks of ``block_size`` tokens; the blocks
  are ranked once by their share of the excess ``A - 1``, ``sum_{t in j} p_tilde_t (e^{u_t} - 1)``
  (``mass_j (e^{u_j} - 1)`` for a block with one radius; summed over the group's over-threshold
  query heads), paged in that order, and after each block the certificate of every query head of
  the group is recomputed exactly (paged positions: exact scores, radius the fp32 dot-product slack
  only); paging stops at the first point where all of them are ``<= tau`` (or every block is
  paged). Paged positions stay exact for the rest of the request and each moves at most once;
  positions written later are stored in the format and may be paged by a later step.
  ``blocks_paged`` / ``bytes_moved`` are reported beside ``bytes_whole_head`` (what the head-level
  gate would have moved at the same steps).

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

from kvlib.certify.bound import FP16_REL, FP16_SUB, certificate_from_scores
from kvlib.certify.fallback import block_excess
from kvlib.hf.cache import PROXY_OF_FORMAT, KVFormatCache, _is_stateful, make_cache

__all__ = ["DETERMINISTIC_FORMATS", "GATE_LEVELS", "GatedCache", "gate_kind", "make_gated_cache",
           "key_error_bound"]

#: repair granularities of the gate
GATE_LEVELS = ("head", "block")

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
                 gate: bool = True, level: str = "head", block_size: int = 32, **options: Any) -> None:
        if level not in GATE_LEVELS:
            raise ValueError(f"level must be one of {GATE_LEVELS}, got {level!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
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
        self.level = level
        self.block_size = block_size
        self.backup_dtype = backup_dtype
        self.backup_device = torch.device(backup_device)
        n_layers = len(self.layers)
        self._exact: list[list[torch.Tensor | None]] = [[None, None] for _ in range(n_layers)]
        self.repaired: list[torch.Tensor | None] = [None] * n_layers  # bool [B, Hkv] per layer
        self._exact_pos: list[torch.Tensor | None] = [None] * n_layers  # bool [B, Hkv, cap]: paged positions
        self.blocks_paged = 0
        self.positions_paged = 0
        self.bytes_whole_head = 0
        self._block_heads: set[tuple[int, int, int]] = set()  # (layer, row, kv head) the block gate touched
        self.row_over: torch.Tensor | None = None  # [B] over-threshold certificates per batch row
        self.row_max: torch.Tensor | None = None  # [B] largest finite certificate per batch row
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
        if self.level == "block":
            self._grow_mask(layer_idx, keys.shape[0], keys.shape[1], layer.cumulative_length)
            if _is_stateful(layer.formats[0]) or _is_stateful(layer.formats[1]):
                self._reapply_blocks(layer_idx, keys, values)
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

    # -- block-level state ----------------------------------------------------------------------
    def _grow_mask(self, layer_idx: int, rows: int, heads: int, n: int) -> None:
        m = self._exact_pos[layer_idx]
        if m is None or m.shape[-1] < n:
            cap = max(n, 2 * (0 if m is None else m.shape[-1]), 64)
            grown = torch.zeros(rows, heads, cap, dtype=torch.bool)
            if m is not None:
                grown[..., :m.shape[-1]] = m
            self._exact_pos[layer_idx] = grown

    def _reapply_blocks(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A stateful format re-reads every row each step: write the paged positions back again."""
        n = self.layers[layer_idx].cumulative_length
        mask = self._exact_pos[layer_idx][..., :n]
        if not bool(mask.any()):
            return
        for side, out in ((0, keys), (1, values)):
            src = self._exact[layer_idx][side]
            for b, h in mask.any(-1).nonzero().tolist():
                pos = mask[b, h].nonzero().squeeze(-1)
                out[b, h, pos] = src[b, h, pos].to(device=out.device, dtype=out.dtype)

    def exact_positions(self, layer_idx: int) -> torch.Tensor:
        """Bool ``[B, Hkv, S]``: positions whose stored K/V are the exact copy (paged or head-repaired)."""
        layer = self.layers[layer_idx]
        n = layer.cumulative_length
        rep = self.repaired[layer_idx]
        if rep is None:
            return torch.zeros(0, self.n_kv, 0, dtype=torch.bool)
        mask = rep.unsqueeze(-1).expand(*rep.shape, n).clone()
        if self._exact_pos[layer_idx] is not None:
            mask |= self._exact_pos[layer_idx][..., :n]
        return mask

    # -- certificates ---------------------------------------------------------------------------
    def scores_and_radius(self, layer_idx: int, b: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Computed scores and radii ``[Hkv, g, S]`` (float64) of row ``b`` for queries ``q [Hq, d]``.

        Positions the block gate paged in carry only the fp32 dot-product slack as radius.
        """
        layer = self.layers[layer_idx]
        g = self.n_heads // self.n_kv
        sm = self.head_dim ** -0.5
        k_hat = layer.keys[b].double()  # [Hkv, S, d]
        qh = q.double().view(self.n_kv, g, self.head_dim)
        z_hat = torch.einsum("hgd,hsd->hgs", qh, k_hat) * sm
        qa_ka = torch.einsum("hgd,hsd->hgs", qh.abs(), k_hat.abs())
        slack = sm * (self.head_dim + 2) * 2.0**-24 * qa_ka  # fp32 dot-product rounding
        if self.kind == "deterministic":
            err = torch.stack([key_error_bound(self.key_format.name, p, k_hat[h])
                               for h, p in enumerate(layer.packed[0][b])])  # [Hkv, S, d]
            u = sm * torch.einsum("hgd,hsd->hgs", qh.abs(), err) + slack
        else:  # the base class's probabilistic radius (KVFormatCache.certify), unchanged
            u = self._packed_radius(layer.packed[0][b], qh, sm, z_hat.shape[-1]).expand_as(z_hat)
        m = self._exact_pos[layer_idx]
        if m is not None:
            paged = m[b, :, :z_hat.shape[-1]].to(u.device).unsqueeze(1)  # [Hkv, 1, S]
            if bool(paged.any()):
                u = torch.where(paged, slack, u)
        return z_hat, u

    def _tv(self, z: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        c = certificate_from_scores(z, u)
        return c.tv_bound if self.two_sided else c.tv_bound_one

    def certify(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """Certificates ``[B, Hq]`` (float64) for queries ``q [B, Hq, d]``; deterministic radius where needed."""
        if self.kind != "deterministic" and self.level == "head":
            return super().certify(layer_idx, q)
        if self.level == "block":
            out = torch.empty(q.shape[0], self.n_heads, dtype=torch.float64, device=q.device)
            for b in range(q.shape[0]):
                out[b] = self._tv(*self.scores_and_radius(layer_idx, b, q[b])).reshape(-1)
            return out
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
        zu = None
        if self.level == "block":  # scores and radii once per row, shared by the certificate and the repair
            zu = [self.scores_and_radius(layer_idx, b, query[b, :, -1, :]) for b in range(query.shape[0])]
            cert = torch.stack([self._tv(z, u).reshape(-1) for z, u in zu]).cpu()  # [B, Hq]
        else:
            cert = self.certify(layer_idx, query[:, :, -1, :]).cpu()  # [B, Hq]
        live = ~rep.repeat_interleave(g, dim=1)  # query heads of not-yet-repaired KV heads
        c = cert[live]
        fin = torch.isfinite(c)
        eff = torch.where(torch.isnan(cert), torch.ones_like(cert), cert.clamp(max=1.0))  # TV <= 1 always
        over = (eff > self.tau) & live
        if self.row_over is None:
            self.row_over = torch.zeros(cert.shape[0], dtype=torch.int64)
            self.row_max = torch.full((cert.shape[0],), -math.inf, dtype=torch.float64)
        self.row_over += over.sum(1)
        self.row_max = torch.maximum(self.row_max, torch.where(live & torch.isfinite(cert), cert, -math.inf).amax(1))
        self.n_certs += int(c.numel())
        self.n_overflow += int((~fin).sum())
        self.n_over += int(over.sum())
        if bool(fin.any()):
            self.max_cert = max(self.max_cert, float(c[fin].max()))
        if self.gate_on:
            heads = over.view(over.shape[0], self.n_kv, g).any(-1)
            for b, h in heads.nonzero().tolist():
                if self.level == "head":
                    self._repair(layer_idx, b, h, float(cert[b, h * g:(h + 1) * g].max()))
                else:
                    self._repair_blocks(layer_idx, b, h, query[b, :, -1, :], over[b, h * g:(h + 1) * g], zu[b])
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
        self.bytes_whole_head += moved
        self.events.append(dict(layer=layer_idx, row=b, kv_head=h, tokens=n, bytes=moved, cert=cert,
                                step=self.forward_steps))

    def _repair_blocks(self, layer_idx: int, b: int, h: int, q: torch.Tensor, over: torch.Tensor,
                       zu: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Page blocks of KV head ``h`` (row ``b``) by decreasing excess until every certificate of its
        group is ``<= tau``; ``q [Hq, d]`` the step's queries, ``over [g]`` the over-threshold heads.

        The certificate after each paged block is computed exactly for every prefix of the order at
        once (one batched :func:`certificate_from_scores` over the candidate states), then the
        shortest prefix that meets ``tau`` is paged in.
        """
        layer = self.layers[layer_idx]
        n = layer.cumulative_length
        bs = self.block_size
        g = self.n_heads // self.n_kv
        sm = self.head_dim ** -0.5
        z_all, u_all = self.scores_and_radius(layer_idx, b, q) if zu is None else zu
        z, u = z_all[h], u_all[h]  # [g, S], the state before this head's repair (other heads are untouched)
        before = float(self._tv(z, u).nan_to_num(nan=1.0).clamp(max=1.0).max())
        mask = self._exact_pos[layer_idx][b, h, :n]
        exc = sum(block_excess(z[i], u[i], bs) for i in over.nonzero().squeeze(-1).tolist())
        exc = torch.where(torch.isnan(exc), torch.full_like(exc, math.inf), exc)
        nb = exc.shape[0]
        blk = torch.arange(n) // bs  # block of each position
        open_ = torch.zeros(nb, dtype=torch.bool).index_put_((blk[~mask],), torch.tensor(True))
        order = [j for j in torch.argsort(exc, descending=True, stable=True).tolist() if bool(open_[j])]
        src_k = self._exact[layer_idx][0][b, h, :n]
        src_v = self._exact[layer_idx][1][b, h, :n]
        qh = q.double().view(self.n_kv, g, self.head_dim)[h]  # [g, d]
        kd = src_k.double()
        z_ex = sm * qh @ kd.T  # [g, S]: exact scores of every position
        u_ex = sm * (self.head_dim + 2) * 2.0**-24 * (qh.abs() @ kd.abs().T)
        # candidate states k = 0..len(order): the first k blocks of the order paged (plus earlier pages)
        rank = torch.full((nb,), len(order) + 1, dtype=torch.long)
        rank[torch.tensor(order, dtype=torch.long)] = torch.arange(1, len(order) + 1)
        ex = (rank[blk].unsqueeze(0) <= torch.arange(len(order) + 1).unsqueeze(1)) & ~mask  # [K+1, S]
        zs = torch.where(ex.unsqueeze(1), z_ex, z)  # [K+1, g, S]
        us = torch.where(ex.unsqueeze(1), u_ex, u)
        traj = self._tv(zs, us).nan_to_num(nan=1.0).clamp(max=1.0).amax(-1)  # [K+1]
        ok = (traj <= self.tau).nonzero()
        k = int(ok[0]) if ok.numel() else len(order)
        pos = ex[k].nonzero().squeeze(-1)
        layer.keys[b, h, pos] = src_k[pos].to(device=layer.keys.device, dtype=layer.keys.dtype)
        layer.values[b, h, pos] = src_v[pos].to(device=layer.values.device, dtype=layer.values.dtype)
        self._exact_pos[layer_idx][b, h, pos] = True
        per_pos = 2 * self.head_dim * src_k.element_size()
        moved = int(pos.numel()) * per_pos
        key = (layer_idx, b, h)
        first = key not in self._block_heads
        self._block_heads.add(key)
        whole = n * per_pos if first else 0  # the head-level gate pages a head once, all positions so far
        self.blocks_paged += k
        self.positions_paged += int(pos.numel())
        self.bytes_moved += moved
        self.bytes_whole_head += whole
        self.events.append(dict(layer=layer_idx, row=b, kv_head=h, tokens=n, blocks=order[:k],
                                positions=int(pos.numel()),
                                priority=[float(exc[j]) for j in order], bytes=moved, bytes_whole_head=whole,
                                cert=before, trajectory=[float(t) for t in traj[:k + 1]], step=self.forward_steps))

    def row_summaries(self) -> list[dict[str, Any]]:
        """Per batch row (request): flagged, over-threshold count, max certificate, what was paged."""
        if self.row_over is None:
            return []
        out = []
        for b in range(self.row_over.shape[0]):
            ev = [e for e in self.events if e["row"] == b]
            moved = sum(e["bytes"] for e in ev)
            out.append({
                "flagged": int(self.row_over[b] > 0),
                "n_over": int(self.row_over[b]),
                "max_cert": float(self.row_max[b]) if math.isfinite(float(self.row_max[b])) else float("nan"),
                "heads_repaired": sum(1 for e in ev if "blocks" not in e),
                "blocks_paged": sum(len(e.get("blocks", ())) for e in ev),
                "bytes_moved": moved,
                "bytes_whole_head": sum(e.get("bytes_whole_head", e["bytes"]) for e in ev),
                "repair_events": len(ev),
                "positions_paged": sum(e.get("positions", 0) for e in ev),
            })
        return out

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
            "bytes_whole_head": self.bytes_whole_head,
            "level": self.level,
            "block_size": self.block_size,
            "blocks_paged": self.blocks_paged,
            "positions_paged": self.positions_paged,
            "repair_events": len(self.events),
            "gate_seconds": self.gate_seconds,
            "steps": self.forward_steps,
        }


def make_gated_cache(format: str, config: Any, *, tau: float = 0.2, backup_dtype: torch.dtype | None = None,
                     backup_device: str | torch.device = "cpu", gate: bool = True, level: str = "head",
                     block_size: int = 32, **options: Any) -> GatedCache:
    """:func:`kvlib.hf.cache.make_cache` with the certificate gate (``tau``, exact-copy options,
    repair ``level`` ``"head"`` or ``"block"`` with ``block_size`` tokens per block).

    See :class:`GatedCache`; every other option goes to ``make_cache``.
    """
    cls = functools.partial(GatedCache, backup_dtype=backup_dtype, backup_device=backup_device, gate=gate,
                            level=level, block_size=block_size)
    return make_cache(format, config, cache_class=cls, tau=tau, **options)
