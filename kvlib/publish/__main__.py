"""``python -m kvlib.publish``: run the registered notebooks for a profile and build the book.

Examples::

    python -m kvlib.publish build                      # default cpu profile: run every notebook, build HTML
    python -m kvlib.publish run --profile ci           # every notebook at seconds-scale parameters
    python -m kvlib.publish run --only concentration_closed_forms -p n_steps=50000
    python -m kvlib.publish build --no-run             # render what is already executed
    python -m kvlib.publish build --fresh              # execute every notebook, cache or not
    python -m kvlib.publish stamp --profile cpu        # give checkable pre-cache executions a cache key
    python -m kvlib.publish check-html                 # read _build/html for what a reader must not see
    python -m kvlib.publish stale                      # which committed cpu executions a build would redo, and why
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
        p.add_argument("-j", "--jobs", type=int, default=1,
                       help="notebooks executed at a time (each kernel gets cpu_count // jobs threads; the schedule "
                            "starts the longest first and keeps recorded peak memory within budget)")
        if name == "build":
            p.add_argument("--no-run", action="store_true", help="render committed/previous runs without executing")
            p.add_argument("--fresh", action="store_true",
                           help="execute every notebook (default: only those whose cache key changed)")
            p.add_argument("--no-strict", action="store_true",
                           help="Sphinx warnings, provenance problems and duplicate claims warn instead of failing")
    a = sub.add_parser("assemble", help="write book/_render and _toc.yml for a profile")
    a.add_argument("--profile", choices=PROFILES, default="cpu")
    sub.add_parser("toc", help="regenerate _toc.yml from notebooks/registry.yml")
    st = sub.add_parser("stamp", help="give executions made before the cache a cache key, where that is checkable")
    st.add_argument("--profile", choices=PROFILES, default="cpu")
    st.add_argument("--only", nargs="+", metavar="NOTEBOOK")
    st.add_argument("--dry-run", action="store_true", help="say what would be stamped, write nothing")
    ch = sub.add_parser("check-html", help="check the built book for what a reader must not see")
    ch.add_argument("--html", default="_build/html")
    sub.add_parser("list", help="list registered notebooks and their profiles")
    sl = sub.add_parser("stale", help="list the executions a build would run again, with why; exit 1 if any")
    sl.add_argument("--profile", choices=PROFILES, default="cpu")
    sl.add_argument("--only", nargs="+", metavar="NOTEBOOK")
    args = ap.parse_args(argv)

    from kvlib.publish.registry import all_notebooks, load_registry

    if args.cmd == "list":  # the registry alone: works without the book extra
        for nb in all_notebooks():
            print(f"{nb.chapter:22s} {nb.name:36s} profiles={','.join(nb.profiles)}{'  (GPU)' if nb.needs_gpu else ''}")
        return 0
    try:
        from kvlib.publish import assemble as asm
    except ModuleNotFoundError as e:
        print(f"error: `{args.cmd}` needs the book extra ({e.name} is missing): pip install -e \".[book]\" "
              "(or make install)", file=sys.stderr)
        return 2
    if args.cmd == "toc":
        from kvlib.publish.provenance import repo_root

        (repo_root() / "_toc.yml").write_text(asm.write_toc(load_registry()))
        return 0
    if args.cmd == "assemble":
        asm.assemble(args.profile)
        return 0
    if args.cmd == "stamp":
        from tabulate import tabulate

        from kvlib.publish.cache import stamp
        from kvlib.publish.runner import select

        rows = stamp(select(args.profile, args.only), args.profile, write=not args.dry_run)
        print(tabulate(rows, headers=["notebook", "stamp"], tablefmt="github"))
        return 0
    if args.cmd == "stale":
        from kvlib.publish.runner import stale_report

        rows = stale_report(args.profile, args.only)
        for name, why in rows:
            print(f"{name}: {'; '.join(why)}")
        n = len(rows)
        print(f"{n} stale execution(s) at profile {args.profile}" + (
            f": `python -m kvlib.publish run --profile {args.profile} --only {' '.join(r[0] for r in rows)}` "
            "from a clean tree executes them again" if n else ": a build renders every one as committed"))
        return 1 if n else 0
    if args.cmd == "check-html":
        from kvlib.publish.htmlcheck import check_book

        found = check_book(args.html)
        for f in found:
            print(f)
        print(f"{len(found)} problem(s) in {args.html}")
        return 1 if found else 0

    from kvlib.publish.runner import run_notebooks, summary_table

    failed = 0
    outcomes = []
    if args.cmd == "run" or not args.no_run:
        try:
            reuse = args.cmd == "build" and not args.fresh
            outcomes = run_notebooks(args.profile, args.only, dict(args.param), progress=not args.no_progress,
                                     reuse=reuse, jobs=args.jobs)
        except (ValueError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(summary_table(outcomes))
        failed = sum(o.status == "failed" for o in outcomes)
        if failed:
            print(f"\n{failed} notebook(s) failed; the others ran.", file=sys.stderr)
    if args.cmd == "build":
        from kvlib.publish.commits import COMMITTED_PROFILES

        problems: list[str] = []
        asm.assemble(args.profile, outcomes, problems)
        # Claim conflicts are a defect at every profile; provenance only binds committed results (ci results
        # are a smoke run of the working tree).
        fatal = [p for p in problems if not args.no_strict and (args.profile in COMMITTED_PROFILES or "claim id" in p)]
        for p in problems:
            print(f"{'error' if p in fatal else 'warning'}: {p}", file=sys.stderr)
        rerun = asm.notebooks_to_rerun(problems)
        if rerun:
            print(f"re-run: verdicts judged under a rule that changed or was not recorded come from "
                  f"{len(rerun)} notebook(s); re-execute them: python -m kvlib.publish run --profile {args.profile} "
                  f"--only {' '.join(rerun)}", file=sys.stderr)
        if fatal:
            print(f"{len(fatal)} provenance/claim problem(s): the book is not built (--no-strict builds it anyway)",
                  file=sys.stderr)
            return 1
        rc = asm.build_html(strict=not args.no_strict)
        if rc != 0:
            print(f"jupyter-book build failed (exit {rc})", file=sys.stderr)
            return rc
        print("book: _build/html/index.html")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
