"""Exact per-sample token counts under a built model's processor: text tokens + visual tokens.

    counter = TokenCounter.load(Path("outputs/model"))    # None when the folder holds no processor/tokenizer
    n = counter.count(sample, sizes=[(640, 480)])          # tokens

Text tokens: the conversation rendered with the processor's chat template (so template tokens count), tokenized
without extra special tokens. Each image's placeholder token in that text is replaced by the family's number of
visual tokens for the image's size:
1. `vlmctl.families.get_family(name).num_visual_tokens(width, height, processor)` when the model folder's
   `vlmctl_model.json` names a registered family;
2. else the processor's own `_get_num_multimodal_tokens(image_sizes=...)` (transformers processors);
3. else the fixed-resolution LLaVA rule `(H / patch) * (W / patch) + num_additional_image_tokens
   (- 1 for vision_feature_select_strategy "default")` from transformers' `LlavaProcessor`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmctl.data.sample import Sample

MODEL_INFO = "vlmctl_model.json"
_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json")


def has_processor(folder: Path | None) -> bool:
    """True when `folder` looks like a saved model/processor folder."""
    return folder is not None and Path(folder).is_dir() and any((Path(folder) / f).is_file() for f in (MODEL_INFO, *_PROCESSOR_FILES))


class TokenCounter:
    """Counts tokens of canonical samples for one processor. Build with `TokenCounter.load(folder)`.

    `family`: a family name (resolved with `vlmctl.families.get_family`); None or an unknown name falls back to the
    processor's own rule.
    """

    def __init__(self, processor: Any, family: str | None, folder: Path):
        from vlmctl.errors import ModelError
        from vlmctl.families import get_family

        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.family_name = family
        self.folder = folder
        self._family = None
        if family:
            try:
                self._family = get_family(family)
            except ModelError:  # a family this version does not know: fall back to the processor's rule
                self._family = None
        token = getattr(processor, "image_token", None) or getattr(self.tokenizer, "image_token", None) or "<image>"
        self.image_token = token
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(token)
        self._has_template = bool(getattr(processor, "chat_template", None) or getattr(self.tokenizer, "chat_template", None))

    @classmethod
    def load(cls, folder: Path | None) -> "TokenCounter | None":
        """Load the processor (or tokenizer) saved in `folder`; None when there is none.

        Raises DataError when the folder has processor files that transformers cannot load.
        """
        if not has_processor(folder):
            return None
        from vlmctl.errors import DataError

        folder = Path(folder)
        family = None
        if (folder / MODEL_INFO).is_file():
            try:
                family = json.loads((folder / MODEL_INFO).read_text()).get("family")
            except (json.JSONDecodeError, OSError):
                family = None
        try:
            from transformers import AutoProcessor

            processor = AutoProcessor.from_pretrained(str(folder))
        except Exception:  # noqa: BLE001 - a text-only folder has a tokenizer but no processor
            try:
                from transformers import AutoTokenizer

                processor = AutoTokenizer.from_pretrained(str(folder))
            except Exception as exc:  # noqa: BLE001
                raise DataError(
                    f"cannot load the processor in {folder}: {exc}",
                    hint="rebuild the model with `vlmctl model build`, or prepare without token counts",
                ) from None
        return cls(processor, family, folder)

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
        messages = [
            {"role": m["role"], "content": [{"type": "image"} if p["type"] == "image" else {"type": "text", "text": p["text"]} for p in m["content"]]}
            for m in sample.messages
        ]
        if self._has_template:
            return self.processor.apply_chat_template(messages, tokenize=False)
        return "\n".join(
            "".join(self.image_token if p["type"] == "image" else p["text"] for p in m["content"]) for m in sample.messages
        )

    def count(self, sample: Sample, sizes: list[tuple[int, int]]) -> int:
        """Tokens of `sample` (text + visual); `sizes` are the (width, height) of its images in order."""
        ids = self.tokenizer(self.render(sample), add_special_tokens=False)["input_ids"]
        placeholders = sum(1 for t in ids if t == self.image_token_id)
        return len(ids) - placeholders + sum(self.visual_tokens(w, h) for w, h in sizes)
