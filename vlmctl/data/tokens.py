"""Exact per-sample token counts under a model's processor: text tokens + visual tokens.

    counter = TokenCounter.load(Path("outputs/model"))    # None when the folder holds no processor/tokenizer
    n = counter.count(sample, sizes=[(640, 480)])          # tokens

Text tokens: the conversation rendered with the processor's chat template (so template tokens count), tokenized
without extra special tokens; a video part is rendered as the family's video prompt (as the collator writes it,
`vlmctl.data.modalities.video.VideoUnit`), an audio part as the family's audio prompt
(`vlmctl.data.modalities.audio.AudioUnit`). Each video's placeholder token is replaced by the family's video-token
count for its stored clip (`FamilySpec.num_video_tokens(frames, width, height, processor, fps=rate)`, frames, size
and rate read from the clip's header; Qwen3-VL's count includes the timestamp text its processor writes per temporal
patch, counted with the tokenizer), each audio clip's by the family's audio-token count (`num_audio_tokens(samples,
sampling_rate, processor)`, read from the stored FLAC's header), and each image's placeholder token by the
family's number of visual tokens for the image's size:
1. `vlmctl.families.get_family(name).num_visual_tokens(width, height, processor)` when the model folder's
   `vlmctl_model.json` names a registered family;
2. else the processor's own `_get_num_multimodal_tokens(image_sizes=...)` (transformers processors);
3. else the fixed-resolution LLaVA rule `(H / patch) * (W / patch) + num_additional_image_tokens
   (- 1 for vision_feature_select_strategy "default")` from transformers' `LlavaProcessor`.

A folder written by `vlmctl model build` (its `vlmctl_model.json` names the family; `tokenizer.json`,
`processor_config.json` and the chat template sit next to it) is read from its files (`TokenCounter.from_files`):
the `tokenizers` library encodes, jinja2 renders the chat template in the sandbox transformers uses, and the
family's visual-token rule reads the saved processor settings. Neither transformers nor torch is imported and no
weights are read, so `data validate` and `data prepare` start in well under a second. Any other folder (a Hub
checkpoint, a base-mode pointer, a slow tokenizer) loads its processor with transformers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from vlmctl.data.chat_template import compile_chat_template
from vlmctl.data.model_files import check_model_files, check_tokenizer
from vlmctl.data.sample import Sample
from vlmctl.errors import DataError, ModelError

# tokenizers and transformers are imported inside the functions that use them: importing vlmctl (the CLI's start-up)
# must not pay for them.
# So are the vlmctl modules that load numpy when imported.
# ctypes (standard library, not loaded at the CLI's start-up) is imported inside the functions that use it.

RENDER_SECONDS = 10.0
"""Longest a chat template may take to render one conversation (real time)."""
RENDER_CHARS = 16 << 20
"""Most characters a chat template may render for one conversation."""
MODEL_INFO = "vlmctl_model.json"
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json")
_TEMPLATE_FILE = "chat_template.jinja"


class _RenderTimeout(BaseException):
    """Raised inside a rendering thread by the watchdog (a BaseException: a template's or library's `except
    Exception` does not swallow it)."""


class _Watchdog:
    """One daemon thread per process that raises `_RenderTimeout` in a thread whose rendering passed its deadline,
    through CPython's `PyThreadState_SetAsyncExc` (delivered between bytecodes, as a signal handler's exception
    is, so a jinja loop stops; a single long C call finishes first). Works in any thread, unlike SIGALRM, which
    only ever interrupts the main thread. Started on first use, and again in a forked child (threads do not
    survive `fork`)."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        # also the fork hook: the parent's lock may have been held at fork time, and its thread is not in the child
        self.cond = threading.Condition()
        self.deadlines: dict[int, tuple[float, int]] = {}  # thread id -> (monotonic deadline, entry number)
        self.fired: set[int] = set()  # entries whose exception was sent
        self.entries = 0
        self.wake_at = float("inf")  # when the watchdog thread looks next
        self.started = False

    def _run(self) -> None:
        import ctypes

        with self.cond:
            while True:
                now = time.monotonic()
                for tid, (deadline, entry) in list(self.deadlines.items()):
                    if deadline <= now and entry not in self.fired:
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_RenderTimeout))
                        self.fired.add(entry)
                pending = [d for d, e in self.deadlines.values() if e not in self.fired]
                self.wake_at = min(pending, default=float("inf"))
                self.cond.wait(None if not pending else max(0.0, self.wake_at - now))

    @contextlib.contextmanager
    def limit(self, seconds: float) -> Iterator[None]:
        """Raise `_RenderTimeout` in this thread once the block has run `seconds` (real time). A nested block runs
        under the outer one's limit."""
        import ctypes

        tid = threading.get_ident()
        with self.cond:
            if not self.started:
                self.started = True
                threading.Thread(target=self._run, name="vlmctl-render-watchdog", daemon=True).start()
            nested = tid in self.deadlines
            if not nested:
                self.entries += 1
                entry = self.entries
                deadline = time.monotonic() + seconds
                self.deadlines[tid] = (deadline, entry)
                if deadline < self.wake_at:  # else the watchdog looks before this is due anyway
                    self.wake_at = deadline
                    self.cond.notify()
        if nested:
            yield
            return
        try:
            yield
        finally:
            while True:
                try:
                    with self.cond:  # the watchdog sends only while holding this: after it, nothing more comes
                        self.deadlines.pop(tid, None)
                        if entry in self.fired:
                            self.fired.discard(entry)
                            # sent but maybe not delivered (the block ended first): withdraw it, it must not land
                            # in the caller's code
                            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)
                    break
                except _RenderTimeout:  # delivered during this clean-up: the rendering had ended; finish it
                    continue


