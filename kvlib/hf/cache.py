"""HF transformers ``Cache`` adapters, written once over the :class:`~kvlib.formats.base.KVFormat` interface.

``make_cache(format, config, **options)`` returns a :class:`KVFormatCache`: one
:class:`KVFormatLayer` per decoder layer, each holding the *packed* form of every
(batch row, kv head, side) stream and handing dequantised float K/V to the attention. Stateless
formats are read incrementally (only new tokens are dequantised; earlier ones are kept as a
float working copy, as the HF interface needs float tensors); stateful formats (those overriding
``append``: side buffers, residual windows) are re-read in full each step, because an old token's
representation can change. ``packed_nbytes()`` measures the packed store from its tensors.

Certificate telemetry (``telemetry=True``, dithered key formats only): on every ``stride``-th
forward call per layer, the last query row of each query head (the real post-RoPE query, seen
through :func:`kvlib.hf.model.instrument`) is certified against the layer's keys with
:func:`kvlib.certify.bound.score_radius` / :func:`kvlib.certify.bound.certificate`, under the
request-level allocation ``delta_loc = delta_req / (L * Hq * steps)``. Results are aggregated on the
device (no host sync in the decode loop); ``telemetry_summary()`` syncs once at the end.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlib.formats.base import KVFormat, available_formats, get_format

#: cache-level options of make_cache; every other keyword goes to the format constructor
CACHE_OPTIONS = (
    "value_format", "value_options", "key_options", "seed", "slot_stride", "telemetry", "stride",
    "tau", "delta_req", "steps", "keep_records", "two_sided", "outlier_table", "outlier_sides",
)
#: key formats whose residual has a known sub-Gaussian proxy (see kvlib.certify.bound.PROXY)
PROXY_OF_FORMAT = {"dither-int8": "dither", "sr-int8": "sr"}


def _is_stateful(fmt: KVFormat) -> bool:
    return type(fmt).append is not KVFormat.append


@dataclass
class Telemetry:
    """Device-side aggregates of the per-(layer, query head, step) certificates."""

    n_layers: int
    n_heads: int
    tau: float
    device: torch.device | None = None
    count: torch.Tensor | None = None  # [L, Hq] certificates taken
    covered: torch.Tensor | None = None  # [L, Hq] certificates <= tau (finite)
    overflow: torch.Tensor | None = None  # [L, Hq] non-finite certificates
    max_cert: torch.Tensor | None = None  # [L, Hq] max over finite certificates
    sum_cert: torch.Tensor | None = None  # [L, Hq] sum over finite certificates
    records: list[tuple[int, int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    seconds: float = 0.0  # wall time spent inside the telemetry (host clock; synced on CUDA)
    calls: int = 0

    def _init(self, device: torch.device) -> None:
        shape = (self.n_layers, self.n_heads)
        self.device = device
        self.count = torch.zeros(shape, dtype=torch.int64, device=device)
        self.covered = torch.zeros(shape, dtype=torch.int64, device=device)
        self.overflow = torch.zeros(shape, dtype=torch.int64, device=device)
        self.max_cert = torch.full(shape, -math.inf, dtype=torch.float64, device=device)
        self.sum_cert = torch.zeros(shape, dtype=torch.float64, device=device)

    def add(self, layer: int, cert: torch.Tensor) -> None:
        """Fold one step's certificates ``[Hq]`` (or ``[B, Hq]``) of ``layer`` in, on the device."""
        if self.count is None:
            self._init(cert.device)
        c = cert.reshape(-1, self.n_heads).double()
        fin = torch.isfinite(c)
        self.count[layer] += c.shape[0]
        self.covered[layer] += (fin & (c <= self.tau)).sum(0)
        self.overflow[layer] += (~fin).sum(0)
        cf = torch.where(fin, c, torch.zeros_like(c))
        self.sum_cert[layer] += cf.sum(0)
        self.max_cert[layer] = torch.maximum(self.max_cert[layer], torch.where(fin, c, -math.inf).amax(0))

    def summary(self) -> dict[str, Any]:
        """Host-side summary (one sync): coverage, overflow fraction, finite mean and max, cost."""
        if self.count is None or int(self.count.sum()) == 0:
            return {"n": 0, "coverage": float("nan"), "overflow_fraction": float("nan"),
                    "mean_finite": float("nan"), "max_finite": float("nan"), "seconds": self.seconds,
                    "calls": self.calls}
        n = int(self.count.sum())
        n_fin = n - int(self.overflow.sum())
        return {
            "n": n,
            "coverage": int(self.covered.sum()) / n,
            "overflow_fraction": int(self.overflow.sum()) / n,
            "mean_finite": float(self.sum_cert.sum()) / n_fin if n_fin else float("nan"),
            "max_finite": float(self.max_cert.max()) if n_fin else float("nan"),
            "seconds": self.seconds,
            "calls": self.calls,
        }


