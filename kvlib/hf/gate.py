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

Two repair paths (``max_repairs_per_step``):

* ``None`` (default): the eager path. Every over-threshold group is repaired, at either ``level``. One
  ``torch.nonzero`` of the over-threshold (row, KV head) mask per layer and step decides whether any repair runs
  (a host sync of a few bytes); the repair itself (rare by design) syncs freely. A gated step on this path cannot
  be captured in a CUDA graph: a capture is refused, naming the option.
* an int ``k``: the fixed-shape path (``level="head"``, ``shadow="device"``), the same at every step, eager or
  captured, with no host sync. The ``k`` over-threshold groups of the layer's step with the largest certificates
  (``torch.topk`` over all (row, KV head) groups, non-over groups ranked last) are recomputed from the shadow over a
  fixed width (the page table's slot-table width, positions past a row's length masked) and merged with
  ``torch.where``; budget slots with no over-threshold group are computed and discarded. The loads the fixed
  shape needs but no repair uses (those slots, positions past a row's length) are redirected to one shadow
  position, so memory moves the repaired rows' positions only (``bytes_moved``, as on the eager path); the
  redirected loads are reported as ``bytes_padding``. When at most
  ``k`` groups are over, every one is repaired, with the same arithmetic as the eager path (both pad to the same
  width; outputs equal). Groups over ``tau`` that the budget left out are counted, per row and in total
  (``unrepaired``; ``gate_summary`` warns), never silently dropped. The host shadow stays eager-only (a capturable
  host read is not implemented), so the option needs ``shadow="device"``.

Counters live on the device (float64 tallies per cache and per row, repair counts per (layer, row, KV head)) and
are read only by :meth:`GatedCache.gate_summary` / :meth:`GatedCache.row_summaries` (one sync each). The eager
path also keeps ``events``, one dict per repair (with blocks and certificate trajectory at ``level="block"``;
``row`` is the batch index at that step).

Batch operations (beam search, assisted and prompt-lookup decoding): ``reorder_cache``,
``batch_repeat_interleave``, ``batch_select_indices`` and ``crop`` mirror the pools. The shadow is indexed by the
pool's slots, so where the page tables keep the codes in place (dithered and other slot-bound formats: token-slot
mode) it needs nothing; where the pools copy a selected row's pages (slot-independent formats such as rtn-int8),
the shadow copies the same positions; an unpaged stateful store's shadow (by row) is indexed like its rows. A
crop shortens the page tables only (the positions past a row's length are never read, and are overwritten by
the next writes). The per-row tallies follow the rows (a repeated row takes its history along, so after repeats
the rows' sums exceed the cache totals, which count work done).

A certificate is a bound on a total variation, which never exceeds 1; a vacuous (``+inf``/NaN) one counts
as over every finite ``tau`` and is reported in ``overflow``. The prefill attends over the float prompt (exact),
so only decode steps are certified and repaired.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from kvlib.certify.bound import certificate_from_scores, score_radius
from kvlib.certify.fallback import block_excess
from kvlib.core.checks import check_bool, check_real
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


#: device tallies of the whole cache (``GatedCache._stats``) and per row (``GatedCache._rows``, one row per name)
_STATS = ("n_certs", "n_over", "overflow", "max_cert", "steps", "repair_events", "bytes_moved", "bytes_whole_head",
          "blocks_paged", "positions_paged", "unrepaired", "bytes_padding")
_ROWS = ("n_over", "max_cert", "repair_events", "bytes_moved", "bytes_whole_head", "blocks_paged", "positions_paged",
         "unrepaired")
_S = {n: i for i, n in enumerate(_STATS)}
_R = {n: i for i, n in enumerate(_ROWS)}


class GatedCache(KVFormatCache):
    """KV format cache with a certificate gate and same-step exact repair from a shadow; see the module doc."""

    watch_writes = True

    def __init__(self, key_format: Any, value_format: Any, config: Any, *, tau: float = 0.2,
                 shadow: str = "device", shadow_dtype: torch.dtype = torch.float16, gate: bool = True,
                 level: str = "head", max_repairs_per_step: int | None = None, **options: Any) -> None:
        if level not in GATE_LEVELS:
            raise ValueError(f"level must be one of {GATE_LEVELS}, got {level!r}")
        if shadow not in SHADOWS:
            raise ValueError(f"shadow must be one of {SHADOWS}, got {shadow!r}")
        if not isinstance(shadow_dtype, torch.dtype):
            raise TypeError(f"shadow_dtype must be a torch.dtype, got {type(shadow_dtype).__name__}")
        if shadow_dtype not in _SHADOW_DTYPES:
            raise ValueError(f"shadow_dtype must be one of {_SHADOW_DTYPES}, got {shadow_dtype}")
        check_real("tau", tau, lo=0.0, allow_inf=True)
        check_bool("gate", gate)
        if options.get("stride", 1) != 1:
            raise ValueError("stride: the gate needs a certificate at every decode step (stride=1)")
        if options.get("prefill", "float") != "float":
            raise ValueError("prefill: a gated cache attends over the float prompt (prefill='float'); only decode "
                             "steps are gated")
        if max_repairs_per_step is not None:
            if isinstance(max_repairs_per_step, bool) or not isinstance(max_repairs_per_step, int):
                raise TypeError(f"max_repairs_per_step must be an int or None, got "
                                f"{type(max_repairs_per_step).__name__}")
            if max_repairs_per_step < 1:
                raise ValueError(f"max_repairs_per_step must be >= 1 (or None: the eager path), got "
                                 f"{max_repairs_per_step}")
            if level != "head":
                raise ValueError("max_repairs_per_step: the fixed-shape repair recomputes whole heads (level='head'); "
                                 "the block gate pages data-dependently and runs on the eager path only "
                                 "(max_repairs_per_step=None)")
            if shadow != "device":
                raise ValueError("max_repairs_per_step: the fixed-shape repair reads a device shadow "
                                 "(shadow='device'); the host shadow runs on the eager path only "
                                 "(max_repairs_per_step=None)")
        self.kind = gate_kind(key_format.name)
        super().__init__(key_format, value_format, config, tau=tau, **options)
        if any(self.windowed):
            raise ValueError("config: a GatedCache repairs over every position of a head, so it cannot serve "
                             "sliding-window layers; use make_cache (which honours the window) for this model")
        self.gate_on = bool(gate)
        self.level = level
        self.shadow = shadow
        self.shadow_dtype = shadow_dtype
        self.max_repairs = max_repairs_per_step
        self._sh: list[list[torch.Tensor | None]] = [[None, None] for _ in range(self.n_layers)]
        self._kernel_cert = self.kind == "dither" and self.store_cls is Int8Store
        self._n_certs_seen = [0] * self.n_layers
        self._stats: torch.Tensor | None = None  # device float64 [len(_STATS)]
        self._rows: torch.Tensor | None = None  # device float64 [len(_ROWS), B]
        self._heads: torch.Tensor | None = None  # device int64 [L, B, Hkv]: repairs per (layer, row, KV head)
        self.events: list[dict[str, Any]] = []  # eager path: one per (layer, row, kv head, step) repair
        self.forward_steps = 0  # host count of the eager steps (events' step numbers); gate_summary counts on device

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
        self._ensure_tallies(self.layers[layer_idx].table.batch, k.device)  # at the prefill: never inside a capture
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

    def _grow_shadow(self, layer_idx: int, need: int) -> None:
        """Make the layer's shadow hold ``need`` slots (paged) or positions per row (unpaged)."""
        paged = self.store.paged
        lead = () if paged else (self.layers[layer_idx].table.batch,)
        for side in (0, 1):
            buf = self._sh[layer_idx][side]
            axis = len(lead)
            if buf is None or buf.shape[axis] < need:
                cap = need if paged else max(need, 2 * (0 if buf is None else buf.shape[axis]), 64)
                grown = self._alloc((*lead, cap, self.n_kv, self.head_dim))
                if buf is not None:
                    grown[(slice(None),) * axis + (slice(0, buf.shape[axis]),)] = buf
                self._sh[layer_idx][side] = grown

    def _store_shadow(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None,
                      pos: torch.Tensor | None, slots: torch.Tensor | None) -> None:
        dev = self._shadow_device()
        if slots is not None:  # paged: the pool's slot index
            self._grow_shadow(layer_idx, self.store.n_slots)
            idx = (slots.long().to(dev),)
        else:  # unpaged stateful store: [B, positions]
            self._grow_shadow(layer_idx, int(pos.max()) + 1 if pos.numel() else 0)
            idx = (rows.long().to(dev), pos.long().to(dev))
        for side, x in ((0, k), (1, v)):
            self._sh[layer_idx][side][idx] = x.detach().to(device=dev, dtype=self.shadow_dtype, non_blocking=True)

    def nbytes_breakdown(self) -> dict[str, int]:
        """The pools' and page tables' bytes (:meth:`KVFormatCache.nbytes_breakdown`) and the shadow's, wherever it
        lives (``shadow="host"``: pinned host memory); ``kv_nbytes()`` is their sum."""
        return {**super().nbytes_breakdown(), "shadow": self.shadow_nbytes()}

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

    def _width(self, layer) -> int:
        """Positions a repair attends over, masked past each row's length: the slot table's width (paged; fixed
        for static pools) or the longest row (unpaged). Both repair paths pad to it (same arithmetic)."""
        t = layer.table
        if isinstance(self.store, ObjectStore):
            return max(t.lens, default=0)
        return t.tok.shape[1] if t.token_slots else t.block_table.shape[1] * t.block_size

    @staticmethod
    def _exact_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, sm: float
                    ) -> torch.Tensor:
        """float32 softmax attention ``[m, g, d]`` of ``q [m, g, d]`` over ``k, v [m, W, d]`` at the positions
        ``valid [m, W]`` (the others masked out, their K/V zeroed, so that what the padding holds never matters)."""
        k = torch.where(valid[..., None], k.float(), 0.0)
        v = torch.where(valid[..., None], v.float(), 0.0)
        z = (sm * torch.bmm(q.float(), k.transpose(1, 2))).masked_fill(~valid[:, None, :], -math.inf)
        return torch.bmm(torch.softmax(z, -1), v)

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
        # the scores and radii are kept for this layer-step: a block repair of the same row starts from them
        self._zu = (layer.layer_idx, self.forward_steps, {})
        for b in range(q.shape[0]):
            p, n = layer.pad[b], layer.table.lens[b]
            k_hat = kv[0][b, :, p:p + n].double()  # the keys only (the certificate never reads the values)
            packed = self._key_heads(layer, b)
            qb = q[b].double().view(self.n_kv, g, self.head_dim)
            z = torch.stack([sm * qb[h] @ k_hat[h].T for h in range(self.n_kv)])  # [Hkv, g, n]
            u = torch.stack([self._radius(packed[h], k_hat[h].to(q.device), qb[h], sm) for h in range(self.n_kv)])
            self._zu[2][b] = (z, u)
            out[b] = certificate_from_scores(z, u).tv_bound_one.reshape(self.n_heads)  # all heads in one call
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

    def _ensure_tallies(self, batch: int, device: torch.device) -> None:
        """Allocate the device counters (cache totals once; per-row ones for the batch, anew for a new batch that
        no batch operation produced, e.g. after ``reset``)."""
        if self._stats is None:
            self._stats = torch.zeros(len(_STATS), dtype=torch.float64, device=device)
            self._stats[_S["max_cert"]] = -math.inf
        if self._rows is None or self._rows.shape[1] != batch:
            self._rows = torch.zeros(len(_ROWS), batch, dtype=torch.float64, device=self._stats.device)
            self._rows[_R["max_cert"]] = -math.inf
            self._heads = torch.zeros(self.n_layers, batch, self.n_kv, dtype=torch.int64, device=self._stats.device)

    def _tally(self, cert: torch.Tensor, over: torch.Tensor) -> None:
        """Device-side counts of the step's certificates (no host sync)."""
        S, R = self._stats, self._rows
        fin = torch.isfinite(cert)
        masked = torch.where(fin, cert, torch.full_like(cert, -math.inf))
        S[_S["n_certs"]] += cert.numel()
        S[_S["n_over"]] += over.sum()
        S[_S["overflow"]] += (~fin).sum()
        S[_S["max_cert"]] = torch.maximum(S[_S["max_cert"]], masked.max())
        R[_R["n_over"]] += over.sum(1)
        R[_R["max_cert"]] = torch.maximum(R[_R["max_cert"]], masked.amax(1))

    def _check_capturable(self, layer, q: torch.Tensor) -> None:
        if self.max_repairs is None:
            raise RuntimeError(
                "a gated decode step on the eager repair path (max_repairs_per_step=None) cannot be captured in a CUDA "
                "graph: it reads one host-side nonzero per layer and step to decide whether a repair runs. "
                "make_gated_cache(..., max_repairs_per_step=k) takes the fixed-shape path (shadow='device', "
                "level='head'), which captures")
        if not (self._kernel_cert and "_cert_buf" in layer.__dict__):
            raise RuntimeError(
                "a captured gated step needs the decode kernel's certificate on static pools: format 'dither-int8' "
                "with make_gated_cache(..., batch_size=, max_len=, device=); the torch certificates of "
                f"{self.key_format.name!r} are computed on the host")
        if self._rows is None or self._rows.shape[1] != q.shape[0]:
            raise RuntimeError("run the prefill (and a decode step) eagerly before capturing a gated step: the "
                               "gate's device counters are allocated then")

    def gate_step(self, layer, q: torch.Tensor, o: torch.Tensor, sm: float, kv: Any = None) -> torch.Tensor:
        """Called by :mod:`kvlib.hf.attention` after a decode step's attention: ``q [B, Hq, d]``, ``o [B, Hq, d]``
        (the kernel's or reference's output; ``kv`` the layer's ``dequantized()`` K/V when the reference path
        already built them). Returns ``o`` with the over-threshold groups recomputed."""
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            self._check_capturable(layer, q)
        self._ensure_tallies(q.shape[0], q.device)
        if layer.layer_idx == 0:
            self.forward_steps += 1
            self._stats[_S["steps"]] += 1
        cert = layer.vacuous_where_flagged(self._step_certificate(layer, q, sm, kv))  # [B, Hq]
        over = ~(cert <= self.tau)  # NaN and +inf are over
        self._tally(cert, over)
        g = self.n_heads // self.n_kv
        over_g = over.view(over.shape[0], self.n_kv, g).any(-1)  # [B, Hkv]: groups to repair
        if not self.gate_on:
            self._rows[_R["unrepaired"]] += over_g.sum(1)
            self._stats[_S["unrepaired"]] += over_g.sum()
            return o
        if self.max_repairs is not None:
            return self._gate_fixed(layer, q, o, sm, cert, over_g)
        return self._gate_eager(layer, q, o, sm, kv, cert, over, over_g)

    def _gate_eager(self, layer, q: torch.Tensor, o: torch.Tensor, sm: float, kv: Any, cert: torch.Tensor,
                    over: torch.Tensor, over_g: torch.Tensor) -> torch.Tensor:
        g = self.n_heads // self.n_kv
        pairs = over_g.nonzero()  # the one host sync of the step
        if pairs.shape[0] == 0:
            return o
        o = o.clone()
        if self.level == "block" and kv is None:
            kv = layer.dequantized()  # once per layer and step
        acc = torch.zeros(len(_ROWS), q.shape[0], dtype=torch.float64)  # host: added to the device tallies once
        pl = pairs.tolist()
        # each group's largest certificate, read once for the step (not one small read per repair)
        cmax = cert.nan_to_num(nan=math.inf).view(cert.shape[0], self.n_kv, g).amax(-1).tolist()
        # head level: every group of the step in one batched attention (the per-group Python loop dominated),
        # merged into the output with one indexed write
        heads = self._repair_heads(layer, pl, q, sm) if self.level == "head" else None
        if heads is not None:
            og = o.view(o.shape[0], self.n_kv, g, o.shape[-1])
            og[pairs[:, 0].to(o.device), pairs[:, 1].to(o.device)] = torch.stack([out for out, _ in heads]).to(o.dtype)
        for i, (b, h) in enumerate(pl):
            rows = slice(h * g, (h + 1) * g)
            if heads is not None:
                _, ev = heads[i]
            else:
                out, ev = self._repair_blocks(layer, b, h, q[b, rows], over[b, rows], sm, kv)
                o[b, rows] = out.to(o.dtype)
            ev.update(layer=layer.layer_idx, row=b, kv_head=h, step=self.forward_steps, cert=cmax[b][h])
            self.events.append(ev)
            for name, val in (("repair_events", 1), ("bytes_moved", ev["bytes"]),
                              ("bytes_whole_head", ev["bytes_whole_head"]), ("blocks_paged", len(ev["blocks"] or ())),
                              ("positions_paged", ev["positions"])):
                acc[_R[name], b] += val
        dev = self._rows.device
        self._rows += acc.to(dev)  # the max_cert row of acc is 0: unchanged
        tot = acc.sum(1)
        for name in ("repair_events", "bytes_moved", "bytes_whole_head", "blocks_paged", "positions_paged"):
            self._stats[_S[name]] += float(tot[_R[name]])
        self._heads[layer.layer_idx].index_put_((pairs[:, 0].to(dev), pairs[:, 1].to(dev)),
                                                torch.ones(len(pairs), dtype=torch.int64, device=dev), accumulate=True)
        return o

    def _gate_fixed(self, layer, q: torch.Tensor, o: torch.Tensor, sm: float, cert: torch.Tensor,
                    over_g: torch.Tensor) -> torch.Tensor:
        """The fixed-shape repair (see the module doc): no host sync, capturable."""
        B, n_kv, d = q.shape[0], self.n_kv, self.head_dim
        g, G = self.n_heads // n_kv, q.shape[0] * n_kv
        kb = min(self.max_repairs, G)
        dev = q.device
        flat_over = over_g.reshape(G)
        score = cert.nan_to_num(nan=math.inf).view(B, n_kv, g).amax(-1).reshape(G)
        score = torch.where(flat_over, score, torch.full_like(score, -math.inf))  # groups under tau rank last
        idx = torch.topk(score, kb, sorted=False).indices  # [kb]: every over group, when at most kb are
        valid = flat_over[idx]
        bi, hi = idx // n_kv, idx % n_kv
        W = self._width(layer)
        sk, sv = self._sh[layer.layer_idx]
        if isinstance(self.store, ObjectStore):
            lens = torch.tensor(layer.table.lens, dtype=torch.int64, device=dev)
            ar = torch.arange(W, device=sk.device)
            at = (bi.to(sk.device)[:, None], ar[None, :], hi.to(sk.device)[:, None])
        else:
            lens = layer.table.seq_lens.long()
            slots = layer.table.slot_table()[bi, :W].long()
            at = (slots.to(sk.device), hi.to(sk.device)[:, None])
        pos_valid = torch.arange(W, device=dev)[None, :] < lens[bi][:, None]
        # loads the fixed shape needs but no repair uses (idle budget slots, positions past a row's length) all read
        # the shadow's first entry instead: one cached line, so memory moves only the repaired rows' positions
        take = (pos_valid & valid[:, None]).to(sk.device)
        at = tuple(torch.where(take, i, 0) for i in torch.broadcast_tensors(*at))
        exact = self._exact_rows(q.reshape(G, g, d)[idx], sk[at].to(dev), sv[at].to(dev), pos_valid, sm)
        flat = o.reshape(G, g, d)
        merged = torch.where(valid[:, None, None], exact.to(o.dtype), flat[idx])
        out = flat.index_copy(0, idx, merged).view_as(o)
        # device counters: bytes moved are the repaired rows' positions (as on the eager path); the redirected
        # loads are counted apart (bytes_padding)
        per_pos = 2 * d * sk.element_size()
        vd = valid.to(torch.float64)
        n_valid = vd.sum()
        used = vd * lens[bi].to(torch.float64)  # positions read per budget slot
        R, S = self._rows, self._stats
        R[_R["repair_events"]].index_add_(0, bi, vd)
        R[_R["bytes_moved"]].index_add_(0, bi, used * per_pos)
        R[_R["bytes_whole_head"]].index_add_(0, bi, used * per_pos)
        R[_R["positions_paged"]].index_add_(0, bi, used)
        rep = torch.zeros(B, dtype=torch.float64, device=dev).index_add_(0, bi, vd)
        R[_R["unrepaired"]] += over_g.sum(1) - rep
        self._heads[layer.layer_idx].view(-1).index_add_(0, idx, valid.to(torch.int64))
        S[_S["repair_events"]] += n_valid
        S[_S["bytes_moved"]] += used.sum() * per_pos
        S[_S["bytes_whole_head"]] += used.sum() * per_pos
        S[_S["positions_paged"]] += used.sum()
        S[_S["unrepaired"]] += flat_over.sum() - n_valid
        S[_S["bytes_padding"]] += (kb * W - used.sum()) * per_pos
        return out

    def _repair_heads(self, layer, pairs: list[tuple[int, int]], q: torch.Tensor, sm: float
                      ) -> list[tuple[torch.Tensor, dict]]:
        """Head-level repairs of the (row, KV head) ``pairs`` of one step, in one batched float32 attention over
        the shadow (each padded to the fixed path's width, positions past a row's length masked)."""
        self._flush(layer.layer_idx)
        g, d, W = self.n_heads // self.n_kv, self.head_dim, self._width(layer)
        dev = q.device
        sk, sv = self._sh[layer.layer_idx]
        pt = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
        bi, hi = pt[:, 0], pt[:, 1]
        ns = [layer.table.lens[b] for b, _ in pairs]
        valid = torch.arange(W)[None, :] < torch.tensor(ns, dtype=torch.int64)[:, None]  # [P, W]
        if isinstance(self.store, ObjectStore):
            at = (bi[:, None], torch.arange(W)[None, :], hi[:, None])
        else:
            st = layer.table.slot_table()
            at = (st[bi.to(st.device), :W].long().cpu(), hi[:, None])
        # positions past a row's length read entry 0 (never used: _exact_rows zeroes them, as the old zero padding)
        at = tuple(torch.where(valid, i, 0).to(sk.device) for i in torch.broadcast_tensors(*at))
        k, v = sk[at].to(dev, torch.float32), sv[at].to(dev, torch.float32)
        qg = q.view(q.shape[0], self.n_kv, g, d)[bi.to(dev), hi.to(dev)]  # [P, g, d]
        out = self._exact_rows(qg, k, v, valid.to(dev), sm)
        per_pos = 2 * d * sk.element_size()
        return [(out[i], dict(tokens=n, bytes=n * per_pos, bytes_whole_head=n * per_pos, positions=n, blocks=None))
                for i, n in enumerate(ns)]

    def _repair_blocks(self, layer, b: int, h: int, qg: torch.Tensor, over: torch.Tensor, sm: float,
                       kv: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        n, bs, d = layer.table.lens[b], self.block_size, self.head_dim
        dev = qg.device
        k_hat, v_hat = self._stored(layer, b, kv)
        k_hat, v_hat = k_hat[h].to(dev), v_hat[h].to(dev)
        q64 = qg.double()
        zu = self.__dict__.get("_zu")
        if zu is not None and zu[:2] == (layer.layer_idx, self.forward_steps) and b in zu[2]:
            z, u = zu[2][b][0][h], zu[2][b][1][h]  # this step's certificate already computed them
        else:
            z = sm * q64 @ k_hat.T  # [g, n]
            u = self._radius(self._key_heads(layer, b)[h], k_hat, q64, sm)
        exc = sum(block_excess(z[i], u[i], bs) for i in over.nonzero().squeeze(-1).tolist())
        exc = torch.where(torch.isnan(exc), torch.full_like(exc, math.inf), exc)  # non-finite blocks first
        order = torch.argsort(exc, descending=True, stable=True).tolist()
        # the shadow's scores and radii (fp32 slack only) at every position, once; the certificate after each number
        # of paged blocks is then evaluated for a chunk of candidate counts at a time (one batched call instead of a
        # full recomputation per block), and paging stops at the first count whose certificate is <= tau
        self._flush(layer.layer_idx)
        sk, sv = self._sh[layer.layer_idx]
        allpos = torch.arange(n)
        if isinstance(self.store, ObjectStore):
            at = (b, allpos.to(sk.device), h)
        else:
            st = layer.table.slot_table()
            at = (st[b, allpos.to(st.device)].long().to(sk.device), h)
        ks = sk[at].to(dev, torch.float32).double()
        vs = sv[at].to(dev, torch.float32).double()
        z_sh = sm * q64 @ ks.T
        u_sh = _slack(sm, d, q64.abs(), ks.abs())
        blk = torch.arange(n, device=dev) // bs  # block of each position
        rank = torch.empty(len(order), dtype=torch.int64)
        rank[torch.tensor(order, dtype=torch.int64)] = torch.arange(len(order))
        rank_pos = rank.to(dev)[blk]  # [n]: how many blocks precede this position's block in the paging order
        traj, paged, chunk = [], None, max(1, 16384 // max(1, z.numel()))
        for c0 in range(0, len(order) + 1, chunk):
            ks_ = torch.arange(c0, min(c0 + chunk, len(order) + 1), device=dev)  # candidate counts of paged blocks
            m = (rank_pos[None, :] < ks_[:, None])[:, None, :]  # [c, 1, n]: paged positions
            tv = certificate_from_scores(torch.where(m, z_sh, z), torch.where(m, u_sh, u)).tv_bound_one
            tv = tv.nan_to_num(nan=1.0).clamp(max=1.0).amax(-1).tolist()
            for k, t in zip(ks_.tolist(), tv):
                traj.append(t)
                if t <= self.tau or k == len(order):
                    paged = k
                    break
            if paged is not None:
                break
        m = rank_pos < paged
        z = torch.where(m[None, :], z_sh, z)
        v_mix = torch.where(m[:, None], vs, v_hat)
        out = torch.softmax(z, -1) @ v_mix
        per_pos = 2 * d * sk.element_size()
        positions = sum(min((j + 1) * bs, n) - j * bs for j in order[:paged])
        return out, dict(tokens=n, bytes=positions * per_pos, bytes_whole_head=n * per_pos, positions=positions,
                         blocks=order[:paged], priority=[float(exc[j]) for j in order], trajectory=traj)

    # -- batch operations: the shadow and the per-row tallies follow the pools --------------------------
    def _batch_op(self, op, rows: torch.Tensor | None) -> None:
        """Run the pools' batch operation ``op`` and make the shadow follow (``rows``: the new batch's source rows,
        None for a crop). See the module doc."""
        for i in range(self.n_layers):
            self._flush(i)  # staged host writes land at the slots they were written to
        snaps = []
        for la in self.layers:  # slot-independent pools copy the selected rows' pages: remember where they were
            moves = (rows is not None and la.is_initialized and self._sh[la.layer_idx][0] is not None
                     and self.store.paged and not la.table.token_slots and la.columns > 0)
            snaps.append((la.table.slot_table().clone(), list(la.table.lens)) if moves else None)
        op()
        if rows is None:
            return
        for la, snap in zip(self.layers, snaps):
            sh = self._sh[la.layer_idx]
            if sh[0] is None:
                continue
            if isinstance(self.store, ObjectStore):  # by row and position: the rows follow
                r = rows.to(sh[0].device)
                self._sh[la.layer_idx] = [sh[0][r], sh[1][r]]
            elif snap is not None:
                old_st, old_lens = snap
                w = old_st.shape[1]
                r = rows.to(old_st.device)
                keep = torch.arange(w, device=old_st.device)[None, :] < torch.tensor(old_lens, device=old_st.device)[r,
                                                                                                                  None]
                src, dst = old_st[r][keep].long(), la.table.slot_table()[:, :w][keep].long()
                self._grow_shadow(la.layer_idx, self.store.n_slots)
                for buf in self._sh[la.layer_idx]:
                    buf[dst.to(buf.device)] = buf[src.to(buf.device)]  # the gather is a copy: in-place moves are safe
        if self._rows is not None:
            r = rows.to(self._rows.device)
            self._rows, self._heads = self._rows[:, r], self._heads[:, r]

    def _batch(self) -> int | None:
        t = self.layers[0].table
        return None if t is None else t.batch

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._batch_op(lambda: super(GatedCache, self).reorder_cache(beam_idx), torch.as_tensor(beam_idx).long().cpu())

    def batch_repeat_interleave(self, repeats: int) -> None:
        b = self._batch()
        rows = None if b is None else torch.arange(b).repeat_interleave(repeats)
        self._batch_op(lambda: super(GatedCache, self).batch_repeat_interleave(repeats), rows)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._batch_op(lambda: super(GatedCache, self).batch_select_indices(indices),
                       torch.as_tensor(indices).long().cpu())

    def crop(self, max_length: int) -> None:
        self._batch_op(lambda: super(GatedCache, self).crop(max_length), None)

    # -- records ------------------------------------------------------------------------------------
    def _totals(self) -> dict[str, float]:
        if self._stats is None:
            return {n: (-math.inf if n == "max_cert" else 0.0) for n in _STATS}
        return dict(zip(_STATS, self._stats.tolist()))  # one sync

    @property
    def bytes_moved(self) -> int:
        """Bytes read from the shadow by repairs (the repaired rows' positions, on either path)."""
        return int(self._totals()["bytes_moved"])

    def row_summaries(self) -> list[dict[str, Any]]:
        """Per batch row (request): flagged, over-threshold count, max certificate, repairs, bytes, unrepaired
        groups (over ``tau`` but beyond the budget). Rows follow batch operations (see the module doc)."""
        if self._rows is None:
            return []
        R = self._rows.tolist()
        heads = (self._heads > 0).sum((0, 2)).tolist()
        out = []
        for b in range(len(heads)):
            r = {n: R[i][b] for i, n in enumerate(_ROWS)}
            mx = r.pop("max_cert")
            out.append({"flagged": int(r["n_over"] > 0), "max_cert": mx if math.isfinite(mx) else float("nan"),
                        "heads_repaired": int(heads[b]), **{n: int(v) for n, v in r.items()}})
        return out

    def gate_summary(self) -> dict[str, Any]:
        """Per-cache record: flagged, heads repaired, bytes moved, certificate maxima and counts, and the groups
        over ``tau`` left unrepaired by ``max_repairs_per_step`` (a warning when there are any)."""
        s = self._totals()
        rows = self._batch() or 0
        unrepaired = int(s["unrepaired"])
        if self.gate_on and unrepaired:
            import warnings

            warnings.warn(f"GatedCache: {unrepaired} over-threshold (row, KV head) groups were not repaired: "
                          f"max_repairs_per_step={self.max_repairs} was exceeded at some steps; raise it, or use "
                          "max_repairs_per_step=None (eager, repairs all)", RuntimeWarning, stacklevel=2)
        mx = s["max_cert"]
        return {
            "kind": self.kind, "tau": self.tau, "level": self.level, "block_size": self.block_size,
            "shadow": self.shadow, "shadow_dtype": str(self.shadow_dtype).removeprefix("torch."),
            "repair_path": "eager" if self.max_repairs is None else "fixed", "max_repairs_per_step": self.max_repairs,
            "flagged": int(s["n_over"] > 0), "n_certs": int(s["n_certs"]), "n_over": int(s["n_over"]),
            "overflow": int(s["overflow"]), "max_cert": mx if math.isfinite(mx) else float("nan"),
            "heads_repaired": 0 if self._heads is None else int((self._heads > 0).sum()),
            "heads_total": self.n_layers * rows * self.n_kv,
            "bytes_moved": int(s["bytes_moved"]), "bytes_whole_head": int(s["bytes_whole_head"]),
            "bytes_padding": int(s["bytes_padding"]), "blocks_paged": int(s["blocks_paged"]),
            "positions_paged": int(s["positions_paged"]), "repair_events": int(s["repair_events"]),
            "unrepaired": unrepaired, "steps": int(s["steps"]), "shadow_nbytes": self.shadow_nbytes(),
        }


def make_gated_cache(format: str, config: Any, *, tau: float = 0.2, shadow: str = "device",
                     shadow_dtype: torch.dtype = torch.float16, gate: bool = True, level: str = "head",
                     block_size: int = 32, max_repairs_per_step: int | None = None, **options: Any) -> GatedCache:
    """:func:`kvlib.hf.cache.make_cache` with the certificate gate: ``tau``, the shadow (``shadow`` ``"device"``
    or ``"host"``, ``shadow_dtype`` fp16/bf16/fp32), repair ``level`` ``"head"`` or ``"block"``, and
    ``block_size`` (the pool's page size, which is also the gate's block). ``gate=False``: certify and count,
    never repair (a flag-only observer). ``max_repairs_per_step``: None (the eager path: every over-threshold
    group repaired, not capturable) or ``k``, the fixed-shape path's budget of (row, KV head) repairs per layer and
    step (no host sync, CUDA-graph capturable; groups beyond it are counted as ``unrepaired``). See
    :class:`GatedCache`; every other option goes to ``make_cache``.
    """
    gone = sorted(set(options) & {"backup_dtype", "backup_device"})
    if gone:
        raise TypeError(f"make_gated_cache: {gone} were the float-copy gate's options; use shadow='device'|'host' "
                        "and shadow_dtype=")
    cls = functools.partial(GatedCache, shadow=shadow, shadow_dtype=shadow_dtype, gate=gate, level=level,
                            max_repairs_per_step=max_repairs_per_step)
    return make_cache(format, config, cache_class=cls, tau=tau, block_size=block_size, **options)
