"""`vlmctl data prepare`: sources -> checks -> dedup -> split -> Parquet shards + manifest (+ energon export).

    result = prepare_data(cfg.data, num_proc=8, processor_dir=cfg.model.output_dir, model=cfg.model,
                          processors=vlmctl.models.build.configured_processor,
                          row_budget=RowBudget(tokens_per_batch=8192, sequence_parallel=2))
    result.manifest["splits"]["train"]["samples"]

Output (`data.prepared_dir`)::

    train/train-00000.parquet ...   rows with the schema of `vlmctl.data.sample.arrow_schema()`
    val/val-00000.parquet ...        (`datasets.load_dataset("parquet", data_dir=prepared_dir)` reads both)
    manifest.json                    kind (sft | preference), sources, totals, splits, image/text/token statistics
    rejected.jsonl                   one line per dropped sample: source, location, reason, detail, id
    length_histogram.png             tokens per sample (or characters when no processor is known), with the limits
    energon/                         with --export energon and no export dir

Everything is written into `.<name>.tmp-<pid>` next to the prepared folder and renamed into place at the end, so
an interrupted run leaves the previous data intact; such folders left by a killed run (their process is gone) are
removed when the next prepare starts. Shards are byte-identical for identical inputs: samples keep input order,
the split is a hash of each sample's content (`checks.is_val`), and no timestamps are written.

Token counts: with the built model's processor (`processor_dir`) when there is one, else with the processor the
configured model will have (`vlmctl.data.counting`; for a random-init preset, a first pass checks every sample
into a spool file, the tokenizer is trained on the train samples kept, and the spool is replayed with counts).
A counted sample over `data.max_length`, or over the packed training row (`row_budget`: `train.tokens_per_batch x
train.sequence_parallel` tokens) when that is smaller, is dropped as too_long; the manifest's `tokens` records the
row budget and the GPUs the longest kept sample needs.

A prepare fails (DataError, nothing replaced) when a source keeps less than `data.min_kept_fraction` of its
records (every rejection counts, those of the project's own limits too, but not the repeats of kept samples:
`check_kept`), when the train split ends
up empty, or when the disk fills up (the message names the path and the free space).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmctl.config.data import DataSection
from vlmctl.config.model import ModelSection
from vlmctl.data.checks import REASONS, Rejection, is_val
from vlmctl.data.pipeline import (DEFAULT_TOKENS_PER_GPU, RowBudget, SourceTally, iter_checked, progress_bar, unique_sources,
                                   with_token_counts)
from vlmctl.data.sample import SCHEMA_VERSION, Sample
from vlmctl.errors import DataError, UsageError
from vlmctl.outputs import check_replaceable, install

if TYPE_CHECKING:
    from vlmctl.data.counting import ProcessorSource

# matplotlib and pyarrow are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.
# Light vlmctl modules and modules the CLI's start-up loads anyway are imported next to their use as well.

ROWS_PER_GROUP = 256
GROUP_BYTES = 64 << 20
EXPORTS = ("energon",)


@dataclass
class PrepareResult:
    """What `prepare_data` wrote. `manifest` is the content of manifest.json."""

    prepared_dir: Path
    manifest: dict[str, Any]
    export_dir: Path | None = None
    token_note: str | None = None  # why there are no token counts, when there are none

    @property
    def kept(self) -> int:
        return self.manifest["totals"]["kept"]

    @property
    def rejected(self) -> dict[str, int]:
        return self.manifest["totals"]["rejected"]

    def to_dict(self) -> dict[str, Any]:
        out = {"prepared_dir": str(self.prepared_dir), "export_dir": str(self.export_dir) if self.export_dir else None, **self.manifest}
        if self.manifest.get("tokens") is None and self.token_note:
            out["token_note"] = self.token_note
        return out


class ShardWriter:
    """Parquet shards of one split: row groups of up to ROWS_PER_GROUP rows / GROUP_BYTES, files of about
    `shard_bytes` (a new file starts once the current one passes it).

    Shards get a `videos` (`audios`) column once a sample with videos (audio clips) arrives: the file being written
    ends there, later files have the column, and at `close` the files written before get it too (null), so every
    shard of a prepared folder has one schema (`datasets.load_dataset("parquet", ...)` needs that). Image-only data
    keeps the image-only schema."""

    def __init__(self, folder: Path, prefix: str, shard_bytes: int):
        from vlmctl.data.sample import arrow_schema

        self.folder, self.prefix, self.shard_bytes = folder, prefix, shard_bytes
        self.modalities: set[str] = {"image"}
        self.preference = False  # a `rejected` column, once a preference pair arrives (same scheme as media columns)
        self.schema = arrow_schema()
        self.rows: list[dict[str, Any]] = []
        self.buffered = 0
        self.writer = None
        self.file_bytes = 0
        self.files: list[str] = []
        self.narrower: dict[str, Any] = {}  # file -> its schema, for files written before a media column was added
        self.samples = 0
        self.bytes = 0

    def add(self, sample: Sample) -> None:
        present = {name for name, parts in sample.media.items() if parts}
        if present - self.modalities or (sample.rejected is not None and not self.preference):
            self.preference |= sample.rejected is not None
            self._widen(present)
        self.rows.append(sample.to_row())
        self.buffered += sum(len(b) for parts in sample.media.values() for b in parts) + sum(len(t) for t in sample.text_parts()) + 64
        self.samples += 1
        if len(self.rows) >= ROWS_PER_GROUP or self.buffered >= GROUP_BYTES:
            self._flush()

    def _open(self) -> None:
        name = f"{self.prefix}-{len(self.files):05d}.parquet"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.writer = _parquet_writer(self.folder / name, self.schema)
        self.files.append(name)
        self.file_bytes = 0

    def _widen(self, present: set[str]) -> None:
        """Switch to the schema with the media columns of `present` too (see the class docstring)."""
        from vlmctl.data.sample import arrow_schema

        self._flush()
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        for name in self.files:
            self.narrower.setdefault(name, self.schema)
        self.modalities |= present
        self.schema = arrow_schema(tuple(self.modalities), preference=self.preference)

    def _add_media_columns(self) -> None:
        """Rewrite the files written before a media column was added with that column null (temporary file, then
        rename), row groups kept as they were."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        for name in self.narrower:
            path = self.folder / name
            table = pq.read_table(path)
            # null, as later rows without such parts have it (`Sample.from_row` reads both as no parts)
            columns = [table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type) for f in self.schema]
            table = pa.Table.from_arrays(columns, schema=self.schema)
            tmp = path.with_name(f".{name}.tmp")
            writer = _parquet_writer(tmp, self.schema)
            for group in range(pq.ParquetFile(path).num_row_groups):
                writer.write_table(table.slice(*_group_span(path, group)))
            writer.close()
            tmp.replace(path)
        self.narrower = {}

    def _flush(self) -> None:
        import pyarrow as pa

        if not self.rows:
            return
        if self.writer is None:
            self._open()
        self.writer.write_batch(pa.RecordBatch.from_pylist(self.rows, schema=self.schema), row_group_size=len(self.rows))
        self.file_bytes += self.buffered
        self.bytes += self.buffered
        self.rows, self.buffered = [], 0
        if self.file_bytes >= self.shard_bytes:
            self.writer.close()
            self.writer = None

    def close(self) -> list[str]:
        self._flush()
        if self.writer is None and not self.files:
            self._open()  # an empty split still gets one (empty) shard, so both splits always load
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        self._add_media_columns()
        return self.files


