"""``python -m kvlib.bench TOPIC [TOPIC ...] [--profile gpu]``: run benchmark modules, save results.

Each topic is a module ``kvlib.bench.<topic>`` exposing ``run(profile) -> dict``; its result goes to
``data/results/<profile>/<topic>.json`` with provenance. One topic failing does not stop the others.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import pkgutil
import sys
import traceback

import kvlib.bench as pkg
from kvlib.publish.provenance import PROFILES, save_result


def topics() -> list[str]:
    # modules starting with "_" are development probes run on their own (python -m kvlib.bench._name)
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)
                  if m.name not in {"timing", "__main__"} and not m.name.startswith("_"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlib.bench")
    ap.add_argument("topics", nargs="*", help=f"benchmarks to run (default: all of {topics()})")
    ap.add_argument("--profile", choices=PROFILES, default=None, help="default: gpu on CUDA, ci elsewhere")
    args = ap.parse_args(argv)
    import torch

    profile = args.profile or ("gpu" if torch.cuda.is_available() else "ci")
    names = args.topics or topics()
    unknown = [t for t in names if t not in topics()]
    if unknown:
        ap.error(f"unknown topic(s) {unknown}; available: {topics()}")
    failed = []
    for t in names:
        started = _dt.datetime.now(_dt.UTC)
        print(f"== {t} [{profile}]", flush=True)
        try:
            mod = importlib.import_module(f"kvlib.bench.{t}")
            res = mod.run(profile)
            path = save_result(t, profile, {"results": res}, {"topic": t, "profile": profile}, started, overwrite=True)
            print(f"   saved {path}", flush=True)
        except Exception:  # noqa: BLE001 - report and go on with the next topic
            traceback.print_exc()
            failed.append(t)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
