"""The layout's house rules, checked on the source with `ast` (docs/architecture.md explains the layout):

- family knowledge lives in vlmctl/families/: no other module compares against or branches on a family name;
- library code never imports the CLI (vlmctl/cli/ renders errors; the library raises typed ones);
- no import cycle between vlmctl modules, counting imports inside functions too;
- layers: families/ imports no other layer (data, models, train, distributed), data/ imports none of models,
  train, distributed (inside functions too);
- an import inside a function says why it is deferred (start-up time, an optional dependency): a top-level comment
  of its module saying what is "imported inside the functions that use" it (or "imported only where used",
  "imported next to their use") and why, not a section heading; or a comment on the import's line or above it;
- the worker reads as named steps: train/worker.py stays short.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
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
SOURCES = {name: path.read_text() for name, path in MODULES.items()}
TREES = {name: ast.parse(source, filename=str(MODULES[name])) for name, source in SOURCES.items()}


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


MODULE_NOTE = re.compile(r"#(?!\s*[-=#*~]{3}).*\bimported (inside|only where|next to)\b")
"""A module-level comment (column 0, no section heading) that says the module imports things inside its functions:
"X is imported inside the functions that use it", "... imported only where used", "... imported next to their use"."""
NOTE_REASON = re.compile(r"start-up|optional|cycle|circular|must not|does not load|without it|loads anyway")
"""The reason the note's comment block (it and the column-0 comment lines around it) must give for the deferral."""
NOT_A_REASON = re.compile(r"#\s*(noqa|type:|pragma|isort|fmt)\b")


