"""The check pipeline shared by `prepare_data` and `validate_data`.

    sources --read (main process, streaming)--> batches --check_images + token count (worker processes)-->
    in-order results --dedup, duplicate ids, too_long (main process)--> (source index, Sample | Rejection)

too_long rejects a sample over `data.max_length` tokens, or over the packed training row (`RowBudget`:
`train.tokens_per_batch x train.sequence_parallel` tokens) when that is smaller: a sample longer than the row would
only be left out by the trainer's sampler.

Reading and parsing stay in the main process (cheap, and it keeps the order of records); image reading,
full decoding, RGB normalization and token counting run in `num_proc` worker processes. At most
`2 * num_proc` batches of `BATCH_SIZE` samples are in flight, so memory does not grow with the dataset.
Results come back in input order, which makes dedup ("an earlier sample") and the written shards deterministic.
The token counter is loaded once, in the main process, and forked workers inherit it; input that fits in one
batch is checked in the main process (starting workers would take longer than the checks).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
from collections import deque
from dataclasses import dataclass, field
from itertools import chain, islice
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from vlmctl.config.data import DataSection, DataSource
from vlmctl.config.plan import DEFAULT_TOKENS, row_tokens
from vlmctl.data.checks import DigestSet, LocationTable, Rejection, SampleInfo, check_images, count_tokens, sample_digest
from vlmctl.data.formats import iter_unchecked, resolve_format
from vlmctl.data.formats._common import GLOB_CHARS, source_name
from vlmctl.data.sample import Sample
from vlmctl.data.tokens import TokenCounter, has_processor
from vlmctl.errors import DataError, MissingSourceError
from vlmctl.processes import die_with_parent

# rich is imported inside the functions that print: using vlmctl as a library does not load it.
# concurrent and multiprocessing (standard library, not loaded at the CLI's start-up) are imported inside the
# functions that use them.

BATCH_SIZE = 32
DEFAULT_TOKENS_PER_GPU = DEFAULT_TOKENS
"""Tokens per GPU when `train.tokens_per_batch` is auto and no probe ran (`vlmctl.config.plan.DEFAULT_TOKENS`):
what `gpus_needed` is computed at without a row budget."""

# Per-process state of the check workers (set by _init_worker, or directly when num_proc == 1).
_STATE: dict[str, Any] = {}


@dataclass(frozen=True)
class RowBudget:
    """The tokens of one packed training row: `tokens_per_batch` per GPU (`train.tokens_per_batch`) times the
    `sequence_parallel` GPUs that split each row along the sequence (`train.sequence_parallel`), as the trainer's
    sampler fills it (`vlmctl.train.data.build_sampler`).

    Raises ValueError for a budget below 1 token per GPU or fewer than 1 GPU.
    """

    tokens_per_batch: int
    sequence_parallel: int = 1

    def __post_init__(self) -> None:
        if self.tokens_per_batch < 1 or self.sequence_parallel < 1:
            raise ValueError(f"RowBudget needs tokens_per_batch >= 1 and sequence_parallel >= 1, got "
                             f"{self.tokens_per_batch} and {self.sequence_parallel}")

    @property
    def tokens(self) -> int:
        """Tokens one packed row holds (`config.plan.row_tokens`: tokens_per_batch x sequence_parallel)."""
        return row_tokens(self)

    def gpus_for(self, n_tokens: int) -> int:
        """GPUs of `tokens_per_batch` tokens each that a sample of `n_tokens` tokens needs: ceil(n / tokens_per_batch),
        at least 1."""
        return max(1, -(-n_tokens // self.tokens_per_batch))

    def to_dict(self) -> dict[str, int]:
        return {"row_budget_tokens": self.tokens, "tokens_per_batch": self.tokens_per_batch, "sequence_parallel": self.sequence_parallel}


def token_limit(max_length: int, row_budget: RowBudget | None) -> int:
    """The most tokens a kept sample may have: `data.max_length`, or the packed row's tokens when smaller."""
    return min(max_length, row_budget.tokens) if row_budget is not None else max_length


