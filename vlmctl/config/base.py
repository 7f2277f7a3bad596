"""Shared pieces of the section models: strict models and project-relative paths."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_default=True)


def resolve_path(value: Path | None, info: ValidationInfo) -> Path | None:
    """Resolve `value` against the project file's directory (passed as validation context `base_dir`)."""
    if value is None:
        return None
    value = Path(value).expanduser()
    base = (info.context or {}).get("base_dir")
    if not value.is_absolute() and base is not None:
        value = Path(base) / value
    return value


def resolve_str_path(value: Any, info: ValidationInfo) -> Any:
    """Like `resolve_path` but keeps strings that are not local paths (Hub ids like `org/name`)."""
    if value is None:
        return None
    base = (info.context or {}).get("base_dir")
    text = str(value)
    looks_local = text.startswith((".", "/", "~")) or (base is not None and (Path(base) / text).exists())
    if looks_local:
        p = Path(text).expanduser()
        if not p.is_absolute() and base is not None:
            p = Path(base) / p
        return str(p.resolve())
    return text


ProjectPath = Annotated[Path, AfterValidator(resolve_path)]
"""A path written relative to the project file's directory."""

ModelRef = Annotated[str, AfterValidator(resolve_str_path)]
"""A Hub id (`org/name`) or a local path relative to the project file's directory."""
