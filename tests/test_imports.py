"""The package's import graph has no circles: neither between modules nor between subpackages.

Read from the source with `ast` (nothing is imported): every `import` and `from ... import`,
at module level or inside a function, counts. A circle between modules means neither can be
read, tested or replaced alone; a circle between subpackages means the layers of
docs/architecture.md are not layers. Imports under `if TYPE_CHECKING:` never run, but a type
named from a higher layer ties the layers for a reader all the same: the subpackage check
counts them too.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "contbatch"


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    return skipped


def imports(name: str, path: Path, known: dict[str, Path], type_checking: bool = False) -> set[str]:
    """The package's modules `name` imports (a `from pkg import mod` names the module); those
    under `if TYPE_CHECKING:` only with `type_checking`."""
    tree = ast.parse(path.read_text())
    skipped = set() if type_checking else _type_checking_nodes(tree)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                target = f"{prefix}.{alias.name}"
                found.add(target if target in known else prefix)
    return {t for t in found if t in known and t != name}


def graph(type_checking: bool = False) -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known, type_checking) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def subpackage(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def test_no_module_imports_in_a_circle():
    found = cycles(graph())
    assert not found, "import circles between modules:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_subpackages_import_in_a_circle():
    edges: dict[str, set[str]] = defaultdict(set)
    witness: dict[tuple[str, str], str] = {}
    for module, targets in graph(type_checking=True).items():
        for target in targets:
            a, b = subpackage(module), subpackage(target)
            if a != b:
                edges[a].add(b)
                witness.setdefault((a, b), f"{module} -> {target}")
    found = cycles(dict(edges))
    lines = []
    for component in found:
        members = set(component)
        lines.append(" <-> ".join(component) + ": " + "; ".join(
            w for (a, b), w in sorted(witness.items()) if a in members and b in members))
    assert not found, "import circles between subpackages:\n" + "\n".join(lines)


def test_the_walker_finds_a_circle(tmp_path):
    """The check itself can fail: a made-up circle is found, a TYPE_CHECKING import is not."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from x import y\nimport z\n")
    assert imports("m", src, {"m": src, "x.y": src, "z": src}) == {"z"}
    assert imports("m", src, {"m": src, "x.y": src, "z": src}, type_checking=True) == {"x.y", "z"}
