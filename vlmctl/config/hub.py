"""`hub` section: where `vlmctl push` uploads and what the model card says."""

from __future__ import annotations

from pydantic import Field

from vlmctl.config.base import Section


class HubSection(Section):
    repo_id: str | None = Field(None, description="Hub repository, ORG/NAME.")
    private: bool = Field(True, description="Create the repository as private.")
    revision: str | None = Field(None, description="Branch to push to (default: the repository's main branch).")
    license: str = Field("apache-2.0", description="License identifier written into the model card.")
    tags: list[str] = Field(default_factory=list, description="Extra model card tags.")
    datasets: list[str] = Field(default_factory=list, description="Hub dataset ids listed in the model card metadata.")
    commit_message: str | None = Field(None, description="Commit message for the upload.")