def _init_worker(processor_dir: str | None, limits: dict[str, Any], counter: Any = None, pool_worker: bool = False) -> None:
    # `counter`: the parent's, inherited by forked workers (loaded once); spawned workers load their own.
    if pool_worker:  # a worker of a killed prepare (kill -9) must not live on, holding memory and CPU

        die_with_parent()
    _STATE["limits"] = limits  # keyword arguments of check_images
    if counter is None and processor_dir:
        counter = TokenCounter.load(Path(processor_dir))
    _STATE["counter"] = counter


def _check_batch(batch: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
    counter = _STATE.get("counter")
    out = []
    for src, item in batch:
        if isinstance(item, Rejection):
            out.append((src, item))
            continue
        result = check_images(item, **_STATE["limits"])
        if not isinstance(result, Rejection) and counter is not None:
            sample, info = result
            sample.num_tokens = count_tokens(counter, sample, list(zip(info.widths, info.heights)))
        out.append((src, result))
    return out


@dataclass
class SourceTally:
    """Per-source counts: what a report says about one source."""

    name: str
    path: str
    format: str
    kept: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    flagged: dict[str, int] = field(default_factory=dict)  # kept samples with a finding (duplicate_id with `keep`)

    def add(self, item: Sample | Rejection, info: SampleInfo | None = None) -> None:
        """Count one result of `iter_checked`."""
        if isinstance(item, Rejection):
            self.rejected[item.reason] = self.rejected.get(item.reason, 0) + 1
            return
        self.kept += 1
        for flag in info.flags if info is not None else ():
            self.flagged[flag] = self.flagged.get(flag, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "path": self.path, "format": self.format, "kept": self.kept, "rejected": dict(sorted(self.rejected.items()))}
        if self.flagged:
            out["flagged"] = dict(sorted(self.flagged.items()))
        return out


def unique_sources(sources: list[DataSource]) -> list[DataSource]:
    """Copies of `sources` with a resolved format and a name unique among them (reports are keyed by name).

    Raises MissingSourceError (a DataError, exit code 2) for a local source that does not exist (or a glob matching
    nothing), before anything is read.
    """
    for src in sources:
        check_exists(src)
    out, seen = [], set()
    for i, src in enumerate(sources):
        name = source_name(src)
        if name in seen:
            name = f"{name}#{i}"
        seen.add(name)
        out.append(src.model_copy(update={"name": name, "format": resolve_format(src)}))
    return out


def check_exists(source: DataSource) -> None:
    """Raise MissingSourceError (a DataError, exit code 2) when a local source's path does not exist or its glob
    matches nothing (Hub ids pass)."""
    if source.format == "hf":
        return
    path = Path(source.path).expanduser()
    if GLOB_CHARS & set(str(path)):
        if not glob.glob(str(path), recursive=True):
            raise MissingSourceError(f"no files match {source.path}", hint="check data.sources[].path (globs like data/*.jsonl are allowed)")
    elif not path.exists():
        raise MissingSourceError(f"data source {source.path} does not exist",
                                 hint="fix the path (data.sources[].path is relative to vlmctl.yaml, a path on the command line to the "
                                 "current folder); for a Hub dataset id set `format: hf`")


def _read_all(sources: list[DataSource], media_roots: list[Path]) -> Iterator[tuple[int, Any]]:
    for i, src in enumerate(sources):
        for item in iter_unchecked(src, media_roots=media_roots):
            yield i, item


def _batched(items: Iterator[tuple[int, Any]], size: int) -> Iterator[list[tuple[int, Any]]]:
    batch: list[tuple[int, Any]] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _checked(sources: list[DataSource], *, num_proc: int, processor_dir: Path | None, limits: dict[str, Any],
             media_roots: list[Path]) -> Iterator[tuple[int, Any]]:
    counter = TokenCounter.load(processor_dir) if processor_dir else None  # once, and a broken one fails here
    batches = _batched(_read_all(sources, media_roots), BATCH_SIZE)
    head = list(islice(batches, 2))
    if num_proc <= 1 or len(head) < 2:  # one batch (a small file): starting workers would cost more than it saves
        _init_worker(None, limits, counter)
        for batch in chain(head, batches):
            yield from _check_batch(batch)
        return
    batches = chain(head, batches)
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # fork where there is one: workers start in milliseconds, inherit the loaded counter, and callers need no
    # `if __name__ == "__main__"` guard (spawn re-imports the caller's main module). Workers only use PIL/numpy/
    # tokenizers, never the parent's pyarrow threads.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(
        max_workers=num_proc,
        mp_context=mp.get_context(method),
        initializer=_init_worker,
        initargs=(str(processor_dir) if processor_dir else None, limits, counter if method == "fork" else None, True),
    ) as pool:
        window: deque = deque()  # (future, its batch), oldest first
        try:
            for batch in batches:
                window.append((pool.submit(_check_batch, batch), batch))
                if len(window) >= 2 * num_proc:
                    yield from _result(window, num_proc)
            while window:
                yield from _result(window, num_proc)
        finally:
            for fut, _ in window:
                fut.cancel()