class GrowingPacked:
    """A stateless format's packed stream with amortised O(1) appends.

    Per-token tensor fields live in buffers that double their capacity when full; ``view()`` gives
    the format's packed dataclass over the first ``n`` rows (what ``read``/``nbytes`` see).
    ``allocated_nbytes`` counts the whole capacity.
    """

    def __init__(self, first: Any) -> None:
        if not dataclasses.is_dataclass(first):
            raise TypeError(f"packed object must be a dataclass, got {type(first).__name__}")
        self.cls = type(first)
        self.fields = [f.name for f in dataclasses.fields(first)]
        self.per_token = {f.name for f in dataclasses.fields(first) if f.metadata.get("per_token", False)}
        self.meta = {k: getattr(first, k) for k in self.fields if k not in self.per_token}
        self.n = 0
        self.bufs: dict[str, torch.Tensor | None] = {
            k: (None if getattr(first, k) is None else getattr(first, k)[:0].clone()) for k in self.per_token}
        self._view: Any = None
        self.append(first)

    def append(self, new: Any) -> None:
        k_new = None
        for k in self.per_token:
            t = getattr(new, k)
            if t is None or self.bufs[k] is None:
                if (t is None) != (self.bufs[k] is None):
                    raise ValueError(f"packed field {k!r} is None in one chunk and not in another")
                continue
            k_new = t.shape[0]
            buf = self.bufs[k]
            if buf.shape[0] < self.n + k_new:
                cap = max(self.n + k_new, 2 * buf.shape[0], 16)
                grown = buf.new_empty((cap, *buf.shape[1:]))
                grown[: self.n] = buf[: self.n]
                self.bufs[k] = buf = grown
            buf[self.n:self.n + k_new] = t
        self.n += 0 if k_new is None else k_new
        self._view = None

    def view(self) -> Any:
        if self._view is None:
            vals = {k: (None if self.bufs[k] is None else self.bufs[k][: self.n]) for k in self.per_token}
            self._view = self.cls(**{k: vals[k] if k in vals else self.meta[k] for k in self.fields})
        return self._view

    def allocated_nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs.values() if b is not None)


