"""Model card generation and upload of a model folder to the Hugging Face Hub.

The card is built with huggingface_hub's `ModelCardData` (YAML metadata, including the `model-index` eval results)
and `ModelCard.from_template`; the body reports how the model was trained, read from the run folder that produced
it (`config.yaml`, `checkpoints/*/trainer_state.json`, `metrics.jsonl`), the eval table from `vlmctl eval`'s
`metrics.json` files (`{"task", "model", "data", "n", "metrics": {name: value}}`) and a usage snippet.

Every push sends vlmctl's card: a folder's `README.md` is replaced when it is a placeholder (the card template
peft's `save_pretrained` writes into adapter folders) or an earlier vlmctl card, and kept when someone wrote it.
The upload goes from a staged copy in a temporary folder (links to the model's files, plus the generated
`README.md` and, for an adapter whose base is on the Hub, an `adapter_config.json` naming that Hub id instead of a
local path): the model folder itself is never written to.

Uploads use `HfApi.create_repo(exist_ok=True)` and `HfApi.upload_folder` (or `upload_large_folder`, where the
installed huggingface_hub has it, for folders over `LARGE_FOLDER_BYTES`). The token comes from `HF_TOKEN` or the
stored login (`huggingface_hub.get_token`) and is never printed. HTTP failures are mapped to `VlmctlError`s that
say what to do (log in, pick a namespace you can write to, go online).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmctl.errors import MissingModelError, UsageError, VlmctlError
from vlmctl.outputs import MARKER as OUTPUT_MARKER

if TYPE_CHECKING:
    from huggingface_hub import ModelCard

    from vlmctl.config.hub import HubSection

# huggingface_hub and yaml are imported inside the functions that use them: importing vlmctl (the CLI's start-up)
# must not pay for them.
# So are the vlmctl modules that load numpy when imported.
# Light vlmctl modules are imported next to their use as well.

CARD_NAME = "README.md"
EXPORT_INFO = "vlmctl_export.json"  # written by `vlmctl convert`: where the folder came from
MODEL_INFO = "vlmctl_model.json"  # written by `vlmctl model build`: how the model was composed
LARGE_FOLDER_BYTES = 50 * 1024**3
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Files of a model folder that never go to the Hub (the export record holds local paths).
# vlmctl's own bookkeeping stays local: where an export came from, which command wrote a folder (`outputs.MARKER`)
IGNORE_PATTERNS = [".git/*", "*.tmp", ".cache/*", "**/.cache/*", EXPORT_INFO, OUTPUT_MARKER, f"**/{OUTPUT_MARKER}"]
# Splits `vlmctl data prepare` writes; `vlmctl eval --data val` records the data as "val".
_PREPARED_SPLITS = ("train", "val")
# Text of huggingface_hub's model card template (what peft's `save_pretrained` fills into adapter folders) that a
# written card no longer holds, and the line that ends vlmctl's own cards.
_PLACEHOLDER_MARKS = ("# Model Card for Model ID", "<!-- Provide a quick summary of what the model is/does. -->")
_VLMCTL_MARK = "Trained with [vlmctl](https://github.com/vlmctl/vlmctl)."

# Eval task (vlmctl eval) -> Hub task type for the model-index metadata.
_TASK_TYPES = {
    "vqa": "visual-question-answering",
    "docvqa": "visual-question-answering",
    "chartqa": "visual-question-answering",
    "mcq": "visual-question-answering",
    "caption": "image-to-text",
    "loss": "image-text-to-text",
    "asr": "automatic-speech-recognition",
}

CARD_TEMPLATE = """---
{{ card_data }}
---

# {{ model_name }}

{{ description }}

## Model

{{ architecture }}