def _result(window: deque, num_proc: int) -> list[tuple[int, Any]]:
    """The oldest batch's checked items; a worker process that died (killed for memory, or crashed in a decoder on
    a sample) is a DataError naming the samples that were in flight, not the pool's own exception."""
    from concurrent.futures.process import BrokenProcessPool

    fut, _ = window[0]
    try:
        out = fut.result()
    except BrokenProcessPool as exc:
        where = [getattr(item, "location", "") for _, batch in window for _, item in batch]
        where = [w for w in where if w]
        span = f" (the samples in flight: {where[0]} to {where[-1]})" if where else ""
        raise DataError(f"a worker process checking samples died{span}: {exc}",
                        hint="run again with data.num_proc=1 (or --num-proc 1): in one process a sample that crashes a "
                        "decoder is the one being read when it stops; a worker killed for memory needs fewer "
                        f"processes than {num_proc} or more memory") from None
    window.popleft()
    return out


def iter_checked(
    data: DataSection,
    sources: list[DataSource],
    *,
    num_proc: int | None = None,
    processor_dir: Path | None = None,
    on_item: Callable[[], None] | None = None,
    row_budget: RowBudget | None = None,
) -> Iterator[tuple[int, Sample | Rejection, SampleInfo | None]]:
    """All checks over `sources` (already passed through `unique_sources`), in input order.

    Yields (source index, Sample, SampleInfo) for kept samples and (source index, Rejection, None) for the rest.
    A `duplicate` or `duplicate_id` rejection names the earlier sample; with `data.duplicate_ids: keep` a repeated
    id is kept and flagged in `SampleInfo.flags`. too_long is checked only when `processor_dir` holds a processor,
    against `token_limit(data.max_length, row_budget)` tokens (text + visual).

    Raises DataError when a source cannot be opened (as the readers do).
    """
    procs = num_proc or data.num_proc or os.cpu_count() or 1
    pdir = processor_dir if has_processor(processor_dir) else None
    limits = {"min_image_side": data.min_image_side, "max_image_pixels": data.max_image_pixels, "video": data.video, "audio": data.audio}
    seen = DigestSet(values=True)  # content digest -> location handle of the first sample
    ids = DigestSet(values=True)  # (source, id) digest -> location handle of the first sample
    where = LocationTable()
    for src, result in _checked(sources, num_proc=procs, processor_dir=pdir, limits=limits, media_roots=list(data.media_roots)):
        if on_item is not None:
            on_item()
        if isinstance(result, Rejection):
            yield src, result, None
            continue
        sample, info = result
        if data.kind == "preference" and not sample.is_preference:
            yield src, Rejection("missing_response", sample.source, sample.location,
                                 "not a preference pair (no rejected answer) and data.kind is preference", sample.id), None
            continue
        if data.kind == "sft" and sample.is_preference:  # SFT on the chosen answers
            sample.rejected = None
            info.digest = sample_digest(sample)
        handle = where.add(sample.location)
        if data.dedup:
            earlier = seen.setdefault(info.digest, handle)
            if earlier is not None:
                detail = f"same normalized text and image bytes as an earlier sample ({where.get(earlier)})"
                yield src, Rejection("duplicate", sample.source, sample.location, detail, sample.id), None
                continue
        earlier = ids.setdefault(id_digest(sample.source, sample.id), handle)
        if earlier is not None:
            detail = f"id {sample.id!r} is also the id of an earlier sample of this source ({where.get(earlier)})"
            if data.duplicate_ids == "reject":
                yield src, Rejection("duplicate_id", sample.source, sample.location, detail, sample.id), None
                continue
            info.flags.append("duplicate_id")
        rejection = too_long(sample, data.max_length, row_budget)
        yield (src, rejection, None) if rejection is not None else (src, sample, info)