def _parquet_writer(path: Path, schema):
    import pyarrow.parquet as pq

    # Image bytes, video clips and audio are already compressed (JPEG/PNG/WebP, Motion JPEG, FLAC): no codec and no dictionary
    # for them (a dictionary over 100 KB values costs 10x the write time for nothing); zstd + dictionaries for the
    # text columns. use_compliant_nested_type=False keeps list fields named "item", so the file's schema is exactly
    # arrow_schema() when read back (the Parquet-compliant spelling would rename them "element").
    leaves = _leaf_paths(schema)
    media = ("images.", "videos.", "audios.")
    return pq.ParquetWriter(
        path,
        schema,
        compression={c: ("none" if c.startswith(media) else "zstd") for c in leaves},
        use_dictionary=[c for c in leaves if not c.startswith(media)],
        write_statistics=False,
        use_compliant_nested_type=False,
    )


def _group_span(path: Path, group: int) -> tuple[int, int]:
    """(first row, rows) of row group `group` of a Parquet file."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    start = sum(meta.row_group(g).num_rows for g in range(group))
    return start, meta.row_group(group).num_rows


def _leaf_paths(schema) -> list[str]:
    """Parquet column paths of an Arrow schema's leaves ("messages.list.item.role", "images.list.item.bytes")."""
    import pyarrow as pa

    def walk(prefix: str, typ) -> list[str]:
        if pa.types.is_struct(typ):
            return [p for i in range(typ.num_fields) for p in walk(f"{prefix}.{typ.field(i).name}", typ.field(i).type)]
        if pa.types.is_list(typ):
            return walk(f"{prefix}.list.item", typ.value_type)
        return [prefix]

    return [p for f in schema for p in walk(f.name, f.type)]


