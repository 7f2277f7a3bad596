"""No module asks which data-parallel strategy runs, except `distributed/engine.py` (the `Engine`s and `strategy_of`)
and `config/plan.py` (where `auto` is resolved): the loop, checkpoints, the export and the rest ask an `Engine` or a
`Strategy`. Checked on the source with `ast`: a comparison or membership test of an expression naming a strategy
against a strategy's name (`strategy == "fsdp"`, `in ("zero2", "zero3")`, `in DEEPSPEED`), `.startswith("zero")`,
indexing a strategy's name (`strategy[-1]`), and `isinstance` against an engine or wrapper class.

`ALLOWED` lists the exceptions with the function(s) they may sit in (None: the whole module). The resolution
functions of `auto` (config/train.py, setup.py's storage/master-weights/liger/precision checks, the autotune probe's
choice) stay there until they move into config/plan.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vlmctl"
ALLOWED: dict[str, set[str] | None] = {
    "distributed/engine.py": None,  # the one reader of a strategy's name
    "config/plan.py": None,  # every `auto` resolved, with its reasons
    # the schema's check that a DeepSpeed JSON goes with a DeepSpeed strategy: config/ sits below distributed/
    "config/train.py": {"_deepspeed_config_needs_deepspeed"},
}
NAMES = {"ddp", "fsdp", "zero", "zero2", "zero3", "deepspeed", "hsdp"}
WRAPPERS = ("DeepSpeed", "DistributedDataParallel", "FSDPModule", "FullyShardedDataParallel", "Engine", "Stepper")


def _names_strategy(node: ast.AST) -> bool:
    """`strategy`, `train.strategy`, `self.strategy`, ... (not a vision feature select strategy)."""
    for sub in ast.walk(node):
        name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else None
        if name and "strateg" in name.lower() and "select" not in name.lower():
            return True
    return False


def _strategy_literal(node: ast.AST) -> bool:
    """A strategy's name, a collection holding one, or a constant of them (DEEPSPEED, SHARDED_STRATEGIES)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lower() in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_strategy_literal(e) for e in node.elts)
    if isinstance(node, ast.Name):
        return "DEEPSPEED" in node.id or "STRATEG" in node.id
    return False


def strategy_tests(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, enclosing function or "") of every strategy test in `tree` (see the module docstring)."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        hit = False
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            hit = any(_names_strategy(o) for o in operands) and any(_strategy_literal(o) for o in operands)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("startswith", "endswith"):
            hit = _names_strategy(node.func.value) or any(_strategy_literal(a) for a in node.args)
        elif isinstance(node, ast.Subscript):
            hit = isinstance(node.value, (ast.Name, ast.Attribute)) and _names_strategy(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" and len(node.args) == 2:
            hit = any(w in ast.unparse(node.args[1]) for w in WRAPPERS)
        if hit:
            found.append((node.lineno, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "")
    return found


def test_only_the_engine_and_the_plan_ask_which_strategy_runs():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        allowed = ALLOWED.get(rel, set())
        if allowed is None:
            continue
        for line, function in strategy_tests(ast.parse(path.read_text(), filename=str(path))):
            if function not in allowed:
                offenders.append(f"vlmctl/{rel}:{line} ({function or 'module level'})")
    assert not offenders, ("strategy tested outside distributed/engine.py and config/plan.py (ask the Engine, or "
                           "distributed.engine.strategy_of / is_deepspeed / is_fsdp):\n" + "\n".join(offenders))


@pytest.mark.parametrize("source", [
    'if train.strategy == "fsdp": pass',
    'x = strategy in ("zero2", "zero3")',
    'x = train.strategy not in DEEPSPEED',
    'x = cfg.train.strategy.startswith("zero")',
    'x = int(train.strategy[-1])',
    'x = isinstance(stepper, DeepSpeedStepper)',
    'x = isinstance(model, DistributedDataParallel)',
    'x = "ddp" != self.strategy',
])
def test_the_check_catches_the_strategy_tests_it_is_for(source):
    assert strategy_tests(ast.parse(source))


@pytest.mark.parametrize("source", [
    'x = model.vision_feature_select_strategy == "full"',
    'x = strategy_of(train.strategy).fsdp',
    'x = train.strategy == "auto"',
    'x = engine.none_norm_skips',
])
def test_the_check_leaves_other_comparisons_alone(source):
    assert not strategy_tests(ast.parse(source))
