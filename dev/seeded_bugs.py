"""Seeded-bug run (issue 37): plant one realistic bug at a time in the cache contract, the softmax-state merge, the
certificate and the formats' quantisers, run the tests that should catch it, and record which survive.

Each mutant is a literal (old -> new) edit of one source line; the file is restored from memory after the run
(never from git: the tree may hold uncommitted work). A mutant is *killed* when its tests fail, *survives* when they
pass; a survivor is a missing test (fix it) or an equivalent mutant (explain it). Run from the repository root:

    PYTHONPATH=$PWD python dev/seeded_bugs.py [--only NAME ...] [--out dev/results/seeded_bugs.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


CONTRACT = ("tests/test_hf_contract.py",)
USER = ("tests/test_user_models.py",)
MUTANTS = [
    # -- the cache contract (kvlib/hf/cache.py, attention.py)
    Mutant("pad-not-reordered", "kvlib/hf/cache.py", "        self.pad = [self.pad[r] for r in rows]\n",
           "        pass\n", CONTRACT, "reorder/select leaves the left-pad list behind"),
    Mutant("crop-keeps-columns", "kvlib/hf/cache.py", "        self.columns -= n\n", "        self.columns -= 0\n",
           CONTRACT, "crop shortens the tables but not the model's column count"),
    Mutant("mask-size-off-by-one", "kvlib/hf/cache.py", "        return self.columns + query_length, 0\n",
           "        return self.columns + query_length + 1, 0\n", CONTRACT, "get_mask_sizes one column too many"),
    Mutant("no-pad-rewrite", "kvlib/hf/attention.py", "        if any(pad):\n", "        if False:\n", CONTRACT,
           "left padding stored as tokens (positions shifted, pads attended)"),
    Mutant("flags-not-selected", "kvlib/hf/cache.py",
           "            self.bad = self.bad[idx.to(self.bad.device)]\n", "            pass\n", USER,
           "bad-row flags do not follow the rows"),
    Mutant("bad-rows-not-zeroed", "kvlib/hf/cache.py", "        z = bad[..., None]\n",
           "        z = bad[..., None] & False\n", USER, "a non-representable vector written as it is"),
    Mutant("window-ignored", "kvlib/hf/attention.py",
           "        windowed = layer.cache.windowed[layer.layer_idx]  # a sliding window",
           "        windowed = False  # a sliding window", USER, "sliding windows take the kernel paths again"),
    Mutant("copied-config-not-adopted", "kvlib/hf/cache.py", "        activate(cfg)\n", "        pass\n", USER,
           "a copied config leaves the model's attention unswitched"),
    # -- the merge (kvlib/core/merge.py)
    Mutant("merge-weight-swapped", "kvlib/core/merge.py",
           "w_b = torch.where(torch.isneginf(lse_b), torch.zeros_like(lse_b), torch.exp(lse_b - safe))",
           "w_b = torch.where(torch.isneginf(lse_b), torch.zeros_like(lse_b), torch.exp(lse_a - safe))",
           ("tests/test_merge_tl.py", "tests/test_kv4_kernels.py"), "the second side weighted by the first's lse"),
    Mutant("merge-empty-side-nan", "kvlib/core/merge.py",
           "        torch.isneginf(lse_a).unsqueeze(-1), torch.zeros_like(o_a), w_a.unsqueeze(-1).to(o_a.dtype) * o_a",
           "        torch.isneginf(lse_a).unsqueeze(-1) & False, torch.zeros_like(o_a), "
           "w_a.unsqueeze(-1).to(o_a.dtype) * o_a",
           ("tests/test_merge_tl.py", "tests/test_kv4_kernels.py"), "an empty side's NaN output multiplied in"),
    # -- the certificate (kvlib/certify/bound.py, the batched reference)
    Mutant("radius-no-log2", "kvlib/certify/bound.py",
           "    return math.sqrt(2.0 * math.log(2.0 * n / delta)) + extra",
           "    return math.sqrt(2.0 * math.log(n / delta)) + extra",
           ("tests/test_certificate.py",), "the union bound's factor 2 dropped"),
    Mutant("cert-B-sign", "kvlib/certify/bound.py",
           "    B = torch.exp(torch.logsumexp(z - uu, -1) - lse)",
           "    B = torch.exp(torch.logsumexp(z + uu, -1) - lse)",
           ("tests/test_certificate.py",), "B computed with +u (the two-accumulator bound collapses to 0)"),
    Mutant("cert-vacuous-not-inf", "kvlib/certify/bound.py",
           "    vac = ~torch.isfinite(A) | ~torch.isfinite(B) | (A > FP32_MAX) | (A <= 0)",
           "    vac = (A > FP32_MAX) | (A <= 0)", ("tests/test_certificate.py",),
           "a NaN certificate is not vacuous"),
    Mutant("batched-cert-ignores-pads", "kvlib/kernels/int8/reference.py",
           "    zm = torch.where(vm, z, torch.full_like(z, -math.inf))",
           "    zm = z", ("tests/test_reference_speedups.py",), "padded positions enter a shorter row's softmax"),
    Mutant("batched-cert-wrong-n", "kvlib/kernels/int8/reference.py",
           "    mult = radius_multiplier(lens.clamp(min=1), delta, d, impl=impl, layout=k.dither_layout)  # [B]",
           "    mult = radius_multiplier(torch.full_like(lens, n), delta, d, impl=impl, layout=k.dither_layout)",
           ("tests/test_reference_speedups.py",), "every row's union bound counts the longest row"),
    # -- the formats' quantisers
    Mutant("dither-scale-div", "kvlib/formats/dither_int8.py", "SCALE_DIV = QMAX - 0.5  #", "SCALE_DIV = QMAX  #",
           ("tests/test_dither.py", "tests/test_formats_int8.py"), "scale amax/127: dithered codes clip"),
    Mutant("dither-no-bump", "kvlib/formats/dither_int8.py", "    if bool(low.any()):\n        bumped",
           "    if False:\n        bumped", ("tests/test_dither.py", "tests/test_formats_int8.py"),
           "subnormal scales not bumped (clipping at tiny amax)"),
    Mutant("rtn-round-floor", "kvlib/formats/rtn_int8.py", "        c = torch.round(y).clamp(-127, 127)",
           "        c = torch.floor(y).clamp(-127, 127)",
           ("tests/test_formats_int8.py", "tests/test_format_capabilities.py"), "round to nearest replaced by floor"),
    Mutant("kv4-offset-round-up", "kvlib/formats/kv4.py", '    m = fp16_round(lo, "down")',
           '    m = fp16_round(lo, "up")', ("tests/test_kv4.py",), "the offset above the minimum (negative codes)"),
    Mutant("kv4-levels", "kvlib/formats/kv4.py",
           "    c = torch.round((xf - m.float().unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, LEVELS)",
           "    c = torch.round((xf - m.float().unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, LEVELS - 1)",
           ("tests/test_kv4.py",), "the top code unreachable"),
    Mutant("fp8-no-clamp", "kvlib/formats/fp8.py", "        y = y.clamp(-E4M3_MAX, E4M3_MAX)\n", "",
           ("tests/test_formats_int8.py", "tests/test_format_capabilities.py"), "e4m3 overflow to NaN at |x/s| > 448"),
    Mutant("kv4-range-no-rotation", "kvlib/formats/kv4.py",
           "        return hadamard(x.float()) if rotates(self.rotate, side) else x\n",
           "        return x\n", USER, "representable checks the unrotated key"),
    Mutant("cpu-write-wrong-head-dither", "kvlib/kernels/int8/write.py",
           "        xi = torch.stack([cached_dither(slots, d, layer=layer, kv_head=i,",
           "        xi = torch.stack([cached_dither(slots, d, layer=layer, kv_head=0,",
           ("tests/test_reference_speedups.py",), "every head written with head 0's dither"),
]


def run(m: Mutant, timeout: int) -> dict:
    path = ROOT / m.path
    src = path.read_text()
    if src.count(m.old) != 1:
        return {"name": m.name, "status": "not-applied", "why": f"{m.old!r} found {src.count(m.old)} times"}
    path.write_text(src.replace(m.old, m.new))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        killed = proc.returncode != 0
        tail = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED") or " passed" in ln or "error" in ln]
    except subprocess.TimeoutExpired:
        killed, tail = True, ["timeout"]
    finally:
        path.write_text(src)
    return {"name": m.name, "path": m.path, "what": m.what, "tests": list(m.tests),
            "status": "killed" if killed else "survived", "by": tail[:2], "seconds": round(time.perf_counter() - t0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--out", default="dev/results/seeded_bugs.json")
    a = ap.parse_args()
    todo = [m for m in MUTANTS if not a.only or m.name in a.only]
    rows = []
    for m in todo:
        r = run(m, a.timeout)
        rows.append(r)
        print(f"{r['status']:<12} {m.name:<30} {r.get('seconds', '')}s  {(r.get('by') or [''])[0][:90]}", flush=True)
    (ROOT / a.out).write_text(json.dumps(rows, indent=1) + "\n")
    n = sum(r["status"] == "killed" for r in rows)
    print(f"{n} killed, {sum(r['status'] == 'survived' for r in rows)} survived, "
          f"{sum(r['status'] == 'not-applied' for r in rows)} not applied, of {len(rows)}")


if __name__ == "__main__":
    main()
