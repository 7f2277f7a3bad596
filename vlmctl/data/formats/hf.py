"""`hf`: a dataset on the Hugging Face Hub, read with `datasets.load_dataset(path, split=..., streaming=True)`.

Rows are mapped like the `parquet` format (same logical columns and `columns:` mapping); images and audio (the
`Image` and `Audio` features) are read undecoded (`IterableDataset.decode(False)`: `{bytes, path}`), so their original
bytes go through the same checks and nothing needs torchcodec. Without network
access (or with `HF_HUB_OFFLINE=1`) loading fails with a DataError that says how to work offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from vlmctl.config.data import DataSource
from vlmctl.data.checks import Rejection
from vlmctl.data.formats._common import media_roots as source_media_roots
from vlmctl.data.formats._common import source_name
from vlmctl.data.formats.parquet import resolve_columns, row_to_sample
from vlmctl.data.sample import Sample
from vlmctl.errors import DataError

# datasets is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# Modules the CLI's start-up loads anyway are imported next to their use as well.


def read_hf(source: DataSource, *, media_roots: Iterable[Path | str] = ()) -> Iterator[Sample | Rejection]:
    """Stream unchecked samples from a Hub dataset. Image paths in rows resolve against `image_root` (default: the
    working directory) and must stay inside it or one of `media_roots`. Raises DataError when the dataset cannot
    be loaded."""
    import os

    import datasets

    name = source_name(source)
    offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get("HF_DATASETS_OFFLINE", "") not in ("", "0")
    try:
        ds = datasets.load_dataset(source.path, split=source.split, streaming=True)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types (connection, not found, auth); all end here
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = (
            "this machine is offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set): download the dataset elsewhere "
            "with `datasets.load_dataset(...).save_to_disk(DIR)` and use `format: parquet` with `path: DIR`"
            if offline
            else "check the dataset id, the split (data.sources[].split), the network and `hf auth login` for gated datasets; "
            "without network, `save_to_disk` the dataset elsewhere and use `format: parquet`"
        )
        raise DataError(f"cannot load Hub dataset {source.path!r} (split {source.split!r}): {reason}", hint=hint) from None
    if hasattr(ds, "decode"):
        ds = ds.decode(False)
    cols = None
    base = source_media_roots(source, None, media_roots)
    # columns of one medium per row (an Image feature, a struct): a null there is a missing medium, not none
    lists = tuple(t for t in (getattr(datasets, n, None) for n in ("List", "LargeList", "Sequence")) if isinstance(t, type))
    scalar = frozenset(k for k, f in (getattr(ds, "features", None) or {}).items() if not isinstance(f, (list, *lists)))
    for index, row in enumerate(ds):
        if cols is None:
            cols = resolve_columns(list(row), source.columns, f"Hub dataset {source.path}")
        yield row_to_sample(row, cols, name=name, location=f"{source.path}[{source.split}]#{index}", index=index, base=base,
                            scalar=scalar)
