"""Model card generation and upload of a model folder to the Hugging Face Hub.

The card is built with huggingface_hub's `ModelCardData` (YAML metadata, including the `model-index` eval results)
and `ModelCard.from_template`; the body reports how the model was trained, read from the run folder that produced
it (`config.yaml`, `checkpoints/*/trainer_state.json`, `metrics.jsonl`), the eval table from `vlmctl eval`'s
`metrics.json` files (`{"task", "model", "data", "n", "metrics": {name: value}}`) and a usage snippet.

Uploads use `HfApi.create_repo(exist_ok=True)` and `HfApi.upload_folder` (or `upload_large_folder`, where the
installed huggingface_hub has it, for folders over `LARGE_FOLDER_BYTES`). The token comes from `HF_TOKEN` or the
stored login (`huggingface_hub.get_token`) and is never printed. HTTP failures are mapped to `VlmctlError`s that
say what to do (log in, pick a namespace you can write to, go online).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmctl.errors import UsageError, VlmctlError

if TYPE_CHECKING:
    from huggingface_hub import ModelCard

    from vlmctl.config.hub import HubSection

CARD_NAME = "README.md"
EXPORT_INFO = "vlmctl_export.json"  # written by `vlmctl convert`: where the folder came from
MODEL_INFO = "vlmctl_model.json"  # written by `vlmctl model build`: how the model was composed
LARGE_FOLDER_BYTES = 50 * 1024**3
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Files of a model folder that never go to the Hub (the export record holds local paths).
IGNORE_PATTERNS = [".git/*", "*.tmp", ".cache/*", "**/.cache/*", EXPORT_INFO]

# Eval task (vlmctl eval) -> Hub task type for the model-index metadata.
_TASK_TYPES = {
    "vqa": "visual-question-answering",
    "docvqa": "visual-question-answering",
    "chartqa": "visual-question-answering",
    "mcq": "visual-question-answering",
    "caption": "image-to-text",
    "loss": "image-text-to-text",
}

CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

{{ description }}

## Model

{{ architecture }}

## Training
{% if training %}
| | |
|---|---|
{% for key, value in training %}| {{ key }} | {{ value }} |
{% endfor %}
{% else %}
No training run was found next to this folder.
{% endif %}
## Evaluation
{% if evals %}
| task | data | samples | metric | value |
|---|---|---|---|---|
{% for row in evals %}| {{ row.task }} | {{ row.data }} | {{ row.n }} | {{ row.metric }} | {{ row.value }} |
{% endfor %}
{% else %}
No `vlmctl eval` results were found for this model.
{% endif %}
## Usage

```python
{{ usage }}
```

Trained with [vlmctl](https://github.com/vlmctl/vlmctl).
"""


@dataclass
class TrainingSummary:
    """What a run folder says about training (None where the run did not record it)."""

    run_dir: str
    stage: str | None = None
    strategy: str | None = None
    steps: int | None = None
    tokens_seen: int | None = None
    hardware: str | None = None
    final_loss: float | None = None
    learning_rate: float | None = None
    lora: str | None = None
    base_models: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)
    project: str | None = None

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows of the model card's training table, skipping unknown values."""
        pairs = [
            ("stage", self.stage),
            ("strategy", self.strategy),
            ("optimizer steps", self.steps),
            ("tokens seen", f"{self.tokens_seen:,}" if self.tokens_seen is not None else None),
            ("hardware", self.hardware),
            ("final training loss", f"{self.final_loss:.4f}" if self.final_loss is not None else None),
            ("peak learning rate", self.learning_rate),
            ("LoRA", self.lora),
        ]
        return [(k, str(v)) for k, v in pairs if v is not None]


@dataclass
class UploadFile:
    path: str  # relative, POSIX
    size: int  # bytes


@dataclass
class PushResult:
    repo_id: str
    files: list[UploadFile]
    card: str
    card_generated: bool
    dry_run: bool
    url: str | None = None
    commit: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_bytes": self.total_bytes}


# --------------------------------------------------------------------------------------------------------------------
# Reading a run folder


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def is_run_dir(path: Path) -> bool:
    """A vlmctl run folder has `config.yaml` plus `checkpoints/`, `final/` or `metrics.jsonl`."""
    return (path / "config.yaml").is_file() and any((path / n).exists() for n in ("checkpoints", "final", "metrics.jsonl"))


