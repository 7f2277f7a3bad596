"""The project file `vlmctl.yaml`: one pydantic model per section, discovery, overrides and clear errors.

Usage::

    cfg = load_config(path=None, overrides=["train.learning_rate=1e-4"])
    build_model(cfg.model)            # each module receives only its own section

Raises `vlmctl.errors.ConfigError` (exit code 2) for a missing file, bad YAML, unknown keys (with a
"did you mean" suggestion), wrong types or ranges (naming the key path and the value; a value that looks like an
access token is shown as `<hidden: N characters>`).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, model_validator

from vlmctl.config.base import Section
from vlmctl.config.data import DataSection, DataSource
from vlmctl.config.eval import EvalSection
from vlmctl.config.hub import HubSection
from vlmctl.config.model import ModelSection
from vlmctl.config.plan import Decision, DeviceFacts, RunPlan, build_plan
from vlmctl.config.project import ProjectSection
from vlmctl.config.train import LoraSection, TrainSection
from vlmctl.errors import ConfigError

# yaml is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.
# Modules the CLI's start-up loads anyway are imported next to their use as well.

CONFIG_NAME = "vlmctl.yaml"

__all__ = [
    "CONFIG_NAME", "VlmctlConfig", "ProjectSection", "DataSection", "DataSource", "ModelSection",
    "TrainSection", "LoraSection", "EvalSection", "HubSection", "load_config", "find_config",
    "apply_overrides", "parse_override", "dump_config", "validate_config", "looks_like_secret", "mask_secrets",
    "RunPlan", "Decision", "DeviceFacts", "build_plan",
]


class VlmctlConfig(Section):
    """The whole project file. Each attribute is one section model."""

    project: ProjectSection = Field(default_factory=ProjectSection, description="Project name and output root.")
    data: DataSection = Field(default_factory=DataSection, description="Data sources and preparation.")
    model: ModelSection = Field(default_factory=ModelSection, description="Model composition or base VLM.")
    train: TrainSection = Field(default_factory=TrainSection, description="Training.")
    eval: EvalSection = Field(default_factory=EvalSection, description="Evaluation.")
    hub: HubSection = Field(default_factory=HubSection, description="Hub upload and model card.")

    @model_validator(mode="before")
    @classmethod
    def _all_sections(cls, data: Any) -> Any:
        # Validate absent sections too, so their defaults see the context (project-relative paths).
        if isinstance(data, dict):
            data = {**{name: {} for name in cls.model_fields}, **{k: ({} if v is None else v) for k, v in data.items()}}
        return data

    # Set by load_config: the project file this was read from (not a key of the file).
    _path: Path | None = None

    @property
    def path(self) -> Path | None:
        """The project file this config was loaded from, or None."""
        return self._path

    @property
    def root(self) -> Path:
        """The project's directory (where relative paths in the file point)."""
        return self._path.parent if self._path is not None else Path.cwd()


