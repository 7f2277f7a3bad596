"""Which file of a local model folder is broken, before and after transformers tries to load it.

    check_model_files("outputs/model")          # DamagedFileError naming the file, or None (`vlmctl.data.model_files`)
    diagnose_load_failure("outputs/model", exc)  # after a failed from_pretrained: a ModelError naming the file, or None

The file checks (JSON files parse, the chat template compiles, safetensors headers and shards are whole) are
`vlmctl.data.model_files`'; after a failed load, `diagnose_load_failure` also tries the tokenizer with the
`tokenizers` library and names the tensors whose shapes in the weight files differ from those `config.json` gives
the model.
"""

from __future__ import annotations

from pathlib import Path

from vlmctl.data.model_files import (  # noqa: F401 - re-exported: callers name one module
    DamagedFileError,
    check_tokenizer,
    check_model_files,
    safetensors_header,
)
from vlmctl.errors import ModelError

# transformers is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for
# it.
# So are the vlmctl modules that load numpy when imported.


def diagnose_load_failure(folder: str | Path, exc: BaseException) -> ModelError | None:
    """After transformers failed to load from the local folder `folder` (with `exc`): a ModelError naming the file
    to blame, or None when no file is found at fault (the caller reports `exc`)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return None
    try:
        check_model_files(folder)
    except ModelError as found:
        return found
    for check in (_check_tokenizer, _check_shapes):
        try:
            found = check(folder, exc)
        except Exception:  # noqa: BLE001 - a diagnosis that fails itself must not hide the original error
            found = None
        if found is not None:
            return found
    return None


def _check_tokenizer(folder: Path, exc: BaseException) -> ModelError | None:
    return check_tokenizer(folder)


def _check_shapes(folder: Path, exc: BaseException) -> ModelError | None:
    """The tensors whose shape in the weight files differs from the one config.json gives the model, as
    transformers itself matches them (`from_pretrained(..., ignore_mismatched_sizes=True,
    output_loading_info=True)`: a second load, on this failure path only)."""
    if "mismatch" not in str(exc).lower():
        return None
    import transformers

    from vlmctl.families import detect_family, get_family
    from vlmctl.models.quiet import quiet_transformers

    cfg = transformers.AutoConfig.from_pretrained(str(folder))
    cls = getattr(transformers, get_family(detect_family(cfg)).model_class)
    with quiet_transformers():
        _, info = cls.from_pretrained(str(folder), ignore_mismatched_sizes=True, output_loading_info=True)
    mismatched = sorted(info.get("mismatched_keys") or [])
    if not mismatched:
        return None
    name, have, want = mismatched[0]
    have, want = list(have), list(want)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    # the file holding it: the shard with a tensor of that shape whose name ends as the model's name does (saved
    # names may keep an older prefix: `language_model.model.layers...` for `model.language_model.layers...`)
    tail = name.split(".", 2)[-1]
    where = next((f for f in files for k, v in safetensors_header(folder / f).items()
                  if k != "__metadata__" and k.endswith(tail) and list(v["shape"]) == have), files[0] if len(files) == 1 else None)
    weights = folder / where if where else f"the weights of {folder}"
    more = f" (and {len(mismatched) - 1} more tensors)" if len(mismatched) > 1 else ""
    return DamagedFileError(
        f"the weights in {weights} do not fit {folder / 'config.json'}: {name} is {have} in the weights, {want} under "
        f"the config{more}",
        hint="config.json and the weights come from different models: restore the config.json that was saved with "
        "these weights (or put back the weights that go with this config)")