_WATCHDOG = _Watchdog()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_WATCHDOG._reset)


@contextlib.contextmanager
def render_limits(what: str) -> Iterator[None]:
    """Stop a chat-template rendering after `RENDER_SECONDS` (real time) with DataError naming `what` (the
    template's model); a template with nested loops of 100,000 steps each would otherwise hang validate, prepare,
    eval and serve. Holds in any thread and process (prepare's workers, serve's request threads): a watchdog
    thread interrupts the rendering thread (`_Watchdog`); no signal or interval timer is used."""
    try:
        with _WATCHDOG.limit(RENDER_SECONDS):
            yield
    except _RenderTimeout:
        raise DataError(f"the chat template of {what} did not finish rendering one conversation in {RENDER_SECONDS:g} s",
                        hint="fix the template's loops (model.chat_template, or chat_template.jinja in the model folder)") from None


def check_rendered(text: str, what: str) -> str:
    """`text`, or DataError when a chat template rendered more than `RENDER_CHARS` characters."""
    if len(text) > RENDER_CHARS:
        raise DataError(f"the chat template of {what} rendered {len(text):,} characters for one conversation (limit "
                        f"{RENDER_CHARS:,})", hint="fix the template (model.chat_template, or chat_template.jinja in the model folder)")
    return text


def has_processor(folder: Path | str | None) -> bool:
    """True when `folder` looks like a saved model/processor folder."""
    return folder is not None and Path(folder).is_dir() and any((Path(folder) / f).is_file() for f in (MODEL_INFO, *_PROCESSOR_FILES))


def load_saved_processor(folder: Path | str, family: str | None = None):
    """The processor saved in `folder` (a built model folder, or one `vlmctl.data.counting.counter_in` wrote), read
    by transformers' `AutoProcessor`; a base-mode build (its `vlmctl_model.json` has mode "base" and the folder no
    config.json) is followed to its `source`. Where `AutoProcessor` cannot build the processor (one that owns a
    video processor, without torchvision) the image-only variant of the family's class is returned
    (`FamilySpec.image_only_processor`; `family`: a family name, default the folder's record's). Raises what
    transformers raises for a folder it cannot read."""
    import transformers  # heavy: only where a processor is loaded

    folder = Path(folder)
    info = _read_json(folder / MODEL_INFO) or {}
    ref = str(info["source"]) if info.get("mode") == "base" and info.get("source") and not (folder / "config.json").is_file() else str(folder)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its load reports repeat what vlmctl prints
    try:
        try:
            return transformers.AutoProcessor.from_pretrained(ref)
        except (OSError, ImportError, AttributeError, ValueError):
            if importlib.util.find_spec("torchvision") is not None:
                raise
            from vlmctl.families import get_family  # the family registry: only for this fallback

            return get_family(family or info.get("family") or "").image_only_processor(ref)  # ModelError: no family
    finally:
        transformers.logging.set_verbosity(verbosity)


