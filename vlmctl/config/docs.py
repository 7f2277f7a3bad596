"""Generate `docs/config.md` from the section models' field descriptions: `python -m vlmctl.config.docs > docs/config.md`.

The reference is generated, so it cannot drift from the code (a test compares the file with this output).
"""

from __future__ import annotations

import types
import typing
from enum import Enum
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from vlmctl.config import VlmctlConfig


def _submodel(annotation) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "" if isinstance(value, BaseModel) else f"`{value!r}`"
    if field.default is PydanticUndefined:
        return "required"
    value = field.default
    if isinstance(value, Enum):
        value = value.value
    return f"`{value}`" if value is not None else "`null`"


def _type(annotation) -> str:
    """A short, readable type: `int`, `path`, `a | b` for literals, `list[...]`, `... | null`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is typing.Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [_type(a) for a in args if a is not type(None)]
        return " \\| ".join(parts) + (" \\| null" if type(None) in args else "")
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type(a) for a in args if a is not Ellipsis)}]"
    if annotation is Path:
        return "path"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _rows(model: type[BaseModel], prefix: str, out: list[str], nested: list[tuple[str, type[BaseModel]]]) -> None:
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}"
        sub = _submodel(field.annotation)
        if sub is not None:
            nested.append((key + ("[]" if typing.get_origin(field.annotation) is list else ""), sub))
        description = (field.description or "").replace("|", "\\|")
        out.append(f"| `{key}` | {_type(field.annotation)} | {_default(field)} | {description} |")


def render() -> str:
    lines = [
        "# `vlmctl.yaml` reference",
        "",
        "Generated from the section models in `vlmctl/config/` by `python -m vlmctl.config.docs`; do not edit by hand.",
        "Paths are relative to the project file's directory. Any key can be overridden on the command line:",
        "`vlmctl train train.learning_rate=1e-4 train.max_steps=50`.",
        "",
    ]
    for section, field in VlmctlConfig.model_fields.items():
        model = _submodel(field.annotation)
        queue = [(section, model)]
        lines += [f"## `{section}`", "", field.description or "", ""]
        while queue:
            prefix, sub = queue.pop(0)
            if prefix != section:
                lines += [f"### `{prefix}`", ""]
            lines += ["| key | type | default | description |", "|---|---|---|---|"]
            nested: list[tuple[str, type[BaseModel]]] = []
            _rows(sub, prefix, lines, nested)
            lines.append("")
            queue.extend(nested)
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