def find_run_dir(folder: Path) -> Path | None:
    """The run folder that produced `folder`: itself, its parents (`<run>/final`, `<run>/checkpoints/checkpoint-N`),
    or the run recorded by `vlmctl convert` in `vlmctl_export.json`."""
    folder = Path(folder).resolve()
    info = _read_json(folder / EXPORT_INFO)
    if isinstance(info, dict) and info.get("run_dir") and is_run_dir(Path(info["run_dir"])):
        return Path(info["run_dir"])
    for candidate in (folder, *list(folder.parents)[:3]):
        if is_run_dir(candidate):
            return candidate
    return None


def _looks_like_hub_id(value: Any) -> bool:
    return isinstance(value, str) and bool(_HUB_ID.match(value)) and not Path(value).exists()


def _last_checkpoint_state(run_dir: Path) -> dict[str, Any]:
    states = []
    for p in (run_dir / "checkpoints").glob("checkpoint-*/trainer_state.json"):
        m = re.fullmatch(r"checkpoint-(\d+)", p.parent.name)
        if m:
            states.append((int(m.group(1)), p))
    for p in (run_dir / "final" / "trainer_state.json",):
        if p.is_file():
            states.append((10**18, p))
    if not states:
        return {}
    data = _read_json(max(states)[1])
    return data if isinstance(data, dict) else {}


def _metrics(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(row, dict):
            rows.append(row)
    return rows


def training_summary(run_dir: Path) -> TrainingSummary:
    """Summarize a run folder for the model card.

    Reads `config.yaml` (stage, strategy, LoRA, learning rate, model and data sources), the newest
    `trainer_state.json` (step, world_size, strategy, hardware) and `metrics.jsonl` (last `loss`; tokens seen from
    the last `tokens_seen`/`total_tokens`/`tokens` value, a cumulative counter).
    """
    run_dir = Path(run_dir)
    cfg = _read_yaml(run_dir / "config.yaml")
    train = cfg.get("train") or {}
    model = cfg.get("model") or {}
    data = cfg.get("data") or {}
    state = _last_checkpoint_state(run_dir)
    rows = _metrics(run_dir)

    steps = state.get("step")
    if steps is None:
        steps = max((r["step"] for r in rows if isinstance(r.get("step"), int)), default=None)
    final_loss = next((float(r["loss"]) for r in reversed(rows) if isinstance(r.get("loss"), (int, float))), None)
    tokens = None
    for key in ("tokens_seen", "total_tokens", "tokens"):
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            tokens = int(max(values))
            break

    world = state.get("world_size")
    device = state.get("hardware") or state.get("device") or next((r.get("device") for r in rows if r.get("device")), None)
    hardware = None
    if world or device:
        hardware = f"{world or 1} x {device}" if device else f"{world} process{'es' if world != 1 else ''}"

    lora = train.get("lora")
    lora_text = None
    if isinstance(lora, dict):
        lora_text = f"r={lora.get('r', '?')}, alpha={lora.get('alpha', '?')}"
    elif isinstance(state.get("lora"), dict):
        lora_text = f"r={state['lora'].get('r', '?')}, alpha={state['lora'].get('lora_alpha', '?')}"

    base_models = [v for v in (model.get("base"), model.get("vision"), model.get("llm")) if _looks_like_hub_id(v)]
    datasets = [s["path"] for s in data.get("sources") or [] if isinstance(s, dict) and s.get("format") == "hf" and s.get("path")]
    return TrainingSummary(
        run_dir=str(run_dir),
        stage=train.get("stage"),
        strategy=state.get("strategy") or train.get("strategy"),
        steps=steps,
        tokens_seen=tokens,
        hardware=hardware,
        final_loss=final_loss,
        learning_rate=train.get("learning_rate"),
        lora=lora_text,
        base_models=base_models,
        datasets=datasets,
        project=(cfg.get("project") or {}).get("name"),
    )


# --------------------------------------------------------------------------------------------------------------------
# Eval results


def find_eval_results(folder: Path, *, run_dir: Path | None = None, eval_dir: Path | None = None) -> list[dict[str, Any]]:
    """`metrics.json` files written by `vlmctl eval` for this model.

    Looks in the folder itself, `<folder>/eval`, `<run>/eval` and `eval_dir` (the project's `eval.output_dir`, one
    level of subfolders too). A file in the model folder is taken as is; elsewhere its `model` field must name this
    folder (or the run's `final/`).
    """
    folder = Path(folder).resolve()
    names = {folder}
    if run_dir is not None:
        names.add((Path(run_dir) / "final").resolve())
    own = [folder / "metrics.json", folder / "eval" / "metrics.json"]
    others: list[Path] = []
    for root in [Path(run_dir) / "eval" if run_dir else None, Path(eval_dir) if eval_dir else None]:
        if root is not None and root.is_dir():
            others += [root / "metrics.json", *sorted(root.glob("*/metrics.json"))]
    results, seen = [], set()
    for path in own + others:
        if not path.is_file() or path.resolve() in seen:
            continue
        seen.add(path.resolve())
        data = _read_json(path)
        if not isinstance(data, dict) or not isinstance(data.get("metrics"), dict):
            continue
        if path not in own:
            model = data.get("model")
            if not model or Path(str(model)).expanduser().resolve() not in names:
                continue
        results.append({**data, "_path": str(path)})
    return results


def _eval_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        for name, value in r["metrics"].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append({"task": r.get("task", "?"), "data": Path(str(r.get("data", "?"))).name or "?", "n": r.get("n", "?"), "metric": name, "value": f"{value:.4g}"})
    return rows


# --------------------------------------------------------------------------------------------------------------------
# Model card


def _architecture(folder: Path) -> str:
    cfg = _read_json(folder / "config.json") or {}
    info = _read_json(folder / MODEL_INFO) or {}
    parts = []
    arch = (cfg.get("architectures") or [None])[0]
    if arch:
        parts.append(f"`{arch}` ({cfg.get('model_type', '?')})")
    vision = (cfg.get("vision_config") or {}).get("model_type")
    text = (cfg.get("text_config") or {}).get("model_type")
    if vision or text:
        parts.append(f"vision encoder: `{vision or '?'}`, language model: `{text or '?'}`")
    built = info.get("built_from") or {}
    for key in ("preset", "vision", "llm", "base", "projector"):
        if built.get(key):
            parts.append(f"{key}: `{built[key]}`")
    params = info.get("parameters") or {}
    if params.get("total"):
        split = ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in params.items() if k != "total" and isinstance(v, int))
        parts.append(f"{params['total'] / 1e6:.2f}M parameters" + (f" ({split})" if split else ""))
    if (folder / "adapter_config.json").is_file():
        adapter = _read_json(folder / "adapter_config.json") or {}
        parts.append(f"peft LoRA adapter on `{adapter.get('base_model_name_or_path', '?')}`")
    return "; ".join(parts) or "A vision-language model."


