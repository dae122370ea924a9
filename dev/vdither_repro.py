"""Upstream-style reproducer (issue 28, the tc value-dither bug): Triton 3.6, sm_90, an mma v2 dot
``[16, K] x [K, 64]`` whose B tile is ``fp16(c - x)``, ``c`` loaded int8 codes and ``x`` built in-kernel by
``tl.reshape(tl.join(tl.join(a, b), tl.join(c, d)), (K, 64))``. The join stops the layout conversion from being
hoisted to the int8 load, and both operands are left with ``kWidth = 8`` (a 32-deep layout): at ``K = 16`` that was
wrong on the H200 (the dither kernel's form); ``x`` loaded gets kWidth 4. ``python -m dev.vdither_repro [OUT.json]``:
one line per case (K, form, kWidth, max_err, ok), then PASS when every case with ``4 kWidth <= K`` is right (the bug
reproducing at ``4 kWidth > K`` is reported, not a failure)."""

import datetime
import re
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _pv(P, C, X, OUT, K: tl.constexpr, JOIN: tl.constexpr):
    h, n, d = tl.arange(0, 16), tl.arange(0, K), tl.arange(0, 64)
    p = tl.load(P + h[:, None] * K + n[None, :])
    c = tl.load(C + n[:, None] * 64 + d[None, :])
    if JOIN:  # x[n, 4g + 2i + j] = ((64 n + 4g + 2i + j) % 7) / 16, built from four [K, 16] pieces
        base = (n[:, None] * 64 + 4 * tl.arange(0, 16)[None, :]).to(tl.float32)
        x0, x1, x2, x3 = (base % 7.0) / 16, ((base + 1) % 7.0) / 16, ((base + 2) % 7.0) / 16, ((base + 3) % 7.0) / 16
        x = tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), (K, 64))
    else:
        x = tl.load(X + n[:, None] * 64 + d[None, :])
    tl.store(OUT + h[:, None] * 64 + d[None, :], tl.dot(p, (c.to(tl.float32) - x).to(tl.float16)))


def main(out: str | None = None) -> int:
    started = datetime.datetime.now(datetime.UTC)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows, ok_all = [], True
    for k in (16, 32, 64):
        g = torch.Generator().manual_seed(k)
        p, c = torch.rand(16, k, generator=g).half(), torch.randint(-127, 128, (k, 64), generator=g, dtype=torch.int8)
        x = ((torch.arange(k * 64).view(k, 64) % 7) / 16).float()
        ref = p.double() @ (c.double() - x.double())  # c - x is exact in fp16
        for join in (False, True):
            o = torch.empty(16, 64, device=dev)
            kern = _pv[(1,)](p.to(dev), c.to(dev), x.to(dev), o, K=k, JOIN=join, num_warps=4)
            ir = getattr(kern, "asm", {}).get("ttgir", "")
            kw = max([int(w) for w in re.findall(r"opIdx = 1, parent = #mma\w*, kWidth = (\d+)", ir)] or [0])
            err = float((o.double().cpu() - ref).abs().max())
            row = dict(K=k, form="join" if join else "loaded", kWidth=kw, max_err=err,
                       ok=err <= 1e-4 * float(ref.abs().max()))  # fp32 accumulation order only
            ok_all &= row["ok"] or 4 * kw > k  # the known bug is reported, not a failure of this script
            rows.append(row)
            print(f"K={k:3d} {row['form']:6s} kWidth={kw} max_err={err:.3g} {'ok' if row['ok'] else 'WRONG'}")
    if out:
        from kvlib.publish.provenance import provenance, write_json_atomic

        write_json_atomic(out, {"name": "vdither_repro", "triton": triton.__version__, "rows": rows,
                                "provenance": provenance({"command": "python -m dev.vdither_repro"}, started)})
    bug = [r for r in rows if not r["ok"]]
    cases = [(r["K"], r["form"], r["kWidth"]) for r in bug]
    print(("PASS" if ok_all else "FAIL") + f" vdither_repro: {len(bug)} wrong case(s) (K, form, kWidth) {cases}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__, "[OUT.json]")
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
