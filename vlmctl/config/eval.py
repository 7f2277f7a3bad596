"""`eval` section: what `vlmctl eval` scores and how."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from vlmctl.config.base import ProjectPath, Section


class EvalSection(Section):
    data: str = Field("val", description="val = the prepared val split; or a path in any format the data commands read.")
    task: Literal["auto", "vqa", "docvqa", "chartqa", "mcq", "caption", "asr", "loss"] = Field("auto", description="Metric family (asr: word and character error rates of transcripts); auto picks from the data.")
    max_new_tokens: int = Field(32, gt=0, description="Tokens generated per answer (greedy).")
    batch_size: int = Field(8, gt=0, description="Samples per generation batch.")
    limit: int | None = Field(None, gt=0, description="Score at most this many samples.")
    backend: Literal["hf", "vllm"] = Field("hf", description="Generation backend; vllm when installed.")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field("auto", description="Compute dtype of the evaluated model; auto = bf16 on GPUs that support it, fp32 on CPU.")
    output_dir: ProjectPath = Field(Path("outputs/eval"), description="Where predictions.jsonl and metrics.json go.")
