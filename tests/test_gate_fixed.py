"""The fixed-shape (CUDA-graph capturable) repair path of the gate, ``max_repairs_per_step=k``, on CPU: equal to
the eager path when the over-threshold groups fit the budget; beyond it, the top-k groups by certificate repaired
exactly, the others left as the kernel gave them and counted; bytes from the fixed gather's shape."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvlib.gate import GatedCache, make_gated_cache
from kvlib.hf.cache import make_cache

D = 32
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel test's device: on CPU under TRITON_INTERPRET=1
DK = 64 if torch.cuda.is_available() else D  # its head dim: the GPU lane's smallest on CUDA, the small one on CPU
#: thresholds that gate part of the tiny model's (row, KV head) groups on these two prompts: at most 3 of the 4 in
#: any (layer, step), none in some (measured: group certificates 0.0014-0.0021 dither-int8, 0.011-0.018 fp8-e4m3,
#: 0.046-0.095 kivi2, 0.0020-0.0031 rtn-int8)
PARTIAL_TAU = {"dither-int8": 0.00175, "fp8-e4m3": 0.0142, "kivi2": 0.076, "rtn-int8": 0.0025}
SHORT_KIVI = {"group": 4, "residual": 4}


def _opts(fmt: str) -> dict:
    return dict(SHORT_KIVI) if fmt == "kivi2" else {}


def _model(d: int = D) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=d, vocab_size=96, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 96, (2, 10), generator=g)  # two requests: four (row, KV head) groups per layer


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, cache, steps: int = 3) -> torch.Tensor:
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for t in range(steps):
        step = torch.full((ids.shape[0], 1), 10 + 7 * t, device=ids.device)
        out = model(input_ids=step, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def _over_per_step(cache: GatedCache) -> int:
    """Most groups the eager path repaired in one (layer, step)."""
    return max(Counter((e["layer"], e["step"]) for e in cache.events).values())


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("fmt", list(PARTIAL_TAU))
def test_fixed_path_equals_the_eager_path_when_repairs_fit(model, ids, fmt, static) -> None:
    if static and fmt == "kivi2":
        pytest.skip("kivi2 keeps an unpaged store: no static pools")
    extra = dict(batch_size=2, max_len=24, device="cpu") if static else {}
    tau = PARTIAL_TAU[fmt]
    eager = make_gated_cache(fmt, model.config, tau=tau, **extra, **_opts(fmt))
    want = teacher_forced(model, ids, eager)
    k = _over_per_step(eager)
    groups = ids.shape[0] * eager.n_kv
    assert 1 <= k < groups, "test setup: a budget below the number of groups"
    fixed = make_gated_cache(fmt, model.config, tau=tau, max_repairs_per_step=k, **extra, **_opts(fmt))
    got = teacher_forced(model, ids, fixed)
    assert torch.equal(got, want), float((got - want).abs().max())
    a, b = eager.gate_summary(), fixed.gate_summary()
    assert b["repair_path"] == "fixed" and b["unrepaired"] == 0 == a["unrepaired"]
    for key in ("n_certs", "n_over", "repair_events", "heads_repaired", "steps"):
        assert a[key] == b[key], key
    assert 0 < a["repair_events"] < 3 * a["heads_total"]  # a partial gate
    # both read each repaired head's positions; the fixed shape's other loads are redirected, and counted apart
    assert b["bytes_moved"] == b["bytes_whole_head"] == a["bytes_moved"] == a["bytes_whole_head"] > 0
    assert b["bytes_padding"] > 0 == a["bytes_padding"]
    assert b["bytes_moved"] == sum(r["bytes_moved"] for r in fixed.row_summaries())
    for ra, rb in zip(eager.row_summaries(), fixed.row_summaries()):
        for key in ("n_over", "repair_events", "heads_repaired", "bytes_whole_head", "flagged"):
            assert ra[key] == rb[key], key


def test_tau_zero_fixed_path_equals_the_float_cache(model, ids) -> None:
    fixed = make_gated_cache("dither-int8", model.config, tau=0.0, shadow_dtype=torch.float32,
                             max_repairs_per_step=4)
    got = teacher_forced(model, ids, fixed)
    want = teacher_forced(model, ids, make_cache("fp32", model.config))
    assert float((got - want).abs().max()) <= 1e-5
    s = fixed.gate_summary()
    assert s["heads_repaired"] == s["heads_total"] and s["repair_events"] == 3 * s["heads_total"]
    assert s["unrepaired"] == 0


class Recorder:
    def __init__(self, cache: GatedCache) -> None:
        self.cache, self.orig, self.orig_cert, self.log = cache, cache.on_step, cache._step_certificate, []
        cache.on_step, cache._step_certificate = self.hook, self.cert

    def cert(self, layer, q, sm, kv=None):
        self.last = self.orig_cert(layer, q, sm, kv)
        return self.last

    def hook(self, layer, q, o, sm, kv=None):
        out = self.orig(layer, q, o, sm, kv)
        self.log.append(dict(layer=layer, q=q.clone(), before=o.clone(), after=out.clone(), sm=sm,
                             cert=self.last.clone(), lens=list(layer.table.lens)))
        return out


def test_budget_overflow_repairs_the_worst_groups_and_counts_the_rest(model, ids) -> None:
    steps, k = 3, 1
    cache = make_gated_cache("dither-int8", model.config, tau=0.0, max_repairs_per_step=k, batch_size=2, max_len=24,
                             device="cpu")
    rec = Recorder(cache)
    teacher_forced(model, ids, cache, steps=steps)
    g, n_kv = cache.n_heads // cache.n_kv, cache.n_kv
    groups = ids.shape[0] * n_kv
    assert len(rec.log) == steps * cache.n_layers
    for e in rec.log:
        gc = e["cert"].view(-1, n_kv, g).amax(-1).reshape(-1)
        worst = int(gc.argmax())
        b, h = divmod(worst, n_kv)
        rows = slice(h * g, (h + 1) * g)
        sk, sv = cache._sh[e["layer"].layer_idx]
        sl = e["layer"].table.slot_table()[b, :e["lens"][b]].long()
        kk, vv = sk[sl, h].double(), sv[sl, h].double()
        exact = torch.softmax(e["sm"] * e["q"][b, rows].double() @ kk.T, -1) @ vv
        assert torch.allclose(e["after"][b, rows].double(), exact, atol=1e-5, rtol=1e-5)  # the worst group: exact
        assert not torch.allclose(e["before"][b, rows].double(), exact, atol=1e-7, rtol=0)  # (and it changed)
        done = torch.zeros(e["q"].shape[:2], dtype=torch.bool)
        done[b, rows] = True
        assert torch.equal(e["after"][~done], e["before"][~done])  # the others: the kernel's output, untouched
    with pytest.warns(RuntimeWarning, match="not repaired"):
        s = cache.gate_summary()
    n = steps * cache.n_layers
    assert s["repair_events"] == n * k and s["unrepaired"] == n * (groups - k) and s["n_over"] == s["n_certs"]
    rows = cache.row_summaries()
    assert sum(r["unrepaired"] for r in rows) == s["unrepaired"] and sum(r["repair_events"] for r in rows) == n * k
    # the repaired head's positions move (fp16 shadow); the fixed shape's other loads (of max_len=24 per budget
    # slot) are redirected and counted as padding
    moved = sum(2 * D * 2 * e["lens"][int(e["cert"].view(-1, n_kv, g).amax(-1).reshape(-1).argmax()) // n_kv]
                for e in rec.log)
    assert s["bytes_moved"] == s["bytes_whole_head"] == moved
    assert s["bytes_moved"] + s["bytes_padding"] == n * k * 24 * 2 * D * 2


def test_idle_budget_is_padding(model, ids) -> None:
    """No group over tau: the budget's loads are all redirected (padding), nothing is moved."""
    cache = make_gated_cache("dither-int8", model.config, tau=1.0, max_repairs_per_step=3, batch_size=2, max_len=24,
                             device="cpu")
    teacher_forced(model, ids, cache, steps=2)
    s = cache.gate_summary()
    assert s["repair_events"] == 0 == s["bytes_moved"]
    assert s["bytes_padding"] == 2 * cache.n_layers * 3 * 24 * 2 * D * 2


