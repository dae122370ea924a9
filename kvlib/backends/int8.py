"""The INT8 backend: dither-int8 (each dither layout, with outlier channels) and rtn-int8 over INT8 pages.

The pages are :class:`kvlib.storage.paged.PagedPool`'s layout, one pool per side (int8 codes, fp16 group scales,
fp16 outliers). Dithered keys are written by :func:`kvlib.kernels.int8.write.write_int8` (the Philox counter is the
slot, so dithered pages are bound to their slots); values RTN in the same layout (``dithered=False``, what the
decode kernel reads). rtn-int8: the same kernel with ``rule="rtn"``, or its format's ``write`` on the torch path.

Decode: :func:`kvlib.kernels.int8.decode.launch_decode` with the kernel chosen here once per device, GQA ratio and
dtype (:meth:`Int8Backend._choose`), its certificate for dithered keys; without a kernel, dithered keys take the
float reference :func:`kvlib.kernels.int8.reference.decode_reference_batched`, certificate included.
"""

from __future__ import annotations

from typing import Any

import torch

from kvlib.backends.base import REFERENCE, Backend, Step, grow_tensor, nbytes, triton_on
from kvlib.formats.base import KVFormat
from kvlib.storage.paged import PagedPool


class Int8Backend(Backend):
    family = "int8"

    @classmethod
    def takes(cls, key_format: KVFormat, value_format: KVFormat, outlier_table: Any = None) -> str | None:
        why = super().takes(key_format, value_format, outlier_table)
        if why:
            return why
        if not type(key_format).variance_proxy and outlier_table is not None:
            return "RTN pages with outlier channels (the INT8 pages keep outliers for dithered keys)"
        if not type(key_format).variance_proxy and key_format.group != value_format.group:
            return f"one group size for K and V (got {key_format.group} and {value_format.group})"
        return None

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        kf = self.formats[0]
        self.dithered = type(kf).variance_proxy == "dither"
        self.slot_bound = self.certifies = self.dithered
        self.group = kf.group
        layout = getattr(kf, "dither_layout", "w24")
        n_out_k = 0 if self.outlier_table is None or 0 not in self.outlier_sides else self.outlier_table.shape[-1]
        n_out_v = 0 if self.outlier_table is None or 1 not in self.outlier_sides else self.outlier_table.shape[-1]
        if self.dithered and kf.outlier_channels is not None and self.outlier_table is None:
            oc = torch.as_tensor(kf.outlier_channels).to(torch.int64)
            self.outlier_table = oc.expand(self.n_layers, self.n_kv, oc.numel())
            n_out_k = oc.numel()
        common = dict(n_layers=self.n_layers, n_slots=self.n_slots, n_kv_heads=self.n_kv, d=self.d, group=self.group,
                      seed=self.seed, device=self.device, dither_layout=layout,
                      include_outliers_in_amax=getattr(kf, "include_outliers_in_amax", False))
        self.k = PagedPool(side=0, n_out=n_out_k, dithered=self.dithered, **common)
        self.v = PagedPool(side=1, n_out=n_out_v, dithered=False, **common)
        for pool in (self.k, self.v):
            if pool.n_out:
                for layer in range(self.n_layers):
                    pool.set_outlier_channels(layer, self.outlier_table[layer].to(torch.int64))

    # -- allocate and grow ------------------------------------------------------------------------
    def _tensors(self) -> list[torch.Tensor]:
        return [self.k.codes, self.k.scales, self.k.outliers, self.v.codes, self.v.scales, self.v.outliers]

    def _resize(self, n_slots: int) -> None:
        for p in (self.k, self.v):
            p.codes, p.scales, p.outliers = (grow_tensor(t, n_slots) for t in (p.codes, p.scales, p.outliers))
            p.n_slots = n_slots

    def nbytes(self) -> int:
        # the outlier channel index set is a per-(layer, head) constant of the pool, counted once
        return super().nbytes() + self.fixed_bytes()

    def bytes_per_position(self) -> float:
        # the pool's layout formula: int8 codes + fp16 group scales + fp16 outliers, per side
        return float(self.k.bytes_per_token_head() + self.v.bytes_per_token_head())

    def fixed_bytes(self) -> int:
        return nbytes(self.k.outlier_channels if self.k.n_out else None,
                      self.v.outlier_channels if self.v.n_out else None)

    # -- write ------------------------------------------------------------------------------------
    def _fused_unsupported(self) -> str | None:
        d, g = self.d, self.group
        if d & (d - 1) or d % 4 or (d // g) & (d // g - 1):
            return f"the fused INT8 write takes d and d // group powers of two, got d={d}, group={g}"
        return None

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
              pos: torch.Tensor, lens_after: torch.Tensor, one_per_row: bool = False) -> None:
        from kvlib.kernels.int8.write import write_int8, write_int8_kv

        fused = self._write_route(k)
        self.write_path = f"int8-{self._route}"
        if fused:  # K and V in one launch, no host read (the checks that sync are the torch path's)
            write_int8_kv(self.k, self.v, layer, k, v, slots, rule="witcert" if self.dithered else "rtn")
            return
        if self.dithered:
            if k.device.type == "cpu":  # the page table's slots: distinct and in range, no re-check needed
                from kvlib.kernels.int8.write import _write_int8_heads

                _write_int8_heads(self.k, layer, k, slots.to(torch.int64))
                _write_int8_heads(self.v, layer, v, slots.to(torch.int64))
                return
            write_int8(self.k, layer, k.contiguous(), slots, backend="torch")
            write_int8(self.v, layer, v.contiguous(), slots, backend="torch")
            return
        n, h, d = k.shape
        for pool, x, fmt in ((self.k, k, self.formats[0]), (self.v, v, self.formats[1])):
            p = fmt.write(x.reshape(n * h, d).float())  # rtn-int8: per-token, per-group, so batched = per stream
            pool.codes[layer, slots] = p.codes.reshape(n, h, d)
            pool.scales[layer, slots] = p.scales.reshape(n, h, -1)

    # -- read -------------------------------------------------------------------------------------
    def gather(self, layer: int, st: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n = st.shape
        flat = st.reshape(-1).long()
        out = []
        for pool in (self.k, self.v):
            x = pool.read(layer, flat) if pool.dithered else self._read_rtn(pool, layer, flat)
            out.append(x.reshape(b, n, self.n_kv, self.d).transpose(1, 2))
        return out[0], out[1]

    def _read_rtn(self, pool: PagedPool, layer: int, slots: torch.Tensor) -> torch.Tensor:
        c = pool.codes[layer, slots].float()  # s * c per group, without expanding the scales
        x = (c.unflatten(-1, (-1, self.group)) * pool.scales[layer, slots].float().unsqueeze(-1)).flatten(-2)
        if pool.n_out:
            oc = pool.outlier_channels[layer]
            x.scatter_(-1, oc.unsqueeze(0).expand(x.shape[0], -1, -1), pool.outliers[layer, slots].float())
        return x

    def packed_heads(self, layer: int, slots: torch.Tensor, row: int, side: int) -> list[Any]:
        from kvlib.formats.dither_int8 import DitherQTensor

        pool = (self.k, self.v)[side]
        out = []
        for h in range(self.n_kv):
            oc = pool.outlier_channels[layer, h] if pool.n_out else None
            outs = pool.outliers[layer, slots, h] if pool.n_out else None
            out.append(DitherQTensor(pool.codes[layer, slots, h], pool.scales[layer, slots, h], slots, outs, oc, layer,
                                     h, self.seed, side, self.group, pool.dithered, pool.dither_layout))
        return out

    # -- decode -----------------------------------------------------------------------------------
    def supports(self, shape: tuple[int, ...], device: torch.device) -> str | None:
        if not triton_on(device, self.interpret):
            return f"no Triton backend on {device.type} (CUDA, or the interpreter with interpret=True)"
        d4 = self.d // 4
        if self.d % 4 or d4 & (d4 - 1) or self.group % 4:
            return f"the INT8 kernels take d // 4 a power of two and group % 4 == 0, got d={self.d}, group={self.group}"
        from kvlib.kernels.int8.decode import resolve_impl, wspec_pages_unsupported

        try:
            resolve_impl("auto", self.d, self.group, False, self.k.dither_layout)
        except ValueError as e:
            # pages no Triton kernel reads (h8 keys at d = 64 in groups of 32) may still be the warp-specialised
            # kernels' (once WSPEC_AUTO_HEAD_DIMS holds their d): _choose asks them on the real query
            if device.type != "cuda" or wspec_pages_unsupported(self.d, self.group, self.dithered,
                                                                 self.k.dither_layout):
                return str(e)
        return None

    def _side(self, pool: PagedPool, layer: int):
        from kvlib.kernels.int8.decode import as_side

        return as_side(pool.layer(layer), "pool")

    def _choose(self, q: torch.Tensor, layer: int, block_table: torch.Tensor | None) -> str | None:
        """The kernel for ``q``'s shape, device and dtype, from the kernels' own rules on the real tensors: the
        warp-specialised kernels (Hopper, vLLM pages) where they take the pages, faster than the Gluon kernel at
        every timed shape (:data:`kvlib.kernels.int8.decode.WSPEC_CERT_CONFIGS` says where and by how much); else
        the Gluon kernel where it runs (h8-dithered or RTN keys: it reads them whatever the pool's layout label);
        else the Triton kernel of the key layout (:func:`kvlib.kernels.int8.decode.resolve_impl`); None (the torch
        reference) where none reads the pages. d = 64 reaches the warp-specialised kernels only once
        :data:`kvlib.kernels.int8.decode.WSPEC_AUTO_HEAD_DIMS` holds it."""
        from kvlib.kernels.int8.decode import resolve_impl, wspec_unsupported
        from kvlib.kernels.int8.gluon import gluon_unsupported

        try:
            impl = resolve_impl("auto", self.d, self.group, False, self.k.dither_layout)
        except ValueError:  # only the warp-specialised kernels may read these pages (supports() let them through)
            impl = None
        if (self.k.dither_layout == "h8" or not self.dithered) and q.is_cuda:
            k, v = self._side(self.k, layer), self._side(self.v, layer)
            if not gluon_unsupported(q, k, v, False):
                impl = "gluon"
            if not wspec_unsupported(q, k, v, v_dither=False, block_table=block_table,
                                     block_size=self.block_size):
                impl = "wspec"
        return impl

    def decode(self, layer: int, q: torch.Tensor, table: Any, sm: float, delta: float, *, certify: bool = True,
               masked: bool = False) -> Step:
        impl = None if masked else self._kernel(q, lambda: self._choose(q, layer, table.block_table))
        if impl is None:
            if not (self.dithered and certify):
                return REFERENCE
            # no kernel for this device, shape or mask: the kernel's arithmetic in torch, certificate included
            o, cert = self.reference_certificates(layer, q, table, sm, delta)
            return Step(o.to(q.device), "torch-reference", cert.to(device=q.device, dtype=torch.float32))
        from kvlib.kernels.int8.decode import launch_decode

        # the warp-specialised kernels read the pages through the block table (TMA boxes inside one page)
        addr = (dict(slots=None, block_table=table.block_table, block_size=self.block_size) if impl == "wspec"
                else dict(slots=table.slot_table()))
        out = launch_decode(q, self.k.layer(layer), self.v.layer(layer), seq_lens=table.seq_lens, layer=layer,
                            seed=self.seed, sm_scale=sm, delta=delta, v_dither=False, impl=impl, cert=self.dithered,
                            **addr)
        return Step(out.o, f"int8-{out.path}", out.tv_bound_one)

    def reference_certificates(self, layer: int, q: torch.Tensor, table: Any, sm: float, delta: float):
        """CPU, dithered keys: the fp32 kernel's arithmetic in torch, every row and head in one batch, with the
        certificate of its rounding model (``impl="fma"``; :func:`kvlib.kernels.int8.reference.
        decode_reference_batched` with ``precision="float32"``: the certificate bounds the attention computed)."""
        from kvlib.kernels.int8.reference import decode_reference_batched

        return decode_reference_batched(q, self.k.layer(layer), self.v.layer(layer), table.slot_table(),
                                        table.seq_lens, layer=layer, seed=self.seed, sm_scale=sm, delta=delta,
                                        impl="fma", precision="float32")
