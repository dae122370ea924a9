"""kvlib's attention function for transformers' ``AttentionInterface`` (standard Llama/Qwen2/Mistral attention).

How it becomes active (nothing for the user to do): :func:`kvlib.hf.cache.make_cache` calls
:func:`activate` on the config it is given. That registers ``"kvlib"`` with ``AttentionInterface`` and
``AttentionMaskInterface`` (once), remembers the config's previous implementation in
``config._kvlib_previous`` and sets ``config._attn_implementation = "kvlib"``. The decoder's attention
modules share that config object, so the next forward calls :func:`kvlib_attention`.

What it does: a kvlib cache's ``update`` hands back the new tokens' float K/V tagged with their layer.
* untagged K/V (any other cache, or none): the previous implementation, unchanged (so a DynamicCache on
  the same model gives the same results as before ``make_cache``); the mask function is the previous
  implementation's too;
* prefill (the cache was empty): the previous implementation over the float prompt with the mask; left
  padding read off the mask is dropped from the pools (the layer rewrites its rows without it);
* a one-token decode step: the format's decode kernel on the pool (all query heads of a GQA group from one
  load), when one applies to the device and shape; otherwise, and for multi-token steps on a filled cache
  (assisted decoding, a continued conversation), the torch reference: the pool dequantised transiently for
  the layer and the previous implementation with the mask. ``cache.kernel_path(layer)`` says which.
A kvlib cache used while another implementation is active (an observing or probing attention, or one the
user set) hands that implementation the whole pool dequantised instead (the reference path; its
``kernel_path`` says ``"dequantized-for:<name>"``), so it never attends over the new tokens alone.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

NAME = "kvlib"
_registered = False


def _previous(config: Any) -> str:
    prev = getattr(config, "_kvlib_previous", None)
    return prev if prev and prev != NAME else "sdpa"


def _delegate(module: torch.nn.Module) -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    prev = _previous(module.config)
    if prev != "eager" and prev in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[prev]
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"kvlib attention: cannot find the {prev!r} implementation for {type(module).__name__}")
    return fn


def _mask(*args: Any, config: Any = None, **kwargs: Any) -> Any:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS[_previous(config)](*args, config=config, **kwargs)


def _left_pad(mask: torch.Tensor | None, b: int) -> list[int]:
    """Leading masked columns per row, from the last query row of a 4D mask (bool: True attends;
    float: 0 attends)."""
    if mask is None or not isinstance(mask, torch.Tensor) or mask.ndim != 4:
        return [0] * b
    last = mask[:, 0, -1, :]
    ok = last if last.dtype == torch.bool else last == 0
    ok = ok.expand(b, -1)
    first = torch.where(ok.any(1), ok.int().argmax(1), torch.zeros(b, dtype=torch.long, device=ok.device))
    return first.tolist()


def kvlib_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registered attention function (see the module docstring)."""
    tag = getattr(key, "_kvlib", None)
    fn = _delegate(module)
    if tag is None:
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    layer, phase = tag.layer, tag.phase
    key._kvlib = None
    tag.consumed = True  # KVFormatCache checks it at the next update
    sm = scaling if scaling is not None else query.shape[-1] ** -0.5
    if phase == "prefill":
        # a sliding window also masks leading columns of the last query row: there the pads stay in the pools (the
        # mask excludes them at every step), since they cannot be told from the window's edge
        windowed = layer.cache.windowed[layer.layer_idx]
        pad = [0] * query.shape[0] if windowed else _left_pad(attention_mask, query.shape[0])
        if any(pad):
            layer.rewrite_without_pads(key, value, pad)
        layer.path = "sdpa-prefill"
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if query.shape[2] == 1 and not kwargs.get("output_attentions", False):
        windowed = layer.cache.windowed[layer.layer_idx]  # a sliding window: only paths that honour the mask
        o = layer.decode_masked(query, sm, attention_mask) if windowed else layer.decode_kernel(query, sm)
        gate = getattr(layer.cache, "gate_step", None)  # kvlib.hf.gate: repair over-threshold rows in this step
        if gate is not None:
            kv = None
            if o is None:
                kv = layer.dequantized()
                layer.path = "torch-reference"
                o = fn(module, query, *kv, attention_mask, scaling=scaling, dropout=dropout, **kwargs)[0][:, 0]
            return gate(layer, query[:, :, 0], o, sm, kv).to(query.dtype).unsqueeze(1), None
        if o is not None:
            return o.to(query.dtype).unsqueeze(1), None  # [B, 1, Hq, d], as the HF implementations return
    k_all, v_all, rotated = layer.reference_kv()
    layer.path = "torch-reference"
    if rotated and not kwargs.get("output_attentions", False):  # (H q) . (H k) = q . k: rotate one query, not L keys
        from kvlib.core.hadamard import hadamard

        query = hadamard(query)
    elif rotated:
        from kvlib.core.hadamard import hadamard

        k_all = hadamard(k_all)
    return fn(module, query, k_all, v_all, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register() -> None:
    """Register ``"kvlib"`` with transformers' attention and mask interfaces (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, kvlib_attention)
    AttentionMaskInterface.register(NAME, _mask)
    _registered = True


def activate(config: Any) -> None:
    """Make kvlib's attention the implementation of ``config`` (and its text sub-config), remembering the
    previous one to delegate to."""
    register()
    targets = [config]
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if text is not config:
        targets.append(text)
    for c in targets:
        cur = getattr(c, "_attn_implementation", None)
        if cur != NAME:
            c._kvlib_previous = cur or "sdpa"
            try:
                c._attn_implementation = NAME
            except Exception:  # a plain object standing in for a config (tests): keep the attribute as is
                object.__setattr__(c, "_attn_implementation", NAME)


def is_active(config: Any) -> bool:
    return getattr(config, "_attn_implementation", None) == NAME
