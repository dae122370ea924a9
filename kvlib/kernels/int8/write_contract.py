"""The proof kernel's write contract, checked on a paged INT8 pool: the stored bytes do not depend on how the
tokens were scheduled, the reader's dither (regenerated from layer, kv head, slot, channel, side) reproduces
the writer's codes and the s/2 bound, and exact .5 ties satisfy the bound in both rounding directions."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from kvlib.core.philox import dither
from kvlib.formats.dither_int8 import quantize_codes
from kvlib.kernels.int8.write import write_int8
from kvlib.storage.paged import PagedPool


def pool_digest(pool: PagedPool, layer: int, slots: torch.Tensor) -> str:
    """sha256 (16 hex digits) of the codes and scales ``pool`` stores at ``slots`` of ``layer``."""
    v = pool.layer(layer)
    blob = torch.cat([v.codes[slots].flatten().view(torch.uint8), v.scales[slots].flatten().view(torch.uint8)])
    return hashlib.sha256(blob.cpu().numpy().tobytes()).hexdigest()[:16]


def schedule_pools(make_pool: Callable[[], PagedPool], x: torch.Tensor, slots: torch.Tensor, g: torch.Generator,
                   triton_label: str) -> dict[str, PagedPool]:
    """The same tokens ``x`` written to ``slots`` of layer 1 of fresh pools in several schedules: the torch
    reference, one Triton launch, shuffled order, four launches of uneven size, and interleaved with another
    request and layer (``g`` draws the permutations; the first entry is the reference)."""
    n_write, H, d = x.shape
    dev = x.device
    ref = make_pool()
    write_int8(ref, 1, x, slots, backend="torch")
    tri = make_pool()
    write_int8(tri, 1, x, slots, backend="triton")
    pools = {"torch reference, one call": ref, f"Triton ({triton_label}), one launch": tri}
    p = make_pool()
    perm = torch.randperm(n_write, generator=g).to(dev)
    write_int8(p, 1, x[perm], slots[perm], backend="triton")
    pools["Triton, shuffled token order"] = p
    p = make_pool()
    for chunk in torch.randperm(n_write, generator=g).to(dev).split([1, 5, n_write // 3, n_write - 6 - n_write // 3]):
        write_int8(p, 1, x[chunk], slots[chunk], backend="triton", block_s=4)
    pools["Triton, 4 launches of 1..n tokens, shuffled"] = p
    p = make_pool()
    other = torch.tensor(sorted(set(range(p.n_slots)) - set(slots.tolist()))[:n_write], device=dev)
    write_int8(p, 1, torch.randn(len(other), H, d, device=dev), other, backend="triton")  # another request first
    write_int8(p, 0, x, slots, backend="triton")  # and another layer
    write_int8(p, 1, x, slots, backend="triton")
    pools["Triton, interleaved with another request and layer"] = p
    return pools


def read_dither_check(ref: PagedPool, x: torch.Tensor, slots: torch.Tensor) -> dict[str, int]:
    """Layer 1 of ``ref`` (holding ``x`` at ``slots``) read back with the read-time dither: codes it reproduces
    (``recode_equal``), violations of s/2 (``viol_same``), and violations when the reader uses another stream,
    the sequence position instead of the slot (``viol_wrong``)."""
    n_write, H, d = x.shape
    v = ref.layer(1)
    viol_same = viol_wrong = recode_equal = 0
    for kv in range(H):
        s16 = v.scales[slots, kv].cpu()
        xs = x[:, kv].float().cpu()
        xi_read = dither(slots.cpu(), d, layer=1, kv_head=kv, seed=ref.seed, side=0)
        recode_equal += int((quantize_codes(xs, s16, xi_read, 32) == v.codes[slots, kv].cpu()).sum())
        s = s16.double().repeat_interleave(32, -1)
        c = v.codes[slots, kv].cpu().double()
        viol_same += int(((s * (c - xi_read.double()) - xs.double()).abs() > s / 2 + 2**-16 * s).sum())
        # a reader with another stream (e.g. tl.rand, or the sequence position instead of the slot)
        xi_pos = dither(torch.arange(n_write), d, layer=1, kv_head=kv, seed=ref.seed, side=0)
        viol_wrong += int(((s * (c - xi_pos.double()) - xs.double()).abs() > s / 2 + 2**-16 * s).sum())
    return dict(recode_equal=recode_equal, viol_same=viol_same, viol_wrong=viol_wrong)


def tie_check(ref: PagedPool, x: torch.Tensor, slots: torch.Tensor) -> tuple[int, bool]:
    """The exact .5 ties of x/s + xi in layer 1 of ``ref``, and whether both rounding directions satisfy the
    bound at every one."""
    H, d = x.shape[1], x.shape[2]
    v = ref.layer(1)
    s_all = v.scales[slots].float().cpu().repeat_interleave(32, -1)
    xi_all = torch.stack([dither(slots.cpu(), d, layer=1, kv_head=kv, seed=ref.seed) for kv in range(H)], 1)
    y = x.float().cpu() / s_all + xi_all
    tie = (y - torch.floor(y)) == 0.5
    lo, hi = torch.floor(y)[tie], torch.floor(y)[tie] + 1
    xt, st, xit = x.float().cpu()[tie], s_all[tie], xi_all[tie]
    both = bool(((st * (lo - xit) - xt).abs() <= st / 2).all() and ((st * (hi - xit) - xt).abs() <= st / 2).all())
    return int(tie.sum()), both
