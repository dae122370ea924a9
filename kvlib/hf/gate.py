"""A certificate-gated KV cache on the paged pools: same-step exact repair from an opt-in shadow.

:class:`GatedCache` is a :class:`kvlib.hf.cache.KVFormatCache` plus a *shadow* of every K/V it stores,
in ``shadow_dtype`` (fp16 by default; bf16/fp32 by option), in the pool's own paged layout (indexed by the
page table's slots; an unpaged stateful store, e.g. kivi2, by row and position), on the device
(``shadow="device"``) or in pinned host memory (``shadow="host"``, the paper's off-GPU copy).

At each one-token decode step, after the kernel (or the torch reference path) has produced the layer's
output, :mod:`kvlib.hf.attention` calls :meth:`GatedCache.gate_step`: every (row, query head) whose
certificate exceeds ``tau`` (or is non-finite) triggers a repair of its GQA group in the same step, merged
in place of the kernel's output rows, and the bytes read from the shadow are counted. A repair is per
step: nothing is written back into the pools (they hold the format only), so a head over ``tau`` at a
later step is repaired again and moves its bytes again.

Which certificate (``kind``, from the key format's declared capabilities, :mod:`kvlib.formats.base`):

* a ``variance_proxy`` (``"dither"``, ``"sr"``): the WitCert probabilistic certificate; dither-int8 on
  the INT8 pools takes the decode kernel's own (or its float64 reference's) certificate of the step,
  recorded by the cache; other proxy formats get the same bound in torch (:func:`score_radius` from
  the stored scales, request-level ``delta_loc``).
* ``"deterministic"`` (``bounded=True`` formats: fp8-e4m3, rtn-int8, kivi2): a worst-case certificate,
  the same ``TV <= 1 - 1/A^2`` with radius ``u_t = sm * sum_c |q_c| E_{t,c} + fp32 dot slack``, ``E`` the
  format's :meth:`error_bound` of the packed keys. Sound with probability one, conservative.

Repair granularity (``level``):

* ``"head"``: the group's rows are recomputed from the shadow K/V of every position of the head
  (float32 softmax attention); the whole head is read.
* ``"block"``: the gate's blocks are the pool's pages (``block_size`` tokens). Blocks are ranked by their
  share of the excess ``A - 1``, ``sum_{t in j} p_tilde_t (e^{u_t} - 1)`` summed over the group's
  over-threshold query heads (:func:`kvlib.certify.fallback.block_excess`), then paged in from the shadow
  one by one in that order; after each, the certificate of every query head of the group is recomputed
  (paged positions: shadow scores, radius the fp32 slack only) and paging stops at the first point where
  all are ``<= tau`` (or every block is paged). The rows are then recomputed over the mixed keys and values
  (shadow for paged blocks, the stored format elsewhere). ``bytes_whole_head`` reports what the head gate
  would have moved for the same repairs.

Host syncs: none at the certificate stage (counts, maxima and the per-row tallies stay on the device);
one ``torch.nonzero`` of the over-threshold (row, KV head) mask per layer and step decides whether any
repair runs (a host sync of a few bytes, microseconds on a GPU; it is also why a gated step cannot be
captured in a CUDA graph: static pools work, eager, and a capture is refused by name). The repair path
itself (rare by design) syncs freely.

A certificate is a bound on a total variation, which never exceeds 1; a vacuous (``+inf``/NaN) one counts
as over every ``tau`` and is reported in ``overflow``. The prefill attends over the float prompt (exact),
so only decode steps are certified and repaired.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from kvlib.certify.bound import certificate_from_scores, score_radius
from kvlib.certify.fallback import block_excess
from kvlib.formats.base import format_class, formats_where
from kvlib.hf.cache import KVFormatCache, make_cache
from kvlib.storage.pools import FormatStore, Int8Store, ObjectStore

__all__ = ["GATE_LEVELS", "SHADOWS", "GatedCache", "gate_kind", "gateable_formats", "make_gated_cache"]

#: repair granularities of the gate
GATE_LEVELS = ("head", "block")
#: where the shadow lives
SHADOWS = ("device", "host")
_SHADOW_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def gateable_formats() -> list[str]:
    """Key formats with a certificate: a declared variance proxy, or a deterministic error bound."""
    return sorted(set(formats_where(bounded=True)) | {n for n in formats_where(deterministic=False)
                                                       if format_class(n).variance_proxy})


def gate_kind(format_name: str) -> str:
    """``"dither"``/``"sr"`` (probabilistic certificate) or ``"deterministic"`` for a key format."""
    try:
        cls = format_class(format_name)
    except (KeyError, ValueError):
        cls = None
    if cls is not None and cls.variance_proxy:
        return cls.variance_proxy
    if cls is not None and cls.bounded:
        return "deterministic"
    raise ValueError(f"format {format_name!r} has no certificate for the gate; gateable key formats: "
                     f"{', '.join(gateable_formats())}")


def _slack(sm: float, d: int, qa: torch.Tensor, ka: torch.Tensor) -> torch.Tensor:
    """fp32 dot-product rounding of the scores, ``sm (d + 2) 2^-24 sum_c |q_c||k_c|``: ``[g, S]``."""
    return sm * (d + 2) * 2.0**-24 * (qa @ ka.T)


class GatedCache(KVFormatCache):
    """KV format cache with a certificate gate and same-step exact repair from a shadow; see the module doc."""

    watch_writes = True

    def __init__(self, key_format: Any, value_format: Any, config: Any, *, tau: float = 0.2,
                 shadow: str = "device", shadow_dtype: torch.dtype = torch.float16, gate: bool = True,
                 level: str = "head", **options: Any) -> None:
        if level not in GATE_LEVELS:
            raise ValueError(f"level must be one of {GATE_LEVELS}, got {level!r}")
        if shadow not in SHADOWS:
            raise ValueError(f"shadow must be one of {SHADOWS}, got {shadow!r}")
        if not isinstance(shadow_dtype, torch.dtype):
            raise TypeError(f"shadow_dtype must be a torch.dtype, got {type(shadow_dtype).__name__}")
        if shadow_dtype not in _SHADOW_DTYPES:
            raise ValueError(f"shadow_dtype must be one of {_SHADOW_DTYPES}, got {shadow_dtype}")
        if options.get("telemetry"):
            raise ValueError("telemetry: a GatedCache records its own certificates (gate_summary); "
                             "pass telemetry=False")
        if not (isinstance(tau, (int, float)) and tau >= 0 and not math.isnan(tau)):
            raise ValueError(f"tau must be a non-negative number, got {tau!r}")
        if options.get("stride", 1) != 1:
            raise ValueError("stride: the gate needs a certificate at every decode step (stride=1)")
        if options.get("prefill", "float") != "float":
            raise ValueError("prefill: a gated cache attends over the float prompt (prefill='float'); only decode "
                             "steps are gated")
        self.kind = gate_kind(key_format.name)
        super().__init__(key_format, value_format, config, tau=tau, **options)
        self.gate_on = bool(gate)
        self.level = level
        self.shadow = shadow
        self.shadow_dtype = shadow_dtype
        self._sh: list[list[torch.Tensor | None]] = [[None, None] for _ in range(self.n_layers)]
        self._kernel_cert = self.kind == "dither" and self.store_cls is Int8Store
        self._n_certs_seen = [0] * self.n_layers
        self._stats: torch.Tensor | None = None  # device [4]: n_certs, n_over, n_overflow, max finite cert
        self.row_over: torch.Tensor | None = None  # device [B]: over-threshold certificates per row
        self.row_max: torch.Tensor | None = None  # device [B]: largest finite certificate per row
        self.events: list[dict[str, Any]] = []  # one per (layer, row, kv head, step) repair
        self.forward_steps = 0

    # -- the shadow -------------------------------------------------------------------------------
    def _shadow_device(self) -> torch.device:
        return self.store.device if self.shadow == "device" else torch.device("cpu")

    def _alloc(self, shape: tuple[int, ...]) -> torch.Tensor:
        pin = self.shadow == "host" and torch.cuda.is_available()  # pinned: async copies to the GPU
        return torch.zeros(shape, dtype=self.shadow_dtype, device=self._shadow_device(), pin_memory=pin)

    #: decode-step writes to a host shadow of a GPU cache are staged on the device and copied over in one go
    #: every this many steps (or before a repair reads the shadow): indexing host memory with device slots
    #: would otherwise sync at every layer and step
    STAGE_STEPS = 64

    def _on_write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                  slots: torch.Tensor | None) -> None:
        if slots is not None and self._stage_writes(k):
            stage = self.__dict__.setdefault("_stage", [[] for _ in range(self.n_layers)])[layer_idx]
            stage.append((slots.detach().clone(), k.detach().to(self.shadow_dtype), v.detach().to(self.shadow_dtype)))
            if len(stage) >= self.STAGE_STEPS:
                self._flush(layer_idx)
            return
        self._store_shadow(layer_idx, k, v, rows, pos, slots)

    def _stage_writes(self, k: torch.Tensor) -> bool:
        return self.shadow == "host" and k.device.type != "cpu"

    def _flush(self, layer_idx: int) -> None:
        """Copy the staged writes of a host shadow (one device-to-host transfer)."""
        stage = self.__dict__.get("_stage", [[]] * self.n_layers)[layer_idx]
        if stage:
            sl, k, v = (torch.cat(t) for t in zip(*stage))
            stage.clear()
            self._store_shadow(layer_idx, k, v, None, None, sl)

    def _store_shadow(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None,
                      pos: torch.Tensor | None, slots: torch.Tensor | None) -> None:
        dev = self._shadow_device()
        if slots is not None:  # paged: the pool's slot index
            need, lead = self.store.n_slots, ()
            idx = (slots.long().to(dev),)
        else:  # unpaged stateful store: [B, positions]
            need, lead = int(pos.max()) + 1 if pos.numel() else 0, (self.layers[layer_idx].table.batch,)
            idx = (rows.long().to(dev), pos.long().to(dev))
        for side, x in ((0, k), (1, v)):
            buf = self._sh[layer_idx][side]
            axis = len(lead)
            if buf is None or buf.shape[axis] < need:
                cap = need if slots is not None else max(need, 2 * (0 if buf is None else buf.shape[axis]), 64)
                grown = self._alloc((*lead, cap, self.n_kv, self.head_dim))
                if buf is not None:
                    grown[(slice(None),) * axis + (slice(0, buf.shape[axis]),)] = buf
                self._sh[layer_idx][side] = buf = grown
            buf[idx] = x.detach().to(device=dev, dtype=self.shadow_dtype, non_blocking=True)

    def shadow_nbytes(self) -> int:
        """Bytes of the shadow as allocated (K and V, every layer), from its tensors."""
        for i in range(self.n_layers):
            self._flush(i)
        return sum(t.numel() * t.element_size() for pair in self._sh for t in pair if t is not None)

    def _shadow_read(self, layer, b: int, h: int, pos: torch.Tensor, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Shadow K, V ``[n, d]`` (float32 on ``device``) of row ``b``, KV head ``h`` at positions ``pos``, and the
        bytes moved (measured from the read tensors)."""
        self._flush(layer.layer_idx)
        sk, sv = self._sh[layer.layer_idx]
        if isinstance(self.store, ObjectStore):
            idx = (b, pos.to(sk.device), h)
        else:
            idx = (layer.table.slot_table()[b, pos.to(layer.table.slot_table().device)].long().to(sk.device), h)
        k, v = sk[idx], sv[idx]
        moved = k.numel() * k.element_size() + v.numel() * v.element_size()
        return (k.to(device, torch.float32, non_blocking=True), v.to(device, torch.float32, non_blocking=True), moved)

    # -- stored keys and radii (repair path and torch certificates) -------------------------------
    def _key_heads(self, layer, b: int) -> list[Any]:
        """The packed key object of each KV head of row ``b`` (for radii and error bounds)."""
        st = self.store
        if isinstance(st, FormatStore):  # rebuild each head's dataclass from its pages
            import dataclasses

            sl = layer.table.slot_table()[b, :layer.table.lens[b]].long()
            per = {f.name for f in dataclasses.fields(st.cls[0]) if f.metadata.get("per_token", False)}
            out = []
            for h in range(self.n_kv):
                vals = {n: t[layer.layer_idx, sl, h] for n, t in st.fields[0].items()}
                vals.update({n: None for n in per if n not in vals})
                out.append(st.cls[0](**vals, **st.meta[(0, layer.layer_idx, h)]))
            return out
        return layer.packed[0][b]

    def _radius(self, packed: Any, k_hat: torch.Tensor, qg: torch.Tensor, sm: float) -> torch.Tensor:
        """Score radius ``[g, S]`` (float64) of one head's stored keys for its group's queries ``qg [g, d]``."""
        d, S = self.head_dim, k_hat.shape[0]
        slack = _slack(sm, d, qg.abs(), k_hat.abs())
        if self.kind == "deterministic":
            err = self.key_format.error_bound(packed, k_hat).to(torch.float64)
            return sm * (qg.abs() @ err.T) + slack
        oc = getattr(packed, "outlier_channels", None)
        outs = getattr(packed, "outliers", None)
        return score_radius(qg, packed.scales.to(qg.device), sm_scale=sm, n=max(S, 1), delta=self.delta_loc,
                            group=packed.group, outlier_channels=oc if outs is not None else None,
                            outliers=outs, proxy=self.kind).expand(qg.shape[0], S)

    def _stored(self, layer, b: int, kv: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored (dequantised) K, V ``[Hkv, n, d]`` float64 of row ``b``'s real tokens (``kv``: the layer's
        ``dequantized()``, when the caller already has it)."""
        k, v = layer.dequantized() if kv is None else kv
        p, n = layer.pad[b], layer.table.lens[b]
        return k[b, :, p:p + n].double(), v[b, :, p:p + n].double()

    def _torch_certificates(self, layer, q: torch.Tensor, sm: float, kv: Any) -> torch.Tensor:
        """Certificates ``[B, Hq]`` computed in torch (formats without a kernel certificate)."""
        g = self.n_heads // self.n_kv
        out = torch.empty(q.shape[0], self.n_heads, dtype=torch.float64, device=q.device)
        for b in range(q.shape[0]):
            k_hat, _ = self._stored(layer, b, kv)
            packed = self._key_heads(layer, b)
            qb = q[b].double().view(self.n_kv, g, self.head_dim)
            for h in range(self.n_kv):
                z = sm * qb[h] @ k_hat[h].T
                u = self._radius(packed[h], k_hat[h].to(q.device), qb[h], sm)
                out[b, h * g:(h + 1) * g] = certificate_from_scores(z, u).tv_bound_one
        return out

    # -- the gate ---------------------------------------------------------------------------------
    def _step_certificate(self, layer, q: torch.Tensor, sm: float, kv: Any = None) -> torch.Tensor:
        if self._kernel_cert and "_cert_buf" in layer.__dict__:  # static pools: by the query's position
            t = layer.table
            buf = layer.__dict__["_cert_buf"]
            return buf[torch.arange(t.batch, device=buf.device), :, (t.seq_lens.long() - 1).clamp(min=0)].double()
        if self._kernel_cert:
            n = len(layer._certs)
            if n == self._n_certs_seen[layer.layer_idx]:
                raise RuntimeError(f"layer {layer.layer_idx}: the decode step recorded no certificate")
            self._n_certs_seen[layer.layer_idx] = n
            return layer._certs[-1].to(torch.float64)
        return self._torch_certificates(layer, q, sm, layer.dequantized() if kv is None else kv)

    def _tally(self, cert: torch.Tensor, over: torch.Tensor) -> None:
        """Device-side counts (no host sync)."""
        fin = torch.isfinite(cert)
        if self._stats is None:
            self._stats = torch.tensor([0.0, 0.0, 0.0, -math.inf], dtype=torch.float64, device=cert.device)
            self.row_over = torch.zeros(cert.shape[0], dtype=torch.int64, device=cert.device)
            self.row_max = torch.full((cert.shape[0],), -math.inf, dtype=torch.float64, device=cert.device)
        masked = torch.where(fin, cert, torch.full_like(cert, -math.inf))
        self._stats[:3] += torch.stack([torch.tensor(float(cert.numel()), dtype=torch.float64, device=cert.device),
                                        over.sum().double(), (~fin).sum().double()])
        self._stats[3] = torch.maximum(self._stats[3], masked.max())
        self.row_over += over.sum(1)
        self.row_max = torch.maximum(self.row_max, masked.amax(1))

    def gate_step(self, layer, q: torch.Tensor, o: torch.Tensor, sm: float, kv: Any = None) -> torch.Tensor:
        """Called by :mod:`kvlib.hf.attention` after a decode step's attention: ``q [B, Hq, d]``, ``o [B, Hq, d]``
        (the kernel's or reference's output; ``kv`` the layer's ``dequantized()`` K/V when the reference path
        already built them). Returns ``o`` with the over-threshold groups recomputed."""
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a gated decode step cannot be captured in a CUDA graph: the gate reads one host-side "
                               "nonzero per layer and step to decide whether a repair runs")
        if layer.layer_idx == 0:
            self.forward_steps += 1
        cert = self._step_certificate(layer, q, sm, kv)  # [B, Hq]
        over = ~(cert <= self.tau)  # NaN and +inf are over
        self._tally(cert, over)
        if not self.gate_on:
            return o
        g = self.n_heads // self.n_kv
        pairs = over.view(over.shape[0], self.n_kv, g).any(-1).nonzero()  # the one host sync of the step
        if pairs.shape[0] == 0:
            return o
        o = o.clone()
        if self.level == "block" and kv is None:
            kv = layer.dequantized()  # once per layer and step
        for b, h in pairs.tolist():
            rows = slice(h * g, (h + 1) * g)
            if self.level == "head":
                out, ev = self._repair_head(layer, b, h, q[b, rows], sm)
            else:
                out, ev = self._repair_blocks(layer, b, h, q[b, rows], over[b, rows], sm, kv)
            o[b, rows] = out.to(o.dtype)
            ev.update(layer=layer.layer_idx, row=b, kv_head=h, step=self.forward_steps,
                      cert=float(cert[b, rows].nan_to_num(nan=math.inf).max()))
            self.events.append(ev)
        return o

    def _repair_head(self, layer, b: int, h: int, qg: torch.Tensor, sm: float) -> tuple[torch.Tensor, dict]:
        n = layer.table.lens[b]
        k, v, moved = self._shadow_read(layer, b, h, torch.arange(n), qg.device)
        out = torch.softmax(sm * (qg.float() @ k.T), -1) @ v  # float32 attention over the shadow
        return out, dict(tokens=n, bytes=moved, bytes_whole_head=moved, positions=n, blocks=None)

    def _repair_blocks(self, layer, b: int, h: int, qg: torch.Tensor, over: torch.Tensor, sm: float,
                       kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        n, bs, d = layer.table.lens[b], self.block_size, self.head_dim
        dev = qg.device
        k_hat, v_hat = self._stored(layer, b, kv)
        k_hat, v_hat = k_hat[h].to(dev), v_hat[h].to(dev)
        q64 = qg.double()
        z = sm * q64 @ k_hat.T  # [g, n]
        u = self._radius(self._key_heads(layer, b)[h], k_hat, q64, sm)
        exc = sum(block_excess(z[i], u[i], bs) for i in over.nonzero().squeeze(-1).tolist())
        exc = torch.where(torch.isnan(exc), torch.full_like(exc, math.inf), exc)  # non-finite blocks first
        order = torch.argsort(exc, descending=True, stable=True).tolist()
        k_mix, v_mix = k_hat.clone(), v_hat.clone()
        tv = certificate_from_scores(z, u).tv_bound_one.nan_to_num(nan=1.0).clamp(max=1.0)
        traj, moved, paged = [float(tv.max())], 0, 0
        while traj[-1] > self.tau and paged < len(order):  # page block by block, recertify after each
            j = order[paged]
            pos = torch.arange(j * bs, min((j + 1) * bs, n))
            ks, vs, nbytes = self._shadow_read(layer, b, h, pos, dev)
            moved += nbytes
            paged += 1
            k_mix[pos], v_mix[pos] = ks.double(), vs.double()
            z[:, pos] = sm * q64 @ k_mix[pos].T
            u[:, pos] = _slack(sm, d, q64.abs(), k_mix[pos].abs())
            tv = certificate_from_scores(z, u).tv_bound_one.nan_to_num(nan=1.0).clamp(max=1.0)
            traj.append(float(tv.max()))
        out = torch.softmax(z, -1) @ v_mix
        per_pos = 2 * d * torch.empty((), dtype=self.shadow_dtype).element_size()
        positions = sum(min((j + 1) * bs, n) - j * bs for j in order[:paged])
        return out, dict(tokens=n, bytes=moved, bytes_whole_head=n * per_pos, positions=positions,
                         blocks=order[:paged], priority=[float(exc[j]) for j in order], trajectory=traj)

    # -- batch operations the shadow does not follow ---------------------------------------------------
    def _refuse(self, what: str) -> None:
        raise NotImplementedError(f"{what} on a GatedCache: the shadow does not follow batch reorders or crops yet")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._refuse("reorder_cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._refuse("batch_select_indices")

    def crop(self, max_length: int) -> None:
        self._refuse("crop")

    # -- records ------------------------------------------------------------------------------------
    def _counts(self) -> tuple[int, int, int, float]:
        if self._stats is None:
            return 0, 0, 0, float("nan")
        n, over, ovf, mx = self._stats.tolist()  # one sync
        return int(n), int(over), int(ovf), mx if math.isfinite(mx) else float("nan")

    @property
    def bytes_moved(self) -> int:
        return sum(e["bytes"] for e in self.events)

    def row_summaries(self) -> list[dict[str, Any]]:
        """Per batch row (request): flagged, over-threshold count, max certificate, what was paged."""
        if self.row_over is None:
            return []
        row_over, row_max = self.row_over.tolist(), self.row_max.tolist()
        out = []
        for b in range(len(row_over)):
            ev = [e for e in self.events if e["row"] == b]
            out.append({
                "flagged": int(row_over[b] > 0),
                "n_over": int(row_over[b]),
                "max_cert": row_max[b] if math.isfinite(row_max[b]) else float("nan"),
                "heads_repaired": len({(e["layer"], e["kv_head"]) for e in ev}),
                "blocks_paged": sum(len(e["blocks"] or ()) for e in ev),
                "bytes_moved": sum(e["bytes"] for e in ev),
                "bytes_whole_head": sum(e["bytes_whole_head"] for e in ev),
                "repair_events": len(ev),
                "positions_paged": sum(e["positions"] for e in ev),
            })
        return out

    def gate_summary(self) -> dict[str, Any]:
        """Per-cache record: flagged, heads repaired, bytes moved, certificate maxima and counts."""
        n, over, ovf, mx = self._counts()
        rows = self.layers[0].table.batch if self.layers[0].table is not None else 0
        return {
            "kind": self.kind, "tau": self.tau, "level": self.level, "block_size": self.block_size,
            "shadow": self.shadow, "shadow_dtype": str(self.shadow_dtype).removeprefix("torch."),
            "flagged": int(over > 0), "n_certs": n, "n_over": over, "overflow": ovf, "max_cert": mx,
            "heads_repaired": len({(e["layer"], e["row"], e["kv_head"]) for e in self.events}),
            "heads_total": self.n_layers * rows * self.n_kv,
            "bytes_moved": self.bytes_moved,
            "bytes_whole_head": sum(e["bytes_whole_head"] for e in self.events),
            "blocks_paged": sum(len(e["blocks"] or ()) for e in self.events),
            "positions_paged": sum(e["positions"] for e in self.events),
            "repair_events": len(self.events), "steps": self.forward_steps,
            "shadow_nbytes": self.shadow_nbytes(),
        }


def make_gated_cache(format: str, config: Any, *, tau: float = 0.2, shadow: str = "device",
                     shadow_dtype: torch.dtype = torch.float16, gate: bool = True, level: str = "head",
                     block_size: int = 32, **options: Any) -> GatedCache:
    """:func:`kvlib.hf.cache.make_cache` with the certificate gate: ``tau``, the shadow (``shadow`` ``"device"``
    or ``"host"``, ``shadow_dtype`` fp16/bf16/fp32), repair ``level`` ``"head"`` or ``"block"``, and
    ``block_size`` (the pool's page size, which is also the gate's block). ``gate=False``: certify and count,
    never repair (a flag-only observer). See :class:`GatedCache`; every other option goes to ``make_cache``.
    """
    gone = sorted(set(options) & {"backup_dtype", "backup_device"})
    if gone:
        raise TypeError(f"make_gated_cache: {gone} were the float-copy gate's options; use shadow='device'|'host' "
                        "and shadow_dtype=")
    cls = functools.partial(GatedCache, shadow=shadow, shadow_dtype=shadow_dtype, gate=gate, level=level)
    return make_cache(format, config, cache_class=cls, tau=tau, block_size=block_size, **options)
