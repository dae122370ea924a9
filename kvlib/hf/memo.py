"""A content-addressed on-disk cache of model computations that do not depend on the code under test.

The exact (float32) prefill K/V of a prompt, or the post-RoPE q/k/v captured from one forward, are the model's
own numbers: a change to a kvlib kernel or KV format cannot change them, yet recomputing them was most of the
cost of re-executing a chapter (a 15-minute prefill in the tasks chapter, the captures of the real-model chapter).
:func:`memoized` keeps them on disk under a key that hashes everything the result depends on:

- the model's weights (every parameter and buffer, bytes and names), not its file name;
- the inputs (token ids by their bytes, and any plain parameters);
- the source of the functions that compute it (so an edit to the capture hook is a new key);
- the torch and transformers versions.

A hit returns tensors equal, bit for bit, to the ones first computed, with the seconds that computation took
(notebooks report that, not the load time). The store lives beside the model's own disk cache
(``$KVLIB_CACHE_DIR``, default ``~/.cache/kvlib``, outside the repository, so a fresh clone renders from the
committed executions and never needs it); ``KVLIB_MODEL_CACHE=off`` turns it off, ``KVLIB_MODEL_CACHE=<dir>``
moves it. Entries are written atomically (a temporary file renamed into place).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

#: layout of an entry; a new layout is a new key
VERSION = 1
_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: hits and misses of this process, by kind (notebooks may print them)
STATS: dict[str, dict[str, float]] = {}


def cache_root() -> Path | None:
    """The store's directory (None: turned off)."""
    env = os.environ.get("KVLIB_MODEL_CACHE", "")
    if env.lower() in ("off", "0", "false", "no"):
        return None
    if env:
        return Path(env)
    xdg = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(os.environ.get("KVLIB_CACHE_DIR") or xdg / "kvlib") / "computations"


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer of ``model`` (names, dtypes, shapes, bytes); computed once per model."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    got = _WEIGHTS.get(model)
    if got is None:
        h = hashlib.sha256()
        for name, t in sorted([*model.named_parameters(), *model.named_buffers()], key=lambda kv: kv[0]):
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(_bytes(t))
        got = _WEIGHTS[model] = h.hexdigest()
    return got


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _digest_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"tensor": hashlib.sha256(_bytes(v)).hexdigest(), "dtype": str(v.dtype), "shape": list(v.shape)}
    if isinstance(v, Mapping):
        return {str(k): _digest_value(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, (list, tuple)):
        return [_digest_value(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"inputs: cannot key a value of type {type(v).__name__}")


def code_digest(fns: tuple[Callable, ...]) -> str:
    """sha256 of the source of each function (its module and qualified name too)."""
    h = hashlib.sha256()
    for fn in fns:
        fn = inspect.unwrap(fn)
        h.update(f"{fn.__module__}.{fn.__qualname__}\n".encode())
        h.update(inspect.getsource(fn).encode())
    return h.hexdigest()


def key_of(kind: str, model: torch.nn.Module, inputs: Mapping[str, Any], code: tuple[Callable, ...]) -> str:
    import transformers

    doc = {"version": VERSION, "kind": kind, "weights": weights_digest(model), "inputs": _digest_value(dict(inputs)),
           "code": code_digest(code), "torch": torch.__version__, "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def memoized(kind: str, model: torch.nn.Module, inputs: Mapping[str, Any], code: tuple[Callable, ...],
             compute: Callable[[], dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], float, bool]:
    """``compute()`` (a flat ``{name: tensor}``), from the store when this exact computation was made before.

    Returns (tensors, seconds the computation took when it was made, whether it came from the store)."""
    if not kind.replace("_", "").isalnum():
        raise ValueError(f"kind must be a plain name, got {kind!r}")
    st = STATS.setdefault(kind, {"hits": 0, "misses": 0, "seconds_saved": 0.0})
    root = cache_root()
    path = None
    if root is not None:
        key = key_of(kind, model, inputs, code)
        path = root / kind / key[:2] / f"{key}.safetensors"
        if path.is_file():
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                out = {k: f.get_tensor(k) for k in f.keys()}
                seconds = float((f.metadata() or {}).get("seconds", "nan"))
            st["hits"] += 1
            st["seconds_saved"] += seconds
            return out, seconds, True
    t0 = time.perf_counter()
    out = compute()
    seconds = time.perf_counter() - t0
    st["misses"] += 1
    if not isinstance(out, dict) or not all(isinstance(v, torch.Tensor) for v in out.values()):
        raise TypeError(f"{kind}: compute() must return a dict of tensors")
    if path is not None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        save_file({k: v.detach().to("cpu").contiguous() for k, v in out.items()}, str(tmp),
                  metadata={"seconds": repr(seconds), "kind": kind})
        os.replace(tmp, path)
    return out, seconds, False
