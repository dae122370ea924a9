"""``python -m kvlib.bench [TOPIC ...] [--profile gpu]``: run benchmark topics, save their results.

Each topic (:data:`kvlib.bench.TOPICS`) is a module exposing ``run(profile) -> dict``; its result goes to
``data/results/<profile>/<topic>.json`` with provenance. One topic failing does not stop the others.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import traceback

from kvlib.bench import TOPICS, topic_module
from kvlib.publish.provenance import PROFILES, save_result


def topics() -> list[str]:
    """Every topic, sorted."""
    return sorted(TOPICS)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvlib.bench",
                                 description="Run benchmark topics; each result goes to "
                                             "data/results/<profile>/<topic>.json.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="topics:\n" + "\n".join(f"  {t:<16} {TOPICS[t]}" for t in topics()))
    ap.add_argument("topics", nargs="*", metavar="TOPIC", help="topics to run (default: all of them)")
    ap.add_argument("--profile", choices=PROFILES, default=None, help="default: gpu on CUDA, ci elsewhere")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    unknown = [t for t in args.topics if t not in TOPICS]
    if unknown:
        ap.error(f"unknown topic(s) {unknown}; available: {topics()}")
    import torch

    profile = args.profile or ("gpu" if torch.cuda.is_available() else "ci")
    failed = []
    for t in args.topics or topics():
        started = _dt.datetime.now(_dt.UTC)
        print(f"== {t} [{profile}]", flush=True)
        try:
            res = topic_module(t).run(profile)
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