class TokenCounter:
    """Counts tokens of canonical samples for one processor. Build with `TokenCounter.load(folder)`, or from a
    loaded processor: `TokenCounter(processor, family, folder)`.

    `family`: a family name (resolved with `vlmctl.families.get_family`); None or an unknown name falls back to the
    processor's own rule.
    """

    def __init__(self, processor: Any, family: str | None, folder: Path | None):
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.folder = folder
        self._set_family(family)
        token = getattr(processor, "image_token", None) or getattr(self.tokenizer, "image_token", None) or "<image>"
        self.image_token = token
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(token)
        video = self._video_prompt_token(getattr(processor, "video_token", None) or getattr(self.tokenizer, "video_token", None))
        self.video_prompt, self.video_token_id = video[0], (self.tokenizer.convert_tokens_to_ids(video[1]) if video[1] else None)
        audio = self._prompt_token("audio", getattr(processor, "audio_token", None) or getattr(self.tokenizer, "audio_token", None))
        self.audio_prompt, self.audio_token_id = audio[0], (self.tokenizer.convert_tokens_to_ids(audio[1]) if audio[1] else None)
        has_template = bool(getattr(processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None))
        self._apply_template: Callable[[list[dict]], str] | None = (
            (lambda messages: self.processor.apply_chat_template(messages, tokenize=False)) if has_template else None
        )
        self._encode: Callable[[str], list[int]] = lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _set_family(self, family: str | None) -> None:
        from vlmctl.families import get_family

        self.family_name = family
        self._family = None
        if family:
            try:
                self._family = get_family(family)
            except ModelError:  # a family this version does not know: fall back to the processor's rule
                self._family = None

    @classmethod
    def load(cls, folder: Path | str | None) -> "TokenCounter | None":
        """The counter of the processor (or tokenizer) saved in `folder`; None when there is none.

        Reads the files directly when they allow it (`from_files`), else loads the processor with transformers
        (`load_saved_processor`, which follows a base-mode build to its checkpoint).
        Raises DataError when the folder has processor files that transformers cannot load, and
        `vlmctl.data.model_files.DamagedFileError` (a ModelError) naming a damaged one.
        """
        if not has_processor(folder):
            return None
        folder = Path(folder)
        check_model_files(folder, weights=False)  # a damaged processor file is named (counting reads no weights)
        light = cls.from_files(folder)
        if light is not None:
            return light

        family = (_read_json(folder / MODEL_INFO) or {}).get("family")
        try:
            processor = load_saved_processor(folder, family)
        except Exception:  # noqa: BLE001 - a text-only folder has a tokenizer but no processor
            try:
                from transformers import AutoTokenizer

                processor = AutoTokenizer.from_pretrained(str(folder))
            except Exception as exc:  # noqa: BLE001
                damaged = check_tokenizer(folder)  # valid JSON that is no tokenizer: name the file
                if damaged is not None:
                    raise damaged from None
                raise DataError(
                    f"cannot load the processor in {folder}: {exc}",
                    hint="rebuild the model with `vlmctl model build`, or prepare without token counts",
                ) from None
        return cls(processor, family, folder)

    @classmethod
    def from_files(cls, folder: Path | str) -> "TokenCounter | None":
        """A counter read from the files `vlmctl model build` writes, without transformers; None when the folder
        lacks one of them (no `vlmctl_model.json` naming a registered family, no readable `tokenizer.json`, no
        processor settings) or its chat template is not the processor's own single one. The result counts exactly
        what the loaded processor counts (tests/unit/test_prepare_counts.py checks every family)."""
        folder = Path(folder)
        family = (_read_json(folder / MODEL_INFO) or {}).get("family")
        settings = _read_json(folder / "processor_config.json") or {}
        tok_config = _read_json(folder / "tokenizer_config.json") or {}
        if not family or not (folder / "tokenizer.json").is_file() or not (settings or (folder / "preprocessor_config.json").is_file()):
            return None
        template = _chat_template(folder, settings)
        if isinstance(template, dict) or (template is None and tok_config.get("chat_template")):
            return None  # named templates, or only the tokenizer's: leave them to transformers
        self = cls.__new__(cls)
        self._set_family(family)
        if self._family is None:
            return None
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception:  # noqa: BLE001 - a damaged file: transformers' load reports it (`load`)
            return None
        tokenizer.no_truncation()
        tokenizer.no_padding()
        if "image_processor" not in settings:
            settings = {**settings, "image_processor": _read_json(folder / "preprocessor_config.json") or {}}
        # what the family's visual- and video-token rules read, by attribute (the tokenizer: Qwen3-VL's timestamps)
        self.processor = SimpleNamespace(**{**settings, "tokenizer": tokenizer})
        self.tokenizer = tokenizer
        self.folder = folder
        # The placeholder the chat template writes per image: the family's prompt when it is one token (Gemma 3's
        # `<start_of_image>`, which its processor expands), else the token the processor repeats (none for a family
        # that takes no images).
        token = None
        if "image" in self._family.modalities:
            prompt = self._family.image_prompt
            token = prompt if tokenizer.token_to_id(prompt) is not None else (
                settings.get("image_token") or _content(tok_config.get("image_token")) or self._family.image_token)
        self.image_token = token
        self.image_token_id = tokenizer.token_to_id(token) if token else None
        self.video_prompt, video_token = self._video_prompt_token(None)
        self.video_token_id = tokenizer.token_to_id(video_token) if video_token else None
        self.audio_prompt, audio_token = self._prompt_token("audio", None)
        self.audio_token_id = tokenizer.token_to_id(audio_token) if audio_token else None
        specials = {k: _content(v) for k, v in tok_config.items() if k.endswith("_token") and _content(v) is not None}
        self._apply_template = _template_renderer(template, specials) if template else None
        self._encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
        return self

    def _video_prompt_token(self, processor_token: str | None) -> tuple[str | None, str | None]:
        """(what a video part renders as, the placeholder token the processor expands): the family's video prompt
        and token when it takes videos, else the processor's video token (both None without one)."""
        return self._prompt_token("video", processor_token)

    def _prompt_token(self, modality: str, processor_token: str | None) -> tuple[str | None, str | None]:
        """(what a part of `modality` renders as, the placeholder token the processor expands): the family's prompt
        and token when it takes the modality, else the processor's token (both None without one)."""
        table = getattr(self._family, "modalities", None) or {}
        if modality in table:
            return self._family.prompt(modality), table[modality]
        return processor_token, processor_token

    def audio_tokens(self, data: bytes) -> int:
        """Placeholder tokens of one stored audio clip (`normalize_audio` bytes) under the family's audio-token rule.
        Raises DataError for a folder without a family, or a family without an audio-token rule."""
        from vlmctl.data.modalities.audio import audio_shape

        rule = getattr(self._family, "num_audio_tokens", None)
        if rule is None:
            raise DataError(f"no audio-token rule is known for the processor in {self.folder}: its audio tokens cannot be counted",
                            hint="use a model folder of a family that takes audio (qwen2_audio) written by `vlmctl model build`")
        samples, rate = audio_shape(data)
        return int(rule(samples, rate, self.processor))

    def video_tokens(self, data: bytes) -> int:
        """Tokens the processor writes in place of one stored clip's placeholder (`normalize_video` bytes) under the
        family's video-token rule. Raises ModelError when the family has none, DataError for a folder without a
        family."""
        from vlmctl.data.modalities.video import probe

        if self._family is None:
            raise DataError(f"no family is known for the processor in {self.folder}: its video tokens cannot be counted",
                            hint="use a model folder written by `vlmctl model build` (its vlmctl_model.json names the family)")
        info = probe(data)
        return int(self._family.num_video_tokens(info.frames, info.width, info.height, self.processor, fps=info.fps))

    def visual_tokens(self, width: int, height: int) -> int:
        """Visual tokens of one image of `width` x `height` pixels."""
        if self._family is not None:
            return int(self._family.num_visual_tokens(width, height, self.processor))
        fn = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if fn is not None:
            try:
                return int(fn(image_sizes=[(height, width)])["num_image_tokens"][0])
            except Exception:  # noqa: BLE001 - some processors need sizes they do not have (e.g. crop_size unset)
                pass
        ip = getattr(self.processor, "image_processor", None)
        patch = getattr(self.processor, "patch_size", None)
        size = getattr(ip, "size", None) or {}
        if patch and "height" in size and "width" in size:
            n = (size["height"] // patch) * (size["width"] // patch) + int(getattr(self.processor, "num_additional_image_tokens", 0) or 0)
            if getattr(self.processor, "vision_feature_select_strategy", None) == "default":
                n -= 1
            return n
        raise ValueError(f"no rule for the number of visual tokens of the processor in {self.folder}")

    def render(self, sample: Sample) -> str:
        """The conversation as the model sees it (chat template applied), with one image token per image."""
        messages = [{"role": m["role"], "content": [self._part(p) for p in m["content"]]} for m in sample.messages]
        if self._apply_template is not None:
            what = str(self.folder or "the model")
            with render_limits(what):
                return check_rendered(self._apply_template(messages), what)
        return "\n".join(
            "".join(self.image_token if p["type"] == "image" else self._part(p)["text"] for p in m["content"]) for m in sample.messages
        )

    def _part(self, part: dict) -> dict:
        if part["type"] == "image":
            return {"type": "image"}
        if part["type"] == "video":
            if self.video_prompt is None:
                raise DataError(f"the processor in {self.folder} has no video token: this model takes no video",
                                hint="drop the video samples, or use a model that takes video (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)")
            return {"type": "text", "text": self.video_prompt}
        if part["type"] == "audio":
            if self.audio_prompt is None:
                raise DataError(f"the processor in {self.folder} has no audio token: this model takes no audio",
                                hint="drop the audio samples, or use a model that takes audio (qwen2_audio)")
            return {"type": "text", "text": self.audio_prompt}
        return {"type": "text", "text": part["text"]}

    def count(self, sample: Sample, sizes: list[tuple[int, int]]) -> int:
        """Tokens of `sample` (text + media); `sizes` are the (width, height) of its images in order, its videos and
        audio clips are read from `sample.videos` / `sample.audios` (stored clips). A part counts each time it is
        used, as the collator passes it. Records the placeholder tokens of each stored image, video and audio clip in
        `sample.media_tokens`."""
        text = self.render(sample)
        per = {"image": [self.visual_tokens(w, h) for w, h in sizes], "video": [self.video_tokens(clip) for clip in sample.videos],
               "audio": [self.audio_tokens(clip) for clip in sample.audios]}
        sample.media_tokens = {kind: n for kind, n in per.items() if n or kind == "image"}
        # Families whose processor writes marker tokens or text around the visual tokens: tokenize the text as the
        # processor rewrites it (the images' tokens are then in it, with their markers).
        used_images = [sizes[p["index"]] for m in sample.messages for p in m["content"] if p["type"] == "image"]
        expanded = self._family.expand_images(text, used_images, self.processor) if self._family is not None and used_images else None
        if expanded is not None:
            text, per["image"], media = expanded, [0] * len(per["image"]), set()
        else:
            media = {self.image_token_id}
        ids = self._encode(text)
        media |= {self.video_token_id} if per["video"] else set()
        media |= {self.audio_token_id} if per["audio"] else set()
        placeholders = sum(1 for t in ids if t in media)
        used = sum(per[p["type"]][p["index"]] for m in sample.messages for p in m["content"] if p["type"] in per)
        return len(ids) - placeholders + used


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _content(value: Any) -> str | None:
    """A special token as saved in tokenizer_config.json: a string or an AddedToken dict ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, settings: dict[str, Any]) -> str | dict | None:
    """The processor's chat template, looked up where transformers' `ProcessorMixin.from_pretrained` finds it."""
    if (folder / _TEMPLATE_FILE).is_file():
        return (folder / _TEMPLATE_FILE).read_text()
    legacy = _read_json(folder / "chat_template.json")
    if legacy and legacy.get("chat_template"):
        return legacy["chat_template"]
    if settings.get("chat_template"):
        return settings["chat_template"]
    if (folder / "additional_chat_templates").is_dir():
        return {}  # named templates: leave the choice to transformers
    return None


def _template_renderer(template: str, specials: dict[str, str]) -> Callable[[list[dict]], str]:
    """`messages -> text` rendering `template` as `processor.apply_chat_template(messages, tokenize=False)` does:
    the special tokens as variables, no generation prompt, in transformers' sandboxed environment
    (`transformers.utils.chat_template_utils._cached_compile_jinja_template`, 5.23: trim_blocks, lstrip_blocks,
    loop controls, the `{% generation %}` tag, `tojson`, `raise_exception`, `strftime_now`, guarded namespaces)."""
    compiled = compile_chat_template(template)

    def render(messages: list[dict]) -> str:
        out, size = [], 0
        for chunk in compiled.generate(messages=messages, tools=None, documents=None, add_generation_prompt=False, **specials):
            size += len(chunk)
            if size > RENDER_CHARS:  # stop before the text fills the memory
                return check_rendered("".join(out) + chunk, "the model")
            out.append(chunk)
        return "".join(out)

    return render
