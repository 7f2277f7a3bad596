"""`vlmctl serve --check`: does the server answer as the model was trained and as `vlmctl generate` answers?

    report = check_serving(Path("outputs/runs/run1/final"), device="cpu")
    report.ok, [(p.name, p.failures) for p in report.probes]

The model is served from a background thread on a free local port (`running_server`) and asked fixed probes over
HTTP, as a client would: an image question, a text-only question and a multi-turn conversation with an image
(families that take no images get the text-only one). For each probe, greedily:

1. `answer`: the served text equals `vlmctl.inference.generate`'s (what `vlmctl generate` writes) for the same
   conversation;
2. `prompt`: the served prompt's token ids equal the trainer's: the probe with the served answer as the last
   assistant turn, encoded by the training collator (`vlmctl.data.collate.Collator`) with the trainer's processor,
   up to where the answer's labels start. The trainer's processor is that of the model the training run started
   from (`model.output_dir` in the run's `config.yaml`, next to `RUN/final`), so a chat template changed in the
   export after training is caught; a folder outside a run is its own reference;
3. `logits`: the served log-probabilities of the first answer token (the chosen one and the top 5) equal the
   log-softmax of the model's forward on the trainer's encoded probe at the position before the answer, within
   `tolerance` (1e-4 in fp32, 2e-2 in 16-bit dtypes).
"""

from __future__ import annotations

import base64
import io
import json
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmctl.data.collate import IGNORE_INDEX, Collator, model_inputs
from vlmctl.data.modalities import get_unit
from vlmctl.data.sample import Sample
from vlmctl.errors import DataError
from vlmctl.inference import GenerationRequest, generate, load_for_generation
from vlmctl.inference.generation import _model_inputs
from vlmctl.inference.prompt import model_family, render_request
from vlmctl.models import load_processor
from vlmctl.serve.server import ServeSettings, running_server

# PIL, torch and yaml are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must
# not pay for them.

PROBES = ("image question", "text-only question", "multi-turn conversation")
TOP = 5


@dataclass
class ProbeResult:
    """One probe: the served and `generate` answers and what did not match (`failures`, empty when it passed)."""

    name: str
    served: str
    generated: str
    failures: list[str] = field(default_factory=list)
    max_logprob_error: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclass
class CheckReport:
    """The probes' results and the folder whose processor was the trainer's reference."""

    model_dir: Path
    reference: Path
    probes: list[ProbeResult]

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.probes)


