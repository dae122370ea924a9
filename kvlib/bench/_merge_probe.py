"""Development probe on the GPU: merged rows per program of the split merge (``merge_tl.MERGE_ROWS``), timed inside
the decode steps that end with a merge launch (KV4-RL at one INT4 split, the certified Gluon INT8 step), CUDA graphs,
interleaved rounds; also whether each setting's outputs equal one row per program's bit for bit.
``python -m kvlib.bench._merge_probe [out.json]``."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import sys

import torch

from kvlib.bench._h10_probe import h10_problem, write_probe
from kvlib.bench._h10_probe2 import module_flags
from kvlib.bench.kv4 import HQ, D, _time, random_kv4_batch
from kvlib.bench.timing import interleaved
from kvlib.bench.witcert_decode import LAYER, SEED

ROWS = (1, 4, 8, 16)


def _steps() -> dict:
    """name -> (make, shape): ``make()`` returns the step to time (built lazily, one shape in memory at a time)."""
    from kvlib.kernels.decode_int8 import decode_int8
    from kvlib.kv4rl_attention import kv4rl_decode

    def kv4rl(b, n):
        lengths = torch.full((b,), n, dtype=torch.int32, device="cuda")
        cache = random_kv4_batch(lengths, n)
        q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
        return lambda: kv4rl_decode(q, cache)

    def cert(b, n):
        qb, kp, vp, slots, seq = h10_problem(b, n, 28, 4)
        kp = dataclasses.replace(kp, dither_layout="h8")
        return functools.partial(decode_int8, qb, kp, vp, slots, seq, layer=LAYER, seed=SEED, impl="gluon",
                                 cert=True, cert_b=False)

    return {"kv4rl_b32_16k": (functools.partial(kv4rl, 32, 16384)),
            "kv4rl_b128_16k": (functools.partial(kv4rl, 128, 16384)),
            "kv4rl_b512_4k": (functools.partial(kv4rl, 512, 4096)),
            "cert_b8_32k": (functools.partial(cert, 8, 32768)),
            "cert_b64_32k": (functools.partial(cert, 64, 32768)),
            "cert_b2_4k": (functools.partial(cert, 2, 4096))}


def main(rounds: int = 3) -> None:
    import kvlib.kernels.merge_tl as M

    started = datetime.datetime.now(datetime.UTC)
    rows = []
    for name, make in _steps().items():
        fn = make()
        outs = {}
        for r in ROWS:
            with module_flags(M, MERGE_ROWS=r):
                res = fn()
            parts = [getattr(res, f.name) for f in dataclasses.fields(res)] if dataclasses.is_dataclass(res) else res
            outs[r] = [x for x in parts if isinstance(x, torch.Tensor)]
        same = {f"rows{r}_identical": all(torch.equal(x, y) for x, y in zip(outs[ROWS[0]], o, strict=True))
                for r, o in outs.items()}

        def timer(r, fn=fn):
            with module_flags(M, MERGE_ROWS=r):
                return _time(fn)[0]

        times = interleaved({f"rows{r}": functools.partial(timer, r) for r in ROWS}, rounds, strict=True)
        row = dict(step=name, **same, **{f"{k}_ms": med for k, (med, _) in times.items()},
                   **{f"{k}_rounds_ms": per for k, (_, per) in times.items()})
        rows.append(row)
        print({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items() if "rounds" not in k},
              flush=True)
        del fn
        torch.cuda.empty_cache()
    write_probe(sys.argv[1] if len(sys.argv) > 1 else "merge_probe.json", "merge_probe", rows, started,
                {"command": "python -m kvlib.bench._merge_probe", "rows": ROWS, "rounds": rounds})


if __name__ == "__main__":
    main()
