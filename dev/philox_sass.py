"""Offline sm_90 compile of the certified Gluon h8 INT8 kernel with each dither generator (issue 28): the decode
loop's instructions per 16-position tile (one warp), registers, stack and shared memory, and the top opcodes
(:func:`kvlib.bench.sass_count.gluon_count`; no GPU needed). ``python -m dev.philox_sass [OUT.json]`` (default
dev/results/philox_sass.json)."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

NAMES = ("philox4x32-10", "philox4x32-8", "philox4x32-7", "philox4x32-6", "threefry4x32-13", "threefry4x32-20",
         "none")


def main() -> None:
    from kvlib.bench.sass_count import gluon_count
    from kvlib.kernels.tl.philox import generator_constexprs
    from kvlib.publish.provenance import provenance, write_json_atomic

    started = datetime.datetime.now(datetime.UTC)
    res = {}
    for name in NAMES:
        r = gluon_count(**generator_constexprs(name))
        res[name] = {k: r[k] for k in ("instructions", "per_position_head", "registers", "stack_bytes",
                                       "shared_bytes")} | {"top_opcodes": dict(list(r["top_opcodes"].items())[:10])}
        print(name, res[name], flush=True)
    base = res["philox4x32-10"]["instructions"]
    for name in NAMES:
        res[name]["vs_philox10"] = res[name]["instructions"] / base
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "dev/results/philox_sass.json")
    write_json_atomic(out, {"name": "philox_sass", "profile": "cpu (offline sm_90 compile)",
                            "provenance": provenance({"command": "python -m dev.philox_sass"}, started),
                            "results": res})


if __name__ == "__main__":
    from dev.cli import help_if_asked

    help_if_asked(__doc__, "[OUT.json]")
    main()