class KVFormatLayer(CacheLayerMixin):
    """One decoder layer's cache: packed K and V per (batch row, kv head) in a KVFormat."""

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self, layer_idx: int, key_format: KVFormat, value_format: KVFormat, *,
                 seed: int = 0, slot_stride: int = 1 << 20, outliers: torch.Tensor | None = None,
                 outlier_sides: tuple[int, ...] = (0,)) -> None:
        super().__init__()
        self.outliers = outliers  # [kv_heads, 2m] channel table of this layer, or None
        self.outlier_sides = tuple(outlier_sides)
        self.layer_idx = layer_idx
        self.formats = (key_format, value_format)
        self.seed = seed
        self.slot_stride = slot_stride
        self.store: list[list[list[Any]]] = []  # [side][batch][kv_head]: GrowingPacked or stateful packed
        self.cumulative_length = 0
        self._work: list[torch.Tensor | None] = [None, None]  # float working copies with spare capacity

    @property
    def packed(self) -> list[list[list[Any]]]:
        """``[side][batch][kv_head]`` packed objects of the format (views for stateless formats)."""
        return [[[p.view() if isinstance(p, GrowingPacked) else p for p in row] for row in side]
                for side in self.store]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.n_kv, _, self.head_dim = key_states.shape
        self.store = [[[None] * self.n_kv for _ in range(self.batch_size)] for _ in range(2)]
        empty = key_states.new_zeros((self.batch_size, self.n_kv, 0, self.head_dim))
        self.keys, self.values = empty, empty.clone()
        self.is_initialized = True

    def _append_work(self, side: int, deq: torch.Tensor) -> torch.Tensor:
        """Append ``deq [B, H, s, d]`` to the working copy (capacity doubling); return the filled view."""
        n, s_new = self.cumulative_length, deq.shape[-2]
        buf = self._work[side]
        if buf is None or buf.shape[-2] < n + s_new:
            cap = max(n + s_new, 2 * (0 if buf is None else buf.shape[-2]), 64)
            grown = deq.new_empty((*deq.shape[:2], cap, deq.shape[-1]))
            if buf is not None:
                grown[:, :, :n] = buf[:, :, :n]
            self._work[side] = buf = grown
        buf[:, :, n:n + s_new] = deq
        return buf[:, :, :n + s_new]

    def _write_side(self, side: int, x: torch.Tensor) -> torch.Tensor:
        fmt = self.formats[side]
        b_n, h_n, s_new, _ = x.shape
        start = self.cumulative_length
        positions = torch.arange(start, start + s_new, dtype=torch.int64, device=x.device)
        stateful = _is_stateful(fmt)
        rows = []
        for b in range(b_n):
            heads = []
            for h in range(h_n):
                ctx = dict(layer=self.layer_idx, kv_head=h, side=side, positions=positions,
                           slots=positions + b * self.slot_stride, seed=self.seed)
                if self.outliers is not None and side in self.outlier_sides:
                    ctx["outlier_channels"] = self.outliers[h].to(torch.int64)
                prev = self.store[side][b][h]
                if stateful:
                    self.store[side][b][h] = fmt.append(prev, x[b, h].float(), **ctx)
                    heads.append(fmt.read(self.store[side][b][h]))
                else:
                    new = fmt.write(x[b, h].float(), **ctx)
                    if prev is None:
                        self.store[side][b][h] = GrowingPacked(new)
                    else:
                        prev.append(new)
                    heads.append(fmt.read(new))
            rows.append(torch.stack(heads))
        deq = torch.stack(rows).to(self.dtype)
        return deq if stateful else self._append_work(side, deq)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch_size:
            raise ValueError(f"key_states: batch {key_states.shape[0]} differs from the cache's {self.batch_size}")
        self.keys = self._write_side(0, key_states)
        self.values = self._write_side(1, value_states)
        self.cumulative_length += key_states.shape[-2]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = []
        self._work = [None, None]
        self.keys = self.values = None
        self.cumulative_length = 0
        self.is_initialized = False

    def packed_nbytes(self) -> int:
        """Bytes held by the packed store of this layer, measured from its tensors."""
        return sum(self.formats[s].nbytes(p) for s, side in enumerate(self.packed) for row in side for p in row
                   if p is not None)

    def allocated_nbytes(self) -> int:
        """Bytes allocated for the packed store, spare capacity of the growing buffers included."""
        total = 0
        for s, side in enumerate(self.store):
            for row in side:
                for p in row:
                    if isinstance(p, GrowingPacked):
                        total += p.allocated_nbytes()
                    elif p is not None:
                        total += self.formats[s].nbytes(p)
        return total

    def working_nbytes(self) -> int:
        """Bytes allocated for the float working copy handed to the attention (not the packed store)."""
        if not self.is_initialized:
            return 0
        work = [w for w in self._work if w is not None] or [t for t in (self.keys, self.values) if t is not None]
        return sum(t.numel() * t.element_size() for t in work)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KVFormatCache does not support beam search (reorder_cache)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            raise NotImplementedError("KVFormatCache cannot repeat a non-empty cache along the batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            raise NotImplementedError("KVFormatCache cannot select batch rows of a non-empty cache")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("KVFormatCache is not croppable")


class KVFormatCache(Cache):
    """A transformers ``Cache`` storing K and V in kvlib formats; see :func:`make_cache`."""

    def __init__(self, key_format: KVFormat, value_format: KVFormat, config: Any, *, seed: int = 0,
                 slot_stride: int = 1 << 20, telemetry: bool = False, stride: int = 32, tau: float = 0.2,
                 delta_req: float = 1e-2, steps: int = 256, keep_records: bool = False,
                 two_sided: bool = False, outlier_table: torch.Tensor | None = None,
                 outlier_sides: tuple[int, ...] = (0,)) -> None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        n_layers = int(text.num_hidden_layers)
        self.n_heads = int(text.num_attention_heads)
        self.n_kv = int(getattr(text, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // self.n_heads)
        layer_types = getattr(text, "layer_types", None) or ["full_attention"] * n_layers
        bad = set(layer_types) - {"full_attention"}
        if bad:
            raise ValueError(f"config: KVFormatCache supports full-attention layers only, found {sorted(bad)}")
        if outlier_table is not None:
            outlier_table = torch.as_tensor(outlier_table)
            if outlier_table.ndim != 3 or tuple(outlier_table.shape[:2]) != (n_layers, self.n_kv):
                raise ValueError(f"outlier_table must have shape [layers={n_layers}, kv_heads={self.n_kv}, 2m], "
                                 f"got {tuple(outlier_table.shape)}")
        layers = [KVFormatLayer(i, key_format, value_format, seed=seed, slot_stride=slot_stride,
                                outliers=None if outlier_table is None else outlier_table[i],
                                outlier_sides=outlier_sides)
                  for i in range(n_layers)]
        super().__init__(layers=layers)
        self.key_format, self.value_format = key_format, value_format
        self.telemetry_on = bool(telemetry)
        self.proxy = PROXY_OF_FORMAT.get(key_format.name, "")
        if self.telemetry_on and not self.proxy:
            raise ValueError(f"telemetry: format {key_format.name!r} has no certificate; "
                             f"certifiable key formats: {', '.join(sorted(PROXY_OF_FORMAT))}")
        self.two_sided = bool(two_sided)
        if not isinstance(stride, int) or stride < 1:
            raise ValueError(f"stride must be a positive int, got {stride!r}")
        self.stride, self.tau, self.delta_req, self.steps = stride, float(tau), float(delta_req), int(steps)
        self.keep_records = keep_records
        self.telemetry = Telemetry(n_layers, self.n_heads, float(tau))
        self._calls = [0] * n_layers

    # -- byte account ---------------------------------------------------------------------------
    def packed_nbytes(self) -> int:
        """Bytes of the packed K+V store over all layers, measured from its tensors."""
        return sum(layer.packed_nbytes() for layer in self.layers)

    def allocated_nbytes(self) -> int:
        """Bytes allocated for the packed store, including spare capacity of the growing buffers."""
        return sum(layer.allocated_nbytes() for layer in self.layers)

    def working_nbytes(self) -> int:
        """Bytes of the float working copies (what the HF attention interface requires)."""
        return sum(layer.working_nbytes() for layer in self.layers)

    # -- certificate telemetry ------------------------------------------------------------------
    @property
    def delta_loc(self) -> float:
        """Request-level allocation ``delta_req / (L * Hq * steps)``."""
        return self.delta_req / (len(self.layers) * self.n_heads * self.steps)

    def observe_query(self, layer_idx: int, query: torch.Tensor) -> None:
        """Called by the instrumented attention with the real post-RoPE query ``[B, Hq, Sq, d]``."""
        if not self.telemetry_on:
            return
        call = self._calls[layer_idx]
        self._calls[layer_idx] += 1
        if call % self.stride:
            return
        t0 = time.perf_counter()
        cert = self.certify(layer_idx, query[:, :, -1, :])
        self.telemetry.add(layer_idx, cert)
        if self.keep_records:
            self.telemetry.records.append((layer_idx, call, self.layers[layer_idx].cumulative_length, cert.detach()))
        if query.is_cuda:
            torch.cuda.synchronize(query.device)
        self.telemetry.seconds += time.perf_counter() - t0
        self.telemetry.calls += 1

    def certify(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """Certificates ``[B, Hq]`` (float64) for queries ``q [B, Hq, d]`` against the layer's keys.

        One-accumulator form ``1 - 1/A^2`` (what a kernel carries) unless ``two_sided``; ``+inf``
        when vacuous. ``p_tilde`` comes from the dequantised keys the attention used. All KV heads
        of a batch row are certified in one batched call.
        """
        from kvlib.certify.bound import certificate_from_scores

        layer = self.layers[layer_idx]
        g = self.n_heads // self.n_kv
        sm = self.head_dim ** -0.5
        out = torch.empty(q.shape[0], self.n_heads, dtype=torch.float64, device=q.device)
        for b in range(q.shape[0]):
            packs = layer.packed[0][b]
            qh = q[b].double().view(self.n_kv, g, self.head_dim)  # [Hkv, g, d]
            z_hat = torch.einsum("hgd,hsd->hgs", qh, layer.keys[b].double()) * sm  # [Hkv, g, S]
            c = certificate_from_scores(z_hat, self._packed_radius(packs, qh, sm, z_hat.shape[-1]))
            out[b] = (c.tv_bound if self.two_sided else c.tv_bound_one).reshape(-1)
        return out

    def _packed_radius(self, packs: list, qh: torch.Tensor, sm: float, n: int) -> torch.Tensor:
        """Score radius ``[Hkv, g, S]`` of one batch row from its packed keys (scales, fp16 outliers)."""
        from kvlib.certify.bound import score_radius

        scales = torch.stack([p.scales for p in packs]).unsqueeze(1)  # [Hkv, 1, S, ng]
        oc = getattr(packs[0], "outlier_channels", None)
        kw: dict[str, Any] = {}
        if oc is not None and oc.numel():
            kw["outlier_channels"] = torch.stack([p.outlier_channels for p in packs]).unsqueeze(1)
            kw["outliers"] = torch.stack([p.outliers for p in packs]).unsqueeze(1)
        # the dither layout sets the dither-mean term of the radius (2^-25 on w24's grid, 2^-11 on h10's, 2^-9 on h8's)
        return score_radius(qh, scales, sm_scale=sm, n=n, delta=self.delta_loc, group=packs[0].group,
                            proxy=self.proxy, layout=getattr(packs[0], "dither_layout", "w24"), **kw)

    def telemetry_summary(self) -> dict[str, Any]:
        """Coverage at ``tau``, overflow fraction, finite mean/max, calls and seconds (one host sync)."""
        s = self.telemetry.summary()
        s.update(tau=self.tau, stride=self.stride, delta_req=self.delta_req, delta_loc=self.delta_loc)
        return s


def make_cache(format: str, config: Any, **options: Any) -> KVFormatCache:
    """A transformers ``Cache`` storing K/V in the registered kvlib format ``format``.

    ``options``: ``value_format`` (default: same as keys), ``key_options`` / ``value_options``
    (per-side constructor options), ``seed``, ``outlier_table`` ``[L, Hkv, 2m]`` with
    ``outlier_sides`` (per-(layer, kv head) fp16 bypass channels, passed to the format as
    ``outlier_channels``), ``telemetry`` / ``stride`` / ``tau`` / ``delta_req`` / ``steps`` /
    ``keep_records`` / ``two_sided`` (certificate telemetry), ``cache_class`` (a
    :class:`KVFormatCache` subclass, or a callable building one, with the same signature: e.g. the
    certificate gate of :mod:`kvlib.hf.gate`), and any other keyword is passed to the format
    constructor of both sides. Usable as ``model.generate(..., past_key_values=cache)``.
    """
    if not isinstance(format, str):
        raise TypeError(f"format must be a str, got {type(format).__name__}")
    names = available_formats()
    vname = options.pop("value_format", None) or format
    for arg, name in (("format", format), ("value_format", vname)):
        if name not in names:
            raise ValueError(f"{arg}: unknown format {name!r}; available formats: {', '.join(names)}")
    if config is None or not hasattr(config, "num_hidden_layers") and not hasattr(config, "get_text_config"):
        raise TypeError("config must be a transformers model config (e.g. model.config)")
    key_opts = dict(options.pop("key_options", None) or {})
    val_opts = dict(options.pop("value_options", None) or {})
    cache_class = options.pop("cache_class", None) or KVFormatCache
    if not callable(cache_class):
        raise TypeError(f"cache_class must be a KVFormatCache subclass or a callable, got {cache_class!r}")
    cache_opts = {k: options.pop(k) for k in list(options) if k in CACHE_OPTIONS}
    shared = options  # the rest: format constructor options
    kf = get_format(format, **{**shared, **key_opts})
    vf = get_format(vname, **({**shared, **val_opts} if vname == format else val_opts))
    return cache_class(kf, vf, config, **cache_opts)
