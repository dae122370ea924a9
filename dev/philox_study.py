"""The dither generators' CPU evidence (issue 28): the stream battery (:func:`kvlib.analysis.generators.stream_tests`,
Bonferroni at family level 0.01 per generator) on every generator of :data:`kvlib.core.philox.GENERATORS` and on
weak controls the battery must reject (Philox4x32 at 2-5 rounds, Threefry4x32 at 4 and 8), then the certificate's
soundness (:func:`kvlib.analysis.generators.soundness`, h8 layout, Gaussian / heavy-tailed / massive-channel keys)
per generator; with the GPU lane's timing (dev/gpu/philox.sh) these are the three checks of the issue.

``python -m dev.philox_study [OUT.json] [--quick]`` (default dev/results/philox_study.json; ``--quick``: small
samples, a smoke run).
"""

from __future__ import annotations

import datetime
import sys
import time

import torch

from kvlib.core.philox import GENERATORS

CONTROLS = (("philox", 2), ("philox", 3), ("philox", 4), ("philox", 5), ("threefry", 4), ("threefry", 8))


def main() -> None:
    from kvlib.analysis.generators import soundness, stream_tests, stream_verdict
    from kvlib.publish.provenance import provenance, write_json_atomic

    torch.set_num_threads(1)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    quick = "--quick" in sys.argv
    out = args[0] if args else "dev/results/philox_study.json"
    started = datetime.datetime.now(datetime.UTC)
    stream_kw = dict(n_slots=1 << 11, avalanche_n=1 << 10) if quick else dict(n_slots=1 << 15, avalanche_n=1 << 13)
    sound_kw = dict(rows=50, trials=10) if quick else dict(rows=300, trials=60)
    res = {"stream": {}, "soundness": {}, "params": {"stream": stream_kw, "soundness": sound_kw | {
        "S": 256, "d": 128, "q_scale": 3.0, "deltas": [0.5, 0.1, 0.01, 0.001], "layout": "h8"}}}
    named = [(name, fam, r) for name, (fam, r) in GENERATORS.items()]
    for name, fam, r in named + [(f"{f}-{r} (control)", f, r) for f, r in CONTROLS]:
        t = time.time()
        rows = stream_tests(fam, r, **stream_kw)
        v = stream_verdict(rows)
        res["stream"][name] = {"family": fam, "rounds": r, "rows": rows, "verdict": v, "seconds": time.time() - t}
        print(f"stream {name:26s} {'pass' if v['pass'] else 'FAIL'} min p {v['min_p']:.2e} "
              f"(threshold {v['threshold']:.1e}) failed {v['failed'][:3]}", flush=True)
    for name in GENERATORS:
        t = time.time()
        rows = soundness(name, **sound_kw)
        res["soundness"][name] = {"rows": rows, "sound": all(r["sound"] for r in rows), "seconds": time.time() - t}
        worst = max(rows, key=lambda r: r["rate 95% hi"] / r["delta"])
        print(f"soundness {name:18s} {'sound' if res['soundness'][name]['sound'] else 'UNSOUND'}: violations "
              f"{sum(r['TV > cert'] for r in rows)} over {rows[0]['pairs']} pairs x {len(rows)} (family, delta); "
              f"worst 95% hi / delta {worst['rate 95% hi'] / worst['delta']:.3f} ({worst['keys']}, {worst['delta']})",
              flush=True)
    from kvlib.analysis.generators import event_homogeneity

    res["event_homogeneity"] = event_homogeneity({n: res["soundness"][n]["rows"] for n in GENERATORS})
    for r in res["event_homogeneity"]:
        print(f"event homogeneity {r['keys']:8s} delta {r['delta']:<6} p {r['p']:.3f}  {r['event fails']}", flush=True)
    res["summary"] = {n: {"stream_pass": res["stream"][n]["verdict"]["pass"], "sound": res["soundness"][n]["sound"]}
                      for n in GENERATORS}
    write_json_atomic(__import__("pathlib").Path(out), {
        "name": "philox_study", "profile": "cpu",
        "provenance": provenance({"command": "python -m dev.philox_study" + (" --quick" if quick else "")}, started),
        "results": res})
    print(res["summary"])


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__, "[OUT.json] [--quick]")
    main()
