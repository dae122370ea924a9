#!/usr/bin/env bash
# Issue 24, fused pool writes on the GPU (kvlib.kernels.write, kvlib.kernels.int8.write; routed by
# kvlib.backends): for dither-int8 (w24, h10, h8 with outlier channels), rtn-int8, kv4, kv4rl:
#   1. tests/test_write_kernels.py on CUDA but its bit-exactness sweep, which part 2 repeats at larger shapes
#      (raw-slot kernel check, no host sync in a decode step under torch.cuda.set_sync_debug_mode("error"),
#      path reporting, bad inputs);
#   2. bit-exactness at larger shapes (B=16 ragged prefill + 8 decode steps, d=64 and 128, H_kv=4);
#   3. capture: one decode step's writes of every layer captured in a CUDA graph and replayed 8 times == the
#      torch path run eagerly on the same tokens (every pool byte);
#   4. one layer's write, torch path vs fused, B=8 and B=64, H_kv=4, d=128 (28 layers' writes per graph,
#      interleaved rounds, median per layer), printing the ratio; eager times of both beside. The torch path of
#      a format whose write syncs the host cannot be captured: it is timed eagerly and labelled so (speed is
#      reported, never asserted).
# Runs from the repo root; prints PASS/FAIL lines and a SUMMARY; writes $OUT/writefuse.json. Under 4 minutes.
set -uo pipefail
export OUT="${OUT:-.}"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compile for the GPU, never the interpreter
PY="${PYTHON:-python}"
mkdir -p "$OUT"

timeout 75 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_write_kernels.py -k "not bit_for_bit" \
  > "$OUT/writefuse_pytest.txt" 2>&1
prc=$?
tail -n 3 "$OUT/writefuse_pytest.txt"
if [ $prc -eq 0 ]; then echo "PASS: tests/test_write_kernels.py on CUDA"; else echo "FAIL: tests/test_write_kernels.py on CUDA (rc=$prc, see $OUT/writefuse_pytest.txt)"; fi

PYTEST_RC=$prc timeout 150 "$PY" - <<'EOF'
import json
import os
import statistics
import time
import traceback

import torch
from transformers import LlamaConfig

from kvlib.hf.cache import make_cache

OUT = os.environ.get("OUT", ".")
# WRITEFUSE_DEV=cpu (with TRITON_INTERPRET=1, WRITEFUSE_SMALL=1): a dry run of this script's code on the CPU
# (graphs become eager calls, events wall clocks); the GPU run is the one that counts
DEV = os.environ.get("WRITEFUSE_DEV", "cuda")
SMALL = os.environ.get("WRITEFUSE_SMALL") == "1"
SECTIONS = os.environ.get("WRITEFUSE_SECTIONS", "bit,capture,timing").split(",")  # to rerun a part alone
CUDA = DEV == "cuda"
fails: list[str] = []
res: dict = {"pytest_rc": int(os.environ.get("PYTEST_RC", "-1")),
             "device": torch.cuda.get_device_name(0) if CUDA else "cpu (dry run)", "torch": torch.__version__}
if res["pytest_rc"] != 0:
    fails.append("tests/test_write_kernels.py")
HKV = 4


def dump() -> None:
    """Results so far (written after each section, so a run stopped by its timeout still leaves them)."""
    res["fails"] = fails
    res["pass"] = not fails
    with open(os.path.join(OUT, "writefuse.json"), "w") as f:
        json.dump(res, f, indent=1)


def sync_mode(m) -> None:
    if CUDA:
        sync_mode(m)


def synchronize() -> None:
    if CUDA:
        synchronize()


def line(status: str, msg: str) -> None:
    print(f"{status}: {msg}", flush=True)
    if status == "FAIL":
        fails.append(msg)


