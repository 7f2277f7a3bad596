"""`project` section: names and where outputs go."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from vlmctl.config.base import ProjectPath, Section


class ProjectSection(Section):
    name: str = Field("vlmctl-project", min_length=1, description="Project name; used in run names and model cards.")
    output_dir: ProjectPath = Field(Path("outputs"), description="Root folder for outputs (relative to the project file).")
    seed: int = Field(0, ge=0, description="Base random seed for data splits, initialization and training.")