class Stats:
    """Exact statistics from value counters: memory is bounded by the number of distinct values, not samples."""

    def __init__(self):
        self.widths: Counter = Counter()
        self.heights: Counter = Counter()
        self.images_per_sample: Counter = Counter()
        self.text_chars: Counter = Counter()
        self.turns: Counter = Counter()
        self.tokens: Counter = Counter()
        self.conversions: Counter = Counter()
        self.video = VideoStats()
        self.audio = AudioStats()

    def add(self, sample: Sample, info) -> None:
        self.widths.update(info.widths)
        self.heights.update(info.heights)
        self.images_per_sample[len(info.widths)] += 1
        self.text_chars[info.text_chars] += 1
        self.turns[info.num_turns] += 1
        self.conversions.update(c.split(",")[0] for c in info.conversions)
        if sample.num_tokens is not None:
            self.tokens[sample.num_tokens] += 1
        self.video.add(sample, info)
        self.audio.add(sample, info)


class VideoStats:
    """Value counters of the kept videos: per sample, frames, seconds (0.1 s bins), frame sizes and placeholder
    tokens per clip (when counted)."""

    def __init__(self):
        self.per_sample: Counter = Counter()
        self.frames: Counter = Counter()
        self.seconds: Counter = Counter()
        self.widths: Counter = Counter()
        self.heights: Counter = Counter()
        self.tokens: Counter = Counter()
        self.kept_as_is = 0
        self.retimed = 0

    def add(self, sample: Sample, info) -> None:
        videos = getattr(info, "videos", [])
        self.per_sample[len(videos)] += 1
        for v in videos:
            self.frames[v.frames] += 1
            self.seconds[round(v.seconds, 1)] += 1
            self.widths[v.width] += 1
            self.heights[v.height] += 1
            self.kept_as_is += not v.converted
            self.retimed += getattr(v, "retimed", False)
        self.tokens.update(sample.media_tokens.get("video", []))

    def section(self, video) -> dict[str, Any] | None:
        """The manifest's `videos` (None when no sample has one); `video` is `data.video`."""
        count = sum(self.frames.values())
        if not count:
            return None
        return {
            "count": count,
            "per_sample": summarize(self.per_sample),
            "frames": summarize(self.frames),
            "seconds": summarize(self.seconds),
            "width": summarize(self.widths),
            "height": summarize(self.heights),
            "tokens_per_clip": summarize(self.tokens),
            "stored": "sampled frames as Motion JPEG in Matroska (docs/formats.md, Video)",
            "kept_as_is": self.kept_as_is,
            # clips whose header gave a duration their frames' timestamps contradict (timed by the frames)
            "duration_from_frames": self.retimed,
            "settings": video.model_dump(),
        }


class AudioStats:
    """Value counters of the kept audio clips: per sample, seconds (0.1 s bins), original sampling rates (Hz) and
    channels, and placeholder tokens per clip (when counted)."""

    def __init__(self):
        self.per_sample: Counter = Counter()
        self.seconds: Counter = Counter()
        self.rates: Counter = Counter()
        self.channels: Counter = Counter()
        self.tokens: Counter = Counter()
        self.kept_as_is = 0
        self.total_seconds = 0.0

    def add(self, sample: Sample, info) -> None:
        audios = getattr(info, "audios", [])
        self.per_sample[len(audios)] += 1
        for a in audios:
            self.seconds[round(a.seconds, 1)] += 1
            self.total_seconds += a.seconds
            self.rates[a.sampling_rate] += 1
            self.channels[a.channels] += 1
            self.kept_as_is += not a.converted
        self.tokens.update(sample.media_tokens.get("audio", []))

    def section(self, audio) -> dict[str, Any] | None:
        """The manifest's `audios` (None when no sample has one); `audio` is `data.audio`."""
        count = sum(self.seconds.values())
        if not count:
            return None
        return {
            "count": count,
            "per_sample": summarize(self.per_sample),
            "seconds": summarize(self.seconds),
            "total_hours": round(self.total_seconds / 3600, 4),
            "original_sampling_rate": dict(sorted(self.rates.items())),
            "original_channels": dict(sorted(self.channels.items())),
            "tokens_per_clip": summarize(self.tokens),
            "stored": f"{audio.sampling_rate} Hz mono 16-bit FLAC (docs/formats.md, Audio)",
            "kept_as_is": self.kept_as_is,
            "settings": audio.model_dump(),
        }


def summarize(counter: Counter) -> dict[str, Any] | None:
    """{count, min, mean, p50, p90, p99, max} of a value counter (nearest-rank percentiles)."""
    n = sum(counter.values())
    if n == 0:
        return None
    values = sorted(counter)
    out: dict[str, Any] = {"count": n, "min": values[0], "mean": round(sum(v * c for v, c in counter.items()) / n, 2)}
    targets = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
    cum = 0
    pending = dict(targets)
    for v in values:
        cum += counter[v]
        for name, q in list(pending.items()):
            if cum >= q * n:
                out[name] = v
                del pending[name]
    out["max"] = values[-1]
    return out