def formats(d: int, small_ring: bool) -> dict:
    m = d // 2
    table = torch.tensor([[[0, 5, m, m + 5], [1, 7, m + 1, m + 7], [2, 9, m + 2, m + 9], [3, 4, m + 3, m + 4]]])
    rl = {"sink": 4, "recent": 32} if small_ring else {}
    return {"dither-int8-w24": ("dither-int8", {"dither_layout": "w24"}),
            "dither-int8-h10": ("dither-int8", {"dither_layout": "h10"}),
            "dither-int8-h8-outliers": ("dither-int8", {"dither_layout": "h8", "outlier_table": table}),
            "rtn-int8": ("rtn-int8", {}), "kv4": ("kv4", {}), "kv4rl": ("kv4rl", rl)}


def cfg(d: int, n_layers: int) -> LlamaConfig:
    return LlamaConfig(hidden_size=28 * d, intermediate_size=256, num_hidden_layers=n_layers, num_attention_heads=28,
                       num_key_value_heads=HKV, head_dim=d, vocab_size=64)


def opts_for(opts: dict, n_layers: int) -> dict:
    o = dict(opts)
    if "outlier_table" in o:
        o["outlier_table"] = o["outlier_table"].expand(n_layers, -1, -1).contiguous()
    return o


def tensors(st) -> list[torch.Tensor]:
    ts = list(st._tensors())
    if getattr(st, "rl", False):
        ts += [t for grp in (st.side8, st.side_scale, st.stash8, st.stash_scale) for lay in grp for t in lay]
    return ts


def diff(a, b) -> int:
    return sum(int((x != y).sum()) for x, y in zip(tensors(a.backend), tensors(b.backend)))