def find_config(start: Path | None = None) -> Path | None:
    """Return `vlmctl.yaml` in `start` (default: cwd) or the nearest parent that has one, like git finds `.git`."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / CONFIG_NAME
        if candidate.is_file():
            return candidate
    return None


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `section.key=value` into a key path and a YAML-parsed value.

    Raises ConfigError when there is no `=` or no section.
    """
    import yaml

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or "." not in key or not all(key.split(".")):
        raise ConfigError(
            mask_secrets(f"override {text!r} is not of the form section.key=value"),
            hint="write overrides like train.learning_rate=1e-4 or data.sources.0.path=more.json",
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(mask_secrets(f"override {text!r}: value is not valid YAML ({exc})")) from None
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `raw` with each `section.key=value` override set (list items by index: `a.0.b=1`)."""
    import copy

    out = copy.deepcopy(raw)
    for text in overrides:
        keys, value = parse_override(text)
        node: Any = out
        for i, key in enumerate(keys[:-1]):
            nxt = keys[i + 1]
            if isinstance(node, list):
                node = _list_item(node, key, text)
                continue
            if node.get(key) is None:
                node[key] = [] if nxt.isdigit() else {}
            node = node[key]
            if not isinstance(node, (dict, list)):
                raise ConfigError(mask_secrets(f"override {text!r}: {'.'.join(keys[: i + 1])} is a value, not a section"))
        last = keys[-1]
        if isinstance(node, list):
            idx = int(last) if last.isdigit() else -1
            if not 0 <= idx <= len(node):
                raise ConfigError(mask_secrets(f"override {text!r}: list index {last} is out of range"))
            node[idx:idx + 1] = [value]
        else:
            node[last] = value
    return out


def _list_item(node: list, key: str, text: str) -> Any:
    if not key.isdigit() or int(key) >= len(node):
        raise ConfigError(mask_secrets(f"override {text!r}: {key!r} is not a valid list index (the list has {len(node)} items)"))
    return node[int(key)]


def load_config(path: Path | str | None = None, overrides: list[str] | None = None) -> VlmctlConfig:
    """Read, override and validate the project file.

    `path` None means discovery from the current directory upwards. Paths in the file are resolved relative to
    the file's directory.
    """
    import yaml

    if path is None:
        found = find_config()
        if found is None:
            raise ConfigError(
                f"no {CONFIG_NAME} in {Path.cwd()} or any parent folder",
                hint="create a project with `vlmctl init DIR --template tiny`, or pass -c path/to/vlmctl.yaml",
            )
        path = found
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / CONFIG_NAME
    if not path.is_file():
        raise ConfigError(f"project file {path} does not exist", hint="check the -c/--config path, or run `vlmctl init`")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(mask_secrets(f"{path} is not valid YAML: {exc}"), hint="fix the YAML syntax at the line shown") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must be a mapping of sections (project, data, model, train, eval, hub)")
    raw = apply_overrides(raw, overrides or [])
    cfg = validate_config(raw, base_dir=path.resolve().parent, source=str(path), overrides=overrides)
    cfg._path = path.resolve()
    return cfg


def validate_config(raw: dict[str, Any], base_dir: Path | None = None, source: str = "config",
                    overrides: list[str] | None = None) -> VlmctlConfig:
    """Validate a raw mapping; raise ConfigError naming every bad key path with its value or a suggestion. A key
    set by one of `overrides` (the command line's `section.key=value`) is blamed on that override, not on `source`."""
    try:
        return VlmctlConfig.model_validate(raw, context={"base_dir": base_dir})
    except ValidationError as exc:
        by_key = _override_keys(overrides or [])
        lines, from_file = [], False
        for err in _merged(exc.errors()):
            line = _describe(err, raw)
            texts = _override_of(_dotted(_plain_loc(err["loc"])), by_key)
            from_file |= not texts
            said = f" (command-line override{'s' if len(texts) > 1 else ''} {', '.join(map(repr, texts))})" if texts else ""
            lines.append(mask_secrets(line + said))
        where = f"{source} is invalid" if from_file else f"the command line's overrides are invalid (over {source})"
        fix = "fix the keys above" if from_file else "fix the overrides on the command line"
        raise ConfigError(
            f"{where}:\n" + "\n".join(f"  - {line}" for line in lines),
            hint=f"{fix} (see `vlmctl config show` for all keys and docs/config.md for their meaning)",
        ) from None


def _merged(errors: list[dict]) -> list[dict]:
    """pydantic's errors with those of one key merged: a union (`int | "auto"`) fails once per member; the
    user gets one line saying what the key takes (`should be an integer or 'auto'`)."""
    by_key: dict[tuple, list[dict]] = {}
    for err in errors:
        by_key.setdefault(_plain_loc(err["loc"]), []).append(err)
    out = []
    for loc, errs in by_key.items():
        if len(errs) == 1 or any(e["type"] in ("extra_forbidden", "missing", "value_error") for e in errs):
            out += errs
            continue
        takes = [_TAKES.get(e["type"]) or e.get("ctx", {}).get("expected") or e["msg"] for e in errs]
        out.append({**errs[0], "loc": loc, "msg": "should be " + " or ".join(dict.fromkeys(takes))})
    return out


_TAKES = {"int_parsing": "an integer", "int_from_float": "an integer", "int_type": "an integer",
          "float_parsing": "a number", "float_type": "a number", "bool_parsing": "true or false",
          "bool_type": "true or false", "string_type": "text", "list_type": "a list", "dict_type": "a mapping",
          "model_type": "a mapping of keys", "none_required": "null"}


def _override_keys(overrides: list[str]) -> dict[str, str]:
    """{dotted key path as `_dotted` writes it: override text} of `section.key=value` overrides."""
    out = {}
    for text in overrides:
        keys, _ = parse_override(text)
        out[_dotted(tuple(int(k) if k.isdigit() else k for k in keys))] = text
    return out


def _override_of(key: str, by_key: dict[str, str]) -> list[str]:
    """The override that set `key` or one of its parent sections, else those that set keys inside `key` (an error
    of a whole section, such as two keys that do not go together, involves them), else none."""
    for path, text in by_key.items():
        if key == path or key.startswith((path + ".", path + "[")):
            return [text]
    return [text for path, text in by_key.items() if key and path.startswith((key + ".", key + "["))]


# pydantic names the member of a union (or the validator) it tried in the error's location: not a key
_LOC_TAGS = ("function-", "literal[", "list[", "tuple[", "dict[", "union[", "nullable[", "json-or-python[", "lax-or-strict[")
_LOC_TYPES = {"int", "str", "float", "bool", "none", "list", "dict", "tuple", "is-instance", "path"}


def _plain_loc(loc: tuple) -> tuple:
    return tuple(p for p in loc if not (isinstance(p, str) and (p.startswith(_LOC_TAGS) or p in _LOC_TYPES)))


KEY_ALIASES = {
    "lr": "train.learning_rate", "epochs": "train.num_epochs", "num_train_epochs": "train.num_epochs",
    "lora_rank": "train.lora.r", "lora_r": "train.lora.r", "lora_alpha": "train.lora.alpha",
    "lora_dropout": "train.lora.dropout", "lora_target": "train.lora.target_modules",
    "per_device_train_batch_size": "train.micro_batch_size", "batch_size": "train.micro_batch_size",
    "gradient_accumulation": "train.gradient_accumulation_steps", "cutoff_len": "data.max_length",
    "max_seq_length": "data.max_length", "model_max_length": "data.max_length", "val_size": "data.val_ratio",
    "deepspeed": "train.deepspeed_config", "resume_from_checkpoint": "train.resume", "warmup_steps": "train.warmup_ratio",
    "load_best_model_at_end": "train.save_best", "metric_for_best_model": "train.save_best",
    "eval_strategy": "train.eval_steps", "evaluation_strategy": "train.eval_steps", "bf16": "train.precision",
    "report_to": "train.report_to", "seed": "train.seed", "max_steps": "train.max_steps",
}
"""Names users bring from transformers' TrainingArguments, LLaMA-Factory and ms-swift, and the key that does the
same here (`suggest_key`)."""


def leaf_keys(loc: tuple = ()) -> list[str]:
    """The dotted keys below the section reached by `loc` (nested sections' keys as `lora.r`; lists of sections,
    such as data.sources, not entered)."""
    out = []
    for name in _fields_at(loc):
        below = leaf_keys((*loc, name)) if _is_section(loc, name) else []
        out += [f"{name}.{k}" for k in below] or [name]
    return out


def _is_section(loc: tuple, name: str) -> bool:
    import typing

    model: Any = VlmctlConfig
    for part in loc:
        model = _section_model(model.model_fields[part].annotation)
    ann = model.model_fields[name].annotation
    return _section_model(ann) is not None and typing.get_origin(ann) is not list


def _section_model(ann) -> Any:
    import typing

    for candidate in (ann, *typing.get_args(ann)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def suggest_key(name: str, loc: tuple = ()) -> str | None:
    """The key below section `loc` a user most likely meant by the unknown `name` (a key there, or a name from
    another trainer, `KEY_ALIASES`), relative to `loc`; None when nothing is close. Nested keys are matched on their
    underscore-joined names: `lora_rank` -> `lora.r`."""
    prefix = "".join(f"{p}." for p in loc)
    alias = KEY_ALIASES.get(str(name).replace("-", "_"))
    if alias and alias.startswith(prefix):
        return alias[len(prefix):]
    keys = [*_fields_at(loc), *leaf_keys(loc)]  # a section's own name too (`trian` -> `train`)
    flat = {k.replace(".", "_"): k for k in keys}
    close = difflib.get_close_matches(str(name).replace("-", "_"), list(flat), n=1, cutoff=0.6)
    return flat[close[0]] if close else None


# Access tokens by their documented prefixes: Hugging Face (hf_, api_org_), GitHub (ghp_, gho_, ghu_, ghs_, ghr_,
# github_pat_), OpenAI/Anthropic (sk-), Slack (xox?-), GitLab (glpat-), AWS access key ids (AKIA/ASIA), W&B keys
# (40 hex characters).
_TOKEN_PREFIXES = re.compile(
    r"(?:hf_|api_org_|ghp_|gho_|ghu_|ghs_|ghr_|github_pat_|sk-|xox[abposr]-|glpat-|AKIA|ASIA)[A-Za-z0-9_\-]{8,}"
)
_LONG_WORD = re.compile(r"[A-Za-z0-9+/=_\-]{24,}")


def looks_like_secret(text: str) -> bool:
    """True for a word that looks like an access token: a known token prefix, or a long random-looking run of
    letters, digits and base64 characters (upper and lower case and digits mixed; at most one `/` below 40
    characters, so paths and Hub ids like `HuggingFaceM4/the_cauldron` are not taken for secrets)."""
    if _TOKEN_PREFIXES.fullmatch(text):
        return True
    if not _LONG_WORD.fullmatch(text):
        return False
    if re.fullmatch(r"[0-9a-fA-F]{32,}", text):
        return True
    mixed = any(c.islower() for c in text) and any(c.isupper() for c in text) and sum(c.isdigit() for c in text) >= 2
    return mixed and (text.count("/") == 0 or (len(text) >= 40 and text.count("/") <= 2))


def mask_secrets(text: str) -> str:
    """`text` with every word that `looks_like_secret` replaced by `<hidden: N characters>`, so validation
    messages never echo a token typed into the wrong key."""

    def hide_word(word: str) -> str:
        return f"<hidden: {len(word)} characters>" if looks_like_secret(word) else word

    def hide(m: re.Match) -> str:
        word = m.group(0)
        if looks_like_secret(word) or "/" not in word:
            return hide_word(word)
        return "/".join(hide_word(part) for part in word.split("/"))  # a token used as a file name in a path

    return re.sub(r"[A-Za-z0-9+/=_\-]{8,}", hide, text)


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _describe(err: dict, raw: dict) -> str:
    loc = _plain_loc(err["loc"])
    key = _dotted(loc)
    if err["type"] == "extra_forbidden":
        valid = _fields_at(loc[:-1])
        close = suggest_key(str(loc[-1]), tuple(p for p in loc[:-1] if not isinstance(p, int))) if valid else None
        parent = _dotted(loc[:-1])
        prefix = f"{parent}." if parent else ""
        msg = f"unknown key {key}"
        if close:
            return msg + f": did you mean {prefix}{close}?"
        return msg + (f" (valid keys: {', '.join(valid)})" if valid else "")
    if err["type"] == "missing":
        return f"{key}: required key is missing"
    value = err.get("input")
    msg = err["msg"].removeprefix("Value error, ").replace("Input should be", "should be")
    if err["type"] == "list_type" and isinstance(value, str):
        msg += f" (on the command line: {key}=[{value}]; in YAML: [{value}])"
    if isinstance(value, (dict, list)) or not key:
        return f"{key}: {msg}" if key else msg
    return f"{key} = {value!r}: {msg}"


def _fields_at(loc: tuple) -> list[str]:
    """Names of the valid keys of the model reached by following `loc` from the root."""
    import typing

    model: Any = VlmctlConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        model = None
        for candidate in (ann, *typing.get_args(ann), *(a for x in typing.get_args(ann) for a in typing.get_args(x))):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                model = candidate
                break
        if model is None:
            return []
    return list(getattr(model, "model_fields", {}))


def dump_config(cfg: VlmctlConfig) -> str:
    """The resolved config as YAML (defaults filled, overrides applied, paths absolute)."""
    import yaml

    data = cfg.model_dump(mode="json")
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
