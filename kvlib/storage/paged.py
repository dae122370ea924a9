"""Paged WitCert KV pool (codes, scales, outliers addressed by slot) and its exact byte account.

STORAGE CONTRACT (the write kernel :mod:`kvlib.kernels.int8.write` and the read-side decode kernel
both honour it; the torch reference is :func:`kvlib.formats.dither_int8.dither_quantize`):

* One pool per side (side 0 = K, side 1 = V). Per layer ``l`` the pool holds
  ``codes[l]`` int8 ``[n_slots, H_kv, d]``, ``scales[l]`` fp16 ``[n_slots, H_kv, d // G]`` (``G`` =
  group, default 32), ``outliers[l]`` fp16 ``[n_slots, H_kv, n_out]`` and
  ``outlier_channels[l]`` int64 ``[H_kv, n_out]`` (``n_out = 2m``: the channels of ``m`` RoPE pairs,
  sorted ascending, one fixed set per (layer, head), shared by all slots). The tensors are allocated
  as ``[n_layers, ...]`` so ``codes[l]`` is a contiguous view.
* Codes at outlier channels are 0 and those channels are excluded from the group amax (unless the
  pool is built with ``include_outliers_in_amax=True``, the paper's controlled experiment).
* Dither for (layer, kv_head, slot, channel c, side): Philox4x32-10 with counter
  ``(slot, c // 4, kv_head, (layer << 1) | side)`` and key ``(seed & 0xFFFFFFFF, seed >> 32)``;
  word ``w = out[c % 4]``; ``xi = (w >> 8) 2^-24 + 2^-25 - 1/2`` (exact in fp32). That is dither
  layout ``"w24"`` (the default, the paper's). A pool built with ``dither_layout="h10"`` uses eight
  10-bit dithers per call instead: counter ``(slot, j, kv_head, (layer << 1) | side)``, ``j < d // 8``,
  word ``i`` half ``h`` (low first) -> channel ``i (d/4) + 2j + h``, ``xi = ((v >> 6) + 1/2) 2^-10 - 1/2``
  (needs ``d % 8 == 0``); ``dither_layout="h8"`` sixteen 8-bit dithers per call, ``j < d // 16``, word ``i``
  byte ``k`` -> channel ``i (d/4) + 4j + k``, ``xi = (b + 1/2) 2^-8 - 1/2`` (needs ``d % 16 == 0``).
  Implemented once per language: :mod:`kvlib.core.philox` (torch),
  :mod:`kvlib.kernels.tl.philox` (Triton). The layout is a property of the pool (``pool.dither_layout``,
  also on every :class:`LayerView`), so writer and readers cannot disagree.
* Quantize: ``s = fp16(amax / 126.5)`` (the STORED scale; if fp16 rounding gives ``127 s < amax``,
  possible only for subnormal scales, ``s`` is bumped to the next fp16 up; ``amax == 0`` stores
  ``s = 0`` with codes 0, so the read ``0 * (0 - xi)`` is exactly 0); then in fp32 with ``s``
  converted from fp16 and IEEE division: ``c = clamp(rne(x / s + xi), -127, 127)``.
  Outlier channels store ``fp16(x)``. NaN in a group stores an inf scale (non-finite on read).
* Read: ``k_hat = s (c - xi)`` in fp32, then the outlier channels are overwritten by their fp16 values.
* A pool built with ``dithered=False`` (e.g. values stored RTN, which the certificate does not need)
  uses the same layout and scale rule with ``xi = 0``: ``c = clamp(rne(x / s), -127, 127)``, read ``s c``.

Byte account per token per head per side: ``d`` (codes) + ``2 d / G`` (scales) + ``2 n_out``
(outliers) — 136 B at d = 128, G = 32, m = 0 (the paper's "136 B/tok/head per side"), 152 B at m = 4.
The channel index set is a per-(layer, head) constant (``8 n_out`` bytes), not a per-token cost.
"""

from __future__ import annotations

import dataclasses

import torch

from kvlib.core.checks import check_group, check_positive_int, check_tensor
from kvlib.core.philox import check_layout_d


