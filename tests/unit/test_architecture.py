"""The layout's house rules, checked on the source with `ast` (docs/architecture.md explains the layout):

- family knowledge lives in vlmctl/families/: no other module compares against or branches on a family name;
- library code never imports the CLI (vlmctl/cli/ renders errors; the library raises typed ones);
- no import cycle between vlmctl modules, counting imports inside functions too;
- layers: families/ imports no other layer (data, models, train, distributed), data/ imports none of models,
  train, distributed (inside functions too);
- the worker reads as named steps: train/worker.py stays short.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vlmctl"


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the vlmctl package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


def _family_names() -> set[str]:
    from vlmctl.families import FAMILIES

    names = set(FAMILIES)
    for spec in FAMILIES.values():
        names.update(spec.model_types)
    return names


def _is_family_name_expr(node: ast.AST) -> bool:
    """`fam.name`, `family.name`, `spec.model_type`, `family_name`, `self.family.name`, ... (a family's name)."""
    if isinstance(node, ast.Attribute) and node.attr in ("name", "model_type"):
        base = node.value
        ident = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
        return any(word in ident.lower() for word in ("fam", "spec"))
    if isinstance(node, ast.Name):
        return node.id in ("family_name", "fam_name")
    return False


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            ids.add(id(body[0].value))
    return ids


def family_branches(tree: ast.AST, family_names: set[str]) -> list[int]:
    """Line numbers where `tree` compares against, tests the prefix of, or indexes by a family name, or spells a
    family name that is not also a common word of another namespace (e.g. "llava" is a data format too)."""
    distinctive = {n for n in family_names if any(c.isdigit() or c == "_" for c in n)}
    docstrings = _docstring_nodes(tree)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_is_family_name_expr(x) for x in [node.left, *node.comparators]):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("startswith", "endswith") and _is_family_name_expr(node.func.value)):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and _is_family_name_expr(node.slice):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in distinctive
              and id(node) not in docstrings):
            lines.append(node.lineno)
    return sorted(set(lines))


def imports_of(name: str, tree: ast.AST) -> set[str]:
    """vlmctl modules `name` imports, at module level or inside functions (`from a.b import c` is a.b.c when that
    is a module, else a.b)."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and target != "vlmctl":
                found.add(target)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_module_outside_families_branches_on_a_family_name():
    names = _family_names()
    found = {name: lines for name, tree in TREES.items()
             if not name.startswith("vlmctl.families") and (lines := family_branches(tree, names))}
    assert found == {}, f"family names outside vlmctl/families (ask the family spec instead): {found}"


def test_the_family_check_catches_the_branches_it_is_for():
    src = ('if fam.name == "idefics3": pass\nif family.name.startswith("qwen"): pass\n'
           'x = {"a": 1}[fam.name]\ny = "qwen2_5_vl"\nif fmt == "llava": pass\n')
    assert family_branches(ast.parse(src), {"idefics3", "qwen2_5_vl", "llava"}) == [1, 2, 3, 4]


def test_library_code_never_imports_the_cli():
    offenders = sorted(name for name, tree in TREES.items()
                       if not name.startswith("vlmctl.cli") and name != "vlmctl.__main__"
                       and any(m.startswith("vlmctl.cli") for m in imports_of(name, tree)))
    assert offenders == []


def test_no_import_cycle_inside_vlmctl():
    graph = {name: imports_of(name, tree) for name, tree in TREES.items()}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


LOWER_LAYERS = {
    "vlmctl.families": ("vlmctl.data", "vlmctl.models", "vlmctl.train", "vlmctl.distributed"),
    "vlmctl.data": ("vlmctl.models", "vlmctl.train", "vlmctl.distributed"),
}
"""Package -> the packages its modules must not import: a family knows no pipeline, the data pipeline builds no
model and starts no training (what they need of those is handed to them)."""


def layer_violations(trees: dict[str, ast.AST]) -> dict[str, list[str]]:
    """Module -> the modules of a forbidden package (`LOWER_LAYERS`) it imports, at module level or in functions."""
    found = {}
    for name, tree in trees.items():
        for package, forbidden in LOWER_LAYERS.items():
            if name == package or name.startswith(package + "."):
                bad = sorted(m for m in imports_of(name, tree) if any(m == f or m.startswith(f + ".") for f in forbidden))
                if bad:
                    found[name] = bad
    return found


def test_families_and_data_import_no_higher_layer():
    assert layer_violations(TREES) == {}


def test_the_layer_check_catches_an_import_inside_a_function():
    tree = ast.parse("def f():\n    from vlmctl.models.build import plan_build\n")
    assert layer_violations({"vlmctl.data.counting": tree}) == {"vlmctl.data.counting": ["vlmctl.models.build"]}
    assert layer_violations({"vlmctl.families.spec": ast.parse("import vlmctl.data.collate\n")}) == {"vlmctl.families.spec": ["vlmctl.data.collate"]}
    assert layer_violations({"vlmctl.data.counting": ast.parse("import vlmctl.families.spec\n")}) == {}


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("limit", [250])
def test_the_worker_reads_as_named_steps(limit):
    assert len((PACKAGE / "train" / "worker.py").read_text().splitlines()) <= limit
