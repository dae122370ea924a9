"""Formats declare their capabilities on the class; a format defined here alone works everywhere.

``toy-int6`` (RTN to 6 bits, per-token per-group fp16 scales, codes in int8 bytes) is defined in this
file only. Registered for the module's tests and removed afterwards, it must reach the registry,
``make_cache`` (forward and ``generate``), the byte account of the cache and the benchmarks, the book's
format table (:func:`kvlib.formats.format_table`) and the storage view of the fidelity probe.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

import kvlib
from kvlib.formats import base
from kvlib.formats.base import (
    KERNELS,
    KVFormat,
    available_formats,
    capabilities,
    format_class,
    format_table,
    formats_where,
    get_format,
    per_token,
    register_format,
    registered_format,
    unregister_format,
)

TOY = "toy-int6"
QMAX = 31.0  # 6-bit signed codes -31..31


@dataclasses.dataclass
class ToyPacked:
    codes: torch.Tensor = per_token()  # int8 [S, d], values in -31..31
    scales: torch.Tensor = per_token()  # fp16 [S, d // group]
    group: int = 32


class ToyInt6(KVFormat):
    """RTN to 6 bits with per-token, per-group fp16 scales ``amax / 31``: stateless, deterministic, no kernel."""

    deterministic = True
    options = ("group",)

    def __init__(self, group: int = 16) -> None:
        self.group = group

    def write(self, x: torch.Tensor, **ctx: Any) -> ToyPacked:
        x32 = x.float()
        amax = x32.abs().unflatten(-1, (-1, self.group)).amax(-1)
        s16 = (amax / QMAX).to(torch.float16)
        s = s16.float().repeat_interleave(self.group, -1)
        c = torch.where(s > 0, torch.round(x32 / torch.where(s > 0, s, torch.ones_like(s))), torch.zeros_like(x32))
        return ToyPacked(c.clamp(-QMAX, QMAX).to(torch.int8), s16, self.group)

    def read(self, packed: ToyPacked) -> torch.Tensor:
        return packed.scales.float().repeat_interleave(packed.group, -1) * packed.codes.float()

    def bytes_per_position(self, d: int) -> float:
        return float(d + 2 * (d // self.group))  # stored one code per byte (6 of its 8 bits used)


@pytest.fixture(scope="module")
def toy():
    with registered_format(TOY, ToyInt6) as cls:
        yield cls
    assert TOY not in available_formats()


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


# ------------------------------------------------------------------------------------------------
# the registry
def test_toy_in_registry(toy) -> None:
    assert TOY in available_formats()
    assert format_class(TOY) is ToyInt6
    assert capabilities(TOY) == dict(variance_proxy=None, stateful=False, deterministic=True, bounded=False,
                                     kernel=None)
    assert TOY in formats_where(deterministic=True, stateful=False)
    assert TOY not in formats_where(kernel="int8")
    assert isinstance(get_format(TOY, group=8), ToyInt6)


def test_unregister_and_context_manager() -> None:
    class Tmp(ToyInt6):
        pass

    with registered_format("toy-tmp", Tmp):
        assert "toy-tmp" in available_formats()
    assert "toy-tmp" not in available_formats()
    with pytest.raises(ValueError, match="not registered"):
        unregister_format("toy-tmp")
    with pytest.raises(ValueError, match="unknown format"):
        get_format("toy-tmp")


def test_a_taken_name_is_refused_unless_replaced() -> None:
    """A name another class holds is refused; ``replace=True`` (a notebook cell run again) takes it over."""

    class A(ToyInt6):
        pass

    class B(ToyInt6):
        pass

    with registered_format("toy-re", A):
        with pytest.raises(ValueError, match="already registered by A"):
            register_format("toy-re")(B)
        assert format_class("toy-re") is A
        register_format("toy-re", replace=True)(B)
        assert format_class("toy-re") is B
    assert "toy-re" not in available_formats()
    with pytest.raises(TypeError, match="replace"):
        register_format("toy-re", replace="yes")


def test_registration_refuses_false_declarations() -> None:
    class Stateful(ToyInt6):  # overrides append without declaring stateful
        def append(self, packed: Any, x: torch.Tensor, **ctx: Any) -> Any:
            return self.write(x)

    class Bounded(ToyInt6):  # declares a bound it does not implement
        bounded = True

    class RandomBounded(ToyInt6):  # a bound for a random format
        deterministic = False
        bounded = True

        def error_bound(self, packed: Any, x_hat: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(x_hat, dtype=torch.float64)

    class BadKernel(ToyInt6):
        kernel = "int6"

    class BadProxy(ToyInt6):
        deterministic = False
        variance_proxy = "gaussian"

    class ProxyButDeterministic(ToyInt6):
        variance_proxy = "dither"

    for cls in (Stateful, Bounded, RandomBounded, BadKernel, BadProxy, ProxyButDeterministic):
        with pytest.raises(TypeError, match="format 'toy-bad'"):
            register_format("toy-bad")(cls)
        assert "toy-bad" not in available_formats()


def test_capabilities_bad_input() -> None:
    with pytest.raises(TypeError, match="format must be a str"):
        capabilities(3)
    with pytest.raises(ValueError, match="unknown capabilities"):
        formats_where(fast=True)


# ------------------------------------------------------------------------------------------------
# properties of every registered format (the toy included)
def _names() -> list[str]:
    return available_formats() + [TOY]


def _ctx(S: int, seed: int, slot0: int) -> dict[str, Any]:
    return dict(layer=1, kv_head=0, side=0, seed=seed, slots=torch.arange(slot0, slot0 + S),
                positions=torch.arange(S))


@pytest.mark.parametrize("name", _names())
def test_declarations_are_true(toy, name) -> None:
    cls = format_class(name)
    assert cls.stateful == (cls.append is not KVFormat.append)
    assert cls.bounded == (cls.error_bound is not KVFormat.error_bound)
    assert cls.kernel in KERNELS
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    f = get_format(name)
    a, b = f.read(f.write(x, **_ctx(64, 0, 0))), f.read(f.write(x, **_ctx(64, 12345, 777)))
    if cls.deterministic:  # a function of x alone: seeds and slots do not matter, bit for bit
        assert torch.equal(a, b)
    else:  # dithered / randomly rounded: another seed and slots give another reconstruction
        assert not torch.equal(a, b)


@pytest.mark.parametrize("name", _names())
def test_declared_bytes_equal_measured(toy, name) -> None:
    """``nbytes(write(x)) == S bytes_per_position + fixed_bytes`` for S a multiple of every block/residual."""
    d, S = 32, 256
    f = get_format(name)
    packed = f.write(torch.randn(S, d), **_ctx(S, 0, 0))
    extra = 0
    if hasattr(packed, "side_pos"):  # KV4-RL's reference packing keeps its ring addresses (int64) too
        extra = packed.side_pos.numel() * packed.side_pos.element_size()
    assert f.nbytes(packed) == S * f.bytes_per_position(d) + f.fixed_bytes(d) + extra
    assert f.bits_per_element(d) == 8 * f.bytes_per_position(d) / d
    assert int(f.side_count(torch.tensor([S]))) == min(S, f.capacity)  # a full side buffer, or none
    if f.capacity == 0:
        assert f.fixed_bytes(d) == 0


@pytest.mark.parametrize("name", formats_where(bounded=True))
def test_error_bound_holds(name) -> None:
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 2, 32)
    f = get_format(name)
    packed = f.write(x, **_ctx(256, 0, 0))
    x_hat = f.read(packed)
    e = f.error_bound(packed, x_hat)
    assert e.shape == x.shape and e.dtype == torch.float64
    assert bool(((x_hat.double() - x.double()).abs() <= e).all())


@pytest.mark.parametrize("name", formats_where(bounded=True))
def test_the_gate_takes_bounded_formats_from_their_class(name) -> None:
    """The gate certifies a bounded format through the class's own error_bound (no table of its own)."""
    from kvlib.gate import gate_kind, gateable_formats

    assert gate_kind(name) == "deterministic" and name in gateable_formats()


