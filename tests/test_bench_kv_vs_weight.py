"""The kv_vs_weight topic: every arm has a row (a time or a reason), torchao's quantised linear layers agree with
bf16 within their quantiser's bound, the byte accounting, and the register's quantities."""

from __future__ import annotations

import math

import pytest
import torch

from kvlib.bench import kv_vs_weight as kvw
from kvlib.bench import kv_vs_weight_report as rep

U_BF16 = 2.0 ** -8  # unit roundoff of bfloat16 (8 significant bits)
EPS_FP32 = 2.0 ** -24


def _torchao():
    why = kvw.torchao_status()
    if why is not None:
        pytest.skip(f"torchao not available here: {why}")


@pytest.fixture(scope="module")
def ci_result():
    return kvw.run("ci")


def test_every_arm_has_a_row_with_model_device_and_a_time_or_a_reason(ci_result):
    rows = ci_result["rows"]
    states = {(r["phase"], r["state"]) for r in rows}
    assert {p for p, _ in states} == {"early", "late"}
    for st in states:  # no arm silently vanishes at any state
        assert {r["arm"] for r in rows if (r["phase"], r["state"]) == st} == set(kvw.ARMS)
    for r in rows:
        assert r["arm"] in kvw.ARMS and r["what"] == kvw.WHAT[r["arm"]]
        assert "random bf16 weights" in r["model"]
        assert r["device"]
        if r["status"] == "ok":
            assert r["step_ms"] > 0 and math.isfinite(r["step_ms"])
            assert r["tokens_per_s"] == pytest.approx(r["batch"] / (r["step_ms"] * 1e-3))
            assert r["step_read_bytes"] == r["weight_bytes_read"] + r["kv_bytes"]
            if r["reference"] is not None:
                assert r["speedup_vs_bf16"] == pytest.approx(r["reference_step_ms"] / r["step_ms"])
                ref = next(x for x in rows if (x["phase"], x["state"], x["group"], x["arm"])
                           == (r["phase"], r["state"], r["group"], r["reference"]))
                assert r["byte_ratio_vs_bf16"] == pytest.approx(ref["step_read_bytes"] / r["step_read_bytes"])
        else:
            assert r["reason"], r
    if not torch.cuda.is_available():  # the CUDA-only arms say so in their rows
        for r in rows:
            if r["arm"] in ("w4-int4wo", "w8a8-fp8") and kvw.torchao_status() is None:
                assert r["status"] == "skipped" and r["reason"].startswith("skipped: needs CUDA"), r
    ok = {r["arm"] for r in rows if r["status"] == "ok"}
    assert "bf16" in ok
    if not torch.cuda.is_available():  # on the GPU lane an arm may refuse the tiny shapes; its row says why
        assert {"kv8-rtn", "kv8-dither", "kv4", "kv4rl"} <= ok
        if kvw.torchao_status() is None:
            assert "w8-int8wo" in ok


def test_the_gpu_profile_is_the_7b_shaped_decoder_at_the_replay_states():
    from kvlib.bench.e2e import QWEN25_7B
    from kvlib.bench.replay import GPU_PHASES

    gpu = kvw._profiles()["gpu"]
    assert gpu.model == QWEN25_7B and "Qwen2.5-7B shapes" in gpu.desc and "random bf16 weights" in gpu.desc
    assert gpu.phases == GPU_PHASES and gpu.compile_linears
    st = kvw.replay_states(gpu)
    assert [s["phase"] for s in st] == ["early", "late"]
    # the median-volume state is one of the replay topic's five per phase
    from kvlib.bench.replay import fixed_states

    for i, s in enumerate(st):
        five = fixed_states(GPU_PHASES[i], 5, seed=17 * i)
        vols = sorted(x["batch"] * x["ctx"] for x in five)
        assert s["batch"] * s["ctx"] == vols[2]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="arms"):
        kvw.run("ci", arms=("kv4",))
    with pytest.raises(ValueError, match="pick"):
        kvw.run("ci", pick="first")
    with pytest.raises(ValueError, match="profile"):
        kvw.run("tpu")
    with pytest.raises(ValueError, match="arm"):
        kvw.quant_config("w2")


