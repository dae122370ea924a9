"""The rollout-time model of the performance_replay notebook: collector traces per phase and format, the
attention time (byte roofline, and fitted to the replay benchmark's timings when it exists), and the modelled
speedups per variant, phase and format."""

from __future__ import annotations

from typing import Any

import pandas as pd

from kvlib.bench import replay
from kvlib.publish.provenance import load_result
from kvlib.rollout import time_model as rt


def bandwidth(r: dict[str, Any] | None) -> tuple[float, str]:
    """The bandwidth the model uses and where it comes from: the replay run's copy bandwidth, else the peers
    run's, else the H200 datasheet's."""
    if r is not None:
        return r["copy"]["bandwidth_GBps"], "copy bandwidth measured in the replay run"
    peers = load_result("peers", "gpu")
    if peers is not None:
        return peers["results"]["copy"]["bandwidth_GBps"], "H200 copy bandwidth from the peers run"
    return 4800.0, "H200 datasheet bandwidth (no measurement available)"


def rollout_model(r: dict[str, Any] | None, bw: float, *, updates: int, warmup: int, seed: int):
    """The rollout model at each GPU phase for every format of ``rt.METHOD_FORMAT``, with attention at the
    byte roofline and (when the replay results ``r`` exist) fitted ``a + c·C`` to the measured calls.
    Returns the fits, the model per variant and phase, and the long table (one row per variant, phase, format,
    plus a cumulative row per format)."""
    fmts = rt.METHOD_FORMAT  # benchmark method -> storage format
    traces = {p.name: {f: rt.collector_trace(p.law(), f, P=p.P, updates=updates, warmup=warmup, seed=seed)
                       for f in fmts.values()} for p in replay.GPU_PHASES}
    variants = {"roofline": {f: rt.roofline_attention(f, bw) for f in fmts.values()}}
    fits = {}
    if r is not None:
        att = {}
        for m, f in fmts.items():
            ok = [row for row in r["rows"] if m in row["timed"]["methods"]]
            att[f], fits[f] = rt.fit_attention([row["batch"] for row in ok], [row["timed"]["ctx_sum"] for row in ok],
                                               [row["timed"]["methods"][m]["median_ms"] for row in ok])
        variants["measured"] = att
    model = {v: {p.name: rt.rollout_model(p.law(), att, bw_GBps=bw, P=p.P, traces=traces[p.name])
                 for p in replay.GPU_PHASES} for v, att in variants.items()}
    recs = []
    for v, per in model.items():
        for ph, res in per.items():
            for f, row in res.items():
                recs.append(dict(variant=v, phase=ph, format=f, exec=row["speedup_exec"],
                                 capacity=row["capacity_factor"], total=row["speedup_total"],
                                 attn_only_exec=row["speedup_exec_attn_only"], mean_batch=row["mean_batch"],
                                 mean_context=row["mean_context"], page_limited=row["page_limited_fraction"],
                                 decode_steps=row["steps"]))
        for f in fmts.values():
            recs.append(dict(variant=v, phase="cumulative", format=f,
                             total=rt.cumulative_speedup(list(per.values()), f),
                             exec=rt.cumulative_speedup(list(per.values()), f, own_trace=False)))
    mt = pd.DataFrame(recs)
    mt.loc[mt.phase == "cumulative", "capacity"] = mt.total / mt.exec
    return fits, model, mt
