"""Peer: HF transformers' quantized KV cache (``QuantizedCache``, backends quanto and HQQ), one decode
step of one attention layer, against torch SDPA bf16 over an uncompressed cache in the same run.

What is timed is what an HF model does per layer per decode step with ``QuantizedCache``
(transformers 5.17, ``cache_utils.QuantizedLayer.update``)::

    keys, values = cache.update(k_new, v_new, layer_idx)   # dequantised bf16, whole context
    out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

Code reading of that ``update`` (and checked at run time by counting the tokens its
``_dequantize``/``_quantize`` see, :func:`probe_update_path`): **every** step dequantises the whole
quantised part of the cache (S tokens) and concatenates it with the bf16 residual and the new token
into a fresh bf16 tensor; once the bf16 residual reaches ``residual_length`` (R) tokens, the whole
cache (S + R tokens) is **re-quantised** from that dequantised copy (not just the residual). So a
step costs about one full bf16 write plus a read of the packed cache, and one step in R also pays a
full quantisation. We report the ordinary step, the flush step and their amortised mean
``((R - 1) * step + flush) / R`` and compare that mean with SDPA bf16 (``speedup_vs_sdpa``; < 1 means
slower). ``hf_dynamic_bf16`` is HF's default ``DynamicCache`` (a ``torch.cat`` of the whole cache
per step) for context.

Cache state per shape: the quantised part holds S tokens (HF's prefill path: the first ``update``
quantises all of them), the bf16 residual holds R/2 tokens for the ordinary step and R - 1 for the
flush step; SDPA bf16 reads the same S + R/2 + 1 tokens from a contiguous ``[B, 8, S, 128]`` cache.
Layout: d = 128, 32 query heads over 8 KV heads (GQA 4:1, as :mod:`kvlib.bench.peers`). HF's
defaults: ``q_group_size`` 64, ``residual_length`` 128; quanto ``axis`` 0 (groups of 64 along d,
per token and head), HQQ ``axis`` 1 (HF's documented choice for HQQ; HQQ's default ``optimize=True``
half-quadratic fit on every quantisation).

quanto's int2/int4 unpacking (``torch.ops.quanto.unpack``) is a C++/CUDA extension that
``torch.utils.cpp_extension.load`` JIT-compiles on first use (ninja + g++/nvcc; the CUDA one builds
quanto's Marlin/AWQ kernels too: minutes). Everything else in quanto's path is plain torch. We time
quanto with its pure-torch unpack (quanto's default ``quanto::unpack`` restated as
:func:`unpack_bits_torch`, patched into ``PackedTensor.unpack``; recorded as ``unpack: "torch"``)
and, on CUDA, also with the compiled one when it is already built, or when
``KVLIB_QUANTO_BUILD_S`` (seconds) allows a build attempt here.

Where a backend cannot be imported or fails, the peer is recorded as
``{"peer": ..., "could_not_run": "<reason>"}``; the run goes on. Packages: quanto and HQQ are not in
the project's venv; :func:`ensure_peer_packages` installs the wheels of ``<repo>/.whl`` (if present)
into a temporary directory on ``sys.path``. On CPU (profiles ci/cpu) tiny shapes run: a wiring check,
never a speed claim.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import importlib.metadata
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kvlib.bench.peers import GQA, kv_bytes_bf16
from kvlib.bench.timing import bench_ms, profile_device

D = 128
Q_GROUP = 64
RESIDUAL = 128
#: backend -> (module to import, axis HF uses for it)
BACKENDS = {"quanto": ("optimum.quanto", 0), "hqq": ("hqq.core.quantize", 1)}
NBITS = (4, 2)
#: shapes whose bf16 K+V exceeds this are skipped (the step's working set is a few times that, see
#: :func:`working_set_bytes`; the measured peak is recorded as ``step_peak_extra_bytes``)
MEM_BUDGET = 20e9
WHEEL_DIR = Path(__file__).resolve().parents[2] / ".whl"

UPDATE_PATH = (
    "transformers 5.17 QuantizedLayer.update: every decode step dequantises the WHOLE quantised cache "
    "(self._dequantize(self._quantized_keys/values)) and torch.cat's it with the bf16 residual and the new "
    "token into a new bf16 tensor that attention reads; when the residual reaches residual_length it "
    "re-quantises the WHOLE cache (S + R tokens, from the dequantised copy), not only the residual."
)


# ----------------------------------------------------------------------------------------- packages


def _refresh_transformers_checks() -> None:
    """Make transformers see packages added to ``sys.path`` after it was imported.

    Its availability checks are ``lru_cache``d, and ``cache_utils`` binds HQQ's ``Quantizer`` at
    import time only if HQQ was importable then.
    """
    importlib.invalidate_caches()
    iu = importlib.import_module("transformers.utils.import_utils")
    for name in ("is_hqq_available", "is_optimum_quanto_available", "is_optimum_available", "is_quanto_greater"):
        fn = getattr(iu, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()
    cu = importlib.import_module("transformers.cache_utils")
    if not hasattr(cu, "HQQQuantizer") and iu.is_hqq_available():
        from hqq.core.quantize import Quantizer

        cu.HQQQuantizer = Quantizer


def _reason(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    lines = str(e).splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def _importable(module: str) -> str | None:
    """``None`` if ``module`` imports, else the reason (first line of the error)."""
    try:
        importlib.import_module(module)
        return None
    except Exception as e:  # noqa: BLE001 - any import failure is a reason to record
        return _reason(e)


def ensure_peer_packages(wheel_dir: Path | str | None = None) -> dict[str, str | None]:
    """Make quanto and HQQ importable if possible; returns backend -> ``None`` (ok) or the reason not.

    Packages already importable are used as they are. Otherwise the wheels in ``wheel_dir``
    (default ``<repo>/.whl``) are installed once (``pip --no-index --no-deps``) into a temporary
    directory keyed by the wheels' hash, which is put on ``sys.path``. Nothing is installed into the
    running environment.
    """
    wheel_dir = Path(wheel_dir) if wheel_dir is not None else WHEEL_DIR
    missing = {b: m for b, (m, _) in BACKENDS.items() if _importable(m) is not None}
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if missing and wheels:
        digest = hashlib.sha256(b"".join(w.name.encode() + w.read_bytes() for w in wheels)).hexdigest()[:16]
        target = Path(tempfile.gettempdir()) / f"kvlib-peers-{digest}"
        if not (target / ".complete").exists():
            tmp = Path(tempfile.mkdtemp(prefix="kvlib-peers-tmp-"))
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--disable-pip-version-check", "--target", str(tmp), *map(str, wheels)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if proc.returncode == 0:
                (tmp / ".complete").touch()
                with contextlib.suppress(OSError):  # another process may have won the race
                    tmp.rename(target)
        if (target / ".complete").exists() and str(target) not in sys.path:
            sys.path.append(str(target))  # appended: never shadows what the environment has
    with contextlib.suppress(Exception):
        _refresh_transformers_checks()
    status: dict[str, str | None] = {}
    for backend, (module, _) in BACKENDS.items():
        reason = _importable(module)
        if reason is not None and not wheels:
            reason += f" (no wheels in {wheel_dir.name}/)"
        status[backend] = reason
    return status


# ----------------------------------------------------------------------------------------- quanto unpack


def quanto_extension_built(device: str) -> bool:
    """Whether quanto's compiled unpack extension for ``device`` is already built for this torch."""
    from optimum.quanto.library import extensions as ext_mod

    name = "quanto_cuda" if device == "cuda" else "quanto_cpp"
    if not ext_mod.is_extension_available(name):
        return False
    version_file = Path(ext_mod.get_extension(name).build_directory) / "pytorch_version.txt"
    return version_file.exists() and version_file.read_text().strip() == torch.__version__


