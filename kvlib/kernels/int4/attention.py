"""KV4 and KV4-RL decode attention over a batch of requests (one layer), merged with ``merge_states``.

:func:`build_kv4_batch` turns float K/V ``[B, Hkv, N, d]`` plus per-request lengths into the decode
layout: INT4 main cache (keys Hadamard-rotated, whole-head affine groups) and, for KV4-RL, the INT8
side buffer holding exactly what :class:`kvlib.formats.kv4rl.KV4RLFormat` would hold after writing the
same positions one by one (sinks in slots ``0..s-1``, recent positions in ring slots
``s + (p - s) mod w``). :func:`kv4_decode` attends over the INT4 cache; :func:`kv4rl_decode` attends
over two disjoint regions (INT4 main ``[min(s,n), max(min(s,n), n-w))`` and the side slots) and merges
the two ``(o, lse)`` states exactly: by default in one launch (the side slots are one extra split per
request and kv head, merged with the INT4 splits by the split merge, a fold of
:func:`kvlib.core.merge.merge_states`), or as two launches merged by :func:`kvlib.core.merge.merge_states`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlib.core.checks import check_tensor
from kvlib.core.hadamard import hadamard
from kvlib.core.merge import merge_states
from kvlib.formats.kv4 import Int4Tensor, int4_dequantize, int4_quantize
from kvlib.formats.kv4rl import int8_quantize, main_range, side_count, side_positions
from kvlib.kernels.int4.config import DEFAULT_CONFIG, KV4KernelConfig
from kvlib.kernels.int4.launch import SideBuffer, kv4_main_decode
from kvlib.kernels.int4.protected import protected_decode
from kvlib.kernels.int4.query import QueryInt8, prepare_query, prepare_query_ref
from kvlib.kernels.int4.reference import region_attention_ref


@dataclass
class KV4Batch:
    """Decode-time KV4 (+ side buffer) cache of ``B`` requests for one layer; see the module docstring."""

    k_codes: torch.Tensor  # uint8 [B, Hkv, N, d/2], rotated keys
    k_scale: torch.Tensor  # fp16 [B, Hkv, N]
    k_off: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_off: torch.Tensor
    lengths: torch.Tensor  # int32 [B]
    sink: int = 0
    recent: int = 0
    k8: torch.Tensor | None = None  # int8 [B, Hkv, C, d], rotated keys
    k8_scale: torch.Tensor | None = None  # fp16 [B, Hkv, C]
    v8: torch.Tensor | None = None
    v8_scale: torch.Tensor | None = None
    side_pos: torch.Tensor | None = None  # int64 [B, C], -1 = empty

    def __post_init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        """Recompute the per-request region bounds after ``lengths``, ``sink`` or ``recent`` change.

        Done once per decode step (as a scheduler would), not inside the attention call.
        """
        n = self.lengths.long()
        if self.protected:
            start, end = main_range(n, self.sink, self.recent)
            count = side_count(n, self.sink, self.recent)
        else:
            start, end, count = torch.zeros_like(n), n, torch.zeros_like(n)
        self._start, self._end, self._count = (t.to(torch.int32) for t in (start, end, count))
        self._zeros = torch.zeros_like(self._start)

    @property
    def protected(self) -> bool:
        return self.k8 is not None

    def main_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-request ``[start, end)`` of the INT4 region (everything for KV4, unprotected for KV4-RL)."""
        return self._start, self._end

    def side_count(self) -> torch.Tensor:
        """Occupied side slots per request (a prefix of the slots)."""
        return self._count


def build_kv4_batch(
    k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, *, sink: int | None = None, recent: int | None = None
) -> KV4Batch:
    """Quantise float ``k, v [B, Hkv, N, d]`` (positions ``>= lengths_b`` ignored) into the decode layout.

    With ``sink``/``recent`` given (KV4-RL), also fill the INT8 side buffer from the same source vectors.
    """
    check_tensor("k", k, ndim=4, floating=True)
    check_tensor("v", v, ndim=4, floating=True)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, hkv, n, d = k.shape
    check_tensor("lengths", lengths, ndim=1, floating=False)
    if lengths.shape[0] != b or int(lengths.max()) > n or int(lengths.min()) < 0:
        raise ValueError(f"lengths must be [B={b}] with values in [0, {n}], got {lengths.tolist()[:8]}")
    kr = hadamard(k.float())
    kq, vq = int4_quantize(kr), int4_quantize(v)
    out = KV4Batch(
        k_codes=kq.codes, k_scale=kq.scale[..., 0].contiguous(), k_off=kq.offset[..., 0].contiguous(),
        v_codes=vq.codes, v_scale=vq.scale[..., 0].contiguous(), v_off=vq.offset[..., 0].contiguous(),
        lengths=lengths.to(torch.int32),
    )  # fmt: skip
    if sink is None and recent is None:
        return out
    sink, recent = int(sink or 0), int(recent or 0)
    if sink < 0 or recent < 0:
        raise ValueError(f"sink and recent must be >= 0, got {sink}, {recent}")
    pos = side_positions(lengths.to(k.device), sink, recent)  # [B, C]
    idx = pos.clamp(min=0)[:, None, :, None].expand(b, hkv, pos.shape[1], d)
    k8, k8s = int8_quantize(torch.gather(kr, 2, idx))
    v8, v8s = int8_quantize(torch.gather(v.float(), 2, idx))
    empty = (pos < 0)[:, None, :]
    k8[empty.unsqueeze(-1).expand_as(k8)] = 0
    v8[empty.unsqueeze(-1).expand_as(v8)] = 0
    out.sink, out.recent = sink, recent
    out.k8, out.k8_scale, out.v8, out.v8_scale, out.side_pos = k8, k8s, v8, v8s, pos
    out.refresh()
    return out