def test_int8_weight_only_linear_is_within_its_quantiser_bound():
    """Per-row symmetric INT8: s = amax / 127.5 and q = clamp(round(w / s), -128, 127), so |w - s q| <= s / 2 (a
    clamp at 127 costs at most (127.5 - 127) s). The eager linear computes bf16(bf16(x q^T) * bf16(s)) + b: four
    bf16 roundings (the mm's output, the scale's cast, the product, the bias add) of at most u = 2^-8 each on
    |y| <= s sum|x||q| + |b|, and fp32 accumulation over K terms. Bound per output:
    (s/2) sum_k |x_k| + (5u + K 2^-24) (s sum_k |x_k||q_k| + |b|)."""
    _torchao()
    g = torch.Generator().manual_seed(0)
    k, n = 192, 48
    lin = torch.nn.Linear(k, n, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        lin.bias.copy_(torch.randn(n, generator=g) * 0.1)
    w, b = lin.weight.detach().double().clone(), lin.bias.detach().double().clone()
    kvw.quantize_linears(lin, "w8-int8wo")
    q, s = lin.weight.qdata.double(), lin.weight.scale.double().reshape(-1, 1)
    err = (w - s * q).abs() / s
    assert err.max() <= 0.5 + 1e-6
    assert err.max() > 0.4  # the codes really round (a test that could fail)
    x = (torch.randn(5, k, generator=g)).to(torch.bfloat16)
    y = lin(x).double()
    xd = x.double()
    y_ref = xd @ w.T + b
    bound = (s.T / 2) * xd.abs().sum(1, keepdim=True) \
        + (5 * U_BF16 + k * EPS_FP32) * (xd.abs() @ (q.abs() * s).T + b.abs())
    assert ((y - y_ref).abs() <= bound).all()
    # and the bound is not vacuous: the quantisation error alone is a visible share of it
    assert ((y - y_ref).abs() / bound).max() > 0.05


def test_every_linear_is_quantised_or_the_arm_is_refused():
    _torchao()
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).to(torch.bfloat16)
    kvw.quantize_linears(m, "w8-int8wo")
    assert all(type(x.weight).__name__ == "Int8Tensor" for x in m if isinstance(x, torch.nn.Linear))
    # INT4 in groups of 128 cannot take 64 input features: torchao skips the layer, the arm refuses
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        m4 = torch.nn.Sequential(torch.nn.Linear(64, 32)).to(torch.bfloat16).cuda()
        with pytest.raises(kvw.ArmUnavailable, match="unquantised"):
            kvw.quantize_linears(m4, "w4-int4wo")


def test_weight_bytes_of_a_known_config():
    """The tiny config's bf16 weights are 2 bytes per parameter; INT8 weight-only holds, per linear layer, int8
    codes (out x in), an fp32 scale and an int8 zero point per row (torchao's Int8Tensor), the bias in bf16."""
    from kvlib.bench.e2e import build_model

    model = build_model(kvw.TINY_KVW, "cpu")
    cfg = model.config
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hq, hk, d, L = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    # (out, in, bias) of each linear layer of one decoder layer, then the head
    layer = [(hq * d, h, True), (hk * d, h, True), (hk * d, h, True), (h, hq * d, False),
             (f, h, False), (f, h, False), (h, f, False)]
    linears = layer * L + [(v, h, False)]
    norms = (2 * L + 1) * h
    emb = v * h
    n_params = sum(o * i + (o if bb else 0) for o, i, bb in linears) + norms + emb
    wb = kvw.model_weight_bytes(model)
    assert wb == {"total": 2 * n_params, "embedding": 2 * emb, "read_per_step": 2 * (n_params - emb)}
    _torchao()
    q = kvw.quantized_model(model, "w8-int8wo")
    int8 = sum(o * i + 4 * o + o + (2 * o if bb else 0) for o, i, bb in linears) + 2 * (norms + emb)
    assert kvw.model_weight_bytes(q) == {"total": int8, "embedding": 2 * emb, "read_per_step": int8 - 2 * emb}
    assert kvw.model_weight_bytes(model)["total"] == 2 * n_params  # the copy left the bf16 model alone


