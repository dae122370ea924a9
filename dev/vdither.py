"""Diagnosis of the tensor-core INT8 kernel's value-dither path (issue 28): removed at b7182e0 because it matched the
float64 reference under the CPU interpreter but not on the H200 (max |do| 3.3), cause unknown.

The path is restored in the scratch kernel :mod:`dev.vdither_kernel` (the de4df59 tc kernel plus the removed
``V_DITHER`` branch). This driver runs it against the float64 reference (:func:`decode_reference` with
``v_dither=True``; the ``fma`` reference, whose dequantisation ``s (c - xi)`` is the one the tc path computes in
fp32 and then splits into fp16 ``hi + lo``: a ``2^-22`` relative rounding, far below the tolerance) and bisects:

* ``vd_mode`` 0: the removed code; 1: the value dither loaded from a tensor the torch reference filled (no Philox
  in the kernel); 2: regenerated and stored, so the in-kernel dither itself is compared with the torch one;
* ``v_order`` 1: ``s c - s xi`` instead of ``s (c - xi)`` (the dither applied after the scale multiply); 2: the
  shipped RTN ``s c`` dots plus the dither's ``s xi`` in dots of its own (a candidate mend);
* values only (RTN keys, no certificate), keys only (RTN values: the shipped path, the control);
* ``block_n``, ``num_warps``, ``num_stages`` (software pipelining), ``d``, splits, slots beyond 2^16.

``python -m dev.vdither [--cpu] [--json OUT] [--sanitize]``: ``--cpu`` a few cases under ``TRITON_INTERPRET=1``
(the interpreter agreed before: it must again); ``--sanitize`` one tiny launch of the failing configuration for
``compute-sanitizer`` to wrap (dev/gpu/vdither.sh). Prints one line per case and a diagnosis.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import torch

LAYER, SEED = 3, 0x5EED_1234_ABCD
TOL = 1e-3  # |do| tolerance: the tc value path rounds at 2^-22 relative; the bug was 3.3


def problem(B=2, hq=4, hkv=2, d=64, S=40, *, k_dither=True, v_dither=True, k_out=True, slot_base=0, dev="cpu",
            seed=0):
    """The test problem of tests/test_decode_int8.py's ``_setup`` (scattered slots, a massive bypassed key channel,
    ragged rows), with optional slot offset ``slot_base`` (large counters)."""
    from kvlib.kernels.int8.decode import make_pool_side

    g = torch.Generator().manual_seed(hq * 100 + hkv * 10 + d + seed)
    T = B * S
    K = torch.randn(T, hkv, d, generator=g)
    K[:, :, 7] *= 25
    V = torch.randn(T, hkv, d, generator=g)
    n_slots = slot_base + T + 9
    slot_ids = slot_base + torch.randperm(T + 9, generator=g)[:T]
    koc = torch.stack([torch.tensor([6, 7]) + 16 * h for h in range(hkv)]) if k_out else None
    kp = make_pool_side(K, layer=LAYER, seed=SEED, side=0, n_slots=n_slots, slot_ids=slot_ids, outlier_channels=koc,
                        dithered=k_dither)
    vp = make_pool_side(V, layer=LAYER, seed=SEED, side=1, n_slots=n_slots, slot_ids=slot_ids, dithered=v_dither)
    slots = slot_ids.view(B, S).to(torch.int32)
    seq = torch.tensor([S - 3 * b for b in range(B)], dtype=torch.int32)
    q = 2 * torch.randn(B, hq, d, generator=g)
    return q.to(dev), _to(kp, dev), _to(vp, dev), slots.to(dev), seq.to(dev), slot_ids


def _to(side, dev):
    return dataclasses.replace(side, **{f.name: getattr(side, f.name).to(dev) for f in dataclasses.fields(side)
                                        if isinstance(getattr(side, f.name), torch.Tensor)})


def value_dither_table(vp, slot_ids, hkv: int, d: int, dev) -> torch.Tensor:
    """float32 ``[n_slots, H_kv, d]``: the torch reference's value dither (w24, side 1) at the written slots."""
    from kvlib.core.philox import dither

    out = torch.zeros(vp.codes.shape[0], hkv, d, dtype=torch.float32)
    for h in range(hkv):
        out[slot_ids, h] = dither(slot_ids, d, layer=LAYER, kv_head=h, seed=SEED, side=1)
    return out.to(dev)