def _usage(repo_id: str, adapter: bool) -> str:
    load = (
        f'model = AutoModelForImageTextToText.from_pretrained("{repo_id}")  # loads the base model and this LoRA adapter (peft)'
        if adapter
        else f'model = AutoModelForImageTextToText.from_pretrained("{repo_id}", dtype="auto")'
    )
    return (
        "from PIL import Image\n"
        "from transformers import AutoModelForImageTextToText, AutoProcessor\n\n"
        f'processor = AutoProcessor.from_pretrained("{repo_id}")\n'
        f"{load}\n"
        'messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]\n'
        "prompt = processor.apply_chat_template(messages, add_generation_prompt=True)\n"
        'inputs = processor(images=Image.open("image.jpg"), text=prompt, return_tensors="pt")\n'
        "out = model.generate(**inputs, max_new_tokens=64)\n"
        'print(processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))'
    )


def build_model_card(
    folder: Path,
    *,
    hub: "HubSection",
    repo_id: str,
    run_dir: Path | None = None,
    eval_dir: Path | None = None,
) -> "ModelCard":
    """Build the model card (README.md) of a model folder.

    Metadata: `base_model` (the Hub ids of the base VLM, or of the vision encoder and LLM it was composed from),
    `datasets`, `license`, `pipeline_tag: image-text-to-text`, `library_name: transformers` (`peft` for an adapter),
    `tags` and a `model-index` with the eval results. `run_dir` defaults to the run found by `find_run_dir`.
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    folder = Path(folder)
    run_dir = run_dir or find_run_dir(folder)
    summary = training_summary(run_dir) if run_dir else None
    built = (_read_json(folder / MODEL_INFO) or {}).get("built_from") or {}
    adapter_cfg = _read_json(folder / "adapter_config.json") if (folder / "adapter_config.json").is_file() else None

    base_models = list(summary.base_models) if summary else []
    for key in ("base", "vision", "llm"):
        if _looks_like_hub_id(built.get(key)) and built[key] not in base_models:
            base_models.append(built[key])
    if adapter_cfg and _looks_like_hub_id(adapter_cfg.get("base_model_name_or_path")):
        base_models = [adapter_cfg["base_model_name_or_path"]]
    datasets = list(dict.fromkeys([*hub.datasets, *(summary.datasets if summary else [])]))

    name = repo_id.split("/")[-1]
    evals = find_eval_results(folder, run_dir=run_dir, eval_dir=eval_dir)
    eval_results = []
    for r in evals:
        for metric, value in r["metrics"].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                data_name = Path(str(r.get("data", "eval"))).name or "eval"
                eval_results.append(
                    EvalResult(
                        task_type=_TASK_TYPES.get(str(r.get("task")), "image-text-to-text"),
                        dataset_type=data_name,
                        dataset_name=data_name,
                        metric_type=metric,
                        metric_value=float(value),
                    )
                )
    tags = list(dict.fromkeys(["vlmctl", "vision-language", "image-text-to-text", *(["lora"] if adapter_cfg else []), *hub.tags]))
    card_data = ModelCardData(
        base_model=base_models or None,
        datasets=datasets or None,
        license=hub.license,
        pipeline_tag="image-text-to-text",
        library_name="peft" if adapter_cfg else "transformers",
        tags=tags,
        model_name=name if eval_results else None,
        eval_results=eval_results or None,
    )
    description = f"A vision-language model trained with vlmctl{f' (project `{summary.project}`)' if summary and summary.project else ''}."
    return ModelCard.from_template(
        card_data,
        template_str=CARD_TEMPLATE,
        model_name=name,
        description=description,
        architecture=_architecture(folder),
        training=summary.rows() if summary else [],
        evals=_eval_rows(evals),
        usage=_usage(repo_id, adapter=adapter_cfg is not None),
    )


# --------------------------------------------------------------------------------------------------------------------
# Upload


def list_upload_files(folder: Path) -> list[UploadFile]:
    """Files `upload_folder` sends (same ignore rules), sorted by path, with their sizes in bytes."""
    from huggingface_hub.utils import filter_repo_objects

    folder = Path(folder)
    paths = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    try:
        from huggingface_hub.hf_api import DEFAULT_IGNORE_PATTERNS
    except ImportError:  # pragma: no cover - older huggingface_hub
        DEFAULT_IGNORE_PATTERNS = [".git", ".git/*", "*/.git", "**/.git/**", ".cache/huggingface", ".cache/huggingface/*"]
    kept = filter_repo_objects(paths, ignore_patterns=[*IGNORE_PATTERNS, *DEFAULT_IGNORE_PATTERNS])
    return [UploadFile(p, (folder / p).stat().st_size) for p in sorted(kept)]


def _api():
    from huggingface_hub import HfApi

    # HF_ENDPOINT is read now rather than when huggingface_hub was imported.
    return HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)


def _offline() -> bool:
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE")
    return env.upper() in ("1", "ON", "YES", "TRUE") if env is not None else constants.HF_HUB_OFFLINE


def _hub_error(exc: Exception, *, repo_id: str, endpoint: str) -> VlmctlError:
    """Map huggingface_hub / httpx failures to an error with a fix."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

    if isinstance(exc, OfflineModeIsEnabled):
        return VlmctlError("HF_HUB_OFFLINE is set: the Hub cannot be reached", hint="unset HF_HUB_OFFLINE (or set it to 0) to upload; `--dry-run` works offline")
    if isinstance(exc, HfHubHTTPError) and getattr(exc, "response", None) is not None:
        status = exc.response.status_code
        server = (getattr(exc, "server_message", None) or "").strip()
        detail = f" ({server})" if server else ""
        if status == 401:
            return VlmctlError(f"the Hub rejected the token: not logged in or the token is invalid{detail}", hint="run `hf auth login` or set HF_TOKEN to a token with write access")
        if status == 403:
            return VlmctlError(f"no write permission on {repo_id}{detail}", hint="use a token with the `write` role (or fine-grained write access to this namespace), or pick a repo id in your own namespace")
        if isinstance(exc, RepositoryNotFoundError) or status == 404:
            return VlmctlError(f"repository {repo_id} is not accessible with this token{detail}", hint="check the repo id and that your token may write to its namespace")
        return VlmctlError(f"the Hub returned HTTP {status} for {repo_id}{detail}", hint="try again; run with --debug for the full response")
    name = type(exc).__name__
    if "Connect" in name or "Timeout" in name or isinstance(exc, (ConnectionError, OSError)) and "connect" in str(exc).lower():
        return VlmctlError(f"cannot reach the Hub at {endpoint} ({name})", hint="check the network connection (or HF_ENDPOINT); `--dry-run` works offline")
    return VlmctlError(f"upload to {repo_id} failed: {name}: {exc}", hint="run with --debug for the full traceback")