def test_kv_bytes_of_the_bf16_rows_are_the_static_cache(ci_result):
    from transformers import Qwen2Config

    cfg = Qwen2Config(**kvw.TINY_KVW)
    for r in ci_result["rows"]:
        if r["arm"] in ("bf16", "w8-int8wo") and r["status"] == "ok":
            # StaticCache of ctx + 1 positions: 2 (K, V) x layers x B x kv heads x positions x d x 2 bytes
            assert r["kv_bytes"] == kvw.static_kv_bytes(cfg, r["batch"], r["ctx"] + 1) \
                == 2 * 2 * 1 * r["batch"] * (r["ctx"] + 1) * 128 * 2
        if r["arm"] == "kv4" and r["status"] == "ok":
            assert r["kv_bytes"] > 0 and r["positions"] > r["ctx"]


def _synthetic(speed: dict[tuple[str, str], float]) -> dict:
    rows = []
    for (phase, arm), sp in speed.items():
        rows.append({"phase": phase, "arm": arm, "status": "ok", "reference": "bf16", "reference_step_ms": 10.0,
                     "step_ms": 10.0 / sp})
    return {"rows": rows}


def test_claim_quantities_known_answer_and_missing_arms():
    res = _synthetic({("early", "kv4"): 1.5, ("early", "w8-int8wo"): 1.1, ("early", "w8a8-fp8"): 1.2,
                      ("late", "kv4"): 2.0, ("late", "w4-int4wo"): 1.25, ("late", "w8a8-fp8"): 1.05})
    measured, given, why = rep.claim_quantities(res)
    assert measured == pytest.approx({"kv4_over_weight_early": 1.5 / 1.2, "kv4_over_weight_late": 2.0 / 1.25})
    assert given == {"weight_only_phases": 2, "w8a8_phases": 2} and why == ""
    measured, given, why = rep.claim_quantities(_synthetic({("early", "kv4"): 1.5, ("late", "kv4"): 2.0,
                                                            ("late", "w8a8-fp8"): 1.0}))
    assert measured is None and "early: no weight arm timed" in why
    assert given == {"weight_only_phases": 0, "w8a8_phases": 1}


def test_the_register_rule_can_go_either_way():
    from kvlib.publish.verdicts import decide, load_claims

    rule = load_claims()["kv4rl-kv-vs-weight-quant"]["rule"]
    g = {"weight_only_phases": 2, "w8a8_phases": 2}
    assert decide(rule, {"kv4_over_weight_early": 1.3, "kv4_over_weight_late": 1.8}, given=g)[0] == "reproduced"
    assert decide(rule, {"kv4_over_weight_early": 1.1, "kv4_over_weight_late": 1.8}, given=g)[0] == "differs"
    assert decide(rule, {"kv4_over_weight_early": 1.3, "kv4_over_weight_late": 1.8},
                  given={"weight_only_phases": 2, "w8a8_phases": 1})[0] == "not reproducible here"


