"""The certificate gate (kvlib.hf.gate) on the paged pools: same-step repair from the shadow, exactness,
soundness of the certificate, byte account, levels. Tiny random Llama models on CPU."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvlib.certify.bound import certificate_from_scores
from kvlib.certify.fallback import block_excess
from kvlib.formats.base import format_class, formats_where, get_format
from kvlib.hf.cache import make_cache
from kvlib.hf.gate import GATE_LEVELS, GatedCache, gate_kind, gateable_formats, make_gated_cache

GATED = ("dither-int8", "fp8-e4m3", "kivi2")
SHORT_KIVI = {"group": 4, "residual": 4}  # a 2-bit body within the 10-token prompt
D = 32
#: the tiny random model's dither certificates lie in [1.2e-3, 2.1e-3]: this tau gates part of them
TAU_DITHER = 0.0016


def _opts(fmt: str) -> dict:
    return dict(SHORT_KIVI) if fmt == "kivi2" else {}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=D, vocab_size=96, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, cache, steps: int = 3) -> torch.Tensor:
    """Logits ``[B, steps + 1, vocab]``: prefill, then ``steps`` decode steps feeding fixed tokens."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for t in range(steps):
        tok = torch.full((ids.shape[0], 1), 10 + 7 * t)
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


class Recorder:
    """Wraps gate_step: per call, the layer, query, the output before and after the gate, the new events."""

    def __init__(self, cache: GatedCache) -> None:
        self.cache, self.orig, self.log = cache, cache.gate_step, []
        cache.gate_step = self.hook

    def hook(self, layer, q, o, sm, kv=None):
        n_ev = len(self.cache.events)
        stored = [self.cache._stored(layer, b) for b in range(q.shape[0])]
        packed = copy.deepcopy([self.cache._key_heads(layer, b) for b in range(q.shape[0])])  # stateful: grows
        out = self.orig(layer, q, o, sm, kv)
        self.log.append(dict(layer=layer, q=q.clone(), before=o.clone(), after=out.clone(), sm=sm, stored=stored,
                             packed=packed, events=self.cache.events[n_ev:]))
        return out


