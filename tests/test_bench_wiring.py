"""Wiring of the decode grid and the decode replay at tiny shapes (CPU: Triton interpreter), the
replay's aggregation formula, and the rollout-time model's known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvlib.bench import decode_grid as grid
from kvlib.bench import replay
from kvlib.rollout import time_model as rt


def test_aggregate_speedup_known_example():
    # two states: bf16 1 ms and 3 ms, quantised 0.5 ms and 1.5 ms -> 4 / 2 = 2 (not the mean of ratios)
    assert replay.aggregate_speedup([1.0, 3.0], [0.5, 1.5]) == pytest.approx(2.0)
    # weighting by reference duration: ratios 4x on a 1 ms state and 1x on a 9 ms state
    assert replay.aggregate_speedup([1.0, 9.0], [0.25, 9.0]) == pytest.approx(10.0 / 9.25)
    # equal-baseline-time phases: n / sum(tau_q / tau_ref) = 2 / (0.25 + 1) = 1.6
    assert replay.equal_time_speedup([1.0, 9.0], [0.25, 9.0]) == pytest.approx(1.6)
    with pytest.raises(ValueError, match="tau_ref"):
        replay.aggregate_speedup([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        replay.aggregate_speedup([1.0, 0.0], [1.0, 2.0])


def test_call_bytes_from_byte_accounts():
    shape = grid.HeadShape(32, 8, 128)
    lengths = torch.tensor([1000, 3000])
    n = 4000 * 2 * 8  # positions x sides x kv heads
    assert grid.call_bytes("sdpa_bf16", lengths, shape) == n * 256
    assert grid.call_bytes("int8_cert", lengths, shape) == n * 136  # the paper's 136 B/tok/head/side
    assert grid.call_bytes("kv4", lengths, shape) == n * 68  # 4.25 bits per element
    side = 2 * (16 + 128)
    assert grid.call_bytes("kv4rl", lengths, shape) == 2 * 8 * ((4000 - side) * 68 + side * 130)
    # short requests: only what exists is protected
    assert grid.side_count(torch.tensor([5, 20, 200])).tolist() == [5, 20, 144]
    with pytest.raises(ValueError, match="method"):
        grid.call_bytes("nope", lengths, shape)


def test_decode_grid_wiring_tiny(monkeypatch):
    # on a GPU the tiny grid runs at d = 128, the head dim every GPU kernel serves (the h10/h8/Gluon kernels need
    # d = 4 x 32, the KV4 kernel d >= 64); the CPU interpreter keeps CPU_SHAPE's d = 32
    if torch.cuda.is_available():
        monkeypatch.setattr(grid, "CPU_SHAPE", grid.HeadShape(grid.CPU_SHAPE.hq, grid.CPU_SHAPE.hkv, 128))
    shape = grid.CPU_SHAPE
    res = grid.run("ci", batches=(1,), ctxs=(40,))
    (row,) = res["rows"]
    assert res["shape"]["d"] == shape.d
    expected = set(grid.ALL_METHODS) - {"int8_nophilox"} if grid.skip_philox_kw() is None else set(grid.ALL_METHODS)
    if shape.d != 4 * grid.INT8_GROUP:  # the h10 kernel's shape rule: skipped with a note, not silently
        expected -= {m for m in grid.ALL_METHODS if m.startswith(("int8_h10", "int8_h8"))}
        assert any("int8_h10" in n for n in row["notes"])
    assert set(row["methods"]) == expected, row["notes"]
    # bytes per position per head and side, from the formats' layouts: bf16 2 B x d; INT8 d codes + one fp16 scale
    # per group of 32; KV4 d/2 B of nibbles + fp16 scale and offset; KV4-RL keeps all 40 positions in its INT8 side
    # buffer (sink 16 + recent 128 >= 40): d codes + one fp16 scale (d = 32: 64, 34, 20, 34)
    d = shape.d
    per_pos = {"bf16": 2 * d, "dither-int8": d + 2 * d // grid.INT8_GROUP, "kv4": d // 2 + 4, "kv4rl": d + 2}
    for name, t in row["methods"].items():
        assert t["q25_ms"] <= t["median_ms"] <= t["q75_ms"]
        assert t["bytes"] == 40 * 2 * shape.hkv * per_pos[grid.METHOD_FORMAT[name]], name
        assert t["GBps"] == pytest.approx(t["bytes"] / t["median_ms"] / 1e6)
    assert set(row["ratios"]) >= {"speedup_int8_cert", "speedup_kv4", "cert_cost", "kv4rl_frac_of_kv4"}
    assert res["copy"]["bandwidth_GBps"] > 0
    assert set(res["summary"]["goals"]) == {"int8_cert_speedup", "kv4_speedup", "kv4rl_frac", "cert_cost"}


#: hand-picked medians (ms) of a fake timer, by context: at 40 positions the INT8 kernel loses to SDPA, at 16k it
#: wins, so the summary's long-context filter shows in its answer
FAKE_MS = {40: {"sdpa_bf16": 1.0, "int8_cert": 2.0, "int8_nocert": 1.0, "kv4": 0.5, "kv4rl": 1.0},
           16384: {"sdpa_bf16": 8.0, "int8_cert": 4.0, "int8_nocert": 3.2, "kv4": 2.0, "kv4rl": 2.5}}


def test_decode_grid_ratios_and_summary_known_answers(monkeypatch):
    def fake_time_state(lengths, *, methods, **kw):
        ctx = int(lengths[0])
        return {"batch": len(lengths), "methods": {m: {"median_ms": FAKE_MS[ctx][m], "GBps": 1.0} for m in methods},
                "notes": []}

    monkeypatch.setattr(grid, "time_state", fake_time_state)
    res = grid.run("ci", methods=tuple(FAKE_MS[40]), batches=(8,), ctxs=(40, 16384))
    short, long = res["rows"]
    assert short["ratios"] == pytest.approx({"speedup_sdpa_bf16": 1.0, "speedup_int8_cert": 0.5,
                                             "speedup_int8_nocert": 1.0, "speedup_kv4": 2.0, "speedup_kv4rl": 1.0,
                                             "cert_cost": 1.0, "kv4rl_frac_of_kv4": 0.5})
    assert long["ratios"]["speedup_int8_cert"] == pytest.approx(2.0)
    assert long["ratios"]["cert_cost"] == pytest.approx(0.25)
    s = res["summary"]
    assert s["int8_cert_speedup_S16k_min"] == pytest.approx(2.0)  # the 40-position row (0.5) is not long context
    assert s["kv4_speedup_S16k_min"] == pytest.approx(4.0)
    assert s["kv4rl_frac_min"] == pytest.approx(0.5) and s["kv4rl_frac_median"] == pytest.approx(0.65)
    assert s["cert_cost_max"] == pytest.approx(1.0) and s["cert_cost_median"] == pytest.approx(0.625)
    assert s["philox_share_skip_median"] is None  # int8_nophilox was not timed


def test_time_state_ragged_sdpa_buckets():
    out = grid.time_state([3, 17, 9, 30], methods=("sdpa_bf16",), shape=grid.CPU_SHAPE, device="cpu", rep_ms=0.0)
    t = out["methods"]["sdpa_bf16"]
    assert not out["uniform"] and out["ctx_sum"] == 59
    assert t["n_calls"] == 4  # one bucket per request at 4 requests
    assert t["bytes_padded"] == t["bytes"]  # singleton buckets need no padding
    with pytest.raises(ValueError, match="lengths"):
        grid.time_state([0, 3], methods=("sdpa_bf16",), shape=grid.CPU_SHAPE, device="cpu")


def test_replay_states_and_wiring_tiny():
    ph = replay.CI_PHASES[0]
    sts = replay.states(ph, 1, seed=0)
    assert [s["kind"] for s in sts] == ["fixed", "ragged"]
    for s in sts:
        assert len(s["lengths"]) == s["batch"] and min(s["lengths"]) >= ph.P
        assert max(s["lengths"]) <= ph.P + ph.max_len
    methods = ("sdpa_bf16", "int8_cert", "kv4rl")
    res = replay.run("ci", methods=methods, n_states=1, phases=(ph,))
    assert [r["kind"] for r in res["rows"]] == ["fixed", "ragged"]
    for r in res["rows"]:
        assert set(r["timed"]["methods"]) == set(methods), r["timed"]["notes"]
        assert r["timed"]["ctx_sum"] == r["batch"] * r["ctx"] if r["kind"] == "fixed" else r["timed"]["ctx_sum"] > 0
    # one speedup per kind and method against SDPA (triton_bf16, the other reference, was not timed)
    assert sorted((r["kind"], r["reference"], r["method"]) for r in res["speedups"]) == [
        (k, "sdpa_bf16", m) for k in ("fixed", "ragged") for m in ("int8_cert", "kv4rl")]


def test_replay_aggregates_ratio_of_sums_per_kind(monkeypatch):
    # a fake timer whose speedup grows with the state's size: the ratio of sums then differs from the mean ratio
    cost = {"sdpa_bf16": (1.0, 1e-2), "triton_bf16": (1.0, 5e-3), "kv4rl": (1.0, 2.5e-3)}

    def fake_time_state(lengths, *, methods, **kw):
        n = int(sum(lengths))
        return {"batch": len(lengths), "ctx_sum": n, "notes": [],
                "methods": {m: {"median_ms": cost[m][0] + cost[m][1] * n} for m in methods}}

    monkeypatch.setattr(replay, "time_state", fake_time_state)
    res = replay.run("ci", methods=tuple(cost), n_states=2, phases=replay.CI_PHASES[:1])
    sp = {(r["kind"], r["reference"], r["method"]): r for r in res["speedups"]}
    assert len(sp) == 2 * 4  # kinds x (sdpa: triton, kv4rl; triton: sdpa, kv4rl)
    for kind in ("fixed", "ragged"):
        ns = [r["timed"]["ctx_sum"] for r in res["rows"] if r["kind"] == kind]
        assert len(ns) == 2 and ns[0] != ns[1]
        ref = [1.0 + 1e-2 * n for n in ns]
        q = [1.0 + 2.5e-3 * n for n in ns]
        r = sp[(kind, "sdpa_bf16", "kv4rl")]
        assert r["n_states"] == 2
        assert r["speedup_sum"] == pytest.approx(sum(ref) / sum(q))
        assert r["speedup_equal_time"] == pytest.approx(2 / (q[0] / ref[0] + q[1] / ref[1]))
        assert sp[(kind, "triton_bf16", "kv4rl")]["speedup_sum"] == pytest.approx(
            sum(1.0 + 5e-3 * n for n in ns) / sum(q))


def test_rollout_model_known_answers():
    # the paper's Qwen3-4B TP2 figure: 4.022272 GB of linear weights per GPU
    assert rt.weight_bytes_per_gpu(rt.QWEN3_4B) == pytest.approx(4.022272e9, rel=1e-9)
    assert rt.attention_calls_per_step(rt.QWEN3_8B) == 18
    # collector formats from the byte accounts agree with the collector's own table
    from kvlib.rollout.partial import CACHE_FORMATS

    assert rt.cache_format("kv4rl").kappa() == CACHE_FORMATS["int4+side"].kappa()
    assert rt.cache_format("kv4rl").side_bytes_per_request() == CACHE_FORMATS["int4+side"].side_bytes_per_request()
    assert rt.cache_format("dither-int8").bits == 8.5
    # roofline attention: 1 GB/s and 1e6 bf16 positions of 8 heads x 2 sides x 256 B -> 4096 ms
    a = rt.roofline_attention("bf16", 1.0)
    assert a(np.array([10.0]), np.array([1e6]))[0] == pytest.approx(4096.0)
    # the fit recovers a line exactly
    f, info = rt.fit_attention([1, 1, 1], [1e5, 2e5, 4e5], [1.1, 1.2, 1.4])
    assert info["intercept_ms"] == pytest.approx(1.0) and info["ms_per_Mpos"] == pytest.approx(1.0)
    assert f(np.array([1.0]), np.array([3e5]))[0] == pytest.approx(1.3)


def test_rollout_model_tiny_law():
    from kvlib.rollout.laws import lognormal_law

    law = lognormal_law(40.0, 0.5, 96)
    att = {f: rt.roofline_attention(f, 1000.0) for f in ("bf16", "kv4")}
    out = rt.rollout_model(law, att, bw_GBps=1000.0, P=16, updates=3, warmup=1)
    assert out["bf16"]["speedup_total"] == pytest.approx(1.0)
    kv4 = out["kv4"]
    # no page pressure at these lengths: same trace, so capacity adds nothing
    assert kv4["capacity_factor"] == pytest.approx(1.0)
    # attention-only speedup on the same trace is the byte ratio 256 / 68
    assert kv4["speedup_exec_attn_only"] == pytest.approx(256 / 68)
    assert 1.0 < kv4["speedup_exec"] < kv4["speedup_exec_attn_only"]
    cum = rt.cumulative_speedup([out, out], "kv4")
    assert math.isclose(cum, kv4["speedup_total"])


def test_timing_profile_and_graph_fallback():
    from kvlib.bench import timing

    with pytest.raises(ValueError, match="profile"):
        timing.profile_device("fast")
    cuda = torch.cuda.is_available()
    assert timing.profile_device("ci") == ("cuda" if cuda else "cpu")
    calls = []
    fn = lambda: calls.append(1)  # noqa: E731
    replay, ok = timing.graphed(fn)
    assert ok == cuda and (replay is fn) == (not cuda)
    t = timing.bench_graphed(fn, warmup_ms=0.0, rep_ms=0.0)
    assert t["graphed"] == cuda and t["q25_ms"] <= t["median_ms"] <= t["q75_ms"] and calls


def test_decode_grid_h10_wiring_at_d128():
    shape = grid.HeadShape(4, 1, 128)  # the h10 kernel's shape rule: d = 4 x 32
    methods = ("int8_h10_cert", "int8_h10_nocert", "int8_h8_cert", "int8_h8_nocert")
    # on the device Triton compiles for (a CPU tensor handed to a compiled kernel fails on a GPU machine)
    out = grid.time_state([40], methods=methods, shape=shape, device="cuda" if torch.cuda.is_available() else "cpu",
                          rep_ms=0.0)
    assert set(out["methods"]) == set(methods), out["notes"]
    d = grid.derived({"methods": out["methods"]})
    assert "h10_cert_cost" in d and "h8_cert_cost" in d and "h8_over_h10" in d


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU side: the Gluon kernel is named as GPU only")
def test_decode_grid_gluon_methods_are_skipped_with_a_note_on_cpu():
    out = grid.time_state([40], methods=("int8_h8g_cert", "int8_h8_cert"), shape=grid.HeadShape(4, 1, 128),
                          device="cpu", rep_ms=0.0)
    assert set(out["methods"]) == {"int8_h8_cert"}
    assert any(n.startswith("int8_h8g_") and "CUDA" in n for n in out["notes"]), out["notes"]


def test_interleaved_rotates_the_order_and_keeps_every_round():
    from kvlib.bench.timing import interleaved

    calls: list[str] = []
    values = {"a": iter([3.0, 1.0, 2.0]), "b": iter([5.0, 4.0, 6.0]), "c": iter([7.0, 9.0, 8.0])}

    def timer(name):
        def t():
            calls.append(name)
            return next(values[name])
        return t

    res = interleaved({n: timer(n) for n in "abc"}, 3)
    assert calls == list("abc") + list("bca") + list("cab")  # each round starts one later
    assert res == {"a": (2.0, [3.0, 1.0, 2.0]), "b": (5.0, [5.0, 4.0, 6.0]), "c": (8.0, [7.0, 9.0, 8.0])}


def test_interleaved_failures_raise_when_strict_and_count_as_none_otherwise():
    from kvlib.bench.timing import interleaved

    def boom():
        raise RuntimeError("no kernel")

    with pytest.raises(RuntimeError, match="no kernel"):
        interleaved({"ok": lambda: 1.0, "bad": boom}, 2, strict=True)
    res = interleaved({"ok": lambda: 1.0, "bad": boom}, 2)
    assert res == {"ok": (1.0, [1.0, 1.0]), "bad": (None, [None, None])}


def test_every_listed_topic_has_a_run_and_every_run_is_listed():
    import importlib
    import inspect
    import pkgutil

    import kvlib.bench as bench

    for name in bench.TOPICS:
        run = getattr(bench.topic_module(name), "run", None)
        assert callable(run), f"topic {name} ({bench.TOPICS[name]}) has no callable run()"
        assert next(iter(inspect.signature(run).parameters)) == "profile", name
    # a module of kvlib.bench that defines run() is a topic and must be listed; the rest are shared code
    listed = set(bench.TOPICS.values())
    for m in pkgutil.iter_modules(bench.__path__):
        if m.name == "__main__":
            continue
        mod = importlib.import_module(f"kvlib.bench.{m.name}")
        assert (mod.__name__ in listed) == callable(getattr(mod, "run", None)), mod.__name__
    assert "kvlib.bench.timing" not in listed  # the harness is a helper, not a topic
    with pytest.raises(ValueError, match="topic"):
        bench.topic_module("int8_sweep")  # moved to dev/: no longer a topic


def test_bench_help_names_every_topic_and_refuses_unknown_ones(capsys):
    from kvlib.bench import TOPICS
    from kvlib.bench.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in TOPICS:
        assert f"  {name} " in out, name
    with pytest.raises(SystemExit) as e:
        main(["decode_grid", "no_such_topic"])
    assert e.value.code == 2
    assert "no_such_topic" in capsys.readouterr().err
