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


def test_decode_grid_wiring_tiny():
    res = grid.run("ci", batches=(1,), ctxs=(40,))
    (row,) = res["rows"]
    expected = set(grid.ALL_METHODS) - {"int8_nophilox"} if grid.skip_philox_kw() is None else set(grid.ALL_METHODS)
    if grid.CPU_SHAPE.d != 4 * grid.INT8_GROUP:  # the h10 kernel's shape rule: skipped with a note, not silently
        expected -= {m for m in grid.ALL_METHODS if m.startswith(("int8_h10", "int8_h8"))}
        assert any("int8_h10" in n for n in row["notes"])
    assert set(row["methods"]) == expected, row["notes"]
    for name, t in row["methods"].items():
        assert t["q25_ms"] <= t["median_ms"] <= t["q75_ms"]
        assert t["bytes"] == grid.call_bytes(name, torch.tensor([40]), grid.CPU_SHAPE)
        assert t["GBps"] > 0
    assert row["ratios"]["speedup_sdpa_bf16"] == pytest.approx(1.0)
    assert res["copy"]["bandwidth_GBps"] > 0
    assert set(res["summary"]["goals"]) == {"int8_cert_speedup", "kv4_speedup", "kv4rl_frac", "cert_cost"}


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
    res = replay.run("ci", methods=("sdpa_bf16", "int8_cert", "kv4rl"), n_states=1, phases=(ph,))
    assert len(res["rows"]) == 2
    sp = {(r["kind"], r["reference"], r["method"]): r for r in res["speedups"]}
    r = sp[("ragged", "sdpa_bf16", "kv4rl")]
    (row,) = [x for x in res["rows"] if x["kind"] == "ragged"]
    m = row["timed"]["methods"]
    assert r["speedup_sum"] == pytest.approx(m["sdpa_bf16"]["median_ms"] / m["kv4rl"]["median_ms"])


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
    out = grid.time_state([40], methods=methods, shape=shape, device="cpu", rep_ms=0.0)
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