def filled(fmt, opts, d, backend, lens, n_layers, max_len, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    c = make_cache(fmt, cfg(d, n_layers), batch_size=len(lens), max_len=max_len, block_size=16, device=DEV,
                   shuffle_blocks=3, **opts_for(opts, n_layers))
    b, s = len(lens), max(lens)
    k = (torch.randn(b, HKV, s, d, device=DEV, generator=g) * 3).to(torch.bfloat16)
    v = torch.randn(b, HKV, s, d, device=DEV, generator=g).to(torch.bfloat16)
    keep = torch.arange(s, device=DEV)[None, :] < torch.tensor(lens, device=DEV)[:, None]
    for layer in range(n_layers):
        la = c.layers[layer]
        la.lazy_initialization(k, v)
        c.backend.write_backend = backend
        la._write(k, v, keep)
        la.columns = s
    return c


def steps_data(b, d, n, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [((torch.randn(b, HKV, 1, d, device=DEV, generator=g) * 2).to(torch.bfloat16),
             torch.randn(b, HKV, 1, d, device=DEV, generator=g).to(torch.bfloat16)) for _ in range(n)]


T0 = time.perf_counter()
# -- 2. bit-exactness at larger shapes -------------------------------------------------------------------------
res["bit_exact"] = []
for d in ((64, 128) if "bit" in SECTIONS else ()):
    for label, (fmt, opts) in formats(d, small_ring=True).items():
        try:
            nb = 3 if SMALL else 16
            lens = [int(x) for x in torch.randint(20, 100, (nb,), generator=torch.Generator().manual_seed(d))]
            ref = filled(fmt, opts, d, "torch", lens, 2, 160)
            got = filled(fmt, opts, d, "triton", lens, 2, 160)
            pre = diff(ref, got)
            for k1, v1 in steps_data(nb, d, 8):
                for layer in range(2):
                    ref.layers[layer]._write(k1, v1)
                    got.layers[layer]._write(k1, v1)
            n_bad = diff(ref, got)
            path = got.backend.write_path
            ok = pre == 0 and n_bad == 0 and path.endswith("-triton") and ref.backend.write_path.split("-")[-1] == "torch"
            res["bit_exact"].append(dict(format=label, d=d, prefill_mismatches=pre, mismatches=n_bad, path=path,
                                         ref_path=ref.backend.write_path))
            line("PASS" if ok else "FAIL", f"bit-exact {label} d={d}: {n_bad} mismatching elements after prefill + "
                 f"8 steps ({pre} after prefill), path {path} vs {ref.backend.write_path}")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            line("FAIL", f"bit-exact {label} d={d}: {type(e).__name__}: {e}")


# -- 3. capture --------------------------------------------------------------------------------------------------
def capture_step(c, kbuf, vbuf, n_layers):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for layer in range(n_layers):
            c.layers[layer]._write(kbuf, vbuf)
    return g


res["seconds_bit_exact"] = time.perf_counter() - T0
dump()
res["capture"] = []
d, b, nl = 128, 8, 2
for label, (fmt, opts) in (formats(d, small_ring=True).items() if "capture" in SECTIONS else ()):
    try:
        lens = [40, 7, 33, 60, 12, 50, 29, 45]
        ref = filled(fmt, opts, d, "torch", lens, nl, 128)
        got = filled(fmt, opts, d, "triton", lens, nl, 128)
        data = steps_data(b, d, 10, seed=2)
        # step 0 eagerly: compiles the kernels, and checks that the fused step never syncs the host
        synchronize()
        sync_mode("error")
        try:
            for layer in range(nl):
                got.layers[layer]._write(*data[0])
            sync_free = True
        except RuntimeError as e:
            sync_free = False
            line("FAIL", f"capture {label}: the fused decode-step write synchronised: {e}")
        finally:
            sync_mode(0)
        for layer in range(nl):
            ref.layers[layer]._write(*data[0])
        kbuf, vbuf = data[1][0].clone(), data[1][1].clone()
        if CUDA:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                g = capture_step(got, kbuf, vbuf, nl)  # capturing runs nothing: replay 1 below is step 1
            torch.cuda.current_stream().wait_stream(s)
            replay = g.replay
        else:
            def replay(got=got, kbuf=kbuf, vbuf=vbuf):
                for layer in range(nl):
                    got.layers[layer]._write(kbuf, vbuf)
        for k1, v1 in data[1:9]:
            kbuf.copy_(k1)
            vbuf.copy_(v1)
            replay()
            for layer in range(nl):
                ref.layers[layer]._write(k1, v1)
        synchronize()
        n_bad = diff(ref, got)
        lens_ok = torch.equal(ref.layers[0].table.seq_lens, got.layers[0].table.seq_lens)
        ok = n_bad == 0 and lens_ok and sync_free
        res["capture"].append(dict(format=label, mismatches=n_bad, seq_lens_equal=lens_ok, sync_free=sync_free))
        line("PASS" if ok else "FAIL", f"capture {label}: 8 graph replays of a {nl}-layer decode-step write vs the "
             f"torch path eagerly: {n_bad} mismatching elements, seq_lens equal: {lens_ok}, sync-free: {sync_free}")
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        line("FAIL", f"capture {label}: {type(e).__name__}: {e}")


# -- 4. timing -----------------------------------------------------------------------------------------------------
def syncs(fn) -> bool:
    synchronize()
    sync_mode("error")
    try:
        fn()
        return False
    except RuntimeError:
        return True
    finally:
        sync_mode(0)


res["seconds_to_capture_end"] = time.perf_counter() - T0
dump()
res["timing"] = []
NL, ROUNDS, REPS, REPS_EAGER = (2, 2, 1, 1) if SMALL else (28, 9, 10, 3)
for b in ((2,) if SMALL else (8, 64)) if "timing" in SECTIONS else ():
    for label, (fmt, opts) in formats(128, small_ring=False).items():
        if label == "dither-int8-h10":
            continue  # same kernel as w24 but for the dither words; keep the script short
        try:
            runners, eagers = {}, {}
            for backend in ("torch", "triton"):
                c = make_cache(fmt, cfg(128, NL), batch_size=b, max_len=512, block_size=16, device=DEV,
                               **opts_for(opts, NL))
                x = torch.zeros(b, HKV, 1, 128, device=DEV, dtype=torch.bfloat16)
                c.layers[0].lazy_initialization(x, x)
                for layer in range(1, NL):
                    c.layers[layer].lazy_initialization(x, x)
                st, t = c.backend, c.layers[0].table
                st.write_backend = backend
                k1 = (torch.randn(b, HKV, 128, device=DEV) * 2).to(torch.bfloat16)
                v1 = torch.randn(b, HKV, 128, device=DEV).to(torch.bfloat16)
                rows = torch.arange(b, device=DEV)
                pos = torch.full((b,), 300, dtype=torch.int64, device=DEV)  # fixed: replays rewrite one position
                slots = t.slots(rows, pos)

                def step(st=st, k1=k1, v1=v1, slots=slots, rows=rows, pos=pos):
                    for layer in range(NL):
                        st.write(layer, k1, v1, slots, rows, pos, pos + 1, one_per_row=True)

                step()  # compile / warm up
                mode = ("eager (host sync: not capturable)" if syncs(step) else
                        "graph" if CUDA else "eager (cpu dry run)")
                fn = step
                if mode == "graph" and CUDA:
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        step()
                    torch.cuda.current_stream().wait_stream(s)
                    gr = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(gr):
                        step()
                    fn = gr.replay
                runners[backend] = (fn, mode, st.write_path)
                eagers[backend + "-eager"] = step
            fns = {**{k: r[0] for k, r in runners.items()}, **eagers}
            times = {k: [] for k in fns}
            for _ in range(ROUNDS):  # interleaved: drift hits both paths alike
                for k, fn in fns.items():
                    reps = REPS if k in runners else REPS_EAGER
                    synchronize()
                    if CUDA:
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        for _ in range(reps):
                            fn()
                        e1.record()
                        e1.synchronize()
                        ms = e0.elapsed_time(e1)
                    else:
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            fn()
                        ms = (time.perf_counter() - t0) * 1e3
                    times[k].append(ms * 1e3 / (reps * NL))  # us per layer write
            med = {k: statistics.median(v) for k, v in times.items()}
            ratio = med["torch"] / med["triton"]
            row = dict(format=label, B=b, H_kv=HKV, d=128, torch_us_per_layer=med["torch"],
                       fused_us_per_layer=med["triton"], ratio_torch_over_fused=ratio,
                       torch_mode=runners["torch"][1], fused_mode=runners["triton"][1],
                       torch_path=runners["torch"][2], fused_path=runners["triton"][2], rounds=ROUNDS,
                       torch_eager_us_per_layer=med["torch-eager"], fused_eager_us_per_layer=med["triton-eager"],
                       eager_ratio=med["torch-eager"] / med["triton-eager"])
            res["timing"].append(row)
            ok = (runners["triton"][1] == "graph" or not CUDA) and runners["triton"][2].endswith("-triton")
            line("PASS" if ok else "FAIL", f"timing {label} B={b}: torch {med['torch']:.1f} us/layer "
                 f"({runners['torch'][1]}), fused {med['triton']:.1f} us/layer ({runners['triton'][1]}), "
                 f"ratio {ratio:.2f}x; eager: torch {med['torch-eager']:.1f}, fused {med['triton-eager']:.1f} "
                 f"us/layer, ratio {med['torch-eager'] / med['triton-eager']:.2f}x")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            line("FAIL", f"timing {label} B={b}: {type(e).__name__}: {e}")

res["seconds_total"] = time.perf_counter() - T0
dump()
print(f"SUMMARY writefuse: {'PASS' if not fails else 'FAIL'} ({len(fails)} failing)", flush=True)
raise SystemExit(0 if not fails else 1)
EOF
rc=$?
[ $rc -eq 124 ] && echo "FAIL: writefuse python part ran past 150 s"
[ $prc -ne 0 ] && [ $rc -eq 0 ] && rc=1
exit $rc