def test_no_bound_for_unbounded(toy) -> None:
    f = get_format(TOY)
    with pytest.raises(NotImplementedError, match="toy-int6"):
        f.error_bound(f.write(torch.randn(4, 32)), torch.zeros(4, 32))


def test_int4_kernel_reads_whole_head_affine_only() -> None:
    """kernel='int4' only where the pool has one (scale, offset) per vector, as kvlib.kernels.int4 reads."""
    x = torch.randn(8, 64)
    for name in formats_where(kernel="int4"):
        f = get_format(name)
        main = f.write(x, side=1)
        main = getattr(main, "main", main)
        assert main.scale.shape == (8, 1) and main.offset.shape == (8, 1), name
    for name in ("kv4-g32", "kv4-g16"):
        assert capabilities(name)["kernel"] is None


def test_bf16_kernel_reads_its_formats() -> None:
    """Every kernel='bf16' format's packed data, laid out as a pool, decodes through the kernel as its
    float64 reference does (interpreter on CPU)."""
    from kvlib.kernels.bf16.decode import decode_bf16, decode_bf16_reference

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(6)
    n, d = 20, 32
    names = formats_where(kernel="bf16")
    assert {"bf16", "fp16"} <= set(names)
    for name in names:
        f = get_format(name)
        k, v = (f.write(torch.randn(n, d, generator=g)).data.unsqueeze(1) for _ in range(2))  # [n, 1, d]
        q = torch.randn(1, 2, d, generator=g).to(k.dtype)
        slots, seq = torch.arange(n, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32)
        ref = decode_bf16_reference(q, k, v, slots, seq)
        out = decode_bf16(q.to(dev), k.to(dev), v.to(dev), slots.to(dev), seq.to(dev), block_n=16)
        torch.testing.assert_close(out.o.double().cpu(), ref.o, atol=2e-2, rtol=2e-2)


