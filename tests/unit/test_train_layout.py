"""The training code stays readable: no function in vlmctl/train/ or vlmctl/distributed/ is longer than 60 lines
(counted with `ast`, decorators and docstring included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vlmctl"
LIMIT = 60


def long_functions(source: str, limit: int = LIMIT) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in `source` longer than `limit` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if node.end_lineno - start + 1 > limit:
                found.append((node.name, node.end_lineno - start + 1))
    return found


def test_no_function_in_train_or_distributed_is_longer_than_60_lines():
    files = sorted([*(PACKAGE / "train").glob("*.py"), *(PACKAGE / "distributed").glob("*.py")])
    assert any(f.name == "mesh.py" for f in files) and any(f.name == "worker.py" for f in files)
    found = {f"{f.parent.name}/{f.name}": funcs for f in files if (funcs := long_functions(f.read_text()))}
    assert found == {}, f"split these functions into named steps: {found}"


def test_the_length_check_counts_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    assert long_functions(f"def short():\n    pass\n\n\ndef long():\n{body}\n") == [("long", 61)]
