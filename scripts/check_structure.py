#!/usr/bin/env python3
"""Print kvcoord's module sizes, longest functions and layering breaches; fail CI on a breach.

Issue 12 ("Size and layering"): no module over 700 lines, no function over 80, no import that points
up the layering of DESIGN.md, argparse only in ``kvcoord/cli/``. ``LAYERS`` below is the one written
source of truth for the layering; a new module fails the check until it is placed there.

Run from anywhere: ``python scripts/check_structure.py``. Exit status 0 when everything holds, 1 otherwise.
The generated ``kvcoord/proto/**`` is not checked.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

LAYERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("kvcoord", "kvcoord._native", "kvcoord.native", "kvcoord.proto", "kvcoord.load", "kvcoord.transport"),
     "leaves: the version, the native switch and extension, generated protobuf, shared load and gRPC types"),
    (("kvcoord.hashing", "kvcoord.sglang_hash", "kvcoord.vllm_hash"),
     "vLLM's and SGLang's block hashes: everything else speaks in them"),
    (("kvcoord.events",), "the event model and its codecs, built on the hashes"),
    (("kvcoord.validate",), "the one rule set that turns events into index operations"),
    (("kvcoord.wire",), "the agent-to-coordinator wire format, carrying validated events"),
    (("kvcoord.index",), "the Index protocol and its backends, fed with validated operations"),
    (("kvcoord.engine",), "the ZMQ wire and the relay: below the coordinator, which relays engines itself"),
    (("kvcoord.tokenize",), "prompt text to token ids: the coordinator tokenizes prompts"),
    (("kvcoord.coordinator",), "the service: ingest into an index, lookups, registry, metrics, server"),
    (("kvcoord.agent",), "the engine side: BlockPool and the reporter that streams to the coordinator"),
    (("kvcoord.router",), "the coordinator's client and the placement policies that take its answers"),
    (("kvcoord.gateway",), "the OpenAI proxy and the Envoy endpoint picker, above the client and policies"),
    (("kvcoord.sim",), "simulated engines and clusters driving real pools, agents and routers"),
    (("kvcoord.cli",), "the kvcoord command: the only place that parses arguments"),
)
"""Lowest first. A module may import from its own layer and lower ones only (``if TYPE_CHECKING:`` too)."""

MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80
TOP_FUNCTIONS = 15
ARGPARSE_HOME = "kvcoord.cli"
EXCLUDED = ("kvcoord.proto",)
"""Generated code: not measured and not scanned for imports."""

PENDING: dict[str, str] = {}
"""Known breaches with an owner. Still failures: the note only says who is on it."""

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvcoord"


@dataclass(frozen=True)
class Function:
    path: str
    line: int
    name: str
    lines: int

    @property
    def key(self) -> str:
        return f"{self.path}:{self.name}"


@dataclass(frozen=True)
class Import:
    path: str
    line: int
    importer: str
    target: str
    type_checking: bool


def _prefix_of(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int | None:
    """The layer of ``module`` by its longest listed prefix (``kvcoord`` alone only matches itself)."""
    best: tuple[int, int] | None = None
    for level, (prefixes, _reason) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix if prefix == "kvcoord" else _prefix_of(module, prefix)
            if matches and (best is None or len(prefix) > best[0]):
                best = (len(prefix), level)
    return None if best is None else best[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file() or base.is_dir()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Scan(ast.NodeVisitor):
    """One file's functions (qualified names) and imports (absolute, with the TYPE_CHECKING flag)."""

    def __init__(self, path: str, module: str, is_package: bool) -> None:
        self.path, self.module, self.is_package = path, module, is_package
        self.functions: list[Function] = []
        self.imports: list[tuple[int, str, bool]] = []
        self._scope: list[str] = []
        self._type_checking = 0

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        name = ".".join([*self._scope, node.name])
        end = node.end_lineno if node.end_lineno is not None else node.lineno
        self.functions.append(Function(self.path, node.lineno, name, end - node.lineno + 1))
        self._scoped(node)

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._type_checking += 1
        for child in node.body:
            self.visit(child)
        self._type_checking -= 1
        for child in node.orelse:
            self.visit(child)

    def _add(self, line: int, target: str) -> None:
        self.imports.append((line, target, self._type_checking > 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node.lineno, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.module.split(".")
            if not self.is_package:
                package.pop()
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self._add(node.lineno, sub if alias.name != "*" and _is_module(sub) else base)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                self._add(node.lineno, arg.value)
        self.generic_visit(node)


def scan() -> tuple[list[tuple[int, str]], list[Function], list[Import], list[str], list[str]]:
    """Sizes, functions, kvcoord imports, argparse breaches and names of every checked module."""
    modules: list[str] = []
    sizes: list[tuple[int, str]] = []
    functions: list[Function] = []
    imports: list[Import] = []
    argparse_uses: list[str] = []
    for file in sorted(PACKAGE.rglob("*.py")):
        module = module_name(file)
        if any(_prefix_of(module, excluded) for excluded in EXCLUDED):
            continue
        modules.append(module)
        rel = file.relative_to(ROOT).as_posix()
        text = file.read_text(encoding="utf-8")
        sizes.append((len(text.splitlines()), rel))
        visitor = _Scan(rel, module, file.name == "__init__.py")
        visitor.visit(ast.parse(text, filename=rel))
        functions.extend(visitor.functions)
        for line, target, type_checking in visitor.imports:
            if target.split(".")[0] == "argparse" and not _prefix_of(module, ARGPARSE_HOME):
                argparse_uses.append(f"{rel}:{line}: imports argparse (only {ARGPARSE_HOME} parses)")
            if _prefix_of(target, "kvcoord"):
                imports.append(Import(rel, line, module, target, type_checking))
    sizes.sort(key=lambda s: (-s[0], s[1]))
    functions.sort(key=lambda f: (-f.lines, f.path, f.line))
    return sizes, functions, imports, argparse_uses, modules


def layering(imports: list[Import], modules: list[str]) -> list[str]:
    """Every import that points up the layering or to a module ``LAYERS`` does not place, and every
    module it does not place."""
    problems = [f"{module}: has no layer in LAYERS" for module in modules if layer_of(module) is None]
    for imp in imports:
        low, high = layer_of(imp.target), layer_of(imp.importer)
        where = f"{imp.path}:{imp.line}: {imp.importer} imports {imp.target}"
        where += " (under TYPE_CHECKING)" if imp.type_checking else ""
        if high is None:
            continue  # reported above
        if low is None:
            problems.append(f"{where}: {imp.target} has no layer in LAYERS")
        elif low > high:
            problems.append(f"{where}: layer {low} is above the importer's layer {high}")
    return problems


def report() -> int:
    sizes, functions, imports, argparse_uses, modules = scan()
    failures = 0
    print(f"== module sizes (lines, largest first; limit {MAX_MODULE_LINES})")
    for lines, rel in sizes:
        over = lines > MAX_MODULE_LINES
        failures += over
        print(f"{lines:6d}  {rel}{'  OVER LIMIT' if over else ''}")
    print(f"\n== longest functions (top {TOP_FUNCTIONS}; limit {MAX_FUNCTION_LINES} lines)")
    for fn in functions[:TOP_FUNCTIONS]:
        flag = "  OVER LIMIT" if fn.lines > MAX_FUNCTION_LINES else ""
        print(f"{fn.lines:6d}  {fn.path}:{fn.line}  {fn.name}{flag}")
    long_functions = [fn for fn in functions if fn.lines > MAX_FUNCTION_LINES]
    failures += len(long_functions)
    problems = layering(imports, modules) + argparse_uses
    failures += len(problems)
    print(f"\n== layering ({len(imports)} kvcoord imports checked; lowest layer first)")
    for level, (prefixes, reason) in enumerate(LAYERS):
        print(f"{level:6d}  {', '.join(prefixes)}: {reason}")
    for problem in problems:
        print(f"VIOLATION {problem}")
    if not problems:
        print("no violations")
    print("\n== result")
    for lines, rel in sizes:
        if lines > MAX_MODULE_LINES:
            print(f"FAIL module {rel}: {lines} lines > {MAX_MODULE_LINES}")
    for fn in long_functions:
        note = PENDING.get(fn.key)
        print(f"FAIL function {fn.path}:{fn.line} {fn.name}: {fn.lines} lines > {MAX_FUNCTION_LINES}"
              + (f" (pending: {note})" if note else ""))
    if problems:
        print(f"FAIL layering: {len(problems)} violation(s) above")
    long_keys = {fn.key for fn in long_functions}
    for key in sorted(set(PENDING) - long_keys):
        print(f"note: PENDING lists {key}, which is no longer over the limit: drop the entry")
    print("ok" if not failures else f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(report())