def test_flag_only_counts_every_over_group_unrepaired(model, ids) -> None:
    cache = make_gated_cache("dither-int8", model.config, tau=0.0, gate=False)
    teacher_forced(model, ids, cache, steps=1)
    s = cache.gate_summary()  # gate=False repairs nothing by request: no warning
    assert s["unrepaired"] == cache.n_layers * ids.shape[0] * cache.n_kv and s["repair_events"] == 0


@torch.no_grad()
def test_fixed_path_on_the_kernel_with_static_pools(ids) -> None:
    """The INT8 decode kernel (on CUDA, else under the Triton interpreter) on static pools: the capturable
    configuration."""
    model, ids = _model(DK).to(DEV), ids.to(DEV)
    cache = make_gated_cache("dither-int8", model.config, tau=0.0, shadow_dtype=torch.float32, max_repairs_per_step=4,
                             batch_size=2, max_len=16, device=DEV)
    cache._ensure_backend(torch.zeros(2, cache.n_kv, 1, DK, device=DEV))
    cache.backend.interpret = True
    got = teacher_forced(model, ids, cache, steps=2)
    assert cache.kernel_path(1).startswith("int8-"), cache.kernel_path(1)
    want = teacher_forced(model, ids, make_cache("fp32", model.config), steps=2)
    assert float((got - want).abs().max()) <= 1e-5
    s = cache.gate_summary()
    assert s["repair_events"] == 2 * s["heads_total"] and s["unrepaired"] == 0


