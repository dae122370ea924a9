"""Peers for decode attention: torch SDPA bf16 on each available backend, and the copy roofline.

Every other benchmark measures SDPA again in its own run (ratios are only taken side by side);
this topic maps SDPA's backends and achieved bandwidth over (batch, context) so the performance
chapter can say which peer is the strongest and how close it sits to the copy roofline.
"""

from __future__ import annotations

import torch

from kvlib.bench.timing import bandwidth_GBps, bench_ms, copy_bandwidth

D = 128
GQA = (32, 8)  # query heads, kv heads (4:1, as the KV4-RL kernels' benchmark)


def sdpa_decode_inputs(batch: int, ctx: int, hq: int, hkv: int, d: int, device: str, dtype=torch.bfloat16):
    q = torch.randn(batch, hq, 1, d, device=device, dtype=dtype)
    k = torch.randn(batch, hkv, ctx, d, device=device, dtype=dtype)
    v = torch.randn(batch, hkv, ctx, d, device=device, dtype=dtype)
    return q, k, v


def kv_bytes_bf16(batch: int, ctx: int, hkv: int, d: int) -> int:
    """K and V bytes a decode step must read at bf16."""
    return 2 * batch * hkv * ctx * d * 2


def sdpa_backends() -> dict[str, object]:
    from torch.nn.attention import SDPBackend

    names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}
    return {k: getattr(SDPBackend, v) for k, v in names.items() if hasattr(SDPBackend, v)}


def time_sdpa(q, k, v, backend=None, expand: bool = False) -> float:
    """Median ms of one SDPA decode call; ``expand`` repeats KV heads instead of ``enable_gqa``."""
    import warnings

    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    # SDPA warns once per unsupported backend/shape; the result records which ones ran.
    warnings.filterwarnings("ignore", message=".*(kernel not used|require query, key and value|runtime disabled).*")

    if expand:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        fn = lambda: F.scaled_dot_product_attention(q, k, v)
    else:
        fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if backend is None:
        return bench_ms(fn).median_ms
    with sdpa_kernel([backend]):
        fn()  # raises here if the backend cannot take these inputs
        return bench_ms(fn).median_ms


def run(profile: str) -> dict:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if profile == "gpu" and not cuda:
        raise RuntimeError("profile 'gpu' needs CUDA")
    if cuda:
        batches, ctxs = (1, 8, 32, 128, 512), (1024, 4096, 16384, 32768)
        budget = 24 << 30  # bytes of K+V per shape, to stay well inside memory
    else:
        batches, ctxs = (1, 2), (64, 128)
        budget = 1 << 26
    hq, hkv = GQA
    out = {"copy": copy_bandwidth(device=device), "shape": {"hq": hq, "hkv": hkv, "d": D}, "rows": [],
           "unsupported": {}}
    for b in batches:
        for s in ctxs:
            nbytes = kv_bytes_bf16(b, s, hkv, D)
            if nbytes > budget:
                continue
            q, k, v = sdpa_decode_inputs(b, s, hq, hkv, D, device)
            row = {"batch": b, "ctx": s, "kv_bytes": nbytes}
            for name, backend in ([("default", None)] + list(sdpa_backends().items()) if cuda else [("default", None)]):
                try:
                    ms = time_sdpa(q, k, v, backend)
                    row[f"{name}_ms"] = ms
                    row[f"{name}_GBps"] = bandwidth_GBps(nbytes, ms)
                except RuntimeError as e:  # backend does not take these inputs
                    out["unsupported"].setdefault(name, str(e).splitlines()[0][:200])
            out["rows"].append(row)
            del q, k, v
            if cuda:
                torch.cuda.empty_cache()
    return out
