"""`vlmctl data validate`: the checks of `data prepare` without writing anything.

    report = validate_data(cfg.data)                      # the configured sources
    report = validate_data(cfg.data, paths=["raw.json"])  # given files/folders (format auto), or a prepared dir
    report = validate_data(cfg.data, processor_dir=built_model, row_budget=RowBudget(8192, 2))  # too_long per row too
    report.ok, report.counts["corrupt_image"], report.examples["corrupt_image"][0]["location"]
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmctl.config.data import DataSection, DataSource
from vlmctl.data.checks import REASONS, Rejection
from vlmctl.data.formats.llamafactory import INFO_FILE
from vlmctl.data.pipeline import RowBudget, SourceTally, iter_checked, progress_bar, unique_sources
from vlmctl.data.tokens import has_processor
from vlmctl.errors import UsageError


@dataclass
class ValidationReport:
    """Counts per reason code with the first few locations of each."""

    total: int = 0
    kept: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    flagged: dict[str, int] = field(default_factory=dict)  # kept samples with a finding (duplicate_id with `keep`)
    sources: list[SourceTally] = field(default_factory=list)
    tokens_checked: bool = False

    @property
    def rejected(self) -> int:
        return sum(self.counts.values())

    @property
    def ok(self) -> bool:
        """True when no sample would be rejected."""
        return self.rejected == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "total": self.total,
            "kept": self.kept,
            "rejected": self.rejected,
            "counts": {r: self.counts[r] for r in REASONS if self.counts.get(r)},
            "examples": {r: self.examples[r] for r in REASONS if r in self.examples},
            "flagged": dict(sorted(self.flagged.items())),
            "sources": [t.to_dict() for t in self.sources],
            "tokens_checked": self.tokens_checked,
        }


def sources_for_paths(paths: list[str | Path], *, image_root: str | Path | None = None,
                      format: str = "auto", dataset: str | None = None) -> list[DataSource]:
    """DataSources for paths given on the command line, in `format` (auto: detected) with relative image paths
    resolved against `image_root` (default: each file's folder); a prepared folder (with manifest.json) is read
    back as parquet; `dataset` names the data set of a LLaMA-Factory `dataset_info.json`.

    Raises UsageError (naming `--dataset` and the registered names) for a dataset_info.json given without
    `dataset` that registers more than one data set, or with a name it does not register, and for `dataset` with
    no dataset_info.json."""
    root = str(Path(image_root).expanduser().resolve()) if image_root is not None else None
    out = []
    for p in paths:
        path = Path(p).expanduser()
        resolved = str(path.resolve()) if path.exists() else str(path)
        if path.is_dir() and (path / "manifest.json").is_file():
            out.append(DataSource(path=resolved, format="parquet", name=path.name))
        else:
            name = dataset
            if format in ("auto", "llamafactory") and path.name == INFO_FILE and path.is_file():
                name = _dataset_name(path, dataset)
            out.append(DataSource(path=resolved, format=format, image_root=root, dataset=name))
    if dataset is not None and not any(Path(s.path).name == INFO_FILE for s in out):
        raise UsageError(f"--dataset {dataset} names a data set of LLaMA-Factory's {INFO_FILE}, and none is given",
                         hint=f"pass the {INFO_FILE} file: `vlmctl data validate data/{INFO_FILE} --dataset {dataset}`")
    return out


def _dataset_name(info_file: Path, dataset: str | None) -> str | None:
    """The data set of `info_file` to read: `dataset`, or the one it registers when it registers one. Raises
    UsageError for an unknown name, or none given where there are several; a file that cannot be read as JSON is
    left to the reader, which reports it."""
    try:
        entries = json.loads(info_file.read_text())
    except (OSError, ValueError):
        return dataset
    if not isinstance(entries, dict) or dataset in entries:
        return dataset
    if dataset is None and len(entries) == 1:
        return str(next(iter(entries)))
    names = ", ".join(sorted(map(str, entries))) or "none"
    what = "names no data set: pass --dataset" if dataset is None else f"has no data set {dataset!r}"
    raise UsageError(f"{info_file} {what}", hint=f"pass --dataset NAME, one of: {names}")


def validate_data(
    data: DataSection,
    *,
    paths: list[str | Path] | None = None,
    num_proc: int | None = None,
    processor_dir: Path | None = None,
    progress: bool = True,
    max_examples: int = 5,
    row_budget: RowBudget | None = None,
    image_root: str | Path | None = None,
    format: str = "auto",
    dataset: str | None = None,
) -> ValidationReport:
    """Run every check over `data.sources` (or `paths`) and count rejections per reason (a duplicate's detail names
    the earlier sample it repeats). Writes nothing. too_long is checked when `processor_dir` holds a processor:
    over `data.max_length` tokens (text + visual), or over `row_budget.tokens` (one packed training row,
    `train.tokens_per_batch x train.sequence_parallel`) when that is smaller. `image_root`, `format` and `dataset`
    apply to `paths` (`sources_for_paths`).

    Raises UsageError when there is nothing to check, MissingSourceError (a DataError, exit code 2) for a source
    that does not exist and DataError when a source cannot be opened.
    """
    raw = sources_for_paths(paths, image_root=image_root, format=format, dataset=dataset) if paths else list(data.sources)
    if not raw:
        raise UsageError("no data to validate", hint="pass files/folders (`vlmctl data validate data/raw/train.json`) or list data.sources in vlmctl.yaml")
    sources = unique_sources(raw)
    report = ValidationReport(sources=[SourceTally(s.name, s.path, s.format) for s in sources], tokens_checked=has_processor(processor_dir))
    with progress_bar(progress, "Validating") as advance:
        for src, item, info in iter_checked(data, sources, num_proc=num_proc, processor_dir=processor_dir, on_item=advance,
                                            row_budget=row_budget):
            report.total += 1
            report.sources[src].add(item, info)
            if isinstance(item, Rejection):
                report.counts[item.reason] = report.counts.get(item.reason, 0) + 1
                examples = report.examples.setdefault(item.reason, [])
                if len(examples) < max_examples:
                    examples.append({"source": item.source, "location": item.location, "detail": item.detail, "id": item.id})
            else:
                report.kept += 1
                for flag in info.flags:
                    report.flagged[flag] = report.flagged.get(flag, 0) + 1
    return report