{{ base_note }}

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
{% if index_note %}
{{ index_note }}
{% endif %}{% else %}
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
    objective: str | None = None  # train.objective with its settings, e.g. "dpo (sigmoid, beta 0.1, reference frozen)"
    strategy: str | None = None
    steps: int | None = None
    tokens_seen: int | None = None
    hardware: str | None = None
    final_loss: float | None = None
    learning_rate: float | None = None
    lora: str | None = None
    base_models: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)  # Hub dataset ids among data.sources (format hf)
    all_sources_on_hub: bool = False  # every data source is a Hub dataset (none is a local file)
    model_dir: str | None = None  # model.output_dir: the built model the run trained
    model_section: dict[str, Any] = field(default_factory=dict)
    project: str | None = None

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows of the model card's training table, skipping unknown values."""
        pairs = [
            ("stage", self.stage),
            ("objective", self.objective),
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
    link_to: str | None = None  # a link inside the folder: the relative path of the file it names (uploaded as that file)


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
    from vlmctl.config.objective import objective_card

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

    base_models = [v for v in (model.get("base"), model.get("vision"), model.get("audio"), model.get("llm")) if _looks_like_hub_id(v)]
    sources = [s for s in data.get("sources") or [] if isinstance(s, dict)]
    datasets = [s["path"] for s in sources if s.get("format") == "hf" and s.get("path")]
    return TrainingSummary(
        run_dir=str(run_dir),
        stage=train.get("stage"),
        objective=objective_card(train),
        strategy=state.get("strategy") or train.get("strategy"),
        steps=steps,
        tokens_seen=tokens,
        hardware=hardware,
        final_loss=final_loss,
        learning_rate=train.get("learning_rate"),
        lora=lora_text,
        base_models=base_models,
        datasets=datasets,
        all_sources_on_hub=bool(sources) and len(datasets) == len(sources),
        model_dir=str(model["output_dir"]) if model.get("output_dir") else None,
        model_section=model,
        project=(cfg.get("project") or {}).get("name"),
    )


# --------------------------------------------------------------------------------------------------------------------
# Eval results


def find_eval_results(folder: Path, *, run_dir: Path | None = None, eval_dir: Path | None = None) -> list[dict[str, Any]]:
    """`metrics.json` files written by `vlmctl eval` for this model.

    Looks in the folder itself, `<folder>/eval`, `<run>/eval` and `eval_dir` (the project's `eval.output_dir`, one
    level of subfolders too). A file in the model folder is taken as is; elsewhere its `model` field must name this
    folder (or the run's `final/`). Of several results of one task on the same data, the newest file's is kept.
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
    seen: set[Path] = set()
    newest: dict[tuple[str, str], tuple[float, dict[str, Any]]] = {}
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
        # one result per task and data: the latest evaluation (`vlmctl eval` writes each run to a new folder)
        key = (str(data.get("task")), str(data.get("data")))
        if key in newest and newest[key][0] >= path.stat().st_mtime:
            continue
        newest[key] = (path.stat().st_mtime, {**data, "_path": str(path)})
    return [result for _, result in newest.values()]


def _eval_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        for name, value in r["metrics"].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                rows.append({"task": r.get("task", "?"), "data": Path(str(r.get("data", "?"))).name or "?", "n": r.get("n", "?"), "metric": name, "value": f"{value:.4g}"})
    return rows


def eval_dataset(data: Any, hub: "HubSection", summary: TrainingSummary | None) -> tuple[str | None, str | None]:
    """(Hub dataset id, split) of the data an eval result names, for the card's `model-index`.

    A prepared split (`val`, `train`, or a `.../val` folder) was drawn from the project's data sources: its id is the
    first of `hub.datasets`, else the one Hub dataset the run trained on when every source was that dataset. Data
    that is itself a Hub id is its own dataset (no split). Local files, lmms-eval tasks and prepared splits of
    mixed or local sources have no id: (None, None).
    """
    text = str(data or "")
    if not text or text.startswith("lmms-eval:"):
        return None, None
    name = Path(text).name
    if name in _PREPARED_SPLITS:
        if hub.datasets:
            return hub.datasets[0], name
        if summary is not None and summary.all_sources_on_hub and len(set(summary.datasets)) == 1:
            return summary.datasets[0], name
        return None, None
    if _looks_like_hub_id(text):
        return text, None
    return None, None


# --------------------------------------------------------------------------------------------------------------------
# Base model


@dataclass
class BaseModels:
    """What the card says about the model's origin.

    `kind`: base (fine-tuned from one existing VLM), composed (vision encoder + LLM), preset (random init) or
    unknown. `ids`: Hub ids for the `base_model` metadata (never a local path). `relation`: `base_model_relation`,
    set only where the Hub's own inference would be wrong (it reads several base models as a merge). `origin`: one
    sentence for the card body on where the weights came from; `remark`: what the metadata makes of it.
    `adapter_base`: the Hub id an adapter applies to (what its `adapter_config.json` should name).
    """

    kind: str = "unknown"
    ids: list[str] = field(default_factory=list)
    relation: str | None = None
    origin: str = ""
    remark: str = ""
    adapter_base: str | None = None

    @property
    def note(self) -> str:
        return " ".join(t for t in (self.origin, self.remark) if t)


def _hub_link(ref: str) -> str:
    return f"[`{ref}`](https://huggingface.co/{ref})"


def _from_build(record: dict[str, Any]) -> BaseModels:
    """BaseModels of a model described by `vlmctl model build`'s record (`vlmctl_model.json`: `mode`, `init`,
    `built_from`, and a base build's `source`)."""
    built = record.get("built_from") or {}
    if record.get("init") == "random":  # weights from configs only: nothing was fine-tuned from the named models
        what = f"vlmctl's `{built['preset']}` preset" if built.get("preset") else "the configs of " + ", ".join(
            f"`{built[k]}`" for k in ("base", "vision", "audio", "llm") if built.get(k))
        return BaseModels("preset", origin=f"Built from {what} with randomly initialized weights.",
                          remark="There is no base model on the Hub.")
    base = built.get("base") or record.get("source")
    if record.get("mode") == "base" or base:
        if _looks_like_hub_id(base):
            return BaseModels("base", [base], origin=f"Fine-tuned from {_hub_link(base)}.")
        return BaseModels("base", origin="Fine-tuned from a local model folder that is not on the Hub.", remark="The card names no `base_model`.")
    llm = built.get("llm")
    kind, vision = ("audio", built["audio"]) if built.get("audio") and not built.get("vision") else ("vision", built.get("vision"))
    if vision or llm:
        ids = [r for r in (llm, vision) if _looks_like_hub_id(r)]  # the language model first, as composed VLMs list them

        def show(ref):  # local paths stay out of the card
            return _hub_link(ref) if _looks_like_hub_id(ref) else "in a local folder (not on the Hub)"

        projector = f"a new `{built['projector']}` projector" if built.get("projector") else "a new projector"
        origin = f"Composed by `vlmctl model build` from the {kind} encoder {show(vision)} and the language model {show(llm)}, joined by {projector}, then trained."
        if len(ids) == 2:
            remark = "Both are listed as `base_model` with `base_model_relation: finetune` (trained from both, not a weight merge)."
        elif ids:
            remark = f"Only `{ids[0]}` is on the Hub: it is the card's `base_model`."
        else:
            remark = "Neither is on the Hub: the card names no `base_model`."
        # Several base models read as a merge on the Hub; these were joined and trained, not weight-merged.
        return BaseModels("composed", ids, relation="finetune" if len(ids) > 1 else None, origin=origin, remark=remark)
    if built.get("preset"):
        return BaseModels("preset", origin=f"Built from vlmctl's `{built['preset']}` preset with randomly initialized weights.",
                          remark="There is no base model on the Hub.")
    return BaseModels()


def _model_record(path: Any) -> dict[str, Any] | None:
    """`vlmctl_model.json` of a local model folder, or None."""
    if not path or _looks_like_hub_id(path):
        return None
    data = _read_json(Path(str(path)).expanduser() / MODEL_INFO)
    return data if isinstance(data, dict) else None


def _trained_model(folder: Path, summary: TrainingSummary | None) -> BaseModels:
    """Origin of a full model folder: its own build record, that of the model the run trained (or that `vlmctl
    convert` recorded), else the run's `model` section."""
    export = _read_json(folder / EXPORT_INFO) or {}
    for record in (_model_record(folder), _model_record(summary.model_dir if summary else None), _model_record(export.get("model_path"))):
        if record:
            return _from_build(record)
    if summary is not None and summary.model_section:
        m = summary.model_section
        return _from_build({"init": m.get("init"), "built_from": {k: m.get(k) for k in ("base", "vision", "audio", "llm", "projector", "preset")}})
    if _looks_like_hub_id(export.get("model_path")):
        return _from_build({"mode": "base", "built_from": {"base": export["model_path"]}})
    return BaseModels(origin="Where the weights came from is not recorded next to this folder.", remark="The card names no `base_model`.")


def _adapter_base(adapter_cfg: dict[str, Any], summary: TrainingSummary | None) -> BaseModels:
    """Origin of a peft adapter folder. Its `base_model` is the model the adapter applies to, so only a Hub model
    qualifies: a model composed or built from a preset is local, and listing its parts would point users at models
    the adapter does not fit."""
    ref = adapter_cfg.get("base_model_name_or_path")
    origin = BaseModels("base", [ref]) if _looks_like_hub_id(ref) else None
    record = None if origin else (_model_record(ref) or _model_record(summary.model_dir if summary else None))
    if record:
        origin = _from_build(record)
    elif origin is None and summary is not None and summary.model_section.get("init") != "random" and _looks_like_hub_id(summary.model_section.get("base")):
        origin = BaseModels("base", [summary.model_section["base"]])
    if origin is not None and origin.kind == "base" and origin.ids:
        base = origin.ids[0]
        return BaseModels("base", [base], origin=f"A LoRA adapter (peft) for {_hub_link(base)}.", adapter_base=base)
    text = "A LoRA adapter (peft) for a base model that is not on the Hub."
    if origin is not None and origin.origin:
        text += f" The base model was {origin.origin[0].lower()}{origin.origin[1:]}"
    return BaseModels(origin.kind if origin else "unknown", origin=text,
                      remark="The card names no `base_model`: load the base model first, or push a standalone model made with `vlmctl convert --merge-lora`.")


# --------------------------------------------------------------------------------------------------------------------
# Model card


def _architecture(folder: Path) -> str:
    cfg = _read_json(folder / "config.json") or {}
    info = _read_json(folder / MODEL_INFO) or {}
    parts = []
    arch = (cfg.get("architectures") or [None])[0]
    if arch:
        parts.append(f"`{arch}` ({cfg.get('model_type', '?')})")
    audio = (cfg.get("audio_config") or {}).get("model_type")
    vision = (cfg.get("vision_config") or {}).get("model_type")
    text = (cfg.get("text_config") or {}).get("model_type")
    if audio or vision or text:
        encoder = f"audio encoder: `{audio}`" if audio and not vision else f"vision encoder: `{vision or '?'}`"
        parts.append(f"{encoder}, language model: `{text or '?'}`")
    built = info.get("built_from") or {}
    for key in ("preset", "vision", "audio", "llm", "base", "projector"):
        if built.get(key) and (key in ("preset", "projector") or _looks_like_hub_id(built[key])):  # no local paths
            parts.append(f"{key}: `{built[key]}`")
    params = info.get("parameters") or {}
    if params.get("total"):
        split = ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in params.items() if k != "total" and isinstance(v, int))
        parts.append(f"{params['total'] / 1e6:.2f}M parameters" + (f" ({split})" if split else ""))
    if (folder / "adapter_config.json").is_file():
        adapter = _read_json(folder / "adapter_config.json") or {}
        parts.append(f"peft LoRA adapter (r={adapter.get('r', '?')}, alpha={adapter.get('lora_alpha', '?')})")
    return "; ".join(parts) or "A vision-language model."


