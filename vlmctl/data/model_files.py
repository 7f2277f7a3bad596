"""Which file of a local model folder is broken, before transformers tries to load it (the checks that read files
only; `vlmctl.models.integrity` adds the diagnosis after a failed load).

    check_model_files("outputs/model")          # DamagedFileError naming the file, or None

transformers reports a damaged file in its own words, often without the file's name ("Expecting property name
enclosed in double quotes", "incomplete metadata, file not fully covered", "'added_tokens'"), and some damage only
shows later (a chat template that does not compile fails at the first prompt, a broken generation_config.json is
skipped without a word). These checks name the file, where in it, and the fix:

- every JSON file a checkpoint holds parses (`JSON_FILES`: config, generation config, processor and tokenizer
  settings, the tokenizer itself, the safetensors index, vlmctl's build record);
- `chat_template.jinja` compiles (in the environment chat templates render in, `vlmctl.data.tokens`);
- every safetensors file has a valid header and is as long as its header says (the format: 8-byte little-endian
  header length, a JSON header of `{name: {dtype, shape, data_offsets}}`, then the data; huggingface/safetensors,
  README "Format"), and every shard that `model.safetensors.index.json` lists is there.

They read headers only (no tensor data) and parse the small files, so they run on every load of a local folder.
They live with the data layer because token counting (`vlmctl.data.tokens`) reads saved processors too.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from vlmctl.errors import ModelError

# jinja2 and tokenizers are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.
# Light vlmctl modules are imported next to their use as well.

JSON_FILES = ("config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json",
              "video_preprocessor_config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
              "added_tokens.json", "chat_template.json", "model.safetensors.index.json", "vlmctl_model.json",
              "adapter_config.json")
TEMPLATE_FILE = "chat_template.jinja"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER = 100 << 20
"""Largest safetensors header read (the safetensors library refuses more than 100 MB too)."""



class DamagedFileError(ModelError):
    """A file of a model folder is damaged or does not fit the others; the message names it, the hint says how to
    get a good copy. Callers that try several folders stop at this one: another folder would not mend it."""


_checked: dict[tuple, None] = {}  # folders whose files passed, keyed by their names, sizes and mtimes


def _fix(folder: Path) -> str:
    built = (folder / "vlmctl_model.json").is_file()
    return ("copy or download it again from where the model came from (an interrupted copy or download leaves a file "
            "so)" + ("; a folder written by `vlmctl model build` is remade with `vlmctl model build --force`" if built else ""))


def check_model_files(folder: str | Path, *, weights: bool = True) -> None:
    """Raise DamagedFileError (a ModelError) naming the first damaged file of the local model folder `folder` (see
    the module docstring), with where in it and the fix; nothing for a folder that passes, or that is not a local
    folder. `weights=False` leaves the weight files and their index out (a command that reads only the processor)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return
    names = [n for n in (*JSON_FILES, TEMPLATE_FILE) if (folder / n).is_file() and (weights or n != INDEX_FILE)]
    weights = sorted(p.name for p in folder.glob("*.safetensors") if p.is_file()) if weights else []
    try:
        key = (str(folder.resolve()), *((n, (st := (folder / n).stat()).st_size, st.st_mtime_ns) for n in (*names, *weights)))
    except OSError:
        key = None
    if key is not None and key in _checked:
        return
    for name in names:
        if name.endswith(".json"):
            _check_json(folder / name, folder)
    if TEMPLATE_FILE in names:
        _check_template(folder / TEMPLATE_FILE)
    if INDEX_FILE in names:
        _check_index(folder)
    for name in weights:
        safetensors_header(folder / name)
    if key is not None:
        _checked[key] = None


def _check_json(path: Path, folder: Path) -> Any:
    try:
        text = path.read_bytes().decode("utf-8")
        return json.loads(text)
    except UnicodeDecodeError as exc:
        raise DamagedFileError(f"{path} is not UTF-8 text (byte {exc.start}): the file is damaged", hint=_fix(folder)) from None
    except json.JSONDecodeError as exc:
        what = "empty" if not text.strip() else f"not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        raise DamagedFileError(f"{path} is {what}", hint=_fix(folder)) from None
    except OSError as exc:
        raise DamagedFileError(f"cannot read {path}: {exc.strerror or exc}", hint=_fix(folder)) from None


def _check_template(path: Path) -> None:
    import jinja2

    from vlmctl.data.chat_template import compile_chat_template

    try:
        compile_chat_template(path.read_text(encoding="utf-8", errors="strict"))
    except UnicodeDecodeError as exc:
        raise DamagedFileError(f"{path} is not UTF-8 text (byte {exc.start})", hint=_fix(path.parent)) from None
    except jinja2.TemplateSyntaxError as exc:
        raise DamagedFileError(f"{path} is not a valid chat template (Jinja2, line {exc.lineno}: {exc.message})",
                         hint="fix the template's syntax, or " + _fix(path.parent)) from None


def _check_index(folder: Path) -> None:
    path = folder / INDEX_FILE
    index = _check_json(path, folder)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise DamagedFileError(f"{path} has no weight_map of tensor names to shard files", hint=_fix(folder))
    for shard in sorted(set(weight_map.values())):
        if not (folder / shard).is_file():
            raise DamagedFileError(f"{path} lists the shard {shard}, which is not in {folder}", hint=_fix(folder))


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of the safetensors file `path` (tensor name -> {dtype, shape, data_offsets}, and
    `__metadata__`). Raises ModelError naming the file when the header is not valid or the file is shorter or
    longer than the header says."""
    fix = _fix(path.parent)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise DamagedFileError(f"{path} is not a safetensors file: it holds {size} bytes, fewer than its 8-byte header length", hint=fix)
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise DamagedFileError(f"{path} is truncated or not a safetensors file: its header would be {n:,} bytes, the file "
                                 f"holds {size:,}", hint=fix)
            raw = f.read(n)
    except OSError as exc:
        raise DamagedFileError(f"cannot read {path}: {exc.strerror or exc}", hint=fix) from None
    try:
        header = json.loads(raw.decode("utf-8"))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, IndexError, TypeError, ValueError):
        raise DamagedFileError(f"{path} is not a safetensors file: its header is not the JSON table of tensors", hint=fix) from None
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        state = "truncated" if size < expected else "longer than its header says"
        raise DamagedFileError(f"{path} is {state}: it holds {size:,} bytes, its header describes {expected:,}", hint=fix)
    return header


def check_tokenizer(folder: str | Path) -> DamagedFileError | None:
    """A DamagedFileError naming `folder`'s tokenizer.json when the `tokenizers` library cannot read it (a file that
    parses as JSON but is no tokenizer), else None."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as bad:  # noqa: BLE001 - tokenizers raises plain Exception for a malformed file
        first = str(bad).splitlines()[0] if str(bad) else type(bad).__name__
        return DamagedFileError(f"{path} is not a tokenizer the `tokenizers` library can read ({first})", hint=_fix(folder))
    return None