def check_write_access(api, repo_id: str) -> str:
    """Check that there is a token, that it is valid, and that it may write to `repo_id`'s namespace.

    Returns the user name. Raises VlmctlError: no token (not logged in), invalid token, read-only token, or a
    namespace that is neither the user nor one of their organizations.
    """
    from huggingface_hub import get_token

    if not get_token():
        raise VlmctlError("not logged in to the Hugging Face Hub", hint="run `hf auth login` or set HF_TOKEN to a token with write access")
    try:
        me = api.whoami()
    except Exception as exc:  # noqa: BLE001 - mapped to a readable error
        raise _hub_error(exc, repo_id=repo_id, endpoint=api.endpoint) from None
    user = me.get("name", "?")
    role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise VlmctlError(f"the token of {user} is read-only: no write permission on {repo_id}", hint="create a token with the `write` role and log in again (`hf auth login`)")
    namespace = repo_id.split("/")[0]
    orgs = {o.get("name") for o in me.get("orgs") or []}
    if namespace != user and namespace not in orgs:
        raise VlmctlError(
            f"{repo_id} is owned by {namespace!r}, which is neither you ({user}) nor one of your organizations",
            hint=f"push to {user}/{repo_id.split('/')[-1]} or to an organization you belong to",
        )
    return user