def _modalities(folder: Path, summary: TrainingSummary | None) -> tuple[str, ...]:
    """What the model in `folder` takes besides text: its family's `modalities` (`vlmctl.families`), the family found
    from the `model_type` of a `config.json` or the `family` of a build record (`vlmctl_model.json`) in the folder, in
    the local base model its adapter config names, or in the model folder the run trained. Empty when none of them
    names a known family."""
    from vlmctl.errors import ModelError
    from vlmctl.families import get_family

    adapter = _read_json(folder / "adapter_config.json")
    base = adapter.get("base_model_name_or_path") if isinstance(adapter, dict) else None
    places = [folder]
    if base and not _looks_like_hub_id(base):
        places.append(Path(str(base)).expanduser())
    if summary is not None and summary.model_dir:
        places.append(Path(summary.model_dir).expanduser())
    for place in places:
        for file, key in (("config.json", "model_type"), (MODEL_INFO, "family")):
            data = _read_json(place / file)
            name = data.get(key) if isinstance(data, dict) else None
            if not name:
                continue
            try:
                return tuple(get_family(str(name)).modalities)
            except ModelError:
                continue
    return ()


def _is_audio(modalities: tuple[str, ...]) -> bool:
    """An audio-language model: its family takes audio and no images (Qwen2-Audio)."""
    return "audio" in modalities and "image" not in modalities