def _shadow_kv(cache: GatedCache, layer, b: int, h: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shadow's K, V of the first ``n`` positions (the length at the recorded step)."""
    k, v, _ = cache._shadow_read(layer, b, h, torch.arange(n), torch.device("cpu"))
    return k.double(), v.double()


@pytest.mark.parametrize("fmt", GATED)
def test_tau_one_never_repairs_and_equals_raw(model, ids, fmt) -> None:
    gated = make_gated_cache(fmt, model.config, tau=1.0, **_opts(fmt))
    got = teacher_forced(model, ids, gated)
    want = teacher_forced(model, ids, make_cache(fmt, model.config, block_size=32, **_opts(fmt)))
    s = gated.gate_summary()
    assert s["heads_repaired"] == 0 and s["bytes_moved"] == 0 and s["flagged"] == 0
    assert s["n_certs"] == 3 * model.config.num_hidden_layers * model.config.num_attention_heads  # decode steps
    assert torch.equal(got, want)


@pytest.mark.parametrize("level", GATE_LEVELS)
@pytest.mark.parametrize("fmt", GATED)
def test_tau_zero_repairs_every_head_and_equals_the_float_cache(model, ids, fmt, level) -> None:
    gated = make_gated_cache(fmt, model.config, tau=0.0, level=level, block_size=4, shadow_dtype=torch.float32,
                             **_opts(fmt))
    got = teacher_forced(model, ids, gated)
    want = teacher_forced(model, ids, make_cache("fp32", model.config))
    raw = teacher_forced(model, ids, make_cache(fmt, model.config, **_opts(fmt)))
    s = gated.gate_summary()
    cfg = model.config
    assert s["heads_repaired"] == s["heads_total"] == cfg.num_hidden_layers * cfg.num_key_value_heads
    assert s["flagged"] == 1 and s["repair_events"] == 3 * s["heads_total"]  # every head, every decode step
    # every row recomputed from the exact (fp32) shadow: the float cache's logits up to fp32 summation order
    assert float((got - want).abs().max()) <= 1e-5 < float((raw - want).abs().max())
    # each step reads every position of every head once: sum over steps of 2 n d 4 bytes per head
    n0 = ids.shape[1]
    per_head = sum(2 * (n0 + t + 1) * D * 4 for t in range(3))
    assert s["bytes_moved"] == s["heads_total"] * per_head == sum(e["bytes"] for e in gated.events)
    if level == "block":
        assert s["positions_paged"] * 2 * D * 4 == s["bytes_moved"] == s["bytes_whole_head"]


@pytest.mark.parametrize("shadow_dtype", [torch.float16, torch.bfloat16])
def test_repaired_rows_are_exact_attention_over_the_shadow_and_others_untouched(model, ids, shadow_dtype) -> None:
    gated = make_gated_cache("dither-int8", model.config, tau=TAU_DITHER, shadow_dtype=shadow_dtype)
    rec = Recorder(gated)
    teacher_forced(model, ids, gated, steps=3)
    g = gated.n_heads // gated.n_kv
    repaired = 0
    for entry in rec.log:
        done = torch.zeros(entry["q"].shape[:2], dtype=torch.bool)
        for e in entry["events"]:
            b, h = e["row"], e["kv_head"]
            rows = slice(h * g, (h + 1) * g)
            k, v = _shadow_kv(gated, entry["layer"], b, h, e["tokens"])
            want = torch.softmax(entry["sm"] * entry["q"][b, rows].double() @ k.T, -1) @ v
            assert torch.allclose(entry["after"][b, rows].double(), want, atol=1e-5, rtol=1e-5)
            assert e["bytes"] == 2 * e["tokens"] * D * torch.empty((), dtype=shadow_dtype).element_size()
            done[b, rows] = True
            repaired += 1
        assert torch.equal(entry["after"][~done], entry["before"][~done])  # rows under tau keep the kernel's
    s = gated.gate_summary()
    assert 0 < repaired == s["repair_events"] < 3 * s["heads_total"]  # a partial gate at this tau
    assert all(e["cert"] > TAU_DITHER for e in gated.events)


@pytest.mark.parametrize("fmt", ["fp8-e4m3", "kivi2", "rtn-int8", "dither-int8"])
def test_certificate_is_sound_against_the_exact_keys(model, ids, fmt) -> None:
    """TV between the stored and the exact (fp32 shadow) attention distributions never exceeds the gate's
    certificate (with probability one for the deterministic formats; at delta_loc for dither)."""
    gated = make_gated_cache(fmt, model.config, tau=1.0, shadow_dtype=torch.float32, **_opts(fmt))
    certs = []
    orig = gated._step_certificate

    def keep(layer, q, sm, kv=None):
        c = orig(layer, q, sm, kv)
        certs.append((layer, q.clone(), sm, c.clone(), [gated._stored(layer, b)[0] for b in range(q.shape[0])]))
        return c

    gated._step_certificate = keep
    teacher_forced(model, ids, gated, steps=3)
    g = gated.n_heads // gated.n_kv
    assert len(certs) == 3 * gated.n_layers
    for layer, q, sm, c, stored in certs:
        for h in range(gated.n_kv):
            k, _ = _shadow_kv(gated, layer, 0, h, stored[0].shape[1])
            qh = q[0, h * g:(h + 1) * g].double()
            p = torch.softmax(sm * qh @ k.T, -1)
            p_hat = torch.softmax(sm * qh @ stored[0][h].T, -1)
            tv = 0.5 * (p - p_hat).abs().sum(-1)
            assert bool((tv <= c[0, h * g:(h + 1) * g]).all()), (tv, c)


def test_bytes_moved_counted_from_tensors(model, ids) -> None:
    moved = {}
    for dtype in (torch.float32, torch.float16):
        gated = make_gated_cache("dither-int8", model.config, tau=0.0, shadow_dtype=dtype)
        teacher_forced(model, ids, gated, steps=1)
        n = ids.shape[1] + 1
        expect = gated.n_layers * gated.n_kv * 2 * n * D * torch.empty((), dtype=dtype).element_size()
        assert gated.bytes_moved == expect == sum(e["bytes"] for e in gated.events)
        assert all(e["tokens"] == n for e in gated.events)
        moved[dtype] = gated.bytes_moved
        elt = torch.empty((), dtype=dtype).element_size()
        assert gated.shadow_nbytes() >= 2 * gated.n_layers * n * gated.n_kv * D * elt
    assert moved[torch.float32] == 2 * moved[torch.float16]


def test_host_shadow_gives_the_same_repair(model, ids) -> None:
    a = make_gated_cache("dither-int8", model.config, tau=TAU_DITHER, shadow="host")
    b = make_gated_cache("dither-int8", model.config, tau=TAU_DITHER, shadow="device")
    assert torch.equal(teacher_forced(model, ids, a), teacher_forced(model, ids, b))
    assert a._sh[0][0].device.type == "cpu"
    assert a.gate_summary()["bytes_moved"] == b.gate_summary()["bytes_moved"] > 0



def test_staged_host_shadow_writes_reach_the_shadow_before_a_repair(model, ids) -> None:
    """A host shadow of a GPU cache stages decode writes on the device; forced here on CPU, with a short stage."""
    staged = make_gated_cache("dither-int8", model.config, tau=TAU_DITHER, shadow="host")
    staged._stage_writes = lambda k: True
    staged.STAGE_STEPS = 2
    plain = make_gated_cache("dither-int8", model.config, tau=TAU_DITHER, shadow="host")
    assert torch.equal(teacher_forced(model, ids, staged, steps=5), teacher_forced(model, ids, plain, steps=5))
    assert staged.gate_summary()["repair_events"] == plain.gate_summary()["repair_events"] > 0
    for i in range(staged.n_layers):
        for side in (0, 1):
            assert torch.equal(staged._sh[i][side], plain._sh[i][side])


def test_flag_only_mode_equals_raw(model, ids) -> None:
    gated = make_gated_cache("dither-int8", model.config, tau=0.0, gate=False)
    got = teacher_forced(model, ids, gated, steps=1)
    assert torch.equal(got, teacher_forced(model, ids, make_cache("dither-int8", model.config, block_size=32), steps=1))
    s = gated.gate_summary()
    assert s["flagged"] == 1 and s["heads_repaired"] == 0 and s["bytes_moved"] == 0


def test_gate_kinds_come_from_the_format_classes() -> None:
    assert set(formats_where(bounded=True)) <= set(gateable_formats())
    for name in gateable_formats():
        cls = format_class(name)
        assert gate_kind(name) == (cls.variance_proxy or "deterministic")
        assert cls.variance_proxy or cls.bounded


@pytest.mark.parametrize("fmt", formats_where(bounded=True))
def test_deterministic_error_bound_holds(fmt) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g) * torch.logspace(-3, 2, 64)  # channel magnitudes over 5 decades
    x[::17] *= 30.0
    f = get_format(fmt)
    packed = f.write(x, side=0)
    k_hat = f.read(packed)
    err = f.error_bound(packed, k_hat)
    assert err.shape == x.shape
    assert bool(((k_hat.double() - x.double()).abs() <= err).all())


