"""The certificate gate (kvlib.hf.gate): repair semantics, exactness, byte account, deterministic bounds."""

from __future__ import annotations

import pytest
import torch

from kvlib.certify.fallback import block_excess
from kvlib.formats.base import get_format
from kvlib.hf import model as kvmodel
from kvlib.hf.cache import make_cache
from kvlib.hf.gate import DETERMINISTIC_FORMATS, GatedCache, gate_kind, key_error_bound, make_gated_cache

PROMPT = "The river ran past the old mill, and the miller's daughter counted the boats."
GATED = ("dither-int8", "fp8-e4m3", "kivi2")


@pytest.fixture(scope="module")
def small(smol):
    return kvmodel.truncated_model(smol[0], 3)


@pytest.fixture(scope="module")
def ids(smol):
    return smol[1](PROMPT, return_tensors="pt").input_ids[:, :10]


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, cache, steps: int = 3) -> torch.Tensor:
    """Logits ``[steps + 1, vocab]``: prefill, then ``steps`` decode steps feeding fixed tokens."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[0, -1]]
    for t in range(steps):
        tok = torch.tensor([[100 + 7 * t]])
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1])
    return torch.stack(logits)


@pytest.mark.parametrize("fmt", GATED)
def test_tau_one_never_repairs_and_equals_raw(small, ids, fmt) -> None:
    gated = make_gated_cache(fmt, small.config, tau=1.0)
    got = teacher_forced(small, ids, gated)
    want = teacher_forced(small, ids, make_cache(fmt, small.config))
    s = gated.gate_summary()
    assert s["heads_repaired"] == 0 and s["bytes_moved"] == 0 and s["flagged"] == 0
    assert s["n_certs"] == 4 * small.config.num_hidden_layers * small.config.num_attention_heads
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", GATED)
def test_tau_zero_repairs_every_head_and_equals_exact(small, ids, fmt) -> None:
    gated = make_gated_cache(fmt, small.config, tau=0.0)
    got = teacher_forced(small, ids, gated)
    want = teacher_forced(small, ids, make_cache("fp32", small.config))
    s = gated.gate_summary()
    assert s["heads_repaired"] == s["heads_total"] == small.config.num_hidden_layers * small.config.num_key_value_heads
    assert s["flagged"] == 1
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["dither-int8", "kivi2"])  # stateless and stateful float stores
def test_repairs_written_back_once(small, ids, fmt) -> None:
    gated = make_gated_cache(fmt, small.config, tau=0.0)
    teacher_forced(small, ids, gated, steps=1)
    bytes_after_prefill = gated.bytes_moved
    teacher_forced_more = [torch.tensor([[42]]), torch.tensor([[43]])]
    with torch.no_grad():
        for tok in teacher_forced_more:
            small(input_ids=tok, past_key_values=gated, use_cache=True)
    keys = [(e["layer"], e["row"], e["kv_head"]) for e in gated.events]
    assert len(keys) == len(set(keys))  # each head paged in once
    assert all(e["step"] == 1 for e in gated.events)  # all at prefill (tau = 0)
    assert gated.bytes_moved == bytes_after_prefill  # later steps move nothing
    for i, layer in enumerate(gated.layers):  # the attention's store holds the exact copy
        n = layer.cumulative_length
        assert torch.equal(layer.keys[:, :, :n], gated._exact[i][0][:, :, :n].to(layer.keys.dtype))
        assert torch.equal(layer.values[:, :, :n], gated._exact[i][1][:, :, :n].to(layer.values.dtype))


def test_bytes_moved_counted_from_tensors(small, ids) -> None:
    cfg = small.config
    d = cfg.hidden_size // cfg.num_attention_heads
    for dtype, size in ((None, 4), (torch.float16, 2)):
        gated = make_gated_cache("dither-int8", cfg, tau=0.0, backup_dtype=dtype)
        teacher_forced(small, ids, gated, steps=1)
        n = ids.shape[1]
        expect = cfg.num_hidden_layers * cfg.num_key_value_heads * 2 * n * d * size
        assert gated.bytes_moved == expect == sum(e["bytes"] for e in gated.events)
        assert all(e["tokens"] == n for e in gated.events)


def test_partial_gate_repairs_only_flagged_heads(small, ids) -> None:
    gated = make_gated_cache("dither-int8", small.config, tau=0.2)
    teacher_forced(small, ids, gated, steps=2)
    s = gated.gate_summary()
    assert all(e["cert"] > 0.2 for e in gated.events)
    assert s["heads_repaired"] == len(gated.events) <= s["heads_total"]
    assert (s["flagged"] == 1) == (s["n_over"] > 0) == (s["heads_repaired"] > 0)


def test_flag_only_mode_equals_raw(small, ids) -> None:
    gated = make_gated_cache("dither-int8", small.config, tau=0.0, gate=False)
    got = teacher_forced(small, ids, gated, steps=1)
    assert torch.equal(got, teacher_forced(small, ids, make_cache("dither-int8", small.config), steps=1))
    s = gated.gate_summary()
    assert s["flagged"] == 1 and s["heads_repaired"] == 0 and s["bytes_moved"] == 0


@pytest.mark.parametrize("fmt", DETERMINISTIC_FORMATS)
def test_deterministic_error_bound_holds(fmt) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g) * torch.logspace(-3, 2, 64)  # channel magnitudes over 5 decades
    x[::17] *= 30.0
    f = get_format(fmt)
    packed = f.write(x, side=0) if fmt == "kivi2" else f.write(x)
    k_hat = f.read(packed)
    err = key_error_bound(fmt, packed, k_hat)
    assert err.shape == x.shape
    assert bool(((k_hat.double() - x.double()).abs() <= err).all())


def test_bad_arguments(small) -> None:
    with pytest.raises(ValueError, match="gateable"):
        gate_kind("kv4")
    with pytest.raises(ValueError, match="tau"):
        make_gated_cache("dither-int8", small.config, tau=-1.0)
    with pytest.raises(ValueError, match="telemetry"):
        make_gated_cache("dither-int8", small.config, telemetry=True)
    with pytest.raises(TypeError, match="backup_dtype"):
        make_gated_cache("dither-int8", small.config, backup_dtype="fp16")
    with pytest.raises(TypeError, match="cache_class"):
        make_cache("fp32", small.config, cache_class=3)
    assert isinstance(make_gated_cache("fp8-e4m3", small.config), GatedCache)


# ----------------------------------------------------------------------------- block-level gate
SHORT_KIVI = {"group": 4, "residual": 4}  # a 2-bit body within the 10-token test prompt


class Recorder:
    """Wraps a block-level gate's hook: the state before and after every gate call, per layer."""

    def __init__(self, cache: GatedCache) -> None:
        self.cache, self.orig, self.log = cache, cache.observe_query, []
        cache.observe_query = self.hook

    def hook(self, layer_idx: int, query: torch.Tensor) -> None:
        c = self.cache
        q = query[:, :, -1, :]
        pre = [c.scores_and_radius(layer_idx, b, q[b]) for b in range(q.shape[0])]
        cert = c.certify(layer_idx, q)
        mask = c._exact_pos[layer_idx].clone()
        n_ev = len(c.events)
        self.orig(layer_idx, query)
        self.log.append(dict(layer=layer_idx, pre=pre, cert=cert, mask=mask, post=c.certify(layer_idx, q),
                             events=c.events[n_ev:]))