# Usage snippet per input kind: the Auto class vanilla transformers loads the model with, the imports, the chat
# content item, the question, the line that reads the input (if any) and the processor's argument for it. Audio
# (transformers 5.23): `Qwen2AudioForConditionalGeneration` is in `MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES`
# (src/transformers/models/auto/modeling_auto.py), not in the image-text-to-text mapping; `Qwen2AudioProcessor` takes
# the waveform as `audio=`, sampled at its feature extractor's `sampling_rate` (16 kHz for Whisper's).
_USAGE = {
    "image": ("AutoModelForImageTextToText", "from PIL import Image\n", "image", "What is in the image?",
              "", 'images=Image.open("image.jpg")'),
    "audio": ("AutoModelForMultimodalLM", "import librosa\n", "audio", "What is said in the audio?",
              'audio, _ = librosa.load("audio.wav", sr=processor.feature_extractor.sampling_rate)', "audio=audio"),
}


def _usage(repo_id: str, adapter: bool, adapter_base: str | None = None, *, audio: bool = False) -> str:
    auto, extra, item, question, read, keyword = _USAGE["audio" if audio else "image"]
    imports = f"{extra}from transformers import {auto}, AutoProcessor\n"
    if adapter and adapter_base is None:  # the base is not on the Hub: load it first, then the adapter onto it
        imports = "from peft import PeftModel\n" + imports
        load = (f'base = {auto}.from_pretrained("PATH/TO/BASE_MODEL", dtype="auto")  # the model the adapter was trained on\n'
                f'model = PeftModel.from_pretrained(base, "{repo_id}")')
    elif adapter:
        load = f'model = {auto}.from_pretrained("{repo_id}")  # loads the base model and this LoRA adapter (peft)'
    else:
        load = f'model = {auto}.from_pretrained("{repo_id}", dtype="auto")'
    return (
        f"{imports}\n"
        f'processor = AutoProcessor.from_pretrained("{repo_id}")\n'
        f"{load}\n"
        f'messages = [{{"role": "user", "content": [{{"type": "{item}"}}, {{"type": "text", "text": "{question}"}}]}}]\n'
        "prompt = processor.apply_chat_template(messages, add_generation_prompt=True)\n"
        + (f"{read}\n" if read else "")
        + f'inputs = processor({keyword}, text=prompt, return_tensors="pt")\n'
        "out = model.generate(**inputs, max_new_tokens=64)\n"
        'print(processor.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))'
    )


