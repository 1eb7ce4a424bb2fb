"""The house's import arrows run one way: no import circle among the modules of engine/ or
agent_bridge/, counting the imports placed inside functions (an import moved into a function
to dodge a circle still closes it), and none among their wings (engine/base, engine/caches,
... agent_bridge/apis, ...): a wing imports only the wings below it. Read from the source
(ast), so nothing is imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "agent_bridge")


def modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package's __init__)"""
    found = {}
    for package in PACKAGES:
        for file in (REPO / package).rglob("*.py"):
            parts = list(file.relative_to(REPO).with_suffix("").parts)
            if "reference_model" in parts[1] if len(parts) > 1 else False:
                continue
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (file, is_package)
    return found


def imports(mods: dict) -> dict[str, set[str]]:
    """module -> the modules of ours it imports, anywhere in its file."""

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    arrows = {}
    for name, (file, is_package) in mods.items():
        out = set()
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                out.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".")[: None if is_package else -1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join(here + ([node.module] if node.module else []))
                for alias in node.names:  # `from pkg import submodule` imports the submodule
                    out.add(known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in mods else known(base))
        out.discard(None)
        out.discard(name)
        arrows[name] = out
    return arrows


def circles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in arrows.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(arrows):
        if v not in index:
            visit(v)
    return found


def wing(module: str) -> str:
    """engine.caches.prefix_cache -> engine.caches; a top-level module (engine.engine,
    agent_bridge.cli) is its own wing."""
    parts = module.split(".")
    return ".".join(parts[:2])


def wing_arrows(arrows: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for src, targets in arrows.items():
        if src in PACKAGES:  # a package's public face (engine/__init__.py) sits above its wings
            continue
        for dst in targets:
            if dst not in PACKAGES and wing(src) != wing(dst):
                out.setdefault(wing(src), set()).add(wing(dst))
    return out


def test_no_module_imports_in_a_circle():
    assert circles(imports(modules())) == []


def test_no_wing_imports_a_wing_above_it():
    assert circles(wing_arrows(imports(modules()))) == []


def test_wings_below_the_package_do_not_import_its_public_face():
    """engine/__init__.py imports every wing; a wing importing `engine` itself would run back up."""
    arrows = imports(modules())
    back = sorted(m for m, targets in arrows.items() if m.startswith("engine.") and "engine" in targets)
    assert back == []


def test_the_check_sees_a_circle_closed_inside_a_function():
    assert circles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    mods = {"engine.x": (REPO / "tests" / "test_import_layers.py", False)}
    assert imports(mods) == {"engine.x": set()}


if __name__ == "__main__":  # the note's check output
    arrows = imports(modules())
    print(f"{len(arrows)} modules, {sum(map(len, arrows.values()))} import arrows")
    print("module circles:", circles(arrows) or "none")
    wings = wing_arrows(arrows)
    print("wing circles:", circles(wings) or "none")
    for w in sorted(wings):
        print(f"  {w} -> {', '.join(sorted(wings[w]))}")
