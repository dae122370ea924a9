"""Shared pieces of the transformers ``Cache`` contract tests (tests/test_hf_contract.py).

Tiny random decoders (Llama, Qwen2, Mistral; 2 layers, hidden 64, 4 query / 2 KV heads), the cache
"kinds" a contract check runs against (the DynamicCache reference, kvlib formats), a teacher-forced
logit replay used to compare a lossy cache with DynamicCache, and *mutants*: DynamicCache
subclasses with one realistic bug each, which the checks must reject (proof that a check can fail).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, MistralConfig, Qwen2Config
from transformers.cache_utils import Cache, DynamicLayer

VOCAB = 128
PAD = 0
#: architecture -> (config class, weight seed offset); distinct seeds so Mistral (= Llama with full
#: attention) is not the same network as Llama
ARCHS = {"llama": (LlamaConfig, 0), "qwen2": (Qwen2Config, 1), "mistral": (MistralConfig, 2)}


@functools.cache
def tiny_model(arch: str = "llama", head_dim: int = 32, dtype: torch.dtype = torch.float32,
               seed: int = 0) -> Any:
    """A tiny random decoder in eval mode on the CPU.

    HF's default ``initializer_range=0.02``: the greedy margins (>= 0.019 std of the logits on the
    prompts check_greedy uses) sit 200x above the 1e-4 tolerance of fp32 rounding, so a token flip means a cache
    bug, not a near tie. EOS is disabled so every generation produces exactly ``max_new_tokens``.
    """
    cls, offset = ARCHS[arch]
    kw: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=256, initializer_range=0.02,
        tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    if cls is MistralConfig:
        kw["sliding_window"] = None  # full attention: the contract is for standard full-attention layers
    cfg = cls(**kw)
    torch.manual_seed(1000 + 10 * offset + seed)
    model = AutoModelForCausalLM.from_config(cfg).eval().to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = PAD
    return model


def prompt(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Random token ids in [3, VOCAB) (never PAD/BOS/EOS)."""
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def repetitive_prompt(length: int = 24, seed: int = 0) -> torch.Tensor:
    """A prompt made of a repeated 6-gram, so that prompt-lookup decoding finds candidates."""
    unit = prompt(1, 6, seed)
    return unit.repeat(1, -(-length // 6))[:, :length]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| in units of the reference logits' standard deviation."""
    return float((a.float() - ref.float()).abs().max() / ref.float().std())


# -- cache kinds ------------------------------------------------------------------------------------

#: kvlib format -> extra make_cache options. kv4rl's side buffer is shrunk (4 sink + 16 recent) so
#: that the 30-40 token sequences of these tests also reach its KV4 main store.
LOSSY_OPTIONS: dict[str, dict[str, Any]] = {
    "dither-int8": {}, "rtn-int8": {}, "kv4": {}, "kv4rl": {"sink": 4, "recent": 16}}
PASSTHROUGH = ("fp32", "bf16")

#: Logit tolerance (max |delta| / std of the reference logits, teacher-forced) of a lossy format
#: against DynamicCache. An absmax INT8 group quantiser moves each element by at most 1/254 of its
#: group's max, KV4's affine INT4 by 1/30 of the head's range (~8x more; the rounding noise of a
#: near-Gaussian head ~16x more); measured on these models: 0.012-0.015 for the int8 formats,
#: 0.13-0.20 for kv4 and 0.05-0.07 for kv4rl (its recent window is int8). The tolerances sit ~3x
#: above. The int8 tolerance excludes a single-token bug (one zeroed value row costs 0.44-0.64);
#: the 4-bit one cannot, which is why the contract's bookkeeping is also checked exactly on the
#: passthrough formats and by same-format self-consistency (deepcopy vs fresh caches).
LOSSY_TOL = {"dither-int8": 0.05, "rtn-int8": 0.05, "kv4": 0.5, "kv4rl": 0.5}
#: passthrough: only the attention's summation order may differ from DynamicCache (fp32 rounding)
EXACT_TOL = 1e-4
#: bf16 passthrough in an fp32 model, against a DynamicCache holding the same bf16-rounded K/V: the
#: attention may also round the query or its output to bf16 (as a bf16 kernel does): 2^-9 relative
#: per rounding, measured 0.002-0.005 std on these models; the greedy margins (>= 0.019 std) stay
#: above twice this tolerance, so greedy tokens must still be equal
BF16_TOL = 8e-3


class _Bf16Layer(DynamicLayer):
    """DynamicLayer storing K/V rounded to bf16: what a bf16 passthrough pool holds in an fp32 model."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        r = lambda x: x.to(torch.bfloat16).to(x.dtype)  # noqa: E731
        return super().update(r(key_states), r(value_states), *args, **kwargs)


def _bf16_reference(model: Any) -> Any:
    return Cache(layers=[_Bf16Layer() for _ in range(model.config.num_hidden_layers)])


def _dynamic(model: Any) -> Any:
    return DynamicCache(config=model.config)


@dataclass(frozen=True)
class Kind:
    """A way of making a cache for a model, its reference, and how closely it must agree with it."""

    name: str
    make: Callable[[Any], Any] = field(compare=False)
    exact: bool = True  # the reference's tokens in every test; else logits within ``tol``
    tol: float = EXACT_TOL
    ref: Callable[[Any], Any] = field(default=_dynamic, compare=False)
    greedy_tokens: bool = False  # not exact, but greedy tokens must equal the reference's (decisive margins)

    def __repr__(self) -> str:
        return self.name


def dynamic_kind() -> Kind:
    return Kind("dynamic", _dynamic)


def kvlib_kind(fmt: str, **extra: Any) -> Kind:
    """``kvlib.make_cache(fmt, model.config, **extra)`` (plus the format's LOSSY_OPTIONS)."""
    import kvlib

    opts = {**LOSSY_OPTIONS.get(fmt, {}), **extra}
    make = lambda model: kvlib.make_cache(fmt, model.config, **opts)  # noqa: E731
    if fmt == "bf16":
        return Kind("kvlib:bf16", make, False, BF16_TOL, ref=_bf16_reference, greedy_tokens=True)
    if fmt in PASSTHROUGH:
        return Kind(f"kvlib:{fmt}", make)
    return Kind(f"kvlib:{fmt}", make, False, LOSSY_TOL[fmt])


def model_for(kind: Kind, arch: str = "llama", head_dim: int = 32, seed: int = 0) -> Any:
    return tiny_model(arch, head_dim, torch.float32, seed)


# -- replay: the same forward calls on two caches ---------------------------------------------------

@torch.no_grad()
def step(model: Any, cache: Any, ids: torch.Tensor, mask: torch.Tensor | None = None,
         position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One forward of ``ids [B, s]`` on ``cache``; returns the logits of the last position ``[B, V]``.

    With a ``mask`` (the full attention mask so far, left padding) the positions are counted from
    it, as ``generate`` does.
    """
    kw: dict[str, Any] = {}
    if mask is not None:
        kw["attention_mask"] = mask
        if position_ids is None:
            position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
    if position_ids is not None:
        kw["position_ids"] = position_ids
    return model(ids, past_key_values=cache, use_cache=True, **kw).logits[:, -1].float()


@torch.no_grad()
def forced_logits(model: Any, cache: Any, ids: torch.Tensor, new_tokens: torch.Tensor,
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """Teacher forcing: prefill ``ids`` then feed ``new_tokens [B, T]`` one by one.

    Returns ``[B, 1 + T, V]``: the logits after the prefill and after each fed token.
    """
    out = [step(model, cache, ids, mask)]
    for t in range(new_tokens.shape[1]):
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        out.append(step(model, cache, new_tokens[:, t:t + 1], mask))
    return torch.stack(out, dim=1)


@torch.no_grad()
def greedy(model: Any, ids: torch.Tensor, cache: Any, n: int = 20, **kw: Any) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=n, do_sample=False, past_key_values=cache, **kw)


# -- mutants: one realistic bug each ---------------------------------------------------------------

class _Mutant(DynamicCache):
    """A DynamicCache whose layers are ``layer_cls``."""

    layer_cls: type = DynamicLayer

    def __init__(self, config: Any) -> None:
        n = config.num_hidden_layers
        super(DynamicCache, self).__init__(layers=[self.layer_cls() for _ in range(n)])


class _NoReorder(DynamicLayer):
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # beams keep their old history
        pass


class _NoCrop(DynamicLayer):
    def crop(self, tokens_to_remove: int) -> None:  # rejected draft tokens stay in the cache
        pass


class _NoRepeat(DynamicLayer):
    def batch_repeat_interleave(self, repeats: int) -> None:  # tiles instead of interleaving
        if self.get_seq_length() > 0:
            self.keys = self.keys.repeat(repeats, 1, 1, 1)
            self.values = self.values.repeat(repeats, 1, 1, 1)


class _SelectFirst(DynamicLayer):
    def batch_select_indices(self, indices: torch.Tensor) -> None:  # keeps the first rows, not the chosen
        if self.get_seq_length() > 0:
            self.keys, self.values = self.keys[: len(indices)], self.values[: len(indices)]


class _ZeroOldest(DynamicLayer):
    """Hands the attention zeros for the oldest cached value (an off-by-one in a page table)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        k, v = super().update(key_states, value_states, *args, **kwargs)
        if k.shape[-2] > key_states.shape[-2]:
            v = v.clone()
            v[..., 0, :] = 0
        return k, v


class _BatchScale(DynamicLayer):
    """Quantises K/V on a grid scaled by the absmax of the *whole batch* (rows leak into each other)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        def q(x: torch.Tensor) -> torch.Tensor:
            s = x.abs().amax() / 7
            return (x / s).round() * s
        return super().update(q(key_states), q(value_states), *args, **kwargs)


class _ResetOnPrefill(DynamicLayer):
    """Re-initialises its stored values when a multi-token chunk arrives (assumes one prefill per cache)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if key_states.shape[-2] > 1 and self.get_seq_length() > 0:
            self.values = torch.zeros_like(self.values)
        return super().update(key_states, value_states, *args, **kwargs)


class _UndoEdits(DynamicLayer):
    """Keeps a private copy and rebuilds keys/values from it on update: external edits are silently undone."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._k, self._v = self.keys, self.values
        self._k = torch.cat([self._k, key_states], dim=-2)
        self._v = torch.cat([self._v, value_states], dim=-2)
        self.keys, self.values = self._k, self._v
        return self.keys, self.values


class _CopyOut(_UndoEdits):
    """Hands out copies of its private store: an in-place edit of ``layer.values`` is silently lost."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        k, v = super().update(key_states, value_states, *args, **kwargs)
        self.keys, self.values = k.clone(), v.clone()
        return k, v


class _OffByOne(DynamicLayer):
    def get_seq_length(self) -> int:
        n = super().get_seq_length()
        return n + 1 if n else 0


class _MaskSize(DynamicLayer):
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length + 1, 0


class _SharedCopy(DynamicCache):
    """``copy.deepcopy`` shares the layers (and their tensors) with the original."""

    def __deepcopy__(self, memo: dict) -> Any:
        return copy.copy(self)


def _mutant(name: str, layer_cls: type) -> Kind:
    cls = type(f"Mutant{layer_cls.__name__}", (_Mutant,), {"layer_cls": layer_cls})
    return Kind(f"mutant:{name}", lambda model: cls(model.config))


MUTANTS: dict[str, Kind] = {
    "no_reorder": _mutant("no_reorder", _NoReorder),
    "no_crop": _mutant("no_crop", _NoCrop),
    "tile_repeat": _mutant("tile_repeat", _NoRepeat),
    "select_first": _mutant("select_first", _SelectFirst),
    "zero_oldest": _mutant("zero_oldest", _ZeroOldest),
    "batch_scale": _mutant("batch_scale", _BatchScale),
    "reset_on_prefill": _mutant("reset_on_prefill", _ResetOnPrefill),
    "undo_edits": _mutant("undo_edits", _UndoEdits),
    "copy_out": _mutant("copy_out", _CopyOut),
    "off_by_one": _mutant("off_by_one", _OffByOne),
    "mask_size": _mutant("mask_size", _MaskSize),
    "shared_copy": Kind("mutant:shared_copy", lambda model: _SharedCopy(config=model.config)),
}