def push_folder(
    folder: Path,
    *,
    hub: "HubSection",
    repo_id: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
    eval_dir: Path | None = None,
) -> PushResult:
    """Upload a model folder to the Hub, generating `README.md` (model card) when absent.

    Arguments left None fall back to the `hub` section. With `dry_run` nothing is written or sent: the result lists
    the files (including the card that would be generated) and the card text.

    Raises:
        UsageError: no repo id, or the folder does not exist / is empty.
        VlmctlError: not logged in, invalid or read-only token, repo owned by someone else, no write permission,
            offline (HF_HUB_OFFLINE or no connection).
    """
    folder = Path(folder)
    repo_id = repo_id or hub.repo_id
    if not repo_id:
        raise UsageError("no repository given", hint="pass --repo-id ORG/NAME or set hub.repo_id in vlmctl.yaml")
    if not _HUB_ID.match(repo_id):
        raise UsageError(f"{repo_id!r} is not a Hub repo id", hint="repo ids look like ORG/NAME")
    if not folder.is_dir():
        raise UsageError(f"model folder {folder} does not exist", hint="pass the folder to upload, e.g. outputs/runs/<run>/final, or run `vlmctl convert` first")
    private = hub.private if private is None else private
    revision = revision or hub.revision
    commit_message = commit_message or hub.commit_message or f"Upload {repo_id.split('/')[-1]} with vlmctl"

    card_path = folder / CARD_NAME
    generated = not card_path.is_file()
    card_text = build_model_card(folder, hub=hub, repo_id=repo_id, eval_dir=eval_dir).content if generated else card_path.read_text()
    files = list_upload_files(folder)
    if generated:
        files = sorted([*files, UploadFile(CARD_NAME, len(card_text.encode()))], key=lambda f: f.path)
    if not files:
        raise UsageError(f"{folder} is empty", hint="convert a checkpoint into it first: vlmctl convert RUN -o FOLDER")
    result = PushResult(repo_id=repo_id, files=files, card=card_text, card_generated=generated, dry_run=dry_run)
    if dry_run:
        return result

    if _offline():
        raise VlmctlError("HF_HUB_OFFLINE is set: the Hub cannot be reached", hint="unset HF_HUB_OFFLINE (or set it to 0) to upload; `--dry-run` works offline")
    api = _api()
    check_write_access(api, repo_id)
    if generated:
        tmp = folder / f".{CARD_NAME}.tmp"
        tmp.write_text(card_text)
        tmp.replace(card_path)
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        large = hasattr(api, "upload_large_folder") and result.total_bytes > LARGE_FOLDER_BYTES
        if large:
            api.upload_large_folder(repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision, private=private, ignore_patterns=IGNORE_PATTERNS)
            commit = None
        else:
            info = api.upload_folder(
                repo_id=repo_id, folder_path=folder, revision=revision, commit_message=commit_message, ignore_patterns=list(IGNORE_PATTERNS)
            )
            commit = getattr(info, "oid", None)
    except VlmctlError:
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to a readable error
        raise _hub_error(exc, repo_id=repo_id, endpoint=api.endpoint) from exc
    result.url = str(url)
    result.commit = commit
    return result