def too_long(sample: Sample, max_length: int, row_budget: RowBudget | None = None) -> Rejection | None:
    """The too_long rejection of a sample whose `num_tokens` exceed `token_limit(max_length, row_budget)`; None
    when it fits or was not counted. Over the row budget, the detail says how many GPUs the sample needs and which
    key to set."""
    n = sample.num_tokens
    if n is None or n <= token_limit(max_length, row_budget):
        return None
    what = "text + visual, chosen and rejected each with the prompt" if sample.rejected is not None else "text + visual"
    detail = f"{n} tokens ({what}) > data.max_length={max_length}" if n > max_length else f"{n:,} tokens ({what})"
    if row_budget is not None and n > row_budget.tokens:
        gpus = row_budget.gpus_for(n)
        row = (f"{row_budget.tokens:,} tokens per packed row (train.tokens_per_batch={row_budget.tokens_per_batch} x "
               f"train.sequence_parallel={row_budget.sequence_parallel}); it needs {gpus} GPUs: ")
        fix = f"set train.sequence_parallel={gpus} (or raise train.tokens_per_batch)"
        detail += f" and > {row}raise data.max_length and {fix}" if n > max_length else f" > {row}{fix}"
    return Rejection("too_long", sample.source, sample.location, detail, sample.id)


def with_token_counts(results: Iterable[tuple[int, Sample | Rejection, SampleInfo | None]], counter: Any,
                      max_length: int, row_budget: RowBudget | None = None) -> Iterator[tuple[int, Sample | Rejection, SampleInfo | None]]:
    """`iter_checked` results checked without a processor, now counted with `counter` (a `TokenCounter`): each
    kept sample gets `num_tokens`, and those over `token_limit(max_length, row_budget)` tokens become too_long
    rejections (the last check)."""
    for src, item, info in results:
        if info is not None:
            item.num_tokens = count_tokens(counter, item, list(zip(info.widths, info.heights)))
            rejection = too_long(item, max_length, row_budget)
            if rejection is not None:
                yield src, rejection, None
                continue
        yield src, item, info


def id_digest(source: str, sample_id: str) -> bytes:
    """The key of a sample id in its source's id namespace (ids repeat legitimately across sources)."""
    return hashlib.blake2b(f"{source}\0{sample_id}".encode("utf-8", "surrogatepass"), digest_size=16).digest()


def progress_bar(enabled: bool, description: str):
    """A rich progress bar on stderr with a samples/s column; a no-op context when disabled or when stderr is not a
    terminal (piped or logged, the bar would leave its last frame, spinner included).

    Returns a context manager whose value is a zero-argument `advance()` callable.
    """
    from rich.console import Console

    if not enabled or not Console(stderr=True).is_terminal:
        return contextlib.nullcontext(lambda: None)
    from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.0f} samples/s" if speed else "- samples/s", style="cyan")

    @contextlib.contextmanager
    def bar():
        with Progress(
            SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,} samples"),
            Rate(), TimeElapsedColumn(), console=Console(stderr=True), transient=False,
        ) as progress:
            task = progress.add_task(description, total=None)
            yield lambda: progress.advance(task)

    return bar()
