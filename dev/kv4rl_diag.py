"""GPU diagnosis of the fused KV4-RL path: per-request LSE error against the torch reference.

``PYTHONPATH=. python -m dev.kv4rl_diag`` prints, per request (main-region length, side
count), the LSE error of the fused launch, of the two-launch path and of KV4 alone, so a mismatch can
be placed in the protected region, the main region or the merge. A diagnosis aid, not a benchmark.
"""

from __future__ import annotations

import torch

from kvlib.kernels.int4.attention import build_kv4_batch, decode_ref, kv4rl_decode


def main() -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hq, hkv, d = 32, 8, 128
    lengths = torch.tensor([768, 1, 300, 129, 145, 144, 16, 17], device=dev)
    b, n = lengths.shape[0], int(lengths.max())
    g = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(b, hkv, n, d, device=dev, generator=g)
    v = torch.randn(b, hkv, n, d, device=dev, generator=g)
    q = torch.randn(b, hq, d, device=dev, generator=g)
    cache = build_kv4_batch(k, v, lengths, sink=16, recent=128)
    from kvlib.kernels.int4.decode import prepare_query

    o_r, lse_r = decode_ref(q, cache)
    o_q, lse_q = decode_ref(q, cache, qp=prepare_query(q))  # the kernel's own INT8 query
    print("reference with the kernel's query vs torch query prep, lse diff",
          f"{float((lse_q - lse_r).abs().max()):.1e}", flush=True)
    o_r, lse_r = o_q, lse_q
    for name, kw in (("fused", dict(fused=True)), ("two_launch", dict(fused=False))):
        try:
            o, lse = kv4rl_decode(q, cache, **kw)
            e = (lse.float() - lse_r.float()).abs().amax(-1)
            eo = (o.float() - o_r.float()).abs().amax((-1, -2))
            print(name, "lse err per request", [f"{x:.1e}" for x in e.tolist()],
                  "o err", [f"{x:.1e}" for x in eo.tolist()], flush=True)
        except Exception as ex:  # noqa: BLE001 - diagnosis: keep going
            print(name, "failed:", type(ex).__name__, str(ex)[:200], flush=True)
    print("side counts", cache.side_count().tolist() if hasattr(cache, "side_count") else "n/a",
          "lengths", lengths.tolist(), flush=True)


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__, "")
    main()
