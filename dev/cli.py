"""``--help`` for the development probes that read ``sys.argv`` themselves (an output path, a flag or two).

``python -m dev.<name> --help`` prints the probe's usage and docstring and runs nothing: without this guard a
probe would take ``--help`` for its output path and start a GPU run. (The sweeps with an ``argparse`` parser,
``dev.kv4_sweep``, ``dev.int8_sweep`` and ``dev.ncu_summary``, answer ``--help`` themselves.)
"""

from __future__ import annotations

import sys

RESULTS = "dev/results/"


def help_if_asked(doc: str | None, usage: str = "[OUT.json]", argv: list[str] | None = None) -> None:
    """If ``-h``/``--help`` is among the arguments: print ``usage`` and ``doc`` and exit 0; else return."""
    args = sys.argv[1:] if argv is None else argv
    if not {"-h", "--help"} & set(args):
        return
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    name = spec.name if spec is not None else "dev.<name>"
    print(f"usage: PYTHONPATH=. python -m {name} {usage}".rstrip() + "\n")
    print((doc or "").strip() + "\n")
    if "OUT" in usage:
        print(f"OUT: the JSON result with its provenance envelope (default in the current directory); results worth\n"
              f"keeping are committed under {RESULTS} with a row in its README.md (see dev/README.md).")
    raise SystemExit(0)