def _token_section(stats: Stats, data: DataSection, counts: "TokenSource", row_budget: RowBudget | None) -> dict[str, Any] | None:
    summary = summarize(stats.tokens)
    if summary is None:
        return None
    longest = summary["max"]
    suggested = -(-longest // 64) * 64
    packing = 1 << max(0, (max(suggested, 8 * summary["p50"]) - 1).bit_length())
    extra = {"tokenizer": counts.tokenizer} if counts.tokenizer else {}
    # Without a row budget (train.tokens_per_batch auto, or no packing) the GPUs are counted at training's
    # default budget; `gpus_needed_at` says at how many tokens per GPU.
    per_gpu = row_budget or RowBudget(DEFAULT_TOKENS_PER_GPU)
    budget = row_budget.to_dict() if row_budget else dict.fromkeys(("row_budget_tokens", "tokens_per_batch", "sequence_parallel"))
    return {
        "processor": counts.processor,
        "family": counts.family,
        **extra,
        "per_sample": "the num_tokens column of every shard row (text + visual tokens)",
        **summary,
        "max_length": data.max_length,
        # Fits every kept sample, rounded up to a multiple of 64 tokens.
        "suggested_max_length": suggested,
        # A power of two holding the longest sample and about 8 median samples.
        "suggested_packing_length": packing,
        **budget,
        # GPUs that split the longest kept sample's row: the train.sequence_parallel it needs.
        "gpus_needed": per_gpu.gpus_for(longest),
        "gpus_needed_at": per_gpu.tokens_per_batch,
    }


def write_histogram(path: Path, stats: Stats, max_length: int | None, row_budget: RowBudget | None = None) -> None:
    """Length histogram PNG: tokens per sample when known, else text characters per sample; with tokens,
    `max_length` and the packed row's tokens (`row_budget`) are drawn as vertical lines."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counter, label = (stats.tokens, "tokens per sample (text + visual)") if stats.tokens else (stats.text_chars, "text characters per sample")
    fig = Figure(figsize=(7, 3.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if counter:
        values = sorted(counter)
        ax.hist(values, weights=[counter[v] for v in values], bins=min(50, max(1, len(values))), color="#4c72b0")
        if stats.tokens and max_length:
            ax.axvline(max_length, color="#c44e52", linestyle="--", label=f"data.max_length = {max_length}")
            if row_budget is not None:
                ax.axvline(row_budget.tokens, color="#dd8452", linestyle=":",
                           label=f"packed row = {row_budget.tokens} (train.tokens_per_batch={row_budget.tokens_per_batch} "
                           f"x train.sequence_parallel={row_budget.sequence_parallel})")
            ax.legend()
    ax.set_xlabel(label)
    ax.set_ylabel("samples")
    ax.set_title(f"Sample lengths ({sum(counter.values()):,} kept samples)")
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})


def _inputs(data: DataSection, processor_dir: Path | None) -> list[Path]:
    """Every local path a prepare reads: the sources (a glob by its fixed prefix), their image roots, the media
    roots and the model folder whose processor counts tokens."""
    paths: list[Path] = []
    for src in data.sources:
        if src.format == "hf":
            continue
        p = str(Path(src.path).expanduser())
        cut = min((p.index(ch) for ch in "*?[" if ch in p), default=None)
        paths.append(Path(p if cut is None else p[:cut]) if cut != 0 else Path("."))
        if src.image_root is not None:
            paths.append(Path(src.image_root))
    paths.extend(Path(m) for m in data.media_roots)
    if processor_dir is not None:
        paths.append(Path(processor_dir))
    return paths


def prepare_data(
    data: DataSection,
    *,
    num_proc: int | None = None,
    processor_dir: Path | None = None,
    model: ModelSection | None = None,
    export: str | None = None,
    export_dir: Path | str | None = None,
    progress: bool = True,
    row_budget: RowBudget | None = None,
    processors: "ProcessorSource | None" = None,
) -> PrepareResult:
    """Read every source of `data`, check, dedup, split and write Parquet shards + manifest.json + rejected.jsonl.

    Token counts (the `num_tokens` column, the manifest's `tokens`) and the too_long check use the processor in
    `processor_dir` (a built model folder) when it holds one, else the processor `model build` would make for
    `model`, which `processors` gives (`vlmctl.models.build.configured_processor`; `vlmctl.data.counting`: a
    random-init preset's tokenizer is trained on the train split as the build trains it). Without either, or when the model's processor cannot be loaded (`PrepareResult.token_note` says
    why), samples have `num_tokens` None. A counted sample is dropped as too_long over `data.max_length` tokens
    (text + visual), or over `row_budget.tokens` (one packed training row: `train.tokens_per_batch x
    train.sequence_parallel`, which the caller builds from the train section; None when it is not known before
    training, e.g. `train.tokens_per_batch: auto`) when that is smaller; the manifest's `tokens` records the budget
    and `gpus_needed`, the GPUs of `tokens_per_batch` tokens (8192 without a budget) the longest kept sample needs.
    `export="energon"` also writes a Megatron-Energon dataset to `export_dir` (default `prepared_dir/energon`) in
    the shape of `data.export.energon_format` (`vlmctl.data.energon`).
    Raises UsageError (no sources, unknown export, an output folder that holds an input or is not one vlmctl may
    replace: `vlmctl.outputs.check_replaceable`) and DataError (a missing or unreadable
    source, a source below `data.min_kept_fraction`, an empty train split, a full disk, a sample that does not fit
    an explicit `data.export.energon_format` of vqa or captioning).
    """
    from vlmctl import __version__
    from vlmctl.data.tokens import has_processor

    if not data.sources:
        raise UsageError("data.sources is empty: there is nothing to prepare", hint="list your data files under data.sources in vlmctl.yaml")
    if export is not None and export not in EXPORTS:
        raise UsageError(f"unknown export format {export!r}", hint=f"use one of: {', '.join(EXPORTS)}")
    out = Path(data.prepared_dir)
    pdir = Path(processor_dir) if has_processor(processor_dir) else None
    inputs = _inputs(data, pdir)
    edir_final = Path(export_dir) if export_dir else out / "energon"
    if export is not None and edir_final.resolve() == out.resolve():
        raise UsageError("the export folder cannot be data.prepared_dir itself", hint="pass --export-dir OTHER_DIR, or leave it unset (prepared_dir/energon)")
    inside = export is not None and out.resolve() in edir_final.resolve().parents

    def check_outputs() -> None:
        check_replaceable(out, "prepared", inputs=inputs, what="data.prepared_dir", fix="set data.prepared_dir to another folder")
        if export is not None and not inside:
            check_replaceable(edir_final, "energon", inputs=[*inputs, out], what="the export folder",
                              fix="pass --export-dir with a new folder")

    check_outputs()  # before anything is read or written
    sources = unique_sources(data.sources)  # a missing source fails here, before any processor is loaded

    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    etmp = None
    work = tmp / ".work"  # a processor saved for counting, the first pass's spool; removed before the rename
    try:
        tmp.mkdir()
        work.mkdir()
        if export is not None:
            if not inside:
                sweep_stale(edir_final)
            etmp = tmp / edir_final.resolve().relative_to(out.resolve()) if inside else edir_final.parent / f".{edir_final.name}.tmp-{os.getpid()}"
            shutil.rmtree(etmp, ignore_errors=True)
            etmp.mkdir(parents=True)
        results, counts = _checked_and_counted(data, sources, work, num_proc=num_proc, pdir=pdir, model=model, progress=progress,
                                               row_budget=row_budget, processors=processors)
        manifest = _run(data, results, sources, tmp, etmp, num_proc=num_proc, counts=counts, progress=progress, row_budget=row_budget)
        if manifest["export"] is not None:
            manifest["export"]["path"] = str(edir_final)  # the writer only knows the temporary folder
        manifest["vlmctl_version"] = __version__
        # backslashreplace: a source path that is not UTF-8 (a surrogate escape) is written escaped, never a crash
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8",
                                           errors="backslashreplace")
        shutil.rmtree(work)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if etmp is not None:
            shutil.rmtree(etmp, ignore_errors=True)
        if isinstance(exc, OSError) and is_disk_full(exc):
            raise disk_full_error(exc, tmp) from None
        raise
    try:
        check_outputs()  # again: the folders may have changed during the run
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if etmp is not None:
            shutil.rmtree(etmp, ignore_errors=True)
        raise
    install(tmp, out, "prepared")
    if etmp is not None and not inside:
        edir_final.parent.mkdir(parents=True, exist_ok=True)
        install(etmp, edir_final, "energon")
    return PrepareResult(out, manifest, edir_final if export else None, token_note=counts.note)


@dataclass
class TokenSource:
    """What counted the tokens of a prepare: `processor` (a folder, or a description of the configured model) and
    `family`; `note` says why there are no counts when `processor` is None."""

    processor: str | None = None
    family: str | None = None
    note: str | None = None
    tokenizer: dict[str, Any] | None = None  # a tokenizer trained at prepare time: {rounds, converged}


Results = Iterator[tuple[int, "Sample | Rejection", Any]]


def _checked_and_counted(data: DataSection, sources, work: Path, *, num_proc, pdir: Path | None, model: ModelSection | None,
                         progress: bool, row_budget: RowBudget | None, processors=None) -> tuple[Results, TokenSource]:
    """The checked samples in input order, counted with the built model's processor (`pdir`), else with the
    configured model's (`vlmctl.data.counting`), else not counted; too_long at `token_limit(data.max_length,
    row_budget)` tokens when counted."""
    from vlmctl.data.tokens import MODEL_INFO

    if pdir is not None:
        family = None
        if (pdir / MODEL_INFO).is_file():
            try:
                family = json.loads((pdir / MODEL_INFO).read_text()).get("family")
            except (ValueError, OSError):
                family = None
        return iter_checked(data, sources, num_proc=num_proc, processor_dir=pdir, row_budget=row_budget), TokenSource(str(pdir), family)
    from vlmctl.data.counting import counter_in, model_configured
    from vlmctl.errors import VlmctlError

    if not model_configured(model):
        return iter_checked(data, sources, num_proc=num_proc), TokenSource(note="no model in the model section")
    if processors is None:
        return iter_checked(data, sources, num_proc=num_proc), TokenSource(note="no source of the configured model's processor was given")
    try:
        conf = processors(model)
    except VlmctlError as exc:  # e.g. a Hub id offline: prepare without counts, and say why
        return iter_checked(data, sources, num_proc=num_proc), TokenSource(note=f"the configured model's processor did not load: {exc.message}")
    if not conf.needs_training:
        folder = work / "processor"
        counter_in(folder, conf.processor, conf.family)
        results = iter_checked(data, sources, num_proc=num_proc, processor_dir=folder, row_budget=row_budget)
        return results, TokenSource(conf.description, conf.family)
    return _counted_with_trained_tokenizer(data, sources, work, conf, num_proc=num_proc, progress=progress, row_budget=row_budget)


def _counted_with_trained_tokenizer(data: DataSection, sources, work: Path, conf, *, num_proc, progress: bool,
                                    row_budget: RowBudget | None) -> tuple[Results, TokenSource]:
    """A first pass checks every sample (no counts) into a spool file; the tokenizer is trained on the train
    samples it kept (`counting.fit_tokenizer`); the spool is then replayed with counts and the too_long check."""
    import pickle

    from vlmctl.data.counting import fit_tokenizer

    spool = work / "checked.pickle"
    with open(spool, "wb") as fh, progress_bar(progress, "Checking") as advance:
        for result in iter_checked(data, sources, num_proc=num_proc):
            pickle.dump(result, fh, protocol=pickle.HIGHEST_PROTOCOL)
            advance()

    def replay() -> Results:
        with open(spool, "rb") as fh:
            while True:
                try:
                    yield pickle.load(fh)
                except EOFError:
                    return

    def kept_train():
        return ((item, info) for _, item, info in replay() if info is not None and not is_val(info.digest, data.val_ratio))

    fit = fit_tokenizer(conf, kept_train, data.max_length, work / "processor", row_budget)
    if fit is None:
        return replay(), TokenSource(note="the train split has no text to train the tokenizer on")
    source = TokenSource(conf.description, conf.family, tokenizer={"rounds": fit.rounds, "converged": fit.converged})
    return with_token_counts(replay(), fit.counter, data.max_length, row_budget), source


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, owned by another user
        return True
    return True


def sweep_stale(final: Path) -> list[Path]:
    """Remove `.<name>.tmp-<pid>` folders next to `final` whose process is gone (a prepare killed before it could
    clean up), and `.<name>.old-<pid>` ones when `final` exists. Returns what was removed."""
    removed = []
    for kind in ("tmp", "old"):
        for path in final.parent.glob(f".{final.name}.{kind}-*"):
            pid = path.name.rsplit("-", 1)[-1]
            if not pid.isdigit() or _pid_alive(int(pid)) or (kind == "old" and not final.exists()):
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def is_disk_full(exc: OSError) -> bool:
    """True for ENOSPC/EDQUOT, also when raised by pyarrow (which keeps only the message)."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc)


def disk_full_error(exc: OSError, folder: Path) -> DataError:
    """A DataError naming the file being written (or `folder`) and the free space left on its filesystem."""
    path = Path(exc.filename) if getattr(exc, "filename", None) else folder
    probe = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    try:
        free = f"{shutil.disk_usage(probe).free / 2**30:,.2f} GiB free"
    except OSError:
        free = "free space unknown"
    return DataError(
        f"disk full while writing {path} ({free} on that filesystem; the partial output was removed)",
        hint=f"free some space on the disk of {folder.parent}, or set data.prepared_dir to a folder on a larger disk",
    )


LIMIT_KEYS = {"image_too_small": "data.min_image_side", "image_too_large": "data.max_image_pixels",
              "video_too_short": "data.video.min_frames", "video_too_long": "data.video.max_seconds",
              "audio_too_short": "data.audio.min_seconds", "audio_too_long": "data.audio.max_seconds",
              "too_long": "data.max_length or train.tokens_per_batch"}
"""The setting behind each limit of `checks.FILTERS` (what a user changes to keep those samples)."""
REPEATS = ("duplicate", "duplicate_id")
"""Rejections of a sample that repeats a kept one (data.dedup, data.duplicate_ids): nothing is lost with them, so
they are the only ones `data.min_kept_fraction` does not count."""


def check_kept(tallies: list[SourceTally], min_fraction: float, kind: str = "auto") -> None:
    """Raise DataError naming every source that kept less than `min_fraction` of its records, counting every
    rejection but the repeats of kept samples (`REPEATS`): a defect of the data, or a limit the project sets
    (`LIMIT_KEYS`: too_long, the image, video and audio limits); the message holds each such source's counts per
    reason, with the setting behind each limit. With `kind` (data.kind) preference, a source rejected mostly as
    missing_response holds conversations where pairs are expected: the hint says to point data.sources at the
    pairs."""
    bad, limits, conversations = [], [], []
    for t in tallies:
        counted = {r: n for r, n in t.rejected.items() if r not in REPEATS}
        judged = t.kept + sum(counted.values())
        if judged and t.kept / judged < min_fraction:
            reasons = sorted(counted.items(), key=lambda x: (-x[1], x[0]))
            table = "\n".join(f"      {r} {n:,}" + (f" (limit: {LIMIT_KEYS[r]})" if r in LIMIT_KEYS else "") for r, n in reasons)
            bad.append(f"{t.name}: kept {t.kept:,} of {judged:,} records ({t.kept / judged:.1%}); rejected:\n{table}")
            limits += [LIMIT_KEYS[r] for r, _ in reasons if r in LIMIT_KEYS and LIMIT_KEYS[r] not in limits]
            if kind == "preference" and reasons[0][0] == "missing_response":
                conversations.append(t.name)
    if conversations:
        raise DataError(
            f"data.kind is preference, and {', '.join(conversations)} kept less than data.min_kept_fraction="
            f"{min_fraction:g} of their records: most are rejected as missing_response, so these sources hold "
            "conversations (one answer each), not preference pairs (a chosen and a rejected answer):\n"
            + "\n".join(f"  - {line}" for line in bad),
            hint="point data.sources at the pairs, e.g. `vlmctl data prepare data.kind=preference "
            "data.prepared_dir=data/pairs data.sources='[{path: data/raw/pairs.jsonl}]'` (layouts: docs/formats.md, "
            "Preference data)",
        )
    if bad:
        raised = f"; for the rejections by a limit, change {', '.join(limits)}" if limits else ""
        raise DataError(
            f"{len(bad)} source(s) kept less than data.min_kept_fraction={min_fraction:g} of their records "
            "(repeats of kept samples not counted):\n" + "\n".join(f"  - {line}" for line in bad),
            hint="run `vlmctl data validate` for the locations of the rejected records and fix the source (format, "
            f"image_root, encoding){raised}; to prepare anyway, lower data.min_kept_fraction (0 turns the check off)",
        )


def check_kind(tallies: list[SourceTally], pairs: Counter) -> str:
    """What the kept data is, for the manifest's `kind`: "preference" when every kept sample is a preference pair,
    "sft" when none is. Raises DataError naming the sources of each kind when both are kept (with `data.kind:
    auto`; `sft` and `preference` settle it before)."""
    n_pairs = sum(pairs.values())
    kept = sum(t.kept for t in tallies)
    if n_pairs == 0 or n_pairs == kept:
        return "preference" if n_pairs else "sft"
    with_pairs = [t.name for i, t in enumerate(tallies) if pairs[i]]
    without = [t.name for i, t in enumerate(tallies) if t.kept > pairs[i]]
    raise DataError(
        f"the data mixes {n_pairs:,} preference pairs (sources: {', '.join(with_pairs)}) and {kept - n_pairs:,} "
        f"conversations without a rejected answer (sources: {', '.join(without)})",
        hint="set data.kind: sft to train on the chosen answers, or data.kind: preference to keep only the pairs "
             "(docs/formats.md, Preference data)",
    )


def check_train_split(train_samples: int, kept: int, rejected: Counter, val_ratio: float) -> None:
    """Raise DataError when the train split is empty, with the rejection counts."""
    if train_samples:
        return
    if kept:
        raise DataError(
            f"the train split is empty: all {kept:,} kept samples went to val (data.val_ratio={val_ratio:g})",
            hint="lower data.val_ratio, or add data",
        )
    if not rejected:
        raise DataError("no samples were read from data.sources: the sources are empty", hint="check data.sources[].path")
    counts = ", ".join(f"{r} {n:,}" for r, n in rejected.most_common())
    raise DataError(
        f"every one of the {sum(rejected.values()):,} samples read was rejected ({counts}): the train split would be empty",
        hint="run `vlmctl data validate` to see where and why; a wrong data.sources[].image_root makes every image "
        "missing_image",
    )


def _val_to_train(writers: dict[str, "ShardWriter"], tmp: Path, energon) -> None:
    """Make the val split the train split (val then empty). For data that is one leakage group (every kept sample
    has the same content digest, so `checks.is_val` sends all of them to the same split): when that split is val,
    training would have nothing, and val would only repeat train's samples if it had any."""
    val, train = writers["val"], writers["train"]
    val.close()
    (tmp / "train").mkdir(parents=True, exist_ok=True)
    names = []
    for name in val.files:
        new = "train" + name[len("val"):]
        (tmp / "val" / name).replace(tmp / "train" / new)
        names.append(new)
    val.folder, val.prefix, val.files = tmp / "train", "train", names
    train.folder, train.prefix = tmp / "val", "val"
    writers["train"], writers["val"] = val, train
    if energon is not None:
        energon.move_split("val", "train")


def _run(data: DataSection, results: Results, sources, tmp: Path, etmp: Path | None, *, num_proc, counts: TokenSource,
         progress, row_budget: RowBudget | None = None) -> dict[str, Any]:
    shard_bytes = data.shard_size_mb << 20
    writers = {"train": ShardWriter(tmp / "train", "train", shard_bytes), "val": ShardWriter(tmp / "val", "val", shard_bytes)}
    energon = None
    val_groups: set[bytes] = set()  # content digests of val samples, up to 2: is val one leakage group?
    if etmp is not None:
        from vlmctl.data.energon import EnergonWriter

        energon = EnergonWriter(etmp, shard_bytes, data.export.energon_format)
    tallies = [SourceTally(s.name, s.path, s.format) for s in sources]
    stats = Stats()
    pairs: Counter = Counter()  # source index -> preference pairs kept
    rejected_total: Counter = Counter()
    # backslashreplace: a lone surrogate in a rejected record's id or location is written escaped, never a crash
    with open(tmp / "rejected.jsonl", "w", encoding="utf-8", errors="backslashreplace") as rej, progress_bar(progress, "Preparing") as advance:
        for src, item, info in results:
            advance()
            tallies[src].add(item, info)
            if isinstance(item, Rejection):
                rejected_total[item.reason] += 1
                rej.write(json.dumps(item.to_dict(), ensure_ascii=False) + "\n")
                continue
            pairs[src] += item.rejected is not None
            split = "val" if is_val(info.digest, data.val_ratio) else "train"
            if split == "val" and len(val_groups) < 2:
                val_groups.add(info.digest)
            writers[split].add(item)
            if energon is not None:
                if item.rejected is not None:  # energon's sample types have no place for a rejected answer
                    raise UsageError("--export energon writes conversations; preference pairs cannot be exported to energon",
                                     hint="prepare without --export, or set data.kind: sft to export the chosen conversations")
                energon.add(split, item)
            stats.add(item, info)
    check_kept(tallies, data.min_kept_fraction, kind=data.kind)
    kind = check_kind(tallies, pairs)
    if not writers["train"].samples and len(val_groups) == 1:
        _val_to_train(writers, tmp, energon)
    check_train_split(writers["train"].samples, sum(t.kept for t in tallies), rejected_total, data.val_ratio)
    splits = {}
    for name, w in writers.items():
        files = w.close()
        splits[name] = {"samples": w.samples, "shards": [f"{name}/{f}" for f in files], "bytes": sum((tmp / name / f).stat().st_size for f in files)}
    # The export is written from the finished shards: its shape (data.export.energon_format: auto) depends on
    # every sample.
    export = energon.finish({n: [tmp / f for f in s["shards"]] for n, s in splits.items()}, workers=num_proc or 1) if energon is not None else None
    write_histogram(tmp / "length_histogram.png", stats, data.max_length if stats.tokens else None, row_budget)
    kept = sum(t.kept for t in tallies)
    n_rejected = sum(rejected_total.values())
    flagged: Counter = Counter()
    for t in tallies:
        flagged.update(t.flagged)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "sources": [t.to_dict() for t in tallies],
        "totals": {
            "read": kept + n_rejected,
            "kept": kept,
            "rejected": {r: rejected_total[r] for r in REASONS if rejected_total[r]},
            "rejected_total": n_rejected,
            "flagged": dict(sorted(flagged.items())),
        },
        "splits": splits,
        "settings": {
            "val_ratio": data.val_ratio, "min_image_side": data.min_image_side, "max_image_pixels": data.max_image_pixels,
            "max_length": data.max_length, "dedup": data.dedup, "duplicate_ids": data.duplicate_ids,
            "min_kept_fraction": data.min_kept_fraction, "media_roots": [str(p) for p in data.media_roots],
        },
        "images": {
            "count": sum(stats.widths.values()),
            "per_sample": summarize(stats.images_per_sample),
            "width": summarize(stats.widths),
            "height": summarize(stats.heights),
            "converted": dict(sorted(stats.conversions.items())),
        },
        "videos": stats.video.section(data.video),
        "audios": stats.audio.section(data.audio),
        "text": {"chars": summarize(stats.text_chars), "turns": summarize(stats.turns)},
        "tokens": _token_section(stats, data, counts, row_budget),
        "export": export,
        "files": {"rejected": "rejected.jsonl", "histogram": "length_histogram.png"},
    }