def deferred_imports(tree: ast.AST) -> list[ast.stmt]:
    """The import statements inside function bodies (nested functions and methods included)."""
    found: list[ast.stmt] = []

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append(child)
            visit(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def unexplained_imports(source: str) -> list[int]:
    """Lines of imports inside functions that no comment explains: none when a top-level comment (column 0) says
    that imports sit inside functions and why, else those without a comment of their own (on their line, or on the line
    above them or above the block of imports they open; `noqa` and the like are no reason)."""
    tree = ast.parse(source)
    imports = deferred_imports(tree)
    if not imports:
        return []
    comments: dict[int, tuple[int, str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = (tok.start[1], tok.string)
    lines = source.splitlines()

    def note_block(line: int) -> str:
        """The column-0 comment lines around `line`, joined."""
        first = last = line
        while comments.get(first - 1, (1,))[0] == 0:
            first -= 1
        while comments.get(last + 1, (1,))[0] == 0:
            last += 1
        return " ".join(comments[n][1].lstrip("#").strip() for n in range(first, last + 1))

    if any(col == 0 and MODULE_NOTE.match(text) and NOTE_REASON.search(note_block(line))
           for line, (col, text) in comments.items()):
        return []

    def reason(line: int) -> bool:
        return line in comments and not NOT_A_REASON.match(comments[line][1])

    bad = []
    for node in imports:
        if any(reason(n) for n in range(node.lineno, node.end_lineno + 1)):
            continue
        above = node.lineno - 1
        while above >= 1 and lines[above - 1].strip().startswith(("import ", "from ")):
            above -= 1  # an import block: the comment above its first import explains it
        if not reason(above):
            bad.append(node.lineno)
    return bad


def test_every_import_inside_a_function_says_why():
    found = {str(MODULES[name].relative_to(PACKAGE.parent)): lines for name, source in SOURCES.items()
             if (lines := unexplained_imports(source))}
    assert found == {}, ("imports inside functions without a comment saying why (a top-level comment of the module "
                         f"naming what is imported inside functions and why, or one on the import): {found}")


def test_the_import_check_catches_an_unexplained_import():
    assert unexplained_imports("def f():\n    import torch\n") == [2]
    assert unexplained_imports("def f():\n    import torch  # noqa: F401\n") == [2]
    assert unexplained_imports("def f():\n    import deepspeed  # optional dependency\n") == []
    assert unexplained_imports("def f():\n    # optional dependencies\n    import deepspeed\n    import soxr\n") == []
    assert unexplained_imports("# torch is imported inside functions: start-up time\n\ndef f():\n    import torch\n") == []
    assert unexplained_imports("def f():\n    # torch is imported here: start-up time\n    x = 1\n    import torch\n") == [4]
    assert unexplained_imports("import torch\n") == []
    # the module note must say that imports sit inside functions, and why; a heading or a passing mention is no note
    assert unexplained_imports("# torch is imported inside functions\n\ndef f():\n    import torch\n") == [4]
    assert unexplained_imports("# --- imported helpers: start-up ---\ndef f():\n    import torch\n") == [3]
    assert unexplained_imports("# modules that load numpy when imported: start-up\ndef f():\n    import torch\n") == [3]
    assert unexplained_imports("# torch is imported inside the functions that use it:\n# the CLI's start-up must not "
                               "pay for it.\ndef f():\n    import torch\n") == []


def test_every_family_module_is_on_the_registration_list():
    # a family registers when vlmctl/families/__init__.py imports its module (the one list of built-in families, in
    # the order of FAMILIES); a module that calls register() but is not on the list would silently not exist
    registering = {name for name, tree in TREES.items() if name.startswith("vlmctl.families.")
                   and any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "register" for n in ast.walk(tree))}
    assert registering and registering <= imports_of("vlmctl.families", TREES["vlmctl.families"])


OBJECTIVE_HOMES = ("vlmctl.train.registry", "vlmctl.train.objectives", "vlmctl.config.objective")
"""Where objectives are named: the registry, the spec, the objectives' config sections; and each objective's own
module (`BUILT_IN`)."""
OBJECTIVE_ALLOWED = {
    "vlmctl.cli.demo": "`vlmctl demo --objective` picks one of the demos (sft trains from scratch, the others start "
                       "from it): a recipe's name, not a run's objective",
}


def objective_dispatch(tree: ast.AST, names: set[str], hook_methods: set[str]) -> list[int]:
    """Lines where `tree` compares an expression that names an objective (its source says `objective`) with an
    objective's name, tests it for membership in a literal holding one, or looks up one of an objective's hook
    methods by name (`getattr` / `hasattr`: hooks are declared in the spec)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any("objective" in ast.unparse(x) for x in sides)
            literal = any(isinstance(x, ast.Constant) and x.value in names for x in sides) or any(
                isinstance(x, (ast.Tuple, ast.List, ast.Set)) and any(isinstance(e, ast.Constant) and e.value in names
                                                                      for e in x.elts) for x in sides)
            if named and literal:
                found.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in hook_methods):
            found.append(node.lineno)
    return sorted(set(found))


def test_no_module_dispatches_on_an_objective_name():
    from vlmctl.train.objectives import HOOKS
    from vlmctl.train.registry import BUILT_IN, OBJECTIVES

    homes = {*OBJECTIVE_HOMES, *(m.__name__ for m in BUILT_IN)}
    methods = {m for ms in HOOKS.values() for m in ms}
    found = {name: lines for name, tree in TREES.items() if name not in homes and name not in OBJECTIVE_ALLOWED
             and (lines := objective_dispatch(tree, set(OBJECTIVES), methods))}
    assert found == {}, f"objective names outside the registry and the objective modules (ask the ObjectiveSpec): {found}"


def test_the_objective_check_catches_the_dispatch_it_is_for():
    src = ('if train.objective == "dpo": pass\nif cfg.train.objective in ("grpo", "x"): pass\n'
           'if labels.get("objective") != "sft": pass\nprepare = getattr(self.objective, "prepare_window", None)\n'
           'if kind == "dpo": pass\nif train.objective == spec.name: pass\n')
    assert objective_dispatch(ast.parse(src), {"sft", "dpo", "grpo"}, {"prepare_window"}) == [1, 2, 3, 4]
