"""How fast can keys be scored as certified INT8 with the dither regenerated? A design probe on the GPU (not
attention): certified-INT8 QK in the non-swapped orientation, as a KV4-style
kernel would compute it. Per tile of positions and per 32-channel scale group: int32 dots of a two-piece INT8
query with the key codes (IMMA, codes straight from the loaded tile), one fp16 dot of ``q_hi`` with the h10
dither ``-m`` generated from Philox in the operand's own layout (offline: no shared-memory round trip), the
per-token group scale. Timed from CUDA graphs streaming the keys of B=8, S=32k, Hkv=4 beside a plain copy of
the same bytes: how fast the keys can be scored with the dither regenerated, before softmax and PV."""

from __future__ import annotations

import datetime
import sys

import torch
import triton
import triton.language as tl

from kvlib.kernels.int8.h10 import _neg_m, _scales_tile, _split4
from kvlib.kernels.tl.philox import philox4x32


@triton.jit
def proto_qk(Q1, Q2, QH, KC, KS, SLOTS, OUT, n, k0, k1, BLOCK_N: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
             RP: tl.constexpr, HKV: tl.constexpr, FAST: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    rows = tl.arange(0, RP)
    acc = tl.zeros([RP, BLOCK_N], tl.float32)
    D8: tl.constexpr = D // 8
    cj = tl.arange(0, D8).to(tl.uint32)[None, :]
    for n0 in range(0, n, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        m = offs < n
        slot = tl.load(SLOTS + b * n + offs, mask=m, other=0).to(tl.int64)
        cs = slot.to(tl.uint32)[:, None] + tl.zeros([BLOCK_N, D8], dtype=tl.uint32)
        w0, w1, w2, w3 = philox4x32(cs, cj + tl.zeros_like(cs), kvh.to(tl.uint32) + tl.zeros_like(cs),
                                    tl.zeros_like(cs), k0, k1, WIDE=FAST)
        s0, s1, s2, s3 = _split4(_scales_tile(KS, slot, m, kvh, HKV * 4, 4))
        score = tl.zeros([RP, BLOCK_N], tl.float32)
        for g in tl.static_range(4):
            offs_c = g * G + tl.arange(0, G)
            kc = tl.load(KC + slot[:, None] * (HKV * D) + kvh * D + offs_c[None, :], mask=m[:, None], other=0)
            q1 = tl.load(Q1 + rows[:, None] * D + offs_c[None, :])
            q2 = tl.load(Q2 + rows[:, None] * D + offs_c[None, :])
            qh = tl.load(QH + rows[:, None] * D + offs_c[None, :])
            ti = tl.dot(q1, tl.trans(kc)).to(tl.float32) + tl.dot(q2, tl.trans(kc)).to(tl.float32) * (1.0 / 128.0)
            w = w0 if g == 0 else (w1 if g == 1 else (w2 if g == 2 else w3))
            td = tl.dot(qh, tl.trans(_neg_m(w, FAST)))
            sg = s0 if g == 0 else (s1 if g == 1 else (s2 if g == 2 else s3))
            score += (ti + td) * sg[None, :]
        acc = tl.maximum(acc, score)
    tl.store(OUT + (b * HKV + kvh) * RP * BLOCK_N + rows[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], acc)


#: (positions per tile, warps, pipeline stages)
CONFIGS = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (64, 2, 2))


def main() -> None:
    from dev.probe_kit import write_probe
    from kvlib.bench.timing import bench_graphed

    started = datetime.datetime.now(datetime.UTC)
    B, S, HKV, D, RP, CHUNK = 8, 32768, 4, 128, 16, 4096
    dev = "cuda"
    kc = torch.randint(-127, 128, (B * S, HKV, D), dtype=torch.int8, device=dev)
    ks = (torch.rand(B * S, HKV, 4, device=dev) * 0.01 + 0.001).half()
    slots = torch.arange(B * S, dtype=torch.int32, device=dev)
    q1 = torch.randint(-127, 128, (RP, D), dtype=torch.int8, device=dev)
    q2 = torch.randint(-127, 128, (RP, D), dtype=torch.int8, device=dev)
    qh = torch.randn(RP, D, device=dev).half()
    buf = torch.empty_like(kc)
    cp = bench_graphed(lambda: buf.copy_(kc), warmup_ms=5.0, rep_ms=30.0)["median_ms"]
    rows = [dict(name="copy_keys", ms=cp, TBps=2 * kc.numel() / cp / 1e9)]
    print(rows[-1], flush=True)
    nb = B * (S // CHUNK)  # one program per 4096-position chunk and kv head: enough programs to fill the GPU
    for bn, nw, ns in CONFIGS:
        out = torch.empty(nb * HKV, RP, bn, device=dev)

        def f(bn=bn, nw=nw, ns=ns, out=out):
            proto_qk[(nb, HKV)](q1, q2, qh, kc, ks, slots, out, CHUNK, 12345, 678, BLOCK_N=bn, D=D, G=32, RP=RP,
                                HKV=HKV, FAST=True, num_warps=nw, num_stages=ns)

        ms = bench_graphed(f, warmup_ms=5.0, rep_ms=30.0)["median_ms"]
        rows.append(dict(name=f"proto_qk_{bn}x{nw}w_{ns}st", ms=ms, frac_of_copy_time=cp / ms))
        print(rows[-1], flush=True)
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "qk_int8_prototype.json", "qk_int8_prototype", rows, started,
                {"command": "python -m dev.qk_int8_prototype", "shape": dict(B=B, S=S, HKV=HKV, D=D, RP=RP),
                 "configs": CONFIGS})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__)
    main()