def build_quanto_extension(device: str, timeout_s: float) -> dict:
    """Try to JIT-build quanto's extension in a subprocess (so a slow build can be cut off)."""
    name = "quanto_cuda" if device == "cuda" else "quanto_cpp"
    code = f"from optimum.quanto.library.extensions import get_extension; get_extension({name!r}).lib"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        ok, why = proc.returncode == 0, (proc.stderr.strip().splitlines() or [""])[-1][:300]
    except subprocess.TimeoutExpired:
        ok, why = False, f"build did not finish in {timeout_s:.0f} s"
    return {"built": ok and quanto_extension_built(device), "seconds": time.perf_counter() - t0,
            "error": None if ok else why}


def unpack_bits_torch(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """quanto's packing undone in plain torch: value ``i`` of each byte (``bits`` wide, lowest first) goes
    to row block ``i`` (``torch.cat`` along dim 0), as quanto's own default ``quanto::unpack``.

    (quanto registers that default through ``torch.library.impl``, which leaves no callable behind in
    recent torch, so it is restated here; ``tests/test_peers_hf.py`` checks it against quanto's packer.)
    """
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits!r}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    mask = (1 << bits) - 1
    return torch.cat([(packed >> (bits * i)) & mask for i in range(8 // bits)])


@contextlib.contextmanager
def quanto_unpack(mode: str) -> Iterator[None]:
    """Within the block, quanto's ``PackedTensor.unpack`` uses ``mode``: ``"torch"``
    (:func:`unpack_bits_torch`, no compiled extension) or ``"extension"`` (as shipped: the dispatcher's
    compiled kernel)."""
    if mode not in ("torch", "extension"):
        raise ValueError(f"mode must be 'torch' or 'extension', got {mode!r}")
    from optimum.quanto.tensor.packed import PackedTensor

    original = PackedTensor.unpack

    def unpack_torch(self):  # same contract as PackedTensor.unpack
        return unpack_bits_torch(self._data, self._bits)[: self.shape[0]]

    if mode == "torch":
        PackedTensor.unpack = unpack_torch
    try:
        yield
    finally:
        PackedTensor.unpack = original


# ----------------------------------------------------------------------------------------- caches


def make_quantized_cache(backend: str, nbits: int, *, q_group_size: int = Q_GROUP, residual_length: int = RESIDUAL):
    """A one-layer ``transformers.QuantizedCache`` with HF's axis for ``backend`` (quanto 0, HQQ 1)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if nbits not in NBITS:
        raise ValueError(f"nbits must be one of {NBITS}, got {nbits!r}")
    from transformers import LlamaConfig
    from transformers.cache_utils import QuantizedCache

    hq, hkv = GQA
    cfg = LlamaConfig(num_hidden_layers=1, num_attention_heads=hq, num_key_value_heads=hkv, hidden_size=hq * D)
    axis = BACKENDS[backend][1]
    return QuantizedCache(backend, cfg, nbits=nbits, axis_key=axis, axis_value=axis, q_group_size=q_group_size,
                          residual_length=residual_length)


def held_bytes(obj: Any) -> int:
    """Bytes of every tensor reachable from ``obj`` (tensor subclasses opened via ``__tensor_flatten__``,
    dicts, lists, tuples): what a cache entry holds in memory."""
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(held_bytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(held_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(held_bytes(v) for v in obj)
    return 0


def layer_bytes(layer) -> dict[str, int]:
    """Bytes a ``QuantizedLayer`` holds: packed part (codes, scales, zero points) and bf16 residual."""
    quant = held_bytes(layer._quantized_keys) + held_bytes(layer._quantized_values)
    resid = held_bytes(layer.keys) + held_bytes(layer.values)
    return {"quantized_bytes": quant, "residual_bytes": resid, "held_bytes": quant + resid}


def set_state(layer, qk, qv, res_k: torch.Tensor, res_v: torch.Tensor, n_quant: int) -> None:
    """Put a ``QuantizedLayer`` back to a fixed state: packed ``qk``/``qv`` for ``n_quant`` tokens and a
    bf16 residual ``res_k``/``res_v`` (so a timed ``update`` can be repeated on the same state)."""
    layer._quantized_keys, layer._quantized_values = qk, qv
    layer.keys, layer.values = res_k, res_v
    layer.cumulative_length = n_quant + res_k.shape[-2]


def probe_update_path(cache, k_new: torch.Tensor, v_new: torch.Tensor) -> dict[str, list[int]]:
    """Run one ``cache.update`` and record how many tokens each ``_dequantize`` returned and each
    ``_quantize`` received: the run-time check of what the code reading says."""
    layer = cache.layers[0]
    seen: dict[str, list[int]] = {"dequantize_tokens": [], "quantize_tokens": []}
    deq, quant = layer._dequantize, layer._quantize

    def deq_probe(q):
        out = deq(q)
        seen["dequantize_tokens"].append(int(out.shape[-2]))
        return out

    def quant_probe(t, axis):
        seen["quantize_tokens"].append(int(t.shape[-2]))
        return quant(t, axis)

    layer._dequantize, layer._quantize = deq_probe, quant_probe
    try:
        cache.update(k_new, v_new, 0)
    finally:
        del layer._dequantize, layer._quantize
    return seen


# ----------------------------------------------------------------------------------------- timing


def time_few(fn: Callable[[], object], n: int = 3, warmup: bool = True) -> dict:
    """Median of ``n`` timed calls after one warm-up (CUDA events on CUDA, wall clock on CPU), for
    steps too slow for :func:`bench_ms`'s repeat budget (the re-quantising flush step)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    cuda = torch.cuda.is_available()
    if warmup:
        fn()
    times = []
    for _ in range(n):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "n": n}


def working_set_bytes(batch: int, ctx: int) -> float:
    """Estimated device bytes for one shape: bf16 K+V reference, the dequantised copy and the concatenated
    output of ``update``, plus room for quantisation temporaries (HQQ fits in fp32)."""
    return 5.0 * kv_bytes_bf16(batch, ctx, GQA[1], D)


def _sdpa(q, k, v):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def time_quantized_peer(backend: str, nbits: int, unpack: str, base: dict, rep_ms: float, n_flush: int) -> dict:
    """Time HF's quantized-cache decode step for one shape (``base`` holds q, k, v, new token, sizes)."""
    b, s, r = base["batch"], base["ctx"], RESIDUAL
    k, v, q, k_new, v_new = base["k"], base["v"], base["q"], base["k_new"], base["v_new"]
    ctx_mgr = quanto_unpack(unpack) if backend == "quanto" else contextlib.nullcontext()
    with ctx_mgr:
        cache = make_quantized_cache(backend, nbits)
        layer = cache.layers[0]
        cache.update(k[:, :, :s].contiguous(), v[:, :, :s].contiguous(), 0)  # HF prefill: quantises S tokens
        qk, qv = layer._quantized_keys, layer._quantized_values
        r_step = r // 2
        res_step = (k[:, :, s:s + r_step].contiguous(), v[:, :, s:s + r_step].contiguous())
        res_flush = (k[:, :, s:s + r - 1].contiguous(), v[:, :, s:s + r - 1].contiguous())

        def step():
            set_state(layer, qk, qv, *res_step, s)
            kk, vv = cache.update(k_new, v_new, 0)
            return _sdpa(q, kk, vv)

        def update_only():
            set_state(layer, qk, qv, *res_step, s)
            return cache.update(k_new, v_new, 0)

        def flush():
            set_state(layer, qk, qv, *res_flush, s)
            kk, vv = cache.update(k_new, v_new, 0)
            return _sdpa(q, kk, vv)

        # run-time check of the update path, and the dequantisation error of the prefilled keys
        set_state(layer, qk, qv, *res_step, s)
        seen_step = probe_update_path(cache, k_new, v_new)
        set_state(layer, qk, qv, *res_flush, s)
        seen_flush = probe_update_path(cache, k_new, v_new)
        set_state(layer, qk, qv, *res_step, s)
        sizes = layer_bytes(layer)
        kk, _ = cache.update(k_new, v_new, 0)
        ref = k[:1, :, :s].float()  # batch row 0: enough for the error, small at every shape
        err = (kk[:1, :, :s].float() - ref).abs()
        k_range = float(ref.amax() - ref.amin())
        max_err, mean_err = float(err.max()), float(err.mean())
        del kk, err, ref

        cuda = k.is_cuda
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t_step = bench_ms(step, rep_ms=rep_ms)
        peak = torch.cuda.max_memory_allocated() - before if cuda else None
        t_update = bench_ms(update_only, rep_ms=rep_ms)
        t_flush = time_few(flush, n_flush, warmup=cuda)  # on CPU the probe above was the warm-up
        set_state(layer, qk, qv, *res_step, s)

    n_tok = s + r_step
    bf16 = kv_bytes_bf16(b, n_tok, GQA[1], D)
    amortized = ((r - 1) * t_step.median_ms + t_flush["median_ms"]) / r
    row = {
        "batch": b, "ctx": s, "tokens_held": n_tok, "backend": backend, "nbits": nbits, "unpack": unpack,
        "step_ms": t_step.median_ms, "step_q25_ms": t_step.q25_ms, "step_q75_ms": t_step.q75_ms,
        "update_ms": t_update.median_ms, "flush_ms": t_flush["median_ms"], "flush_timing": t_flush,
        "amortized_ms": amortized, "sdpa_bf16_ms": base["sdpa_ms"],
        "speedup_vs_sdpa": base["sdpa_ms"] / amortized, "step_speedup_vs_sdpa": base["sdpa_ms"] / t_step.median_ms,
        **sizes, "bf16_bytes": bf16, "compression_vs_bf16": bf16 / sizes["held_bytes"],
        "bits_per_value": 8 * sizes["quantized_bytes"] / (2 * b * GQA[1] * s * D),
        "dequantize_tokens_per_step": seen_step["dequantize_tokens"],
        "quantize_tokens_per_step": seen_step["quantize_tokens"],
        "quantize_tokens_at_flush": seen_flush["quantize_tokens"],
        "whole_cache_dequantised_each_step": all(t >= s for t in seen_step["dequantize_tokens"]),
        "whole_cache_requantised_at_flush": bool(seen_flush["quantize_tokens"])
        and all(t >= s + r - 1 for t in seen_flush["quantize_tokens"]),
        "key_max_abs_err": max_err, "key_mean_abs_err": mean_err, "key_range": k_range,  # batch row 0
        "step_peak_extra_bytes": peak,  # CUDA: peak over the timed steps (incl. do_bench's L2-flush buffer)
    }
    return row


def _base_inputs(batch: int, ctx: int, device: str, seed: int) -> dict:
    """Random bf16 q ([B, 32, 1, d]), K and V ([B, 8, S + R, d]) and one new K/V token, from ``seed``."""
    g = torch.Generator(device=device).manual_seed(seed)
    hq, hkv = GQA
    total = ctx + RESIDUAL
    shape = (batch, hkv, total, D)
    k = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    v = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    q = torch.randn((batch, hq, 1, D), generator=g, device=device, dtype=torch.bfloat16)
    k_new = torch.randn((batch, hkv, 1, D), generator=g, device=device, dtype=torch.bfloat16)
    v_new = torch.randn((batch, hkv, 1, D), generator=g, device=device, dtype=torch.bfloat16)
    return {"batch": batch, "ctx": ctx, "q": q, "k": k, "v": v, "k_new": k_new, "v_new": v_new}


def _time_baselines(base: dict, rep_ms: float) -> dict:
    """SDPA bf16 over a contiguous cache of the same S + R/2 + 1 tokens, and HF's DynamicCache step."""
    from transformers.cache_utils import DynamicCache

    s, r_step = base["ctx"], RESIDUAL // 2
    n = s + r_step + 1
    k_full, v_full = base["k"][:, :, :n].contiguous(), base["v"][:, :, :n].contiguous()
    t_sdpa = bench_ms(lambda: _sdpa(base["q"], k_full, v_full), rep_ms=rep_ms)
    dyn = DynamicCache()
    k_old, v_old = base["k"][:, :, :n - 1].contiguous(), base["v"][:, :, :n - 1].contiguous()
    dyn.update(k_old, v_old, 0)
    layer = dyn.layers[0]

    def dyn_step():
        layer.keys, layer.values = k_old, v_old
        kk, vv = dyn.update(base["k_new"], base["v_new"], 0)
        return _sdpa(base["q"], kk, vv)

    t_dyn = bench_ms(dyn_step, rep_ms=rep_ms)
    return {"sdpa_ms": t_sdpa.median_ms, "sdpa_q25_ms": t_sdpa.q25_ms, "sdpa_q75_ms": t_sdpa.q75_ms,
            "hf_dynamic_ms": t_dyn.median_ms}


def _peer_name(backend: str, nbits: int, unpack: str | None) -> str:
    return f"hf-{backend}-int{nbits}" + ("-compiled-unpack" if unpack == "extension" else "")


def run(profile: str, *, batches: tuple[int, ...] | None = None, ctxs: tuple[int, ...] | None = None,
        backends: tuple[str, ...] = ("quanto", "hqq"), seed: int = 0) -> dict:
    """HF ``QuantizedCache`` decode step vs SDPA bf16 over (batch, context); JSON-able result.

    GPU: B in {1, 8, 32}, S in {4096, 16384}; CPU (ci/cpu): tiny shapes, wiring only.
    ``could_not_run`` lists every peer (or peer at a shape) that did not run, with the reason.
    """
    device = profile_device(profile)
    cuda = device == "cuda"
    if batches is None:
        batches = (1, 8, 32) if cuda else ((1,) if profile == "ci" else (1, 2))
    if ctxs is None:
        ctxs = (4096, 16384) if cuda else ((64,) if profile == "ci" else (128, 512))
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise ValueError(f"backends must be among {sorted(BACKENDS)}, got {sorted(unknown)}")
    rep_ms = 100.0 if cuda else (5.0 if profile == "ci" else 30.0)
    n_flush = 3 if cuda else 1
    t_start = time.perf_counter()

    status = ensure_peer_packages()
    could_not_run: list[dict] = []
    variants: list[tuple[str, int, str | None]] = []
    for backend in backends:
        if status.get(backend) is not None:
            could_not_run.append({"peer": f"hf-{backend}", "could_not_run": f"cannot import: {status[backend]}"})
            continue
        for nbits in NBITS:
            variants.append((backend, nbits, "torch" if backend == "quanto" else None))

    extension: dict = {"device": device}
    if "quanto" in backends and status.get("quanto") is None:
        ready = quanto_extension_built(device)
        budget = float(os.environ.get("KVLIB_QUANTO_BUILD_S", "0") or 0)
        if not ready and cuda and budget > 0:
            extension["build"] = build_quanto_extension(device, budget)
            ready = extension["build"]["built"]
        extension["built"] = ready
        if ready and cuda:
            variants += [("quanto", nbits, "extension") for nbits in NBITS]
        elif cuda:
            could_not_run.append({"peer": "hf-quanto-compiled-unpack", "could_not_run": (
                "quanto's CUDA unpack extension is JIT-compiled (ninja + nvcc, with its Marlin/AWQ kernels) on "
                "first use and was not built on this machine"
                + (f": {extension['build']['error']}" if extension.get("build") else
                   " (set KVLIB_QUANTO_BUILD_S to allow a build attempt)")
                + "; quanto was timed with its pure-torch unpack instead")})

    rows: list[dict] = []
    skipped: list[dict] = []
    for b in batches:
        for s in ctxs:
            if kv_bytes_bf16(b, s, GQA[1], D) > MEM_BUDGET:
                skipped.append({"batch": b, "ctx": s, "why": f"bf16 K+V > {MEM_BUDGET / 1e9:.0f} GB",
                                "working_set_estimate_bytes": working_set_bytes(b, s)})
                continue
            base = _base_inputs(b, s, device, seed)
            base.update(_time_baselines(base, rep_ms))
            rows.append({"peer": "sdpa_bf16", "batch": b, "ctx": s, "step_ms": base["sdpa_ms"],
                         "step_q25_ms": base["sdpa_q25_ms"], "step_q75_ms": base["sdpa_q75_ms"],
                         "amortized_ms": base["sdpa_ms"], "speedup_vs_sdpa": 1.0,
                         "held_bytes": kv_bytes_bf16(b, s + RESIDUAL // 2, GQA[1], D)})
            rows.append({"peer": "hf_dynamic_bf16", "batch": b, "ctx": s, "step_ms": base["hf_dynamic_ms"],
                         "amortized_ms": base["hf_dynamic_ms"],
                         "speedup_vs_sdpa": base["sdpa_ms"] / base["hf_dynamic_ms"],
                         "held_bytes": kv_bytes_bf16(b, s + RESIDUAL // 2, GQA[1], D)})
            for backend, nbits, unpack in variants:
                name = _peer_name(backend, nbits, unpack)
                try:
                    row = time_quantized_peer(backend, nbits, unpack or "n/a", base, rep_ms, n_flush)
                    rows.append({"peer": name, **row})
                except Exception as e:  # noqa: BLE001 - one peer failing must not stop the run
                    could_not_run.append({"peer": name, "batch": b, "ctx": s, "could_not_run": _reason(e)})
                finally:
                    if cuda:  # free the peer's device memory before the next one
                        gc.collect()
                        torch.cuda.empty_cache()
            del base
            if cuda:
                gc.collect()
                torch.cuda.empty_cache()

    summary = {}
    for peer in sorted({r["peer"] for r in rows}):
        mine = [r for r in rows if r["peer"] == peer]
        long_ctx = [r["speedup_vs_sdpa"] for r in mine if r["ctx"] == max(ctxs)]
        summary[peer] = {"speedup_vs_sdpa_min": min(r["speedup_vs_sdpa"] for r in mine),
                         "speedup_vs_sdpa_max": max(r["speedup_vs_sdpa"] for r in mine),
                         f"speedup_vs_sdpa_at_S{max(ctxs)}_max": max(long_ctx, default=None),
                         "held_bytes_over_bf16_max": max(r["held_bytes"] / kv_bytes_bf16(r["batch"], r["ctx"]
                                                         + RESIDUAL // 2, GQA[1], D) for r in mine)}
    versions = {}
    for dist in ("transformers", "optimum-quanto", "hqq", "torch"):
        with contextlib.suppress(Exception):
            versions[dist] = importlib.metadata.version(dist)
    return {
        "device": device, "profile": profile, "speed_claim": cuda,
        "shape": {"hq": GQA[0], "hkv": GQA[1], "d": D},
        "config": {"q_group_size": Q_GROUP, "residual_length": RESIDUAL,
                   "axis": {b: BACKENDS[b][1] for b in backends}, "residual_tokens_in_step": RESIDUAL // 2},
        "timing": "eager (HF's update is Python per step; no CUDA graph); ordinary step by bench_ms, flush step "
                  "by time_few; amortized = ((R-1)*step + flush)/R; speedup_vs_sdpa = sdpa_ms / amortized_ms",
        "update_path": UPDATE_PATH, "packages": status, "versions": versions, "quanto_extension": extension,
        "rows": rows, "summary": summary, "could_not_run": could_not_run, "skipped_shapes": skipped,
        "wall_s": time.perf_counter() - t_start,
    }