def _check_q(q: torch.Tensor, cache: KV4Batch) -> None:
    check_tensor("q", q, ndim=3, floating=True)
    b, hkv, _, half = cache.k_codes.shape
    if q.shape[0] != b or q.shape[2] != 2 * half or q.shape[1] % hkv:
        raise ValueError(f"q must be [B={b}, Hq (multiple of {hkv}), d={2 * half}], got {tuple(q.shape)}")


def kv4_decode(
    q: torch.Tensor, cache: KV4Batch, *, sm_scale: float | None = None, int_pv: bool | None = None,
    qp: QueryInt8 | None = None, backend: str = "auto", config: KV4KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """KV4 decode: ``q [B, Hq, d]`` over all positions of the INT4 cache; returns ``(o, lse)``.

    ``config`` sets the kernel's launch parameters (default :data:`~kvlib.kernels.int4.config.DEFAULT_CONFIG`).
    """
    _check_q(q, cache)
    qp = qp or prepare_query(q, rotate=True, backend=backend, pdl=(config or DEFAULT_CONFIG).pdl)
    c = cache
    start, end = c._zeros, c.lengths  # all positions, whether or not a side buffer exists
    return kv4_main_decode(
        qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, start, end,
        sm_scale=sm_scale, int_pv=int_pv, backend=backend, config=config,
    )  # fmt: skip


def side_buffer(cache: KV4Batch) -> SideBuffer:
    """The KV4-RL protected region of ``cache`` in the kernel's argument form."""
    if not cache.protected:
        raise ValueError("cache has no side buffer: build it with sink/recent for KV4-RL")
    return SideBuffer(cache.k8, cache.k8_scale, cache.v8, cache.v8_scale, cache.side_count())


def kv4rl_decode(
    q: torch.Tensor, cache: KV4Batch, *, sm_scale: float | None = None, int_pv: bool | None = None,
    merge=merge_states, backend: str = "auto", config: KV4KernelConfig | None = None, fused: bool = True,
    qp: QueryInt8 | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """KV4-RL decode: INT4 main region and INT8 protected region, merged exactly.

    ``fused`` (default): one kernel launch whose extra program per (request, kv head) attends over
    the side slots, its state merged with the INT4 split states by the same split merge (a fold of
    :func:`~kvlib.core.merge.merge_states`), so KV4-RL costs the launches of KV4. ``fused=False``: two
    launches (INT4 region, then :func:`~kvlib.kernels.int4.protected.protected_decode`) merged by
    ``merge`` (``merge_states`` or a compiled copy of it). ``qp``: ``q`` already prepared (:func:`prepare_query`).
    """
    _check_q(q, cache)
    side = side_buffer(cache)
    c = cache
    qp = qp or prepare_query(q, rotate=True, backend=backend, pdl=(config or DEFAULT_CONFIG).pdl and fused)
    start, end = c.main_range()
    args = (qp, c.k_codes, c.k_scale, c.k_off, c.v_codes, c.v_scale, c.v_off, start, end)
    if fused:
        return kv4_main_decode(*args, sm_scale=sm_scale, int_pv=int_pv, backend=backend, config=config, side=side)
    o_m, lse_m = kv4_main_decode(*args, sm_scale=sm_scale, int_pv=int_pv, backend=backend, config=config)
    o_p, lse_p = protected_decode(qp, *side, sm_scale=sm_scale, backend=backend)
    return merge(o_m, lse_m, o_p, lse_p)


def dequantized_kv(cache: KV4Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Effective float32 ``k, v [B, Hkv, N, d]`` a KV4/KV4-RL decode attends over (keys in the rotated basis)."""

    def deq(codes, scale, off):
        return int4_dequantize(Int4Tensor(codes, scale.unsqueeze(-1), off.unsqueeze(-1), group=codes.shape[-1] * 2))

    k = deq(cache.k_codes, cache.k_scale, cache.k_off)
    v = deq(cache.v_codes, cache.v_scale, cache.v_off)
    if cache.protected:
        b, hkv, n, d = k.shape
        pos = cache.side_pos
        ok = pos >= 0
        for i in range(b):
            p = pos[i][ok[i]]
            k[i][:, p] = cache.k8[i][:, ok[i]].float() * cache.k8_scale[i][:, ok[i]].float().unsqueeze(-1)
            v[i][:, p] = cache.v8[i][:, ok[i]].float() * cache.v8_scale[i][:, ok[i]].float().unsqueeze(-1)
    return k, v


def decode_ref(
    q: torch.Tensor, cache: KV4Batch, *, sm_scale: float | None = None, qp: QueryInt8 | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-pass reference: the INT8-dequantised rotated query over :func:`dequantized_kv`, all positions."""
    qp = qp or prepare_query_ref(q, rotate=True)
    qd = qp.q8.float() * qp.scale.unsqueeze(-1)
    k, v = dequantized_kv(cache)
    mask = torch.arange(k.shape[2], device=k.device)[None, :] < cache.lengths[:, None].long()
    return region_attention_ref(qd, k, v, mask, q.shape[-1] ** -0.5 if sm_scale is None else sm_scale)