@pytest.mark.parametrize("fmt", ["dither-int8", "kivi2"])
def test_block_gate_tau_zero_pages_every_block_and_equals_exact(small, ids, fmt) -> None:
    opts = SHORT_KIVI if fmt == "kivi2" else {}
    gated = make_gated_cache(fmt, small.config, tau=0.0, level="block", block_size=4, **opts)
    got = teacher_forced(small, ids, gated)
    assert torch.equal(got, teacher_forced(small, ids, make_cache("fp32", small.config)))
    for i in range(len(gated.layers)):
        assert bool(gated.exact_positions(i).all())
    s = gated.gate_summary()
    n = gated.get_seq_length()
    per_pos = 2 * gated.head_dim * 4
    assert s["positions_paged"] == len(gated.layers) * gated.n_kv * n  # each position moved exactly once
    assert s["bytes_moved"] == s["positions_paged"] * per_pos == sum(e["bytes"] for e in gated.events)
    assert s["bytes_whole_head"] >= s["bytes_moved"] * ids.shape[1] / n


@pytest.mark.parametrize(("fmt", "tau", "opts"), [("dither-int8", 0.2, {}), ("kivi2", 0.2, SHORT_KIVI),
                                                  ("kivi2", 0.6, SHORT_KIVI)])
def test_block_gate_order_stop_and_certificate_after_repair(small, ids, fmt, tau, opts) -> None:
    bs = 2
    gated = make_gated_cache(fmt, small.config, tau=tau, level="block", block_size=bs, **opts)
    rec = Recorder(gated)
    teacher_forced(small, ids, gated, steps=2)
    g = gated.n_heads // gated.n_kv
    n_events = 0
    for entry in rec.log:
        for e in entry["events"]:
            n_events += 1
            b, h = e["row"], e["kv_head"]
            z, u = (t[h] for t in entry["pre"][b])
            eff = entry["cert"][b, h * g:(h + 1) * g].nan_to_num(nan=1.0).clamp(max=1.0)
            over = (eff > tau).nonzero().squeeze(-1).tolist()
            assert over and e["cert"] == pytest.approx(float(eff.max()))
            exc = sum(block_excess(z[i], u[i], bs) for i in over)
            n = e["tokens"]
            open_blocks = sorted({p // bs for p in range(n) if not bool(entry["mask"][b, h, p])})
            prio = [float(exc[j]) for j in e["blocks"]]
            assert prio == sorted(prio, reverse=True)  # paged by decreasing priority
            rest = [float(exc[j]) for j in open_blocks if j not in e["blocks"]]
            assert not rest or min(prio, default=float("inf")) >= max(rest)  # and no skipped block ranks higher
            traj = e["trajectory"]
            assert len(traj) == len(e["blocks"]) + 1 and all(t > tau for t in traj[:-1])
            post = entry["post"][b, h * g:(h + 1) * g].nan_to_num(nan=1.0).clamp(max=1.0)
            all_paged = sorted(e["blocks"]) == open_blocks
            assert bool((post <= tau).all()) or all_paged  # certificate after repair <= tau, or all paged
            assert float(post.max()) == pytest.approx(traj[-1], rel=1e-9, abs=1e-12)
            assert e["bytes"] <= e["tokens"] * 2 * gated.head_dim * 4
    assert n_events == len(gated.events) > 0


def test_block_gate_certificate_matches_head_gate_before_repair(small, ids) -> None:
    """Untouched, the block gate's certificate is the base (telemetry) certificate, bit for bit."""
    head = make_gated_cache("dither-int8", small.config, tau=1.0)
    block = make_gated_cache("dither-int8", small.config, tau=1.0, level="block")
    q = {}

    def keep(_m, query, _k, _v):
        q[_m.layer_idx] = query[:, :, -1, :].detach()

    with kvmodel.observe(keep):
        teacher_forced(small, ids, head, steps=0)
    teacher_forced(small, ids, block, steps=0)
    for i, qi in q.items():
        assert torch.equal(block.certify(i, qi), head.certify(i, qi))


def test_block_gate_bad_arguments(small) -> None:
    with pytest.raises(ValueError, match="level"):
        make_gated_cache("kivi2", small.config, level="token")
    with pytest.raises(ValueError, match="block_size"):
        make_gated_cache("kivi2", small.config, level="block", block_size=0)


@pytest.mark.parametrize("level", ["head", "block"])
def test_row_summaries_add_up_and_rows_are_independent(small, ids, level) -> None:
    two = torch.cat([ids, ids.flip(-1)])  # two requests in one batch
    gated = make_gated_cache("dither-int8", small.config, tau=0.2, level=level, block_size=2)
    with torch.no_grad():
        small(input_ids=two, past_key_values=gated, use_cache=True)
        small(input_ids=torch.tensor([[100], [100]]), past_key_values=gated, use_cache=True)
    rows = gated.row_summaries()
    s = gated.gate_summary()
    assert len(rows) == 2
    for key in ("bytes_moved", "bytes_whole_head", "blocks_paged", "positions_paged", "n_over"):
        assert sum(r[key] for r in rows) == s[key]
    assert sum(r["repair_events"] for r in rows) == len(gated.events)
    for r in rows:
        assert r["flagged"] == int(r["n_over"] > 0) == int(r["repair_events"] > 0)
    assert max(r["max_cert"] for r in rows) == pytest.approx(s["max_cert"])
    alone = make_gated_cache("dither-int8", small.config, tau=0.2, level=level, block_size=2)
    teacher_forced(small, ids, alone, steps=1)
    assert alone.row_summaries()[0]["flagged"] == rows[0]["flagged"]
