"""What of ``kvlib`` an execution ran, function by function: the instrumenting import hook and the unit hashes.

Standard library only, and never imported inside a notebook's kernel: the runner's prologue ``exec``s this file's
text (:func:`install` then patches the import system), so the record does not change the module set it reports.
The build side imports it normally to hash the files as they are now (:func:`units`).

A module's *units* are its ``def``s reachable from module level through classes (``C.m``; a second ``def`` of the
same name, e.g. a property's setter, is ``C.m#2``) and its *skeleton*: the module with the body of every such
``def`` left out (imports, constants, class attributes, decorators, signatures and default values stay). A
function nested in another belongs to its parent's unit. The hook inserts ``__kvlib_ran__.add(<unit id>)`` at the
head of every unit's body (on the line of its first statement, so line numbers stay), so a unit is recorded the
first time it is entered; hashes are of ``ast.dump`` without positions, so moving code or editing comments changes
nothing. Triton kernels (a ``jit``/``autotune``/``heuristics`` decorator) are not instrumented: Triton compiles them
from the file's text; :func:`report` takes the ones the interpreter ran from Triton's own record.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys

BUILTIN = "__kvlib_ran__"
KERNEL_DECORATORS = ("jit", "autotune", "heuristics")


def _decorator_names(node: ast.AST) -> list[str]:
    out = []
    for d in getattr(node, "decorator_list", []):
        d = d.func if isinstance(d, ast.Call) else d
        out.append(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return out


def is_kernel(node: ast.AST) -> bool:
    return any(n in KERNEL_DECORATORS for n in _decorator_names(node))


def _walk_units(tree: ast.Module):
    """(qualified unit name, def node) for every unit of ``tree``, in source order."""
    seen: dict[str, int] = {}

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                q = prefix + node.name
                seen[q] = seen.get(q, 0) + 1
                yield (q if seen[q] == 1 else f"{q}#{seen[q]}"), node
            elif isinstance(node, ast.ClassDef):
                yield from visit(node.body, f"{prefix}{node.name}.")
            else:  # if/try/with/for at module or class level: their defs are still reachable
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(node, field, None)
                    if isinstance(sub, list):
                        yield from visit(sub, prefix)

    yield from visit(tree.body, "")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def units(source: str) -> tuple[str, dict[str, str]]:
    """(skeleton hash, {unit: hash of its def}) of a module's source."""
    tree = ast.parse(source)
    found = list(_walk_units(tree))
    hashes = {q: _sha(ast.dump(node)) for q, node in found}
    for _, node in found:
        node.body = []  # a def's body belongs to its unit; what the def itself evaluates stays in the skeleton
    return _sha(ast.dump(tree)), hashes


def instrument(source: str, rel: str) -> ast.Module:
    """``source`` parsed, with the unit-entry record inserted in every non-kernel unit."""
    tree = ast.parse(source)
    for q, node in _walk_units(tree):
        if is_kernel(node):
            continue
        body = node.body
        at = 1 if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None),
                                                                           ast.Constant) and len(body) > 1 else 0
        call = ast.Expr(ast.Call(ast.Attribute(ast.Name(BUILTIN, ast.Load()), "add", ast.Load()),
                                 [ast.Constant(f"{rel}:{q}")], []))
        ref = body[min(at, len(body) - 1)]
        for n in ast.walk(call):
            if "lineno" in n._attributes:
                n.lineno, n.col_offset, n.end_lineno, n.end_col_offset = ref.lineno, ref.col_offset, ref.lineno, \
                    ref.col_offset
        body.insert(at, call)
    return tree


def install(root: str, package: str = "kvlib") -> set:
    """Make every later import of ``package`` (under ``root``) instrumented; returns the set units are added to."""
    import builtins
    import importlib.machinery as mach

    ran: set = getattr(builtins, BUILTIN, None) or set()
    setattr(builtins, BUILTIN, ran)
    root = os.path.abspath(root) + os.sep

    class Loader(mach.SourceFileLoader):
        def source_to_code(self, data, path, *, _optimize=-1):
            rel = os.path.relpath(path, root)
            tree = instrument(data.decode() if isinstance(data, bytes) else data, rel)
            return compile(tree, path, "exec", dont_inherit=True, optimize=_optimize)

        def get_code(self, fullname):  # never the bytecode cache: it holds uninstrumented code
            path = self.get_filename(fullname)
            return self.source_to_code(self.get_data(path), path)

    class Finder:
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name != package and not name.startswith(package + "."):
                return None
            spec = mach.PathFinder.find_spec(name, path)
            if spec is None or not isinstance(spec.loader, mach.SourceFileLoader):
                return spec
            if not os.path.abspath(spec.origin).startswith(root):
                return spec
            spec.loader = Loader(name, spec.origin)
            return spec

    sys.meta_path.insert(0, Finder)
    return ran


def kernels_ran() -> list[tuple[str, str]] | None:
    """(file, qualname) of every Triton function the interpreter ran; None: Triton compiled kernels (or may have),
    and which ones ran is not known here."""
    if "triton" not in sys.modules:
        return []
    interp = sys.modules.get("triton.runtime.interpreter")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True") or interp is None:
        return None
    fns = getattr(getattr(interp, "InterpretedFunction", None), "rewritten_fn", None)
    if fns is None:
        return None
    return [(f.__code__.co_filename, f.__qualname__) for f in fns if hasattr(f, "__code__")]


def report(ran: set, root: str, package: str = "kvlib", subprocess_python: bool = False) -> dict:
    """{module: {file, sha256, skeleton, functions: {unit: hash}}} of every loaded ``package`` module, with only
    the units it ran (all of them when that is not known: a kernel compiled by Triton, a Python subprocess)."""
    root = os.path.abspath(root) + os.sep
    kernels = kernels_ran()
    by_file: dict[str, set] = {}
    for key in ran:
        rel, _, q = key.partition(":")
        by_file.setdefault(rel, set()).add(q)
    for path, q in kernels or []:
        if os.path.abspath(path).startswith(root):
            by_file.setdefault(os.path.relpath(path, root), set()).add(q.replace(".<locals>.", "."))
    out = {}
    for name in sorted(m for m in sys.modules if m == package or m.startswith(package + ".")):
        path = getattr(sys.modules[name], "__file__", None)
        if not path or not os.path.abspath(path).startswith(root):
            continue
        rel = os.path.relpath(os.path.abspath(path), root)
        with open(path, "rb") as f:
            data = f.read()
        skeleton, hashes = units(data.decode())
        if subprocess_python:
            mine = set(hashes)
        else:
            mine = by_file.get(rel, set()) & set(hashes)
            if kernels is None:
                tree = ast.parse(data.decode())
                mine |= {q for q, node in _walk_units(tree) if is_kernel(node)}
        out[name] = {"file": rel, "sha256": hashlib.sha256(data).hexdigest(), "skeleton": skeleton,
                     "functions": {q: hashes[q] for q in sorted(mine)}}
    return out


def changed(entry: dict, source: str | None) -> list[str]:
    """What of a recorded module (:func:`report`'s entry) differs in ``source`` (None: the file is gone)."""
    if source is None:
        return ["the file is gone"]
    skeleton, hashes = units(source)
    out = [] if skeleton == entry["skeleton"] else ["module-level code"]
    out += [q for q, h in entry["functions"].items() if hashes.get(q) != h]
    return out
