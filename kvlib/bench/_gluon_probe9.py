"""Development probe (the stream plan in the latency benchmark: grid vs stream vs stream + prefetch at the three
stream shapes, without and with 12 GB of other tensors allocated): ``python -m kvlib.bench._gluon_probe9 out.json``."""
import datetime
import sys

import torch

import kvlib.bench._gluon_probe as P
from kvlib.bench._h10_probe import write_probe

started = datetime.datetime.now(datetime.UTC)
P.SHAPES = ((64, 32768, 28, 4), (32, 32768, 28, 4), (64, 16384, 28, 4))
F = {"PREFETCH": 0, "PREFETCH_STREAM": 1, "STREAM": False, "CERT_EARLY": False, "STREAM_MIN_PIECE": 0,
     "STREAM_MIN_IDLE": 0}
P.CONFIGS = tuple((n, F | f, 8) for n, f in (("grid", {}), ("stream", {"STREAM": True, "PREFETCH_STREAM": 0}),
                                              ("stream_pf1", {"STREAM": True})))
rows = [dict(r, ballast_gb=0) for r in P.timings()]
ballast = torch.empty(12 * 2**30, dtype=torch.uint8, device="cuda")  # the latency benchmark's other tensors
rows += [dict(r, ballast_gb=12) for r in P.timings()]
write_probe(sys.argv[1], "gluon_probe9", rows, started,
            {"command": "python -m kvlib.bench._gluon_probe9", "shapes": P.SHAPES})