def run_case(name: str, *, shape=None, k_dither=True, v_dither=True, vd_mode=0, v_order=0, block_n=16,
             num_warps=4, num_stages=3, ns=2, xi_split=True, pv_terms=3, slot_base=0, dev="cuda") -> dict:
    """One configuration against the float64 reference: ``do`` = max |o - o_ref|, ``dlse``, and (``vd_mode`` 2)
    ``dxi`` = max |in-kernel value dither - torch dither| over the slots read."""
    from dev.vdither_kernel import launch
    from kvlib.core.philox import seed_key
    from kvlib.kernels.int8.decode import decode_reference

    shape = shape or {}
    q, kp, vp, slots, seq, slot_ids = problem(**shape, k_dither=k_dither, v_dither=v_dither, slot_base=slot_base,
                                              dev=dev)
    B, hq, d = q.shape
    hkv = kp.codes.shape[1]
    cert = k_dither
    ref = decode_reference(q, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="fma", v_dither=v_dither)
    o_s = torch.empty(B, hq, ns, d, dtype=torch.float32, device=dev)
    lse_s = torch.empty(B, hq, ns, dtype=torch.float32, device=dev)
    a_s = torch.empty_like(lse_s)
    b_s = torch.empty_like(lse_s)
    vxi = value_dither_table(vp, slot_ids, hkv, d, dev) if v_dither else None
    dbg = torch.full_like(vxi, float("nan")) if vd_mode == 2 and vxi is not None else None
    k0, k1 = seed_key(SEED)
    from kvlib.certify.bound import radius_multiplier

    rad_extra = radius_multiplier(1, 1e-2, d, impl="tc") - radius_multiplier(1, 1e-2, d, slack=False)
    row = dict(name=name, shape=shape, k_dither=k_dither, v_dither=v_dither, vd_mode=vd_mode, v_order=v_order,
               block_n=block_n, num_warps=num_warps, num_stages=num_stages, ns=ns, xi_split=xi_split,
               pv_terms=pv_terms, slot_base=slot_base)
    try:
        launch(q, kp, vp, slots, seq, o_s, lse_s, a_s, b_s, sm=1 / math.sqrt(d), delta=1e-2, rad_extra=rad_extra,
               layer=LAYER, k0=k0, k1=k1, ns=ns, cert=cert, cert_b=True, v_dither=v_dither, block_n=block_n,
               num_warps=num_warps, num_stages=num_stages, vd_mode=vd_mode, v_order=v_order,
               vxi=vxi if vd_mode == 1 else None, dbg=dbg, xi_split=xi_split, pv_terms=pv_terms)
        if dev == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # a case that does not compile or run is reported, not fatal
        return row | {"error": f"{type(e).__name__}: {str(e)[-400:]}"}
    lse = torch.logsumexp(lse_s.double(), -1)
    w = torch.exp(lse_s.double() - lse[..., None])
    o = (w[..., None] * o_s.double()).sum(-2)
    do = (o.cpu() - ref.o).abs()
    row |= {"do": float(do.max()), "dlse": float((lse.cpu() - ref.lse).abs().max()),
            "bad": int((do > TOL).sum()), "of": do.numel()}
    if row["bad"]:  # where the error sits: which heads / channels (channel mod 4 = Philox word, // 4 = call)
        idx = (do > TOL).nonzero()
        row["bad_channels"] = sorted({int(c) for c in idx[:, 2]})[:32]
        row["bad_heads"] = sorted({int(h) for h in idx[:, 1]})
    if dbg is not None:
        read = torch.cat([slots[b, : int(seq[b])].long() for b in range(B)]).unique()
        dx = (dbg[read] - vxi[read]).abs()
        row["dxi"] = float(dx.nan_to_num(nan=float("inf")).max())
        if row["dxi"] > 0:
            row["dxi_channels"] = sorted({int(c) for c in (dx > 0).nonzero()[:, 2]})[:32]
    row["ok"] = row["bad"] == 0 and row.get("dxi", 0.0) == 0.0
    return row