def base_models(folder: Path, *, run_dir: Path | None = None) -> BaseModels:
    """Where the model in `folder` came from (see `BaseModels`), from its build record, its adapter config and the
    run that produced it (`run_dir` defaults to the run found by `find_run_dir`)."""
    folder = Path(folder)
    run_dir = run_dir or find_run_dir(folder)
    summary = training_summary(run_dir) if run_dir else None
    if (folder / "adapter_config.json").is_file():
        return _adapter_base(_read_json(folder / "adapter_config.json") or {}, summary)
    return _trained_model(folder, summary)


def build_model_card(
    folder: Path,
    *,
    hub: "HubSection",
    repo_id: str,
    run_dir: Path | None = None,
    eval_dir: Path | None = None,
) -> "ModelCard":
    """Build the model card (README.md) of a model folder with huggingface_hub's `ModelCardData` + `ModelCard`.

    Metadata (the Hub's model card spec, https://huggingface.co/docs/hub/model-cards): `base_model` (Hub ids only,
    see `base_models`: the base VLM, or the language model and vision encoder a composed model was built from, with
    `base_model_relation: finetune`; an adapter's base only when that is on the Hub; omitted, with a note in the
    text, otherwise), `datasets` (`hub.datasets`, then the Hub datasets the run trained on), `license`,
    `pipeline_tag` (`image-text-to-text`; `audio-text-to-text` for a model whose family takes audio and no images,
    see `_modalities`: the Hub's task tags, https://huggingface.co/tasks), `library_name` (`peft` for an adapter, else `transformers`), `tags`, and a
    `model-index` with the eval results whose data has a Hub dataset id (`eval_dataset`): the id in `dataset.type`,
    the split in `dataset.split`. Results without an id stay in the body's table only. `run_dir` defaults to the run
    found by `find_run_dir`.
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    folder = Path(folder)
    run_dir = run_dir or find_run_dir(folder)
    summary = training_summary(run_dir) if run_dir else None
    adapter = (folder / "adapter_config.json").is_file()
    audio = _is_audio(_modalities(folder, summary))
    task = "audio-text-to-text" if audio else "image-text-to-text"
    origin = base_models(folder, run_dir=run_dir)
    datasets = list(dict.fromkeys([*hub.datasets, *(summary.datasets if summary else [])]))

    name = repo_id.split("/")[-1]
    evals = find_eval_results(folder, run_dir=run_dir, eval_dir=eval_dir)
    eval_results, unindexed = [], 0
    for r in evals:
        dataset_id, split = eval_dataset(r.get("data"), hub, summary)
        for metric, value in r["metrics"].items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if dataset_id is None:
                unindexed += 1
                continue
            eval_results.append(
                EvalResult(
                    task_type=_TASK_TYPES.get(str(r.get("task")), task),
                    dataset_type=dataset_id,
                    dataset_name=f"{dataset_id.split('/')[-1]} ({split})" if split else dataset_id.split("/")[-1],
                    dataset_split=split,
                    metric_type=metric,
                    metric_value=float(value),
                )
            )
    index_note = (
        "Results on data without a Hub dataset id (a local file, or the prepared val split when neither `hub.datasets` "
        "nor a single Hub data source names its dataset) are listed here only, not in the card's `model-index` metadata."
        if unindexed else ""
    )
    tags = list(dict.fromkeys(["vlmctl", "audio-language" if audio else "vision-language", task, *(["lora"] if adapter else []), *hub.tags]))
    card_data = ModelCardData(
        base_model=origin.ids or None,
        datasets=datasets or None,
        license=hub.license,
        pipeline_tag=task,
        library_name="peft" if adapter else "transformers",
        tags=tags,
        model_name=name if eval_results else None,
        eval_results=eval_results or None,
        **({"base_model_relation": origin.relation} if origin.relation else {}),
    )
    description = f"A{'n audio' if audio else ' vision'}-language model trained with vlmctl{f' (project `{summary.project}`)' if summary and summary.project else ''}."
    return ModelCard.from_template(
        card_data,
        template_str=CARD_TEMPLATE,
        model_name=name,
        description=description,
        architecture=_architecture(folder),
        base_note=origin.note,
        training=summary.rows() if summary else [],
        evals=_eval_rows(evals),
        index_note=index_note,
        usage=_usage(repo_id, adapter=adapter, adapter_base=origin.adapter_base, audio=audio),
    )


# --------------------------------------------------------------------------------------------------------------------
# Upload


def _walk_regular(folder: Path) -> tuple[list[str], dict[str, str]]:
    """(regular files, links to regular files inside `folder` as {link: target}) under `folder`, relative POSIX
    paths. Links are not followed while walking. Raises UsageError naming every link that points outside the
    folder (or to a folder, or nowhere) and every entry that is not a regular file (FIFO, socket, device)."""
    root = folder.resolve()
    files, links, bad = [], {}, []
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            rel = path.relative_to(folder).as_posix()
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode):
                target = path.resolve()
                if root not in target.parents or not target.is_file() or not stat.S_ISREG(target.stat().st_mode):
                    bad.append(f"{rel} -> {os.readlink(path)} (a link {'out of the folder' if root not in target.parents else 'to no regular file'})")
                else:
                    links[rel] = target.relative_to(root).as_posix()
            elif stat.S_ISREG(mode):
                files.append(rel)
            elif not stat.S_ISDIR(mode):
                bad.append(f"{rel} (not a regular file)")
    if bad:
        raise UsageError(
            f"{folder} holds {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} push does not upload: " + "; ".join(bad[:5])
            + (f"; and {len(bad) - 5} more" if len(bad) > 5 else ""),
            hint="push uploads the regular files inside the model folder only: copy the file into the folder or remove the link",
        )
    return files, links


def list_upload_files(folder: Path) -> list[UploadFile]:
    """Files `upload_folder` sends (same ignore rules), sorted by path, with their sizes in bytes. A link to a
    regular file inside the folder is listed with `link_to` and uploaded as that file. Raises UsageError for a link
    out of the folder or an entry that is not a regular file (`_walk_regular`)."""
    from huggingface_hub.utils import filter_repo_objects

    folder = Path(folder)
    files, links = _walk_regular(folder)
    try:
        from huggingface_hub.hf_api import DEFAULT_IGNORE_PATTERNS
    except ImportError:  # pragma: no cover - older huggingface_hub
        DEFAULT_IGNORE_PATTERNS = [".git", ".git/*", "*/.git", "**/.git/**", ".cache/huggingface", ".cache/huggingface/*"]
    kept = filter_repo_objects([*files, *links], ignore_patterns=[*IGNORE_PATTERNS, *DEFAULT_IGNORE_PATTERNS])
    return [UploadFile(p, (folder / links.get(p, p)).stat().st_size, links.get(p)) for p in sorted(kept)]


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


def is_replaceable_card(text: str) -> bool:
    """True for a README.md that `push` replaces with vlmctl's card: huggingface_hub's unfilled model card template
    (the placeholder peft's `save_pretrained` writes into adapter folders) or a card vlmctl generated before."""
    return any(mark in text for mark in _PLACEHOLDER_MARKS) or _VLMCTL_MARK in text


def _adapter_config_for_hub(folder: Path, adapter_base: str | None) -> bytes | None:
    """The folder's `adapter_config.json` with `base_model_name_or_path` set to the Hub id of the adapter's base, so
    that `from_pretrained(repo_id)` finds it anywhere; None when there is nothing to change."""
    path = folder / "adapter_config.json"
    cfg = _read_json(path) if adapter_base and path.is_file() else None
    if not isinstance(cfg, dict) or cfg.get("base_model_name_or_path") == adapter_base:
        return None
    return (json.dumps({**cfg, "base_model_name_or_path": adapter_base}, indent=2, sort_keys=True) + "\n").encode()


def plan_upload(folder: Path, card_text: str | None, adapter_config: bytes | None = None) -> dict[str, Path | bytes]:
    """What the Hub repository receives: repo path -> the file on disk, or generated bytes (`card_text` as
    README.md, `adapter_config` as adapter_config.json), for the files `list_upload_files` selects."""
    contents: dict[str, Path | bytes] = {f.path: Path(folder) / (f.link_to or f.path) for f in list_upload_files(folder)}
    if card_text is not None:
        contents[CARD_NAME] = card_text.encode()
    if adapter_config is not None:
        contents["adapter_config.json"] = adapter_config
    return dict(sorted(contents.items()))


def stage_upload(contents: dict[str, Path | bytes], stage: Path) -> None:
    """Lay `contents` out in the empty folder `stage`: links to the model's files (copies where links cannot be
    made), generated files written. The upload then reads `stage`; the model folder is not written to."""
    for rel, value in contents.items():
        dst = stage / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(value, bytes):
            dst.write_bytes(value)
            continue
        if Path(value).is_symlink() or not Path(value).is_file():  # replaced by a link since it was listed
            raise UsageError(f"{value} changed while the upload was prepared (it is no longer a regular file)",
                             hint="run `vlmctl push` again")
        try:
            os.symlink(Path(value).resolve(), dst)
        except OSError:  # no symlinks on this file system (or no permission to make them)
            shutil.copy2(value, dst)


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
    """Upload a model folder to the Hub with vlmctl's model card (`build_model_card`) as `README.md`.

    A `README.md` in the folder is sent as is only when someone wrote it (`is_replaceable_card` is False); a peft
    placeholder or an earlier vlmctl card is replaced. An adapter whose base model is on the Hub is sent with that
    Hub id in `adapter_config.json`. The upload reads a staged copy in a temporary folder (`stage_upload`), removed
    afterwards: the model folder is never written to. Arguments left None fall back to the `hub` section. With
    `dry_run` nothing is written or sent: the result lists the files (with their sizes in bytes, the card included)
    and the card text.

    Raises:
        UsageError: no repo id, or the folder does not exist / is empty.
        ModelError: a damaged file in the folder (`vlmctl.models.integrity.check_model_files`), named.
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
        raise MissingModelError(f"no model folder at {folder}", hint="pass the folder to upload, e.g. outputs/runs/<run>/final, or run `vlmctl convert` first")
    listed = {f.path: f for f in list_upload_files(folder)}  # first: a link out of the folder is never read
    if not listed:
        raise UsageError(f"{folder} is empty", hint="convert a checkpoint into it first: vlmctl convert RUN -o FOLDER")
    from vlmctl.models.integrity import check_model_files

    check_model_files(folder)  # a damaged file (invalid JSON, a truncated shard) is never published
    private = hub.private if private is None else private
    revision = revision or hub.revision
    commit_message = commit_message or hub.commit_message or f"Upload {repo_id.split('/')[-1]} with vlmctl"

    card_path = folder / CARD_NAME
    existing = card_path.read_text(encoding="utf-8", errors="replace") if card_path.is_file() else None
    generated = existing is None or is_replaceable_card(existing)
    card_text = build_model_card(folder, hub=hub, repo_id=repo_id, eval_dir=eval_dir).content if generated else existing
    adapter_config = _adapter_config_for_hub(folder, base_models(folder).adapter_base)
    contents = plan_upload(folder, card_text if generated else None, adapter_config)
    files = [UploadFile(rel, len(v), None) if isinstance(v, bytes) else listed[rel] for rel, v in contents.items()]
    result = PushResult(repo_id=repo_id, files=files, card=card_text, card_generated=generated, dry_run=dry_run)
    if dry_run:
        return result

    if _offline():
        raise VlmctlError("HF_HUB_OFFLINE is set: the Hub cannot be reached", hint="unset HF_HUB_OFFLINE (or set it to 0) to upload; `--dry-run` works offline")
    api = _api()
    check_write_access(api, repo_id)
    stage = Path(tempfile.mkdtemp(prefix="vlmctl-push-"))
    try:
        stage_upload(contents, stage)
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        large = hasattr(api, "upload_large_folder") and result.total_bytes > LARGE_FOLDER_BYTES
        if large:
            api.upload_large_folder(repo_id=repo_id, folder_path=stage, repo_type="model", revision=revision, private=private, ignore_patterns=IGNORE_PATTERNS)
            commit = None
        else:
            info = api.upload_folder(
                repo_id=repo_id, folder_path=stage, revision=revision, commit_message=commit_message, ignore_patterns=list(IGNORE_PATTERNS)
            )
            commit = getattr(info, "oid", None)
    except VlmctlError:
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to a readable error
        raise _hub_error(exc, repo_id=repo_id, endpoint=api.endpoint) from exc
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    result.url = str(url)
    result.commit = commit
    return result
