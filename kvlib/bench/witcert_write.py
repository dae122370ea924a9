"""WitCert write path: Triton write kernel vs the torch reference per call, and bandwidth vs copy.

One call = quantize + dither + pack ``N`` new tokens of one layer and side (all KV heads) into the
paged pool. Shapes follow the paper's setting (Qwen2.5-7B: 4 KV heads, d = 128, G_c = 32): decode
steps of 1..128 new tokens (launch-bound) and prefill chunks of 2k..64k tokens (bandwidth-bound,
where the fraction of copy bandwidth is meaningful). The paper reports the Triton kernel 82x
faster per call than its torch reference (no shape stated). The torch reference is timed twice:
as shipped, int64 Philox per head with its validation (which synchronises the host), and without
the validation (``validate=False``, as the Triton kernel is timed): the like-for-like ratio.
Bytes moved per call: read ``x`` (bf16) + write codes, scales and outliers.
On the CPU this runs tiny shapes through the torch reference only (a wiring check, no speed claim).
"""

from __future__ import annotations

import torch

from kvlib.bench.timing import bandwidth_GBps, bench_ms, copy_bandwidth
from kvlib.storage.paged import PagedPool

H_KV, D, GROUP = 4, 128, 32
SHAPES = {
    "ci": dict(decode=[1, 8], prefill=[64], n_out=[0], blocks=[16]),
    "cpu": dict(decode=[1, 8, 32], prefill=[256], n_out=[0, 8], blocks=[16]),
    "gpu": dict(decode=[1, 8, 32, 128], prefill=[2048, 16384, 65536], n_out=[0, 8], blocks=[8, 16, 32, 64]),
}


def call_bytes(n: int, h: int = H_KV, d: int = D, group: int = GROUP, n_out: int = 0, in_bytes: int = 2) -> int:
    """Bytes one write call must move: x in, codes + scales + outliers out."""
    return n * h * (d * in_bytes + d + 2 * (d // group) + 2 * n_out)


def _pool(n_slots: int, n_out: int, device: str) -> PagedPool:
    p = PagedPool(n_layers=1, n_slots=n_slots, n_kv_heads=H_KV, d=D, group=GROUP, n_out=n_out, seed=1234, device=device)
    if n_out:
        from kvlib.core.outliers import rope_pairs

        ch = rope_pairs(D)[torch.arange(n_out // 2) * 7].flatten().sort().values
        p.set_outlier_channels(0, ch.expand(H_KV, n_out).to(device))
    return p


def measure(kind: str, n: int, n_out: int, blocks: list[int], device: str, copy_GBps: float) -> dict:
    """One shape: torch reference ms, best Triton ms over ``blocks`` (CUDA only), bit identity."""
    from kvlib.kernels.int8.write import write_int8

    n_slots = max(2 * n, 256)
    g = torch.Generator(device=device).manual_seed(n)
    x = torch.randn(n, H_KV, D, device=device, generator=g).to(torch.bfloat16)
    slots = torch.randperm(n_slots, device=device, generator=g)[:n]
    ref_pool = _pool(n_slots, n_out, device)
    t_ref = bench_ms(lambda: write_int8(ref_pool, 0, x, slots, backend="torch"), rep_ms=200)
    t_raw = bench_ms(lambda: write_int8(ref_pool, 0, x, slots, backend="torch", validate=False), rep_ms=200)
    row = dict(kind=kind, n_tokens=n, n_kv_heads=H_KV, d=D, group=GROUP, n_out=n_out,
               bytes_per_call=call_bytes(n, n_out=n_out), torch_ms=t_ref.median_ms, torch=t_ref.as_dict(),
               torch_novalidate_ms=t_raw.median_ms, torch_novalidate=t_raw.as_dict())
    if device != "cuda":
        return row
    tri_pool = _pool(n_slots, n_out, device)
    best = None
    for bs in blocks:
        t = bench_ms(lambda bs=bs: write_int8(tri_pool, 0, x, slots, backend="triton", validate=False, block_s=bs))
        if best is None or t.median_ms < best[1].median_ms:
            best = (bs, t)
    bs, t = best
    identical = all(torch.equal(getattr(tri_pool, f), getattr(ref_pool, f)) for f in ("codes", "scales", "outliers"))
    gbps = bandwidth_GBps(row["bytes_per_call"], t.median_ms)
    row.update(triton_ms=t.median_ms, triton=t.as_dict(), block_s=bs, speedup_vs_torch=t_ref.median_ms / t.median_ms,
               speedup_vs_torch_novalidate=t_raw.median_ms / t.median_ms,
               achieved_GBps=gbps, fraction_of_copy=gbps / copy_GBps, bit_identical=bool(identical))
    return row


def ablation(n: int, copy_GBps: float) -> list[dict]:
    """Where the write time goes at the largest prefill shape: dither on/off, rounding instruction,
    warps x block size; dithered rows are checked bit for bit against the torch reference."""
    from kvlib.kernels.int8.write import write_int8

    x = torch.randn(n, H_KV, D, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(2 * n, device="cuda")[:n]
    ref = _pool(2 * n, 0, "cuda")
    write_int8(ref, 0, x, slots, backend="torch")
    rows = []
    for dith in (True, False):
        for rint in (False, True):
            for nw in (4, 8):
                for bs in (16, 32, 64):
                    pool = _pool(2 * n, 0, "cuda")
                    t = bench_ms(lambda pool=pool, bs=bs, nw=nw, dith=dith, rint=rint: write_int8(
                        pool, 0, x, slots, backend="triton", validate=False, block_s=bs, num_warps=nw, dither=dith,
                        use_rint=rint))
                    same = bool(torch.equal(pool.codes, ref.codes) and torch.equal(pool.scales, ref.scales))
                    gbps = bandwidth_GBps(call_bytes(n), t.median_ms)
                    rows.append(dict(n_tokens=n, dither=dith, use_rint=rint, num_warps=nw, block_s=bs, ms=t.median_ms,
                                     fraction_of_copy=gbps / copy_GBps, bit_identical=same if dith else None))
    return rows


def run(profile: str) -> dict:
    """All shapes of ``profile``; on CUDA also the copy roofline and the best block size per shape."""
    if profile not in SHAPES:
        raise ValueError(f"profile must be one of {tuple(SHAPES)}, got {profile!r}")
    cfg = SHAPES[profile]
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    copy = copy_bandwidth(device=device)
    rows = [
        measure(kind, n, n_out, cfg["blocks"], device, copy["bandwidth_GBps"])
        for n_out in cfg["n_out"]
        for kind in ("decode", "prefill")
        for n in cfg[kind]
    ]
    out = dict(device=torch.cuda.get_device_name() if cuda else "cpu", copy=copy, rows=rows,
               note="" if cuda else "CPU: torch reference only, a wiring check (no speed claim)")
    if cuda:
        out["ablation"] = ablation(cfg["prefill"][-1], copy["bandwidth_GBps"])
        out["max_fraction_of_copy"] = max(r["fraction_of_copy"] for r in rows if r["kind"] == "prefill")
        out["all_bit_identical"] = all(r["bit_identical"] for r in rows)
    return out
