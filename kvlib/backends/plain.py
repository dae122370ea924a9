"""The plain backend: bf16, fp16 and fp32 pages, the tokens as they are in the format's dtype.

Writes are a cast and a scatter per side (nothing to fuse); decode is :func:`kvlib.kernels.bf16.decode.decode_bf16`
(the 16-bit kernel, fp32 dots, which also reads fp32 pages).
"""

from __future__ import annotations

from typing import Any

import torch

from kvlib.backends.base import REFERENCE, Backend, Step, grow_tensor, triton_on


class PlainBackend(Backend):
    family = "bf16"

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.dtype = self.formats[0].dtype
        self.kv = [torch.zeros(self.n_layers, self.n_slots, self.n_kv, self.d, dtype=self.dtype, device=self.device)
                   for _ in range(2)]

    def _tensors(self) -> list[torch.Tensor]:
        return list(self.kv)

    def _resize(self, n_slots: int) -> None:
        self.kv = [grow_tensor(t, n_slots) for t in self.kv]

    def write(self, layer, k, v, slots, rows, pos, lens_after, one_per_row=False) -> None:
        self.write_path = "plain-torch"  # a cast and a scatter per side: nothing to fuse
        self.kv[0][layer, slots] = k.to(self.dtype)
        self.kv[1][layer, slots] = v.to(self.dtype)

    def as_attended(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # what the pages hold (a bf16 pool in an fp32 model): the prompt's attention sees the same values
        if self.dtype == k.dtype:
            return k, v
        return k.to(self.dtype).to(k.dtype), v.to(self.dtype).to(v.dtype)

    def gather(self, layer: int, st: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n = st.shape
        flat = st.reshape(-1).long()
        return tuple(t[layer, flat].reshape(b, n, self.n_kv, self.d).transpose(1, 2) for t in self.kv)

    def supports(self, shape: tuple[int, ...], device: torch.device) -> str | None:
        if not triton_on(device, self.interpret):
            return f"no Triton backend on {device.type} (CUDA, or the interpreter with interpret=True)"
        if self.d & (self.d - 1):
            return f"the 16-bit kernel takes a power-of-two head_dim, got {self.d}"
        return None

    def decode(self, layer: int, q: torch.Tensor, table: Any, sm: float, delta: float, *, certify: bool = True,
               masked: bool = False) -> Step:
        if masked or self._kernel(q, lambda: "triton") is None:
            return REFERENCE
        from kvlib.kernels.bf16.decode import decode_bf16

        out = decode_bf16(q, self.kv[0][layer], self.kv[1][layer], table.slot_table(), table.seq_lens, sm_scale=sm)
        return Step(out.o, "bf16-triton", None)