def bytes_per_token_head(d: int, group: int = 32, n_out: int = 0) -> int:
    """Bytes per token per head per side from the layout: int8 codes, fp16 scales, fp16 outliers."""
    check_group("group", group, d)
    return d * torch.int8.itemsize + (d // group) * torch.float16.itemsize + n_out * torch.float16.itemsize


@dataclasses.dataclass
class LayerView:
    """Contiguous views of one layer of a pool (what kernels receive)."""

    codes: torch.Tensor  # int8 [n_slots, H, d]
    scales: torch.Tensor  # fp16 [n_slots, H, d // G]
    outliers: torch.Tensor  # fp16 [n_slots, H, n_out]
    outlier_channels: torch.Tensor  # int64 [H, n_out]
    dither_layout: str = "w24"  # Philox dither layout of the pool (kvlib.core.philox.DITHER_LAYOUTS)
    dithered: bool = True  # False: xi = 0 (RTN codes); the decode kernels read such keys in RTN-key mode


class PagedPool:
    """Slot-addressed storage of one side (K or V) for ``n_layers`` layers."""

    def __init__(
        self,
        *,
        n_layers: int,
        n_slots: int,
        n_kv_heads: int,
        d: int,
        group: int = 32,
        n_out: int = 0,
        side: int = 0,
        seed: int = 0,
        include_outliers_in_amax: bool = False,
        dithered: bool = True,
        device: str | torch.device = "cpu",
        dither_layout: str = "w24",
    ) -> None:
        for name, v in (("n_layers", n_layers), ("n_slots", n_slots), ("n_kv_heads", n_kv_heads), ("d", d)):
            check_positive_int(name, v)
        check_group("group", group, d)
        check_positive_int("n_out", n_out, minimum=0)
        if n_out % 2 or n_out > d:
            raise ValueError(f"n_out must be an even number of channels (m RoPE pairs) <= d, got {n_out}")
        if side not in (0, 1):
            raise ValueError(f"side must be 0 (K) or 1 (V), got {side!r}")
        self.dither_layout = check_layout_d(dither_layout, d)
        self.n_layers, self.n_slots, self.n_kv_heads, self.d = n_layers, n_slots, n_kv_heads, d
        self.group, self.n_out, self.side, self.seed = group, n_out, side, seed
        self.include_outliers_in_amax = include_outliers_in_amax
        self.dithered = bool(dithered)
        L, N, H = n_layers, n_slots, n_kv_heads
        self.codes = torch.zeros(L, N, H, d, dtype=torch.int8, device=device)
        self.scales = torch.zeros(L, N, H, d // group, dtype=torch.float16, device=device)
        self.outliers = torch.zeros(L, N, H, n_out, dtype=torch.float16, device=device)
        # default outlier set: the first m rotate-half pairs; replace with set_outlier_channels
        from kvlib.core.outliers import rope_pairs

        default = rope_pairs(d)[: n_out // 2].flatten().sort().values if n_out else torch.zeros(0, dtype=torch.int64)
        self.outlier_channels = default.to(device).expand(L, H, n_out).contiguous()

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def layer(self, layer: int) -> LayerView:
        """Views of layer ``layer`` (contiguous, shapes as in the storage contract)."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer must lie in [0, {self.n_layers}), got {layer}")
        return LayerView(self.codes[layer], self.scales[layer], self.outliers[layer], self.outlier_channels[layer],
                         self.dither_layout, self.dithered)

    def set_outlier_channels(self, layer: int, channels: torch.Tensor) -> None:
        """Fix the outlier set of ``layer``: int64 ``[H, n_out]`` (each row sorted, unique, in [0, d))."""
        check_tensor("channels", channels, ndim=2, floating=False)
        if tuple(channels.shape) != (self.n_kv_heads, self.n_out):
            raise ValueError(f"channels must have shape {(self.n_kv_heads, self.n_out)}, got {tuple(channels.shape)}")
        ch = channels.to(torch.int64).sort(dim=-1).values
        if ch.numel() and (int(ch.min()) < 0 or int(ch.max()) >= self.d):
            raise ValueError(f"channels must lie in [0, d={self.d})")
        if ch.numel() and bool((ch[:, 1:] == ch[:, :-1]).any()):
            raise ValueError("channels must not repeat within a head")
        self.outlier_channels[layer] = ch.to(self.device)

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Torch reference read: fp32 ``[N, H, d]`` = ``s (c - xi)`` with outliers substituted."""
        from kvlib.core.dither_tables import cached_dither  # the same dither, kept per stream by slot
        from kvlib.formats.dither_int8 import dequantize_codes

        check_tensor("slots", slots, ndim=1, floating=False)
        v = self.layer(layer)
        slots = slots.to(torch.int64).to(self.device)
        out = torch.empty(slots.shape[0], self.n_kv_heads, self.d, dtype=torch.float32, device=self.device)
        for h in range(self.n_kv_heads):
            if self.dithered:
                xi = cached_dither(slots, self.d, layer=layer, kv_head=h, seed=self.seed, side=self.side,
                                   layout=self.dither_layout).to(self.device)
            else:
                xi = torch.zeros(slots.shape[0], self.d, device=self.device)
            out[:, h] = dequantize_codes(v.codes[slots, h], v.scales[slots, h], xi, self.group)
            if self.n_out:
                out[:, h, v.outlier_channels[h]] = v.outliers[slots, h].to(torch.float32)
        return out

    # -- byte account ------------------------------------------------------------------------
    def bytes_per_token_head(self) -> int:
        """From the layout (no tensors consulted)."""
        return bytes_per_token_head(self.d, self.group, self.n_out)

    def measured_bytes_per_token_head(self) -> float:
        """From the allocated tensors: (codes + scales + outliers) nbytes / (layers * slots * heads)."""
        payload = sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.outliers))
        return payload / (self.n_layers * self.n_slots * self.n_kv_heads)

    def constant_bytes_per_layer_head(self) -> float:
        """The outlier channel index set: a per-(layer, head) constant, not per token."""
        t = self.outlier_channels
        return t.numel() * t.element_size() / (self.n_layers * self.n_kv_heads)


class PagedKV:
    """K and V pools (side 0 and side 1) sharing slots; V has its own outlier count (often 0) and
    may be stored RTN (``dither_v=False``: only keys need the dither for the certificate). Every other
    keyword (``dither_layout`` included) goes to both :class:`PagedPool` sides."""

    def __init__(self, *, n_out_k: int = 0, n_out_v: int = 0, dither_v: bool = True, **kw: object) -> None:
        self.k = PagedPool(side=0, n_out=n_out_k, **kw)  # type: ignore[arg-type]
        self.v = PagedPool(side=1, n_out=n_out_v, dithered=dither_v, **kw)  # type: ignore[arg-type]

    def pool(self, side: int) -> PagedPool:
        return (self.k, self.v)[side]

    def bytes_per_token_head(self) -> int:
        """K + V bytes per token per head."""
        return self.k.bytes_per_token_head() + self.v.bytes_per_token_head()