def test_int8_kernel_reads_its_formats() -> None:
    """The INT8 kernel subtracts the key dither, or (RTN-key mode, a pool side with ``dithered=False``) none: a
    dithered format naming it carries the dither's variance proxy, and a deterministic one's packed codes and scales,
    laid out as a pool, decode through the kernel as exact attention over the format's own read does (interpreter on
    CPU), with no certificate."""
    from kvlib.kernels.int8.decode import PoolSide, decode_int8

    names = formats_where(kernel="int8")
    assert {"dither-int8", "rtn-int8"} <= set(names)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(7)
    n, d = 24, 64
    for name in names:
        caps = capabilities(name)
        if not caps["deterministic"]:
            assert caps["variance_proxy"] == "dither", name
            continue
        f = get_format(name)
        pk, pv = (f.write(torch.randn(n, d, generator=g), **_ctx(n, 0, 0)) for _ in range(2))
        side = lambda p: PoolSide(p.codes.unsqueeze(1).to(dev), p.scales.unsqueeze(1).to(dev), group=p.group,  # noqa: E731
                                  dithered=False)
        q = torch.randn(1, 2, d, generator=g)
        slots, seq = torch.arange(n, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32)
        out = decode_int8(q.to(dev), side(pk), side(pv), slots.to(dev), seq.to(dev), layer=0, seed=0, cert=False,
                          fallback_to_reference=False)
        assert out.path in ("tc", "fma") and out.tv_bound is None, (name, out.path)
        kd, vd = f.read(pk).double(), f.read(pv).double()
        p = torch.softmax(q.double()[0] @ kd.T / math.sqrt(d), -1)
        torch.testing.assert_close(out.o.double().cpu()[0], p @ vd, atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------------------------
# make_cache and the byte account
@torch.no_grad()
def test_toy_through_make_cache(toy, tiny_model) -> None:
    model = tiny_model
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(4))
    # prefill="stored": the prompt attends over the stored 6-bit K/V (by default it attends over the float prompt)
    cache = kvlib.make_cache(TOY, model.config, prefill="stored")
    logits = model(ids, past_key_values=cache, use_cache=True).logits
    ref = model(ids).logits
    assert torch.isfinite(logits).all()
    assert not torch.equal(logits, ref)  # the cache holds 6-bit keys and values ...
    assert (logits - ref).abs().max() < 0.5 * ref.abs().max()  # ... close to the exact ones
    cache2 = kvlib.make_cache(TOY, model.config)
    out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, past_key_values=cache2)
    assert out.shape == (1, ids.shape[1] + 3)
    # no kernel family declared: the reference backend holds it, and every decode step says it took the reference
    assert type(cache2.backend).__name__ == "ReferenceBackend" and cache2.kernel_path(0) == "torch-reference"
    assert "kernel=None" in cache2.backend.supports((1, 4, 32), torch.device("cpu"))
    # the byte account of the cache is the class's: the toy's bytes per position x the positions its pages
    # hold (every allocated slot, K and V, all layers) + the page tables
    cfg = model.config
    f = get_format(TOY)
    st = cache2.backend
    positions = cfg.num_hidden_layers * st.n_slots * cfg.num_key_value_heads
    assert positions >= cfg.num_hidden_layers * cfg.num_key_value_heads * cache2.get_seq_length()
    tables = sum(la.table.nbytes() for la in cache2.layers)  # block tables, lengths (+ per-token slots)
    layout = 2 * positions * f.bytes_per_position(cfg.head_dim) + tables
    assert cache2.kv_nbytes() == layout


