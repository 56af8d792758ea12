"""Architecture figures over src/corral, read from its own imports and definitions:
no import cycle, no module over 600 lines, no function over 80, no class over 25 methods, no
class named for stand-ins, no gateway module importing `corral.worker`, at most 3 parameters
typed as the whole `Store`, no `-> X | Response`, no mixin stack. `scripts/architecture.py`
prints them; the unit tier asserts those that hold."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_CLASS_METHODS = 25
MAX_WHOLE_STORE_PARAMS = 3
STAND_IN_WORDS = ("standin", "mirror")


def modules() -> Iterator[tuple[str, Path]]:
    """(dotted name, path) of every module of the package."""
    for f in sorted((SRC / "corral").rglob("*.py")):
        parts = f.relative_to(SRC).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), f


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (at any depth, typing-only included)."""
    files = dict(modules())
    graph: dict[str, set[str]] = {m: set() for m in files}
    for m, f in files.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    if sub in files:
                        graph[m].add(sub)
                    elif node.module in files:
                        graph[m].add(node.module)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in files)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    component.append(x)
                    if x == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


@dataclass
class Figures:
    """What breaks each bound (empty lists mean the figure holds)."""

    cycles: list[list[str]] = field(default_factory=list)
    long_modules: list[str] = field(default_factory=list)
    long_functions: list[str] = field(default_factory=list)
    big_classes: list[str] = field(default_factory=list)
    stand_in_classes: list[str] = field(default_factory=list)
    gateway_imports_worker: list[str] = field(default_factory=list)
    whole_store_params: list[str] = field(default_factory=list)
    or_response_returns: list[str] = field(default_factory=list)
    mixin_stacks: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        out = [k for k, v in vars(self).items() if v and k != "whole_store_params"]
        if len(self.whole_store_params) > MAX_WHOLE_STORE_PARAMS:
            out.append("whole_store_params")
        return out


def _is_whole_store(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation).replace('"', "").replace("'", "")
    return any(part.strip() in ("Store", "store.Store") for part in text.split("|"))


def measure() -> Figures:
    """Every figure, with what breaks it."""
    figs = Figures()
    graph = import_graph()
    figs.cycles = cycles(graph)
    for name, path in modules():
        rel = str(path.relative_to(SRC.parent))
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            figs.long_modules.append(f"{rel}: {len(text.splitlines())} lines")
        if name.startswith("corral.gateway") and any(
            m == "corral.worker" or m.startswith("corral.worker.") for m in graph[name]
        ):
            figs.gateway_imports_worker.append(rel)
        for node in ast.walk(ast.parse(text, rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                _function(figs, f"{rel}:{node.lineno} {node.name}", node)
            elif isinstance(node, ast.ClassDef):
                _class(figs, f"{rel}:{node.lineno} {node.name}", node)
    return figs


def _function(figs: Figures, where: str, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
    length = (node.end_lineno or node.lineno) - node.lineno + 1
    if length > MAX_FUNCTION_LINES:
        figs.long_functions.append(f"{where}: {length} lines")
    if node.returns is not None:
        returns = ast.unparse(node.returns).replace('"', "")
        if any(part.strip() == "Response" for part in returns.split("|")) and "|" in returns:
            figs.or_response_returns.append(f"{where} -> {returns}")
    args = node.args
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
        if _is_whole_store(arg.annotation):
            figs.whole_store_params.append(f"{where}({arg.arg})")


def _class(figs: Figures, where: str, node: ast.ClassDef) -> None:
    methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if len(methods) > MAX_CLASS_METHODS:
        figs.big_classes.append(f"{where}: {len(methods)} methods")
    if any(word in node.name.lower() for word in STAND_IN_WORDS):
        figs.stand_in_classes.append(where)
    mixins = [ast.unparse(b) for b in node.bases if ast.unparse(b).endswith("Mixin")]
    if mixins:
        figs.mixin_stacks.append(f"{where}({', '.join(mixins)})")