def test_capture_needs_the_fixed_path_on_static_kernel_pools(model, ids) -> None:
    """What a CUDA-graph capture checks (called directly here: no capture on the CPU)."""
    eager = make_gated_cache("dither-int8", model.config, tau=0.1)
    teacher_forced(model, ids, eager, steps=1)
    q = torch.zeros(2, eager.n_heads, D)
    with pytest.raises(RuntimeError, match="max_repairs_per_step"):
        eager._check_capturable(eager.layers[0], q)
    growing = make_gated_cache("dither-int8", model.config, tau=0.1, max_repairs_per_step=2)
    teacher_forced(model, ids, growing, steps=1)
    with pytest.raises(RuntimeError, match="batch_size"):
        growing._check_capturable(growing.layers[0], q)
    fp8 = make_gated_cache("fp8-e4m3", model.config, tau=0.1, max_repairs_per_step=2, batch_size=2, max_len=24,
                           device="cpu")
    teacher_forced(model, ids, fp8, steps=1)
    with pytest.raises(RuntimeError, match="dither-int8"):
        fp8._check_capturable(fp8.layers[0], q)
    static = make_gated_cache("dither-int8", model.config, tau=0.1, max_repairs_per_step=2, batch_size=2, max_len=24,
                              device="cpu")
    teacher_forced(model, ids, static, steps=1)
    static._check_capturable(static.layers[0], q)  # the capturable configuration passes


def test_bad_budget_arguments(model) -> None:
    cfg = model.config
    with pytest.raises(ValueError, match="max_repairs_per_step"):
        make_gated_cache("dither-int8", cfg, max_repairs_per_step=0)
    for bad in (1.5, True, "4"):
        with pytest.raises(TypeError, match="max_repairs_per_step"):
            make_gated_cache("dither-int8", cfg, max_repairs_per_step=bad)
    with pytest.raises(ValueError, match="level"):
        make_gated_cache("dither-int8", cfg, max_repairs_per_step=2, level="block")
    with pytest.raises(ValueError, match="shadow='device'"):
        make_gated_cache("dither-int8", cfg, max_repairs_per_step=2, shadow="host")