def test_report_speedups_and_table_from_the_ci_run(ci_result):
    sp = rep.speedups(ci_result)
    for (phase, arm), v in sp.items():
        rows = [r for r in ci_result["rows"] if r["phase"] == phase and r["arm"] == arm and r.get("status") == "ok"
                and r.get("reference")]
        assert v["speedup"] == pytest.approx(sum(r["reference_step_ms"] for r in rows)
                                             / sum(r["step_ms"] for r in rows))
    t = rep.table(ci_result)
    assert len(t) == len(ci_result["rows"]) and t["model"].str.contains("random bf16 weights").all()


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_int4_weight_only_linear_is_within_its_quantiser_bound():
    """Asymmetric INT4 in groups of g = 128 (tinygemm's scheme): per group s = (max - min) / 15, 16 levels, so a
    weight is within s/2 of its level; scale and zero point are bf16 (|z| = |min + 8 s| <= 2.1 amax), adding at
    most u (s/2 + 8 s + |z|), and the kernel's bf16 copy of the dequantised weight u (amax + s/2): in all
    s/2 + u (9 s + 4 amax) per weight. The output adds fp32 accumulation and one bf16 rounding of |y|."""
    _torchao()
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("tinygemm needs sm80+")
    g = torch.Generator(device="cuda").manual_seed(0)
    k, n, grp = 512, 64, 128
    lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16).cuda()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g, device="cuda") * 0.05)
    w = lin.weight.detach().double().clone()
    kvw.quantize_linears(lin, "w4-int4wo")
    wg = w.reshape(n, k // grp, grp)
    s = (wg.amax(-1) - wg.amin(-1)) / 15
    amax = wg.abs().amax(-1)
    e = (s / 2 + U_BF16 * (9 * s + 4 * amax)).repeat_interleave(grp, dim=1)  # [n, k] per-weight bound
    x = torch.randn(8, k, generator=g, device="cuda").to(torch.bfloat16)
    y, xd = lin(x).double(), x.double()
    y_ref = xd @ w.T
    bound = xd.abs() @ e.T + (U_BF16 + k * EPS_FP32) * (xd.abs() @ (w.abs() + e).T)
    assert ((y - y_ref).abs() <= bound).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_w8a8_linear_is_within_its_quantiser_bound():
    """FP8 e4m3 per row (weights) and per token (activations): scale = amax / 448, 3 mantissa bits give a relative
    rounding of 2^-4 on normal values and an absolute 2^-10 scale on subnormals: |e_w| <= 2^-4 |w| + 2^-10 s_w,
    likewise for x. The product's error is sum |e_x||w| + |x||e_w| + |e_x||e_w|, plus one bf16 output rounding and
    the accumulation: torchao asks ``_scaled_mm`` for fast accumulation, whose Hopper accumulator keeps 13 mantissa
    bits (u = 2^-14), so K 2^-14 of sum |x^||w^|."""
    _torchao()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs sm89+")
    g = torch.Generator(device="cuda").manual_seed(0)
    k, n = 512, 64
    lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16).cuda()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g, device="cuda") * 0.05)
    w = lin.weight.detach().double().clone()
    kvw.quantize_linears(lin, "w8a8-fp8")
    x = torch.randn(8, k, generator=g, device="cuda").to(torch.bfloat16)
    y, xd = lin(x).double(), x.double()
    sw = w.abs().amax(1, keepdim=True) / 448
    sx = xd.abs().amax(1, keepdim=True) / 448
    ew = 2.0 ** -4 * w.abs() + 2.0 ** -10 * sw
    ex = 2.0 ** -4 * xd.abs() + 2.0 ** -10 * sx
    y_ref = xd @ w.T
    bound = ex @ w.abs().T + xd.abs() @ ew.T + ex @ ew.T
    bound = bound + (U_BF16 + k * 2.0 ** -14) * ((xd.abs() + ex) @ (w.abs() + ew).T)
    assert ((y - y_ref).abs() <= bound).all()


def test_a_spent_time_budget_leaves_a_skip_row_for_every_arm():
    res = kvw.run("ci", time_budget_s=1e-9)
    rows = res["rows"]
    for st in {(r["phase"], r["state"]) for r in rows}:
        assert {r["arm"] for r in rows if (r["phase"], r["state"]) == st} == set(kvw.ARMS)
    assert all(r["status"] == "skipped" and "time budget" in r["reason"] for r in rows)
    with pytest.raises(ValueError, match="group"):
        kvw.group_arms("kv2")