BIG = dict(B=2, hq=8, hkv=2, d=128, S=300)


def mini_cases(dev: str) -> list[dict]:
    """The minimal PV kernel (:func:`dev.vdither_kernel.mini_pv`) with the dither loaded (mode 0) and built by joins
    and a reshape in the kernel (mode 1), at d = 64 and 128."""
    from dev.vdither_kernel import mini_pv

    rows = []
    for mode in (0, 1):
        for d in (64, 128):
            try:
                r = mini_pv(mode, d=d, dev=dev)
            except Exception as e:  # reported, not fatal
                r = {"error": f"{type(e).__name__}: {str(e)[-300:]}"}
            rows.append({"name": f"mini_pv_mode{mode}_d{d}", "ok": r.get("bad") == 0} | r)
    return rows


def cases(cpu: bool) -> list[tuple[str, dict]]:
    base = dict(block_n=16, num_warps=4, num_stages=3)  # the 2026-11-29 diagnosis run's launch (stages: tc default)
    if cpu:
        return [("removed_code", base), ("loaded_dither", base | {"vd_mode": 1}),
                ("stored_dither", base | {"vd_mode": 2}),
                ("keys_only", base | {"v_dither": False}), ("values_only", base | {"k_dither": False})]
    return [
        ("removed_code", base),
        ("loaded_dither", base | {"vd_mode": 1}),
        ("stored_dither", base | {"vd_mode": 2}),
        ("scale_then_dither", base | {"v_order": 1}),
        ("separate_dither_dot", base | {"v_order": 2}),
        ("keys_only", base | {"v_dither": False}),
        ("values_only", base | {"k_dither": False}),
        ("stages1", base | {"num_stages": 1}),
        ("stages2", base | {"num_stages": 2}),
        ("warps8", base | {"num_warps": 8}),
        ("block64", base | {"block_n": 64}),
        ("d128", base | {"shape": BIG}),
        ("d128_stored", base | {"shape": BIG, "vd_mode": 2}),
        ("slots_above_2^20", base | {"slot_base": 1 << 20, "vd_mode": 2}),
    ]