def test_toy_in_rollout_byte_account(toy) -> None:
    from kvlib.rollout.partial import KAPPA_BF16
    from kvlib.rollout.time_model import cache_format, roofline_attention

    cf = cache_format(TOY, d=128)
    assert cf.bits == 8 * (128 + 2 * 8) / 128 and cf.side_positions == 0
    assert cf.kappa() == KAPPA_BF16 * cf.bits / 16
    a = roofline_attention(TOY, bw_GBps=1000.0, d=128, kv_heads=8)
    assert float(a(1, 1000)) == pytest.approx(2 * 8 * 1000 * 144 / 1e12 * 1e3)


def test_grid_byte_account_reads_classes() -> None:
    from kvlib.bench import decode_grid as grid

    shape = grid.HeadShape(4, 2, 64)
    lengths = torch.tensor([10, 300])
    for method in grid.METHOD_FORMAT:
        f = grid.method_format(method)
        side = f.side_count(lengths)
        main = float((lengths - side).sum()) * f.bytes_per_position(64)
        side_b = float(side.sum()) * (f.fixed_bytes(64) / f.capacity if f.capacity else 0.0)
        assert grid.call_bytes(method, lengths, shape) == 2 * 2 * (main + side_b), method
    # known answers: dither-int8 G=32 is 68 B per position at d=64; KV4-RL (16 + 128) holds 10 and 144
    # positions in INT8 (66 B each: codes + fp16 scale), the other 156 in INT4 (36 B: nibbles + fp16 scale/offset)
    assert grid.call_bytes("int8_cert", lengths, shape) == 2 * 2 * 310 * 68
    assert grid.call_bytes("kv4rl", lengths, shape) == 2 * 2 * (156 * 36 + 154 * 66)
    with pytest.raises(ValueError, match="method must be one of"):
        grid.call_bytes("nope", lengths, shape)


# ------------------------------------------------------------------------------------------------
# the book's format table and the storage view
def test_toy_in_format_table(toy) -> None:
    rows = {r["format"]: r for r in format_table(d=64)}
    assert set(rows) == set(available_formats())
    t = rows[TOY]
    assert t["bytes_per_position"] == t["measured_bytes_per_position"] == 64 + 2 * 4
    assert t["bits_per_element"] == 9.0
    assert (t["stateful"], t["deterministic"], t["kernel"]) == (False, True, None)
    for name, r in rows.items():
        assert {k: r[k] for k in base.CAPABILITIES} == capabilities(name)
        if not r["capacity"]:  # side buffers: see test_declared_bytes_equal_measured
            assert r["measured_bytes_per_position"] == r["bytes_per_position"], name
    with pytest.raises(ValueError, match="d must be"):
        format_table(d=0)
    # (name, options) entries: a configured format, as the book's byte table lists them
    pairs = torch.tensor([0, 32, 1, 33])
    row, = format_table(d=64, names=[("dither-int8", {"outlier_channels": pairs})])
    assert row["options"] == {"outlier_channels": pairs}
    assert row["bytes_per_position"] == row["measured_bytes_per_position"] == 64 + 2 * 2 + 2 * 4
    with pytest.raises(TypeError, match="names"):
        format_table(names=[3])


@torch.no_grad()
def test_storage_view_of_every_view_format(toy, tiny_model) -> None:
    """Each format the fidelity probe views (the toy included) gives the same logits as its make_cache."""
    from kvlib.analysis.storage_probe import storage_view, view_formats

    model = tiny_model
    assert TOY in view_formats() and "kivi2" not in view_formats() and "dither-int8" not in view_formats()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(5))
    for name in view_formats():
        a = model(ids, past_key_values=kvlib.make_cache(name, model.config, prefill="stored"), use_cache=True).logits
        b = model(ids, past_key_values=storage_view(name)(model.config), use_cache=True).logits
        assert torch.allclose(a, b, rtol=0, atol=1e-5), name