def _png(size: int = 64) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (255, 255, 255))
    ImageDraw.Draw(img).rectangle([size // 4, size // 4, 3 * size // 4, 3 * size // 4], fill=(220, 30, 30))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def probes(takes_images: bool) -> list[tuple[str, list[dict[str, Any]], list[bytes]]]:
    """(name, canonical messages, images) of the fixed probes."""
    image = _png()
    text = lambda t: {"type": "text", "text": t}  # noqa: E731
    out = [("text-only question", [{"role": "user", "content": [text("Name a primary color.")]}], [])]
    if takes_images:
        out.insert(0, ("image question", [{"role": "user", "content": [{"type": "image", "index": 0},
                                                                         text("What color is the square?")]}], [image]))
        out.append(("multi-turn conversation", [
            {"role": "user", "content": [{"type": "image", "index": 0}, text("What shape is in the picture?")]},
            {"role": "assistant", "content": [text("A square.")]},
            {"role": "user", "content": [text("And what color is it?")]}], [image]))
    return out


def _openai_messages(messages: list[dict], images: list[bytes]) -> list[dict]:
    out = []
    for m in messages:
        parts = [{"type": "text", "text": p["text"]} if p["type"] == "text" else
                 {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(images[p["index"]]).decode()}}
                 for p in m["content"]]
        out.append({"role": m["role"], "content": parts})
    return out


def training_reference(model_dir: Path) -> Path:
    """The folder whose processor the trainer used for the model in `model_dir`: the run's `model.output_dir` (from
    `config.yaml` of the run `RUN/final` or `RUN/checkpoints/NAME` belongs to) when it holds a built model, else
    `model_dir` itself."""
    import yaml

    model_dir = Path(model_dir).resolve()
    for run in (model_dir.parent, model_dir.parent.parent):
        config = run / "config.yaml"
        if config.is_file() and ((run / "final").is_dir() or (run / "checkpoints").is_dir()):
            try:
                source = Path(str(((yaml.safe_load(config.read_text()) or {}).get("model") or {}).get("output_dir", "")))
            except (OSError, yaml.YAMLError, AttributeError):
                break
            if str(source) and source.is_absolute() and (source / "config.json").is_file():
                return source
            break
    return model_dir


def _post(url: str, body: dict, api_key: str | None) -> dict:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def check_serving(model_dir: Path, *, device: str = "auto", dtype: str = "auto", max_new_tokens: int = 16,
                  tolerance: float | None = None) -> CheckReport:
    """Serve `model_dir` on a free local port and run the probes (module docstring). Raises ModelError for a folder
    that cannot be loaded; a mismatch is a failed probe in the report, not an error."""
    import torch

    model_dir = Path(model_dir).resolve()
    model, processor = load_for_generation(model_dir, device=device, dtype=dtype)
    family = model_family(model)
    reference = training_reference(model_dir)
    trainer_processor = load_processor(reference) if reference != model_dir else processor
    tolerance = tolerance if tolerance is not None else (1e-4 if model.dtype == torch.float32 else 2e-2)
    results = []
    settings = ServeSettings(port=0, max_batch_size=1)
    with running_server(model, processor, settings, name="probe") as url:
        for name, messages, images in probes(family is None or get_unit("image").accepted_by(family)):
            body = {"model": "probe", "messages": _openai_messages(messages, images), "temperature": 0,
                    "max_tokens": max_new_tokens, "logprobs": True, "top_logprobs": TOP}
            choice = _post(url, body, None)["choices"][0]
            served = choice["message"]["content"]
            request = GenerationRequest(messages=messages, images=images)
            generated = generate(model, processor, [request], batch_size=1, max_new_tokens=max_new_tokens, family=family)[0].text
            result = ProbeResult(name, served, generated)
            if served != generated:
                result.failures.append(f"answer: served {served!r}, vlmctl generate {generated!r}")
            _compare_with_trainer(result, model, processor, trainer_processor, family, request, choice, tolerance)
            results.append(result)
    return CheckReport(model_dir, reference, results)


def _compare_with_trainer(result: ProbeResult, model, processor, trainer_processor, family, request, choice: dict,
                          tolerance: float) -> None:
    """Add the `prompt` and `logits` failures of one probe (module docstring) to `result`."""
    import torch

    answer = [{"role": "assistant", "content": [{"type": "text", "text": result.served or "."}]}]
    try:
        batch = Collator(trainer_processor, family, dummy_image=False)([Sample(id=result.name, messages=[*request.messages, *answer],
                                                                               images=request.images)])
    except DataError as exc:  # e.g. a generation prompt that is not how the template writes an assistant turn
        result.failures.append(f"prompt: the trainer's collator cannot encode this conversation: {exc.message}")
        return
    labels = batch["labels"][0].tolist()
    start = max(i for i in range(len(labels)) if labels[i] != IGNORE_INDEX and (i == 0 or labels[i - 1] == IGNORE_INDEX))
    trainer_prompt = batch["input_ids"][0, :start].tolist()
    text, images, audios, videos = render_request(request, processor, family)
    served_prompt = _model_inputs(model, processor, [text], images)["input_ids"][0].tolist()
    if served_prompt != trainer_prompt:
        first = next((i for i, (a, b) in enumerate(zip(served_prompt, trainer_prompt)) if a != b), min(len(served_prompt), len(trainer_prompt)))
        tok = processor.tokenizer
        result.failures.append(f"prompt: the served prompt ({len(served_prompt)} tokens) differs from the trainer's "
                               f"({len(trainer_prompt)} tokens) from token {first}: served "
                               f"{tok.decode(served_prompt[first:first + 8])!r}, trainer {tok.decode(trainer_prompt[first:first + 8])!r}")
        return
    device = next(model.parameters()).device
    inputs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in model_inputs(batch).items() if k != "labels"}
    for key in ("pixel_values", "pixel_values_videos", "input_features"):
        if key in inputs and inputs[key].is_floating_point():
            inputs[key] = inputs[key].to(model.dtype)
    with torch.inference_mode():
        logits = model(**inputs).logits[0, start - 1].float()
    logp = torch.log_softmax(logits, dim=-1)
    served = (choice.get("logprobs") or {}).get("content") or []
    if not served:
        result.failures.append("logits: the server returned no logprobs for the first token")
        return
    first = served[0]
    values, ids = torch.topk(logp, TOP)
    tok = processor.tokenizer
    expected = [(tok.decode([int(i)]), float(v)) for i, v in zip(ids, values)]
    got = [(e["token"], e["logprob"]) for e in first["top_logprobs"]]
    errors = [abs(a[1] - b[1]) for a, b in zip(got, expected)]
    errors.append(abs(first["logprob"] - float(logp[int(ids[0])])) if first["token"] == expected[0][0] else float("inf"))
    result.max_logprob_error = max(errors)
    if [t for t, _ in got] != [t for t, _ in expected] or result.max_logprob_error > tolerance:
        result.failures.append(f"logits: first-token log-probabilities differ from the trainer's forward by up to "
                               f"{result.max_logprob_error:.2e} (tolerance {tolerance:g}); served top {got[:3]}, trainer {expected[:3]}")


__all__ = ["CheckReport", "PROBES", "ProbeResult", "check_serving", "probes", "training_reference"]