def diagnose(rows: list[dict]) -> list[str]:
    """Plain-language conclusions from the case table (only what the rows show)."""
    by = {r["name"]: r for r in rows}
    ok = lambda n: n in by and by[n].get("ok") is True  # noqa: E731
    bad = lambda n: n in by and by[n].get("ok") is False  # noqa: E731
    out = []
    if not bad("removed_code"):
        out.append("the removed code AGREES with the reference here (bug not reproduced at this commit's kernel)"
                   if ok("removed_code") else f"removed_code did not run: {by.get('removed_code', {}).get('error')}")
    else:
        out.append(f"reproduced: removed code max |do| = {by['removed_code']['do']:.3g}")
    if "stored_dither" in by and "dxi" in by["stored_dither"]:
        dx = by["stored_dither"]["dxi"]
        out.append("in-kernel value dither == torch dither (bit-exact): Philox, counters and the join/reshape are right"
                   if dx == 0 else f"in-kernel value dither differs from torch (max {dx:.3g}, channels "
                   f"{by['stored_dither'].get('dxi_channels')}): the generation/layout is wrong on this device")
    if bad("removed_code") and ok("loaded_dither"):
        out.append("with the dither loaded instead of regenerated the path is right: the regeneration (Philox or the "
                   "join/reshape of its words into the [BLOCK_N, D] tile) is the cause")
    if bad("removed_code") and bad("loaded_dither"):
        out.append("wrong even with the dither loaded: not the generator; the dithered values' PV path")
    if bad("removed_code") and ok("stages1"):
        out.append("right with num_stages=1: the software pipeliner (num_stages > 1) breaks the path")
    for n in ("stages2", "warps8", "block64", "scale_then_dither", "separate_dither_dot"):
        if bad("removed_code") and ok(n):
            out.append(f"the case {n!r} is right where the removed code is wrong")
    if ok("keys_only") and bad("values_only"):
        out.append("values alone (RTN keys) fail: the bug is in the value path, independent of the key dither")
    if bad("keys_only"):
        out.append("the shipped keys-only path FAILS here: the harness or the scratch copy is wrong, fix that first")
    # the offline sm_90 TTGIR (dev.vdither_ttgir): removed_code, stages1/2, warps8, block64, stored_dither and
    # values_only convert
    # an fp32 value tile into the PV dot's B-operand layout (a local_load of 16x64xf32 as dot_op opIdx 1, kWidth 8:
    # the conversion hoisted above s * (c - xi) and the fp16 rounding); loaded_dither, scale_then_dither,
    # separate_dither_dot and keys_only convert fp16 tiles only
    hoisted = ("removed_code", "stages1", "stages2", "warps8", "block64", "stored_dither", "values_only")
    clean = ("loaded_dither", "scale_then_dither", "separate_dither_dot", "keys_only")
    if all(bad(n) for n in hoisted if n in by) and all(ok(n) for n in clean if n in by) and bad("removed_code"):
        out.append("the failing cases are exactly those whose compiled kernel converts an fp32 value tile into the PV "
                   "dot's operand layout (TTGIR: local_load of f32 as dot_op opIdx 1, kWidth 8): a Triton layout-"
                   "conversion codegen fault, not Philox; separate_dither_dot is a mend")
    mini = [r for r in rows if r["name"].startswith("mini_pv")]
    if mini and any(r.get("ok") is False for r in mini):
        out.append("the minimal PV kernel fails too: " + ", ".join(r["name"] for r in mini if r.get("ok") is False)
                   + " (an upstream-sized reproducer, dev/vdither_kernel.py:_mini_pv)")
    elif mini and all(r.get("ok") for r in mini):
        out.append("the minimal PV kernel is right in both modes: the fault needs more of the kernel's context")
    if "slots_above_2^20" in by and by["slots_above_2^20"].get("dxi", 0) != 0:
        out.append("large slot indices change the dither: counter overflow")
    return out


def sanitize_run() -> None:
    """One tiny launch of the removed code (for compute-sanitizer): B=1, 1 KV head, 32 positions."""
    r = run_case("sanitize", shape=dict(B=1, hq=2, hkv=1, d=64, S=32), ns=1, dev="cuda")
    print(json.dumps(r), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(prog="PYTHONPATH=. python -m dev.vdither", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="a few cases under TRITON_INTERPRET=1")
    ap.add_argument("--json", default=None, help="write the rows and the diagnosis here")
    ap.add_argument("--sanitize", action="store_true", help="one tiny launch for compute-sanitizer")
    a = ap.parse_args()
    if a.sanitize:
        sanitize_run()
        return
    dev = "cpu" if a.cpu else "cuda"
    if a.cpu and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--cpu needs TRITON_INTERPRET=1 set before Python starts")
    t0 = time.time()
    rows = []
    for r in mini_cases(dev):  # first: small compiles, so a timed-out bisection still has them
        rows.append(r)
        print(f"{r['name']:24s} ok={r.get('ok')} " + " ".join(f"{k}={r[k]}" for k in ("max_err", "bad", "error")
                                                              if k in r), flush=True)
    for name, kw in cases(a.cpu):
        r = run_case(name, dev=dev, **kw)
        rows.append(r)
        keys = ("do", "dlse", "bad", "dxi", "bad_channels", "dxi_channels", "error")
        print(f"{name:24s} ok={r.get('ok')} " + " ".join(f"{k}={r[k]}" for k in keys if k in r), flush=True)
        if a.json:  # after every case: a timed-out run keeps what it measured
            _write(a.json, dev, rows, diagnose(rows), t0)
    diag = diagnose(rows)
    print("DIAGNOSIS:")
    for line in diag:
        print("  -", line)
    if a.json:
        _write(a.json, dev, rows, diag, t0)


def _write(path: str, dev: str, rows: list, diag: list, t0: float) -> None:
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
                   "rows": rows, "diagnosis": diag, "seconds": time.time() - t0}, f, indent=1)


if __name__ == "__main__":
    main()
