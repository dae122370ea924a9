"""A transformers ``Cache`` whose K/V live only in kvlib's packed paged pools (:mod:`kvlib.storage`).

``make_cache(format, config, ...)`` returns a :class:`KVFormatCache`: one :class:`KVFormatLayer` per
decoder layer, each with its own page table (:class:`kvlib.storage.blocks.PageTable`) over the layer's
slice of one :class:`kvlib.backends.Backend` (the format family's pages and kernels). There is no float copy:
``update`` writes the new tokens into the pool and hands the *new tokens only* back, tagged, to the
attention function of :mod:`kvlib.hf.attention`, which ``make_cache`` activates on the config. That
function attends over the float prompt at prefill (SDPA with the mask) and, at each decode step, calls the
decode kernel on the pool (or, where no kernel applies, the torch reference: the pool dequantised for the
layer, transiently, and the model's previous attention implementation with its mask).
``kernel_path(layer)`` says which path the last step took.

Left padding: at prefill the attention reads the pad columns off the mask and rewrites each row without
them, so pools hold real tokens only (positions count from a row's first real token); the cache keeps the
pad count per row to map mask columns back.

``prefill="stored"`` makes the prompt's attention see what the pool holds instead (the fidelity analyses'
semantics). Another attention implementation switched on after ``make_cache`` (an observing or probing
one) gets the whole pool dequantised from ``update`` (``kernel_path`` ``"dequantized-for:<name>"``).

Batch operations: slot-independent pools (bf16, rtn-int8, kv4, kv4rl) copy a selected row's pages;
dithered INT8 (and other slot-bound format pages) never move a code, since its Philox counter is its
slot: page tables switch to token-slot mode (:mod:`kvlib.storage.blocks`), repeats share the prefix and
write fresh pages. ``crop`` works for every paged format (kv4rl restores its side buffer from a stash of
the last ``crop_window`` ring evictions). ``layer.keys``/``layer.values`` are dequantised views: assigning
them (a kvpress press) is refused at once, an in-place edit at the next update.

Certificates (dithered keys): the decode kernel's (or on CPU its float64 torch reference's) one-accumulator
TV bound per (layer, query head, row, step), kept on the device; :meth:`KVFormatCache.certificates` stacks
them, :meth:`KVFormatCache.certificate_summary` syncs once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlib.backends import Backend, backend_class
from kvlib.core.checks import check_open_unit, check_positive_int, check_real
from kvlib.core.philox import seed_key
from kvlib.formats.base import KVFormat, available_formats, capabilities, format_class, get_format
from kvlib.storage.blocks import BlockAllocator, PageTable

#: cache-level options of make_cache; every other keyword goes to the format constructor
CACHE_OPTIONS = (
    "value_format", "value_options", "key_options", "seed", "tau", "delta_req", "steps",
    "outlier_table", "outlier_sides", "shuffle_blocks", "crop_window", "prefill", "stride", "hook",
)


def _is_stateful(fmt: KVFormat) -> bool:
    return bool(type(fmt).stateful)


def kernel_formats() -> list[str]:
    """Names of the formats that have decode kernels (their declared ``kernel`` capability)."""
    return [n for n in available_formats() if capabilities(n)["kernel"]]


class _Tag:
    """What ``KVFormatLayer.update`` hangs on the new tokens' key tensor for :mod:`kvlib.hf.attention`: the layer,
    the phase, and whether kvlib's attention consumed it (a model attending with another implementation over the
    new tokens alone never does)."""

    __slots__ = ("layer", "phase", "consumed")

    def __init__(self, layer: KVFormatLayer, phase: str) -> None:
        self.layer, self.phase, self.consumed = layer, phase, False


class _SlotView:
    """A page table's read interface (``slot_table()``, ``seq_lens``) over given slots: a windowed step's."""

    def __init__(self, slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
        self._slots, self.seq_lens = slots, seq_lens

    def slot_table(self) -> torch.Tensor:
        return self._slots


def _allowed_columns(mask: Any, b: int, columns: int) -> torch.Tensor | None:
    """bool ``[B, columns]``: the key columns the last query row of a 4D attention mask lets through (bool: True
    attends; float: 0 attends); None when there is no mask (every column)."""
    if mask is None or not isinstance(mask, torch.Tensor) or mask.ndim != 4:
        return None
    last = mask[:, 0, -1, :columns]
    ok = last if last.dtype == torch.bool else last == 0
    return ok.expand(b, -1)


def _calling_module_config(depth: int) -> Any:
    """The ``config`` of the ``nn.Module`` whose method called ``depth`` frames up (a decoder's attention calls
    ``cache.update``), or None when the caller is not a module (a direct ``update`` call)."""
    import sys

    try:
        f = sys._getframe(depth + 1)
    except ValueError:
        return None
    mod = f.f_locals.get("self")
    return getattr(mod, "config", None) if isinstance(mod, torch.nn.Module) else None


class KVFormatLayer(CacheLayerMixin):
    """One decoder layer: a page table over its slice of the cache's backend (see the module docstring)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: KVFormatCache, layer_idx: int) -> None:
        super().__init__()
        self.cache, self.layer_idx = cache, layer_idx
        self.table: PageTable | None = None
        self.columns = 0  # sequence length as the model sees it (pad columns included)
        self.pad = [0]  # left-pad columns per row (not stored)
        self.bad: torch.Tensor | None = None  # bool [B]: rows that stored a vector the format cannot hold
        self.path = "none"
        self._certs: list[torch.Tensor] = []

    @property
    def is_croppable(self) -> bool:  # noqa: D401
        return self.cache.backend_cls.croppable

    @property
    def formats(self) -> tuple[KVFormat, KVFormat]:
        return self.cache.key_format, self.cache.value_format

    @property
    def packed(self) -> list[list[list[Any]]]:
        """``[side][row][kv_head]``: the format's packed object of each stream, rebuilt from the pages
        (INT8 pools, format pages and stateful objects; a view for inspection, not what the kernels read)."""
        t = self.table
        return [[self.cache.backend.packed_heads(self.layer_idx, t.slot_table()[b, :n].long(), b, side)
                 for b, n in enumerate(t.lens)] for side in (0, 1)]

    # kvpress-style presses rewrite layer.keys / layer.values: the packed pool cannot take float edits
    @property
    def keys(self) -> torch.Tensor | None:
        return None if not self.is_initialized else self._view(0)

    @keys.setter
    def keys(self, value: Any) -> None:
        self._refuse_edit(value, "keys")

    @property
    def values(self) -> torch.Tensor | None:
        return None if not self.is_initialized else self._view(1)

    def _view(self, side: int) -> torch.Tensor:
        """A dequantised view of the pool; a snapshot is kept so that an in-place edit of it (which cannot
        reach the packed pool) is refused at the next update instead of being silently lost."""
        views = self.__dict__.get("_views")
        if views is None or views[2] != self.columns:
            k, v = self.dequantized()
            views = self.__dict__["_views"] = ((k, v), (k.clone(), v.clone()), self.columns)
        return views[0][side]

    def _check_views(self) -> None:
        views = self.__dict__.pop("_views", None)
        if views is None:
            return
        for name, got, snap in zip(("keys", "values"), views[0], views[1]):
            if not torch.equal(got, snap):
                raise NotImplementedError(
                    f"layer.{name} of a kvlib cache was modified in place; it is a dequantised view of the packed "
                    "pool, so the edit cannot reach the cache and is refused (a kvpress press needs a DynamicCache)")

    @values.setter
    def values(self, value: Any) -> None:
        self._refuse_edit(value, "values")

    def _refuse_edit(self, value: Any, name: str) -> None:
        if value is None and not getattr(self, "is_initialized", False):
            return  # the mixin's constructor
        raise NotImplementedError(
            f"layer.{name} of a kvlib cache is a read-only dequantised view of the packed pool; editing it (as a "
            "kvpress press does) would be undone at the next step, so it is refused. Prune tokens before they "
            "enter the cache, or use a DynamicCache with the press.")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        c = self.cache
        c._ensure_backend(key_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.table is None:
            self.table = c._new_table(key_states.shape[0])
        self.pad = [0] * key_states.shape[0]
        if self.table.static and c.backend.certifies:
            # allocated here, not inside a (possibly captured) decode step whose replays would re-fill it
            self.__dict__["_cert_buf"] = torch.full((self.table.batch, c.n_heads, self.table.max_len), math.nan,
                                                    dtype=torch.float32, device=c.backend.device)
        self.is_initialized = True

    # -- writes ---------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        c._check_states(key_states, value_states, self.layer_idx)
        from kvlib.hf.attention import is_active

        # the config that decides which attention runs next is the calling module's (the model's own), which
        # may be another object than the one make_cache was given (see KVFormatCache.update)
        cfg = c._caller_config if c._caller_config is not None else c.config
        foreign = cfg is not None and not is_active(cfg)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.table.batch:
            raise ValueError(f"key_states: batch {key_states.shape[0]} differs from the cache's {self.table.batch}")
        self._check_views()
        prior = self.columns
        self._write(key_states, value_states)
        self.columns += key_states.shape[-2]
        if foreign:
            # another attention implementation is active (an observing or probing one, or the user's): it needs
            # the whole K/V, so hand it the pool dequantised (the reference path; slower, never wrong)
            self.path = f"dequantized-for:{getattr(c.config, '_attn_implementation', None)}"
            return self.dequantized()
        phase = "prefill" if prior == 0 and c.prefill == "float" else "step"
        key_states, value_states = c.backend.as_attended(key_states, value_states)
        key_states = key_states.detach() if key_states.requires_grad else key_states
        tag = _Tag(self, phase)
        key_states._kvlib = tag  # read (and marked consumed) by kvlib.hf.attention; plain tensors everywhere else
        if c._caller_config is not None:
            c._pending = tag
        return key_states, value_states

    def _isolate(self, k: torch.Tensor, v: torch.Tensor, rows_keep: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """One bad row never aborts the batch: a K or V vector the formats cannot store (non-finite, or past their
        fp16 range: :meth:`KVFormat.representable`) is written as zeros and its row is flagged (``row_flags()``;
        its certificates are ``+inf``, vacuous, and counted as overflow). Elementwise, no host sync."""
        c = self.cache
        kf, vf = c.key_format, c.value_format
        if k.device.type == "cpu" and not self.table.static:
            # growing pools on the CPU, where a host check is free: the cheap sufficient test first, and nothing to
            # rewrite when every vector passes (static pools and GPUs: no host read, the elementwise path below)
            if bool((kf.surely_representable(k, 0) & vf.surely_representable(v, 1)).all()):
                if self.bad is None or self.bad.shape[0] != k.shape[0]:
                    self.bad = torch.zeros(k.shape[0], dtype=torch.bool)
                return k, v
        bad = ~(kf.representable(k, 0) & vf.representable(v, 1))  # [B, H, s]
        if rows_keep is not None:
            bad = bad & rows_keep[:, None, :]
        rows_bad = bad.flatten(1).any(1)
        self.bad = rows_bad if self.bad is None or self.bad.shape != rows_bad.shape else self.bad | rows_bad
        z = bad[..., None]
        return torch.where(z, torch.zeros((), dtype=k.dtype, device=k.device), k), \
            torch.where(z, torch.zeros((), dtype=v.dtype, device=v.device), v)

    def vacuous_where_flagged(self, cert: torch.Tensor) -> torch.Tensor:
        """``cert [B, Hq]`` with ``+inf`` (vacuous) on the rows that stored a vector the format could not hold."""
        if self.bad is None:
            return cert
        return torch.where(self.bad.to(cert.device)[:, None], torch.full_like(cert, math.inf), cert)

    def _write(self, k: torch.Tensor, v: torch.Tensor, rows_keep: torch.Tensor | None = None) -> None:
        """Append ``k, v [B, H, s, d]`` to every row (``rows_keep [B, s]`` bool: tokens to keep); a cache hook (a
        gated cache's shadow) sees the tokens stored."""
        k, v = self._isolate(k, v, rows_keep)
        hook = self.cache.hook
        written = self.cache.backend.append(self.layer_idx, self.table, k, v, rows_keep, record=hook is not None)
        if hook is not None:
            hook.on_write(self.layer_idx, *written)

    def rewrite_without_pads(self, k: torch.Tensor, v: torch.Tensor, pad: list[int]) -> None:
        """Prefill with left padding: forget the row writes and store only each row's real tokens."""
        t = self.table
        t.reset()
        s = k.shape[-2]
        keep = torch.arange(s, device=k.device)[None, :] >= torch.tensor(pad, device=k.device)[:, None]
        self._write(k, v, keep)
        self.pad = list(pad)

    # -- reads ----------------------------------------------------------------------------------
    def reference_kv(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The reference path's K, V (:meth:`dequantized`) and whether the keys are left in the stored rotated basis
        (INT4 pages: the caller rotates its query with :func:`kvlib.core.hadamard.hadamard` instead of every key)."""
        rot = self.cache.backend.rotated_keys
        return (*self.dequantized(keys_rotated=rot), rot)

    def dequantized(self, keys_rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Float K, V ``[B, H, columns, d]`` (model dtype) at the model's columns (pads zero): the reference
        path's transient view of the pool. ``keys_rotated``: INT4 pages' keys in their stored basis."""
        t = self.table
        n = max(t.lens) if t.lens else 0
        k, v = self.cache.backend.read(self.layer_idx, t, n, rotated=keys_rotated)
        k, v = k.to(self.dtype), v.to(self.dtype)
        if min(t.lens, default=n) < n:  # rows shorter than the longest: zero what lies past their length
            lens = torch.tensor(t.lens, device=k.device)
            valid = torch.arange(n, device=k.device)[None, :] < lens[:, None]
            k = k * valid[:, None, :, None]
            v = v * valid[:, None, :, None]
        if any(self.pad) or n != self.columns:
            kk = k.new_zeros(k.shape[0], k.shape[1], self.columns, k.shape[-1])
            vv = torch.zeros_like(kk)
            for b, p in enumerate(self.pad):
                kk[b, :, p:p + t.lens[b]] = k[b, :, : t.lens[b]]
                vv[b, :, p:p + t.lens[b]] = v[b, :, : t.lens[b]]
            k, v = kk, vv
        return k, v

    def decode_step(self, query: torch.Tensor, scaling: float, mask: torch.Tensor | None = None
                    ) -> torch.Tensor | None:
        """``o [B, Hq, d]`` of a one-token step from the backend (its kernel, or its float reference where that
        certifies the step), or None: the caller attends over :meth:`reference_kv` with the model's attention.

        A sliding-window layer's step honours the model's ``mask``: no decode kernel takes a mask, so none runs
        there; dithered keys take their float reference over the allowed positions only, so the certificate bounds
        the attention the model computes (the window's), not the whole history's."""
        c = self.cache
        q = query[:, :, 0]
        self._calls = self.__dict__.get("_calls", 0) + 1
        certify = (self._calls - 1) % c.stride == 0  # telemetry stride (CPU reference path)
        windowed = c.windowed[self.layer_idx]
        table = self._window(q, mask) if windowed and c.backend.certifies and certify else self.table
        step = c.backend.decode(self.layer_idx, q, table, scaling, c.delta_loc, certify=certify, masked=windowed)
        if step.certificate is not None:
            self._record(step.certificate)
        if step.o is None:
            return None
        self.path = step.path + ("-windowed" if windowed else "")
        return step.o

    def _window(self, q: torch.Tensor, mask: torch.Tensor | None) -> _SlotView:
        """The slots the model's ``mask`` lets each row's query attend (a sliding window), as a page table's read
        interface."""
        t = self.table
        full, lens = t.slot_table(), t.lens
        allowed = _allowed_columns(mask, q.shape[0], self.columns)
        rows = []
        for b, (p, n) in enumerate(zip(self.pad, lens)):
            keep = torch.ones(n, dtype=torch.bool) if allowed is None else allowed[b, p:p + n].cpu()
            rows.append(full[b, :n][keep.to(full.device)])
        width = max((r.numel() for r in rows), default=0)
        slots = torch.zeros(len(rows), max(width, 1), dtype=full.dtype, device=full.device)
        for b, r in enumerate(rows):
            slots[b, :r.numel()] = r
        return _SlotView(slots, torch.tensor([r.numel() for r in rows], dtype=t.seq_lens.dtype,
                                             device=t.seq_lens.device))

    def _record(self, cert: torch.Tensor) -> None:
        """Keep a step's certificates ``[B, Hq]`` on the device. Static pools write them into a buffer
        ``[B, Hq, max_len]`` at the query's position (device indices: a captured step records every replay);
        growing ones keep a list of steps."""
        t = self.table
        cert = self.vacuous_where_flagged(cert)
        if not t.static:
            self._certs.append(cert)
            return
        buf = self.__dict__.get("_cert_buf")
        if buf is None:
            buf = self.__dict__["_cert_buf"] = torch.full((t.batch, cert.shape[1], t.max_len), math.nan,
                                                          dtype=torch.float32, device=cert.device)
        rows = torch.arange(t.batch, device=cert.device)
        buf[rows, :, (t.seq_lens.long() - 1).clamp(min=0)] = cert.to(torch.float32)

    # -- HF layer interface ---------------------------------------------------------------------
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return -1 if self.cache.max_len is None else self.cache.max_len

    def reset(self) -> None:
        self.__dict__.pop("_views", None)
        self._calls = 0
        if self.table is not None:
            self.table.reset()
        self.columns = 0
        self.pad = [0] * (self.table.batch if self.table else 1)
        self.bad = None
        self._certs = []
        if "_cert_buf" in self.__dict__:
            self.__dict__["_cert_buf"].fill_(math.nan)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:  # legacy form: the absolute length to keep
            if tokens_to_remove >= self.columns:
                return
            tokens_to_remove = self.columns - tokens_to_remove
        n = abs(tokens_to_remove)
        if n == 0:
            return
        self._check_views()
        old = list(self.table.lens)
        new = [max(0, ln - n) for ln in old]
        self.cache.backend.crop(self.layer_idx, old, new)
        self.columns -= n
        self.table.set_lens(new)

    def _select(self, idx: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        self._check_views()
        idx = idx.to(torch.int64).cpu()
        rows = idx.tolist()
        self.cache.backend.select(self.layer_idx, self.table, idx, filled=self.columns > 0)
        self.pad = [self.pad[r] for r in rows]
        if self.bad is not None:
            self.bad = self.bad[idx.to(self.bad.device)]
        if self._certs:
            self._certs = [c[idx.to(c.device)] for c in self._certs]
        buf = self.__dict__.get("_cert_buf")
        if buf is not None:
            self._cert_buf = buf[idx.to(buf.device)].clone()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select(torch.arange(self.table.batch).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)


class CacheHook:
    """The explicit plug-in point of a :class:`KVFormatCache` (``make_cache(..., hook=...)``): it sees every token
    stored and every one-token decode step's output, and may replace that output. :class:`kvlib.gate.GatedCache`'s
    certificate gate is one (its shadow mirrors the writes; its repair rewrites the over-threshold rows)."""

    def on_write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                 slots: torch.Tensor | None) -> None:
        """Tokens ``k, v [N, H, d]`` were stored for ``rows``/``pos`` at ``slots`` (None: a store without pages)."""

    def on_step(self, layer: KVFormatLayer, q: torch.Tensor, o: torch.Tensor, sm: float,
                kv: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """A decode step of ``layer``: ``q [B, Hq, d]``, its attention output ``o [B, Hq, d]`` (the kernel's or the
        reference's; ``kv`` the layer's :meth:`KVFormatLayer.dequantized` K/V where the reference path built them).
        Returns the output the model goes on with."""
        return o


class KVFormatCache(Cache):
    """A transformers ``Cache`` storing K and V in kvlib's paged pools; see :func:`make_cache`."""

    def __init__(self, key_format: KVFormat, value_format: KVFormat, config: Any, *, seed: int = 0,
                 tau: float = 0.2, delta_req: float = 1e-2, steps: int = 256,
                 outlier_table: torch.Tensor | None = None, outlier_sides: tuple[int, ...] = (0,),
                 batch_size: int | None = None, max_len: int | None = None, block_size: int = 16,
                 device: Any = None, dtype: torch.dtype | None = None, shuffle_blocks: int | None = None,
                 crop_window: int = 32, prefill: str = "float", stride: int = 1,
                 hook: CacheHook | None = None) -> None:
        if hook is not None and not isinstance(hook, CacheHook):
            raise TypeError(f"hook must be a kvlib.hf.cache.CacheHook or None, got {type(hook).__name__}")
        #: the cache hook (:class:`CacheHook`), or None
        self.hook = hook
        self.stride = check_positive_int("stride", stride)
        self.crop_window = check_positive_int("crop_window", crop_window)
        if prefill not in ("float", "stored"):
            raise ValueError(f"prefill must be 'float' (attend over the float prompt, as serving does) or 'stored' "
                             f"(attend over what the pool holds, the fidelity analyses' semantics), got {prefill!r}")
        self.prefill = prefill
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.n_layers = int(text.num_hidden_layers)
        self.n_heads = int(text.num_attention_heads)
        self.n_kv = int(getattr(text, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // self.n_heads)
        if self.n_heads % self.n_kv:
            raise ValueError(f"config: num_attention_heads={self.n_heads} is not a multiple of "
                             f"num_key_value_heads={self.n_kv}")
        # sliding-window layers (layer_types, or a sliding_window with none, as Mistral's): the cache keeps every
        # position and the decode step honours the model's own mask (see KVFormatLayer.decode_step)
        window = getattr(text, "sliding_window", None)
        layer_types = getattr(text, "layer_types", None) or (
            ["sliding_attention" if window is not None else "full_attention"] * self.n_layers)
        bad = set(layer_types) - {"full_attention", "sliding_attention"}
        if bad:
            raise ValueError(f"config: KVFormatCache supports full and sliding-window attention layers, found "
                             f"{sorted(bad)}")
        self.windowed = [t == "sliding_attention" for t in layer_types]
        seed_key(seed)  # TypeError/ValueError naming seed
        self.seed = seed
        self.delta_req = check_open_unit("delta_req", delta_req)
        self.tau = check_real("tau", tau, lo=0.0, allow_inf=True)
        self.steps = check_positive_int("steps", steps)
        check_positive_int("block_size", block_size)
        for name, v in (("batch_size", batch_size), ("max_len", max_len)):
            if v is not None:
                check_positive_int(name, v)
        if (batch_size is None) != (max_len is None) and max_len is not None:
            raise ValueError("max_len needs batch_size (static pools are allocated for a fixed batch)")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__} {dtype!r}")
        sides = tuple(outlier_sides) if isinstance(outlier_sides, (tuple, list)) else None
        if sides is None or not sides or not set(sides) <= {0, 1}:
            raise ValueError(f"outlier_sides must be a non-empty tuple of sides 0 (keys) and 1 (values), got "
                             f"{outlier_sides!r}")
        if outlier_table is not None:
            outlier_table = torch.as_tensor(outlier_table)
            if outlier_table.ndim != 3 or tuple(outlier_table.shape[:2]) != (self.n_layers, self.n_kv):
                raise ValueError(f"outlier_table must have shape [layers={self.n_layers}, kv_heads={self.n_kv}, 2m], "
                                 f"got {tuple(outlier_table.shape)}")
            if outlier_table.is_floating_point() or outlier_table.is_complex() or outlier_table.dtype == torch.bool:
                raise TypeError(f"outlier_table holds channel indices: it must be an integer tensor, got "
                                f"{outlier_table.dtype}")
            if outlier_table.numel() and (int(outlier_table.min()) < 0 or int(outlier_table.max()) >= self.head_dim):
                raise ValueError(f"outlier_table: channel indices must lie in [0, head_dim={self.head_dim}), got "
                                 f"[{int(outlier_table.min())}, {int(outlier_table.max())}]")
            srt = outlier_table.sort(-1).values
            if outlier_table.shape[-1] > 1 and bool((srt[..., 1:] == srt[..., :-1]).any()):
                raise ValueError("outlier_table: a (layer, kv head) row repeats a channel")
        self.key_format, self.value_format = key_format, value_format
        self.config = config if hasattr(config, "_attn_implementation") else None
        #: the backend of the format pair (the format class names its family: :func:`kvlib.backends.backend_class`)
        self.backend_cls = backend_class(key_format, value_format, outlier_table=outlier_table)
        self.stateful = _is_stateful(key_format) or _is_stateful(value_format)
        self.proxy = type(key_format).variance_proxy or ""
        self.outlier_table, self.outlier_sides = outlier_table, tuple(outlier_sides)
        self.static_batch, self.max_len, self.block_size = batch_size, max_len, block_size
        self.device = None if device is None else check_device("device", device)
        self.dtype, self.shuffle_blocks = dtype, shuffle_blocks
        self.backend: Backend | None = None  # allocated at the first update (or here, for static pools)
        self.allocators: list[BlockAllocator] = []
        self._caller_config: Any = None  # the calling attention module's config at the current update
        self._pending: _Tag | None = None  # the last tag handed to a model's attention (consumed or not)
        self._adopted: set[int] = set()  # model configs kvlib's attention was switched on by _check_model_config
        super().__init__(layers=[KVFormatLayer(self, i) for i in range(self.n_layers)])
        if batch_size is not None and self.device is not None:
            self._build_backend(batch_size, self.device)
            for la in self.layers:  # static pools: the page tables too, once
                la.table = self._new_table(batch_size)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_states(key_states, value_states, layer_idx)
        cfg = _calling_module_config(1)
        if cfg is not None:
            self._check_model_config(cfg)
        self._caller_config = cfg
        try:
            return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)
        finally:
            self._caller_config = None

    def _check_model_config(self, cfg: Any) -> None:
        """The model's attention modules read ``cfg``. make_cache switched kvlib's attention on the config it was
        given; when that is a copy (``copy.deepcopy(model.config)``, ``LlamaConfig(**model.config.to_dict())``, a
        truncated model's config) the model would attend with its own implementation over the new tokens alone.
        So kvlib's attention is switched on the model's own config too, with a warning, before the model looks it
        up; and where the model attended without it anyway (an architecture that looks its attention up before
        the cache update), the next update refuses to go on."""
        from kvlib.hf.attention import activate, is_active

        pending, self._pending = self._pending, None
        if pending is not None and not pending.consumed:
            raise RuntimeError(
                f"layer {pending.layer.layer_idx} attended with {getattr(cfg, '_attn_implementation', None)!r} "
                "instead of kvlib's attention over a kvlib cache, so it saw the new tokens only: make_cache was "
                "given a config the model's attention does not read. Pass the model's own config: "
                "make_cache(fmt, model.config)")
        if cfg is self.config or self.config is None or is_active(cfg) or not is_active(self.config):
            return
        if id(cfg) not in self._adopted:
            import warnings

            warnings.warn("make_cache was given a config that is not the one this model's attention reads (a copy?); "
                          "kvlib's attention was switched on the model's own config. Pass model.config to make_cache.",
                          UserWarning, stacklevel=4)
            self._adopted.add(id(cfg))
        activate(cfg)

    # -- construction -----------------------------------------------------------------------------
    def _build_backend(self, batch: int, device: torch.device) -> None:
        nb = -(-self.max_len // self.block_size) * batch if self.max_len else 1  # grows exactly as pages are taken
        self.backend = self.backend_cls(self.n_layers, self.n_kv, self.head_dim, self.block_size, nb, device,
                                    self.key_format, self.value_format, batch=batch, seed=self.seed,
                                    outlier_table=self.outlier_table, outlier_sides=self.outlier_sides,
                                    crop_window=self.crop_window)
        self.allocators = [BlockAllocator(nb, shuffle=self.shuffle_blocks) for _ in range(self.n_layers)]

    def _ensure_backend(self, key_states: torch.Tensor) -> None:
        if self.backend is None:
            if self.device is not None and key_states.device != self.device:
                raise ValueError(f"key_states on {key_states.device}, make_cache was given device={self.device}")
            self._build_backend(key_states.shape[0], key_states.device)
        elif self.backend.device != key_states.device:
            raise ValueError(f"key_states on {key_states.device}, the cache's pools on {self.backend.device}")

    def _grow(self, min_blocks: int) -> int:
        if self.max_len is not None:
            raise ValueError(f"the static pools (batch_size={self.static_batch}, max_len={self.max_len}) are full")
        nb = self.backend.grow(min_blocks)
        for a in self.allocators:
            a.grow(nb)
        return nb

    def _new_table(self, batch: int) -> PageTable:
        if self.static_batch is not None and batch != self.static_batch:
            raise ValueError(f"key_states: batch {batch} differs from batch_size={self.static_batch} of make_cache")
        i = sum(1 for la in self.layers if la.table is not None)
        return PageTable(batch, self.block_size, self.backend.device, self.allocators[i], self._grow,
                         max_len=self.max_len, token_slots=self.backend.paged and self.backend.slot_bound)

    def _check_states(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int) -> None:
        if not 0 <= layer_idx < self.n_layers:
            raise ValueError(f"layer_idx={layer_idx}: the cache was made for a config with {self.n_layers} layers")
        if self.dtype is not None and k.dtype != self.dtype:
            raise ValueError(f"key_states are {k.dtype}, make_cache was given dtype={self.dtype}")
        if k.ndim != 4 or k.shape[1] != self.n_kv or k.shape[-1] != self.head_dim or v.shape != k.shape:
            raise ValueError(f"key/value states must be [B, kv_heads={self.n_kv}, s, head_dim={self.head_dim}] as "
                             f"the config says; got {tuple(k.shape)} and {tuple(v.shape)} (a config of another "
                             "model?)")

    # -- telemetry / certificates -----------------------------------------------------------------
    @property
    def delta_loc(self) -> float:
        """Request-level allocation ``delta_req / (L * Hq * steps)`` (per row and step)."""
        return self.delta_req / (self.n_layers * self.n_heads * self.steps)

    def kernel_path(self, layer_idx: int = 0) -> str:
        """Which path layer ``layer_idx``'s last step took (``"int8-gluon"``, ``"kv4-triton"``,
        ``"torch-reference"``, ``"sdpa-prefill"``, ...)."""
        return self.layers[layer_idx].path

    def certificates(self) -> torch.Tensor:
        """float ``[L, Hq, B, steps]`` device tensor: the decode kernel's TV bound per (layer, query head, row,
        step) for dithered keys (``+inf`` vacuous); empty when no certified step ran. No host sync.

        Static pools (``batch_size``/``max_len``): ``[L, Hq, B, max_len]`` indexed by the query's position,
        NaN where no certified step ran (so CUDA-graph replays record theirs)."""
        bufs = [la.__dict__.get("_cert_buf") for la in self.layers]
        if all(b is not None for b in bufs):
            return torch.stack(bufs).permute(0, 2, 1, 3)
        per = [la._certs for la in self.layers]
        n = min((len(c) for c in per), default=0)
        if n == 0:
            return torch.empty(self.n_layers, self.n_heads, 0, 0)
        return torch.stack([torch.stack(c[:n], -1) for c in per]).permute(0, 2, 1, 3)

    def row_flags(self) -> torch.Tensor:
        """bool ``[B]`` (device): the rows that stored a K or V vector their format cannot hold (non-finite, or past
        its fp16 range) in any layer. Such a vector is stored as zeros, so the row's outputs are not to be trusted;
        its certificates in the layers that lost a vector are ``+inf`` (the other layers' still bound their own
        attention). Every other row is untouched. Follows batch operations; a crop keeps a flag."""
        flags = [la.bad for la in self.layers if la.bad is not None]
        if not flags:
            b = self.layers[0].table.batch if self.layers[0].table is not None else 0
            return torch.zeros(b, dtype=torch.bool)
        out = flags[0].clone()
        for f in flags[1:]:
            if f.shape == out.shape:
                out |= f.to(out.device)
        return out

    def certificate_summary(self) -> dict[str, Any]:
        """Coverage at ``tau``, overflow fraction, finite mean and max over all certificates, and the number of
        flagged rows (:meth:`row_flags`) (one sync)."""
        flagged = int(self.row_flags().sum())
        c = self.certificates().double()
        c = c[~torch.isnan(c)]  # static pools: positions without a certified step
        n = c.numel()
        if n == 0:
            return {"n": 0, "coverage": float("nan"), "overflow_fraction": float("nan"),
                    "mean_finite": float("nan"), "max_finite": float("nan"), "tau": self.tau,
                    "flagged_rows": flagged}
        fin = torch.isfinite(c)
        cf = torch.where(fin, c, torch.zeros_like(c))
        stats = torch.stack([(fin & (c <= self.tau)).sum().double(), (~fin).sum().double(), cf.sum(),
                             torch.where(fin, c, torch.full_like(c, -math.inf)).max(), fin.sum().double()]).tolist()
        cov, ovf, s, mx, nf = stats
        return {"n": n, "coverage": cov / n, "overflow_fraction": ovf / n,
                "mean_finite": s / nf if nf else float("nan"), "max_finite": mx if nf else float("nan"),
                "tau": self.tau, "delta_req": self.delta_req, "delta_loc": self.delta_loc, "stride": self.stride,
                "flagged_rows": flagged}

    # -- byte account -----------------------------------------------------------------------------
    def nbytes_breakdown(self) -> dict[str, int]:
        """Bytes the cache keeps for K/V, by part, from the tensors: ``pools`` (format bytes of the allocated
        positions, per-sequence side buffers), ``page_tables``, ``shadow`` (a gated cache's repair copy; 0 here)."""
        if self.backend is None:
            return {"pools": 0, "page_tables": 0, "shadow": 0}
        return {"pools": self.backend.nbytes(),
                "page_tables": sum(la.table.nbytes() for la in self.layers if la.table is not None), "shadow": 0}

    def kv_nbytes(self) -> int:
        """Every byte the cache keeps for K/V (the sum of :meth:`nbytes_breakdown`): pools, page tables and, for a
        gated cache, its shadow."""
        return sum(self.nbytes_breakdown().values())


def _options_dict(name: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict of format options, got {type(value).__name__} {value!r}")
    return dict(value)


def check_device(name: str, device: Any) -> torch.device:
    """``torch.device(device)`` where tensors can be made (ValueError naming ``name`` otherwise: a "cuda" device on
    a machine without CUDA, an index past the device count)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise TypeError(f"{name}={device!r} is not a torch device ({e})") from None
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as e:
        raise ValueError(f"{name}={device!r}: no such device here ({str(e).strip()})") from None
    return dev


def _probe_format(fmt: KVFormat, d: int, side: int, outlier_table: Any) -> None:
    """Write and read two tokens of width ``d`` (CPU) so option errors surface at make_cache."""
    cpu = torch.device("cpu")  # whatever the default device is
    x = torch.linspace(-1.0, 1.0, 2 * d, device=cpu).reshape(2, d)
    ctx = dict(layer=0, kv_head=0, side=side, positions=torch.arange(2, device=cpu),
               slots=torch.arange(2, device=cpu), seed=0)
    if outlier_table is not None:
        ctx["outlier_channels"] = torch.as_tensor(outlier_table)[0, 0].to(torch.int64)
    try:
        p = fmt.write(x, **ctx)
        nxt = torch.arange(2, 3, device=cpu)
        fmt.read(fmt.append(p, x[:1], **{**ctx, "positions": nxt, "slots": nxt}))
    except NotImplementedError as e:
        raise ValueError(f"format {fmt.name!r} cannot decode token by token ({e}); it cannot back a cache") from None
    except (ValueError, TypeError) as e:
        raise type(e)(f"format {fmt.name!r} with head_dim={d}: {e}") from None


def make_cache(format: str, config: Any, *, batch_size: int | None = None, max_len: int | None = None,
               block_size: int = 16, device: Any = None, dtype: torch.dtype | None = None,
               **options: Any) -> KVFormatCache:
    """A transformers ``Cache`` storing K/V in the registered kvlib format ``format`` (paged pools).

    ``config``: the model's ``PretrainedConfig`` (shapes are validated from it, and kvlib's attention
    function is made active on it: :mod:`kvlib.hf.attention`). With ``batch_size`` and ``max_len`` (and
    ``device``) the pools and page tables are allocated once, with static shapes (CUDA-graph capturable).
    ``dtype``: the K/V dtype the model hands over, checked at each update (None: any).
    ``options``: ``prefill`` (``"float"``, default: the prompt's attention sees the float K/V, as serving
    engines do; ``"stored"``: it sees what the pool holds, the semantics of the fidelity analyses),
    ``crop_window`` (kv4rl: ring evictions kept so that ``crop`` can restore the side buffer),
    ``stride`` (CPU reference path of dithered keys: certify every ``stride``-th decode step per layer; the
    decode kernel certifies every step within its own launch),
    ``value_format`` (default: the key format), ``key_options`` / ``value_options``, ``seed``,
    ``outlier_table`` ``[L, Hkv, 2m]`` with ``outlier_sides``, ``tau`` / ``delta_req`` / ``steps`` (the
    certificate's allocation), ``shuffle_blocks`` (hand out pages in a shuffled order, as a block manager
    may), ``cache_class``; any other keyword goes to the format constructor of both sides.
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
    key_opts, val_opts = (_options_dict(name, options.pop(name, None)) for name in ("key_options", "value_options"))
    cache_class = options.pop("cache_class", None) or KVFormatCache
    if not callable(cache_class):
        raise TypeError(f"cache_class must be a KVFormatCache subclass or a callable, got {cache_class!r}")
    gone = sorted(set(options) & {"slot_stride", "keep_records", "two_sided"})
    if gone:
        raise TypeError(f"make_cache: option(s) {gone} belonged to the previous adapter's host-side telemetry; the "
                        "certificate now comes from the decode kernel (one-accumulator bound, slots from the page "
                        "table): drop them")
    cache_opts = {k: options.pop(k) for k in list(options) if k in CACHE_OPTIONS}
    shared = options  # the rest: format constructor options
    v_all = {**shared, **val_opts} if vname == format else val_opts
    for name, opts in ((format, {**shared, **key_opts}), (vname, v_all)):
        unknown = sorted(set(opts) - set(format_class(name).options))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(map(repr, unknown))} for format {name!r}; it accepts "
                            f"{format_class(name).options or 'none'}, make_cache accepts {CACHE_OPTIONS}")
    kf = get_format(format, **{**shared, **key_opts})
    vf = get_format(vname, **({**shared, **val_opts} if vname == format else val_opts))
    if device is not None:
        device = check_device("device", device)
        if device.type == "cuda" and device.index is None:  # "cuda" names the current device: compare as cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
    cache = cache_class(kf, vf, config, batch_size=batch_size, max_len=max_len, block_size=block_size,
                        device=device, dtype=dtype, **cache_opts)
    ot = cache.outlier_table
    for side, fmt in enumerate((kf, vf)):
        _probe_format(fmt, cache.head_dim, side, ot if ot is not None and side in cache.outlier_sides else None)
    from kvlib.hf.attention import activate

    activate(config)
    return cache
