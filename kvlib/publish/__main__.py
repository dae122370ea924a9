"""``python -m kvlib.publish``: run the registered notebooks for a profile and build the book.

Examples::

    python -m kvlib.publish build                      # default cpu profile: run every notebook, build HTML
    python -m kvlib.publish run --profile ci           # every notebook at seconds-scale parameters
    python -m kvlib.publish run --only concentration_closed_forms -p n_steps=50000
    python -m kvlib.publish build --no-run             # render what is already executed
"""

from __future__ import annotations

import argparse
import ast
import sys

from kvlib.publish.provenance import PROFILES


def _parse_param(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"parameter {text!r} must look like key=value")
    key, raw = text.split("=", 1)
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw  # a bare string
    return key.strip(), value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvlib.publish", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "build"):
        p = sub.add_parser(name, help=f"{name} the notebooks" + (" and the HTML book" if name == "build" else ""))
        p.add_argument("--profile", choices=PROFILES, default="cpu")
        p.add_argument("--only", nargs="+", metavar="NOTEBOOK", help="run only these registered notebooks")
        p.add_argument("-p", "--param", action="append", type=_parse_param, default=[], metavar="KEY=VALUE",
                       help="override a notebook parameter (repeatable; applies to every selected notebook)")
        p.add_argument("--no-progress", action="store_true")
        if name == "build":
            p.add_argument("--no-run", action="store_true", help="render committed/previous runs without executing")
            p.add_argument("--no-strict", action="store_true", help="do not turn Sphinx warnings into errors")
    a = sub.add_parser("assemble", help="write book/_render and _toc.yml for a profile")
    a.add_argument("--profile", choices=PROFILES, default="cpu")
    sub.add_parser("toc", help="regenerate _toc.yml from notebooks/registry.yml")
    sub.add_parser("list", help="list registered notebooks and their profiles")
    args = ap.parse_args(argv)

    from kvlib.publish import assemble as asm
    from kvlib.publish.registry import all_notebooks, load_registry

    if args.cmd == "list":
        for nb in all_notebooks():
            print(f"{nb.chapter:22s} {nb.name:36s} profiles={','.join(nb.profiles)}{'  (GPU)' if nb.needs_gpu else ''}")
        return 0
    if args.cmd == "toc":
        from kvlib.publish.provenance import repo_root

        (repo_root() / "_toc.yml").write_text(asm.write_toc(load_registry()))
        return 0
    if args.cmd == "assemble":
        asm.assemble(args.profile)
        return 0

    from kvlib.publish.runner import run_notebooks, summary_table

    failed = 0
    if args.cmd == "run" or not args.no_run:
        try:
            outcomes = run_notebooks(args.profile, args.only, dict(args.param), progress=not args.no_progress)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(summary_table(outcomes))
        failed = sum(o.status == "failed" for o in outcomes)
        if failed:
            print(f"\n{failed} notebook(s) failed; the others ran.", file=sys.stderr)
    if args.cmd == "build":
        asm.assemble(args.profile)
        rc = asm.build_html(strict=not args.no_strict)
        if rc != 0:
            print(f"jupyter-book build failed (exit {rc})", file=sys.stderr)
            return rc
        print("book: _build/html/index.html")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
