"""kvlib.backends: the format class names its backend, the backend chooses its kernel once and says which path ran,
and the HF cache reaches the gate through its explicit hook."""

from __future__ import annotations

import pytest
import torch

import kvlib
from kvlib.backends import (
    FAMILIES,
    Int4Backend,
    Int8Backend,
    ObjectBackend,
    PlainBackend,
    ReferenceBackend,
    backend_class,
)
from kvlib.formats.base import available_formats, format_class, get_format
from kvlib.hf.cache import CacheHook, make_cache

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _config(layers: int = 2, n_heads: int = 4, n_kv: int = 2, d: int = 64):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32, hidden_size=n_heads * d, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=d)


def test_the_format_class_names_its_backend() -> None:
    """Each registered format on both sides takes its declared family's backend where that backend reads its
    options, else the reference backend (the object store for a stateful format): no name is matched."""
    for name in available_formats():
        cls = format_class(name)
        f = get_format(name)
        got = backend_class(f, f)
        if cls.kernel is not None:
            assert got is FAMILIES[cls.kernel], name
        else:
            assert got is (ObjectBackend if cls.stateful else ReferenceBackend), name
    # options a family's kernels do not read send the pair to the reference path, with the backend's reason
    for name, opts, want in [("kv4", dict(group=32), ReferenceBackend), ("kv4", dict(rotate="none"), ReferenceBackend),
                             ("kv4rl", dict(protect="bf16"), ObjectBackend),
                             ("kv4rl", dict(capacity=200), ObjectBackend)]:
        f = get_format(name, **opts)
        assert Int4Backend.takes(f, f) is not None and backend_class(f, f) is want, (name, opts)
    ot = torch.zeros(2, 2, 2, dtype=torch.int64)
    rtn, dither = get_format("rtn-int8"), get_format("dither-int8")
    assert backend_class(rtn, rtn, outlier_table=ot) is ReferenceBackend  # RTN pages keep no outliers
    assert backend_class(dither, dither, outlier_table=ot) is Int8Backend
    assert backend_class(rtn, get_format("rtn-int8", group=16)) is ReferenceBackend
    assert backend_class(dither, rtn) is ReferenceBackend  # two families' formats: no one backend holds both
    bf16 = get_format("bf16")
    assert backend_class(bf16, bf16) is PlainBackend


@pytest.mark.parametrize("fmt", ["dither-int8", "kv4", "bf16", "rtn-int8"])
def test_the_kernel_is_chosen_once_and_the_step_names_it(fmt: str, monkeypatch) -> None:
    """Steps of one shape ask the kernels' rules once (not per step, and not on a probe tensor); the path the step
    reports is the kernel's own record."""
    cfg = _config()
    cache = make_cache(fmt, cfg, block_size=16)
    k = torch.randn(2, 2, 12, 64, device=DEV)
    for layer in range(2):
        cache.update(k, k.flip(-1), layer)
    be = cache.backend
    be.interpret = True  # the kernels on CPU tensors, under TRITON_INTERPRET=1 (conftest)
    calls = []
    real = be.supports
    monkeypatch.setattr(be, "supports", lambda shape, device: calls.append(shape) or real(shape, device))
    la = cache.layers[1]
    paths = []
    for _ in range(3):
        for layer in range(2):
            cache.update(torch.randn(2, 2, 1, 64, device=DEV), torch.randn(2, 2, 1, 64, device=DEV), layer)
        q = torch.randn(2, 4, 1, 64, device=DEV)
        assert la.decode_step(q, 0.125) is not None
        paths.append(la.path)
    family = {"dither-int8": "int8-", "rtn-int8": "int8-", "kv4": "kv4-", "bf16": "bf16-"}[fmt]
    assert len(set(paths)) == 1 and paths[0].startswith(family), paths
    assert len(calls) == 1, calls
    assert len(be._chosen) == 1


def test_no_kernel_means_the_reference_path_and_says_why() -> None:
    cfg = _config()
    for fmt in ("sr-int8", "kivi2"):
        cache = make_cache(fmt, cfg)
        k = torch.randn(1, 2, 8, 64)
        for layer in range(2):
            cache.update(k, k, layer)
        why = cache.backend.supports((1, 4, 64), torch.device("cpu"))
        assert why and "kernel=None" in why, why
        assert cache.layers[0].decode_step(torch.randn(1, 4, 1, 64), 0.125) is None
    # a family with kernels: on CPU without the interpreter, none runs
    assert "no Triton" in Int8Backend(2, 2, 64, 16, 1, torch.device("cpu"), get_format("dither-int8"),
                                      get_format("dither-int8"), batch=1).supports((1, 4, 64), torch.device("cpu"))


class _Counter(CacheHook):
    def __init__(self) -> None:
        self.writes, self.steps = 0, 0

    def on_write(self, layer_idx, k, v, rows, pos, slots) -> None:
        self.writes += int(k.shape[0])

    def on_step(self, layer, q, o, sm, kv):
        self.steps += 1
        return o


@torch.no_grad()
def test_a_cache_hook_sees_every_write_and_step() -> None:
    """make_cache(..., hook=) is the explicit plug-in point (the gate is one): it sees each token stored and each
    one-token decode step, and a hook that returns the output unchanged changes nothing."""
    from transformers import LlamaForCausalLM

    cfg = _config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 32, (2, 7))
    hook = _Counter()
    a = model.generate(ids, past_key_values=make_cache("rtn-int8", cfg, hook=hook), max_new_tokens=3,
                       min_new_tokens=3, do_sample=False)
    b = model.generate(ids, past_key_values=make_cache("rtn-int8", cfg), max_new_tokens=3, min_new_tokens=3,
                       do_sample=False)
    assert torch.equal(a, b)
    assert hook.writes == 2 * (7 + 2) * 2  # layers x (prompt + the decode steps' tokens) x rows
    assert hook.steps == 2 * 2  # layers x decode steps (the prefill is no step)
    with pytest.raises(TypeError, match="hook"):
        make_cache("rtn-int8", cfg, hook=object())
    with pytest.raises(TypeError, match="hook"):
        kvlib.make_gated_cache("rtn-int8", cfg, hook=hook)