def test_bad_arguments(model) -> None:
    cfg = model.config
    with pytest.raises(ValueError, match="gateable"):
        gate_kind("kv4")
    with pytest.raises(ValueError, match="tau"):
        make_gated_cache("dither-int8", cfg, tau=-1.0)
    with pytest.raises(TypeError, match="telemetry"):
        make_gated_cache("dither-int8", cfg, telemetry=True)
    with pytest.raises(TypeError, match="shadow_dtype"):
        make_gated_cache("dither-int8", cfg, shadow_dtype="fp16")
    with pytest.raises(ValueError, match="shadow_dtype"):
        make_gated_cache("dither-int8", cfg, shadow_dtype=torch.int8)
    with pytest.raises(ValueError, match="shadow"):
        make_gated_cache("dither-int8", cfg, shadow="disk")
    with pytest.raises(TypeError, match="backup_dtype"):
        make_gated_cache("dither-int8", cfg, backup_dtype=torch.float16)
    with pytest.raises(ValueError, match="level"):
        make_gated_cache("kivi2", cfg, level="token")
    with pytest.raises(ValueError, match="block_size"):
        make_gated_cache("kivi2", cfg, level="block", block_size=0)
    with pytest.raises(ValueError, match="prefill"):
        make_gated_cache("dither-int8", cfg, prefill="stored")
    assert isinstance(make_gated_cache("fp8-e4m3", cfg), GatedCache)


# ----------------------------------------------------------------------------- block-level gate
@pytest.mark.parametrize(("fmt", "tau"), [("dither-int8", TAU_DITHER), ("kivi2", 0.06), ("fp8-e4m3", 0.012)])
def test_block_gate_order_stop_and_certificate_after_repair(model, ids, fmt, tau) -> None:
    bs = 2
    gated = make_gated_cache(fmt, model.config, tau=tau, level="block", block_size=bs, **_opts(fmt))
    rec = Recorder(gated)
    teacher_forced(model, ids, gated, steps=3)
    g = gated.n_heads // gated.n_kv
    elt = 2  # fp16 shadow
    n_events = checked = 0
    for entry in rec.log:
        layer, sm = entry["layer"], entry["sm"]
        for e in entry["events"]:
            n_events += 1
            b, h, n = e["row"], e["kv_head"], e["tokens"]
            qg = entry["q"][b, h * g:(h + 1) * g].double()
            k_hat, v_hat = (t[h] for t in entry["stored"][b])
            z = sm * qg @ k_hat.T
            u = gated._radius(entry["packed"][b][h], k_hat, qg, sm)
            cert = certificate_from_scores(z, u).tv_bound_one.nan_to_num(nan=1.0).clamp(max=1.0)
            over = (cert > tau).nonzero().squeeze(-1).tolist()
            if not over:  # triggered by the kernel's certificate, which can be a little looser than torch's
                continue
            exc = sum(block_excess(z[i], u[i], bs) for i in over)
            prio = [float(exc[j]) for j in e["blocks"]]
            assert prio == sorted(prio, reverse=True)  # paged by decreasing priority
            rest = [float(exc[j]) for j in range(len(exc)) if j not in e["blocks"]]
            assert not rest or min(prio, default=math.inf) >= max(rest)  # no skipped block ranks higher
            traj = e["trajectory"]
            assert len(traj) == len(e["blocks"]) + 1 and all(t > tau for t in traj[:-1])
            assert traj[-1] <= tau or len(e["blocks"]) == len(exc)  # certificate met, or every block paged
            # independent recomputation of the final state: paged positions from the shadow, rest stored
            k_s, v_s = _shadow_kv(gated, layer, b, h, n)
            paged = torch.zeros(n, dtype=torch.bool)
            for j in e["blocks"]:
                paged[j * bs:(j + 1) * bs] = True
            k_mix = torch.where(paged[:, None], k_s, k_hat)
            v_mix = torch.where(paged[:, None], v_s, v_hat)
            z_mix = sm * qg @ k_mix.T
            u_mix = torch.where(paged, sm * (D + 2) * 2.0**-24 * (qg.abs() @ k_mix.abs().T), u)
            c_mix = certificate_from_scores(z_mix, u_mix).tv_bound_one.nan_to_num(nan=1.0).clamp(max=1.0)
            assert float(c_mix.max()) == pytest.approx(traj[-1], rel=1e-9, abs=1e-12)
            want = torch.softmax(z_mix, -1) @ v_mix
            assert torch.allclose(entry["after"][b, h * g:(h + 1) * g].double(), want, atol=1e-5, rtol=1e-5)
            assert e["bytes"] == int(paged.sum()) * 2 * D * elt == e["positions"] * 2 * D * elt
            assert e["bytes"] <= e["bytes_whole_head"] == n * 2 * D * elt
            checked += 1
    assert n_events == len(gated.events) > 0 and checked >= n_events // 2


@pytest.mark.parametrize("level", GATE_LEVELS)
def test_row_summaries_add_up_and_rows_are_independent(model, ids, level) -> None:
    two = torch.cat([ids, ids.flip(-1)])  # two requests in one batch
    gated = make_gated_cache("dither-int8", model.config, tau=TAU_DITHER, level=level, block_size=2)
    teacher_forced(model, two, gated, steps=2)
    rows = gated.row_summaries()
    s = gated.gate_summary()
    assert len(rows) == 2
    for key in ("bytes_moved", "bytes_whole_head", "blocks_paged", "positions_paged", "n_over"):
        assert sum(r[key] for r in rows) == s[key]
    assert sum(r["repair_events"] for r in rows) == len(gated.events)
    for r in rows:
        assert r["flagged"] == int(r["n_over"] > 0) == int(r["repair_events"] > 0)
    assert max(r["max_cert"] for r in rows) == pytest.approx(s["max_cert"])
    alone = make_gated_cache("dither-int8", model.config, tau=TAU_DITHER, level=level, block_size=2)
    teacher_forced(model, ids, alone, steps=2)
    assert alone.row_summaries()[0]["flagged"] == rows[0]["flagged"]
    assert alone.row_summaries()[0]["bytes_moved"] == rows[0]["bytes_moved"]


@torch.no_grad()
def test_kernel_path_takes_the_kernels_certificate(model, ids) -> None:
    """Under the Triton interpreter the INT8 decode kernel runs; the gate repairs from its certificate."""
    gated = make_gated_cache("dither-int8", model.config, tau=0.0, shadow_dtype=torch.float32)
    gated._ensure_store(torch.zeros(1, gated.n_kv, 1, D))
    gated.store.interpret = True
    got = teacher_forced(model, ids, gated, steps=2)
    assert gated.kernel_path(1).startswith("int8-"), gated.kernel_path(1)
    want = teacher_forced(model, ids, make_cache("fp32", model.config), steps=2)
    assert float((got - want).abs().max()) <= 1e-5
    assert gated.gate_summary()["n_certs"] == int(gated.certificates().numel())


def test_static_pools_gate_like_growing_ones(model, ids) -> None:
    """Static pools (batch_size/max_len): certificates from the by-position buffer, the same repairs."""
    grow = make_gated_cache("dither-int8", model.config, tau=TAU_DITHER)
    static = make_gated_cache("dither-int8", model.config, tau=TAU_DITHER, batch_size=1, max_len=32, device="cpu")
    assert torch.equal(teacher_forced(model, ids, grow), teacher_forced(model, ids, static))
    a, b = grow.gate_summary(), static.gate_summary()
    assert a["repair_events"] == b["repair_events"] > 0 and a["bytes_moved"] == b["bytes_moved"]
    assert a["n_certs"] == b["n_certs"]
