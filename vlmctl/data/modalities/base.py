"""The modality unit: what the data pipeline and the collator ask of one kind of media (image, video, audio).

A unit is stateless and knows no family: whatever differs between families (which modalities it takes, the
placeholder prompt, token counts) it reads from the family spec it is given, and whatever differs between
processors from the processor. Units are registered by name in `vlmctl.data.modalities.UNITS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from vlmctl.data.sample import MEDIA_COLUMNS
from vlmctl.errors import DataError


def placeholder_token_ids(processor: Any, name: str) -> set[int]:
    """Ids of the processor's placeholder token(s) of modality `name`: `processor.<name>_token_id`, and the id of
    `<name>_token` (an attribute of the processor or of its tokenizer) when the vocabulary has it."""
    tok = processor.tokenizer
    ids = set()
    value = getattr(processor, f"{name}_token_id", None)
    if isinstance(value, int):
        ids.add(value)
    token = getattr(processor, f"{name}_token", None) or getattr(tok, f"{name}_token", None)
    if isinstance(token, str):
        tid = tok.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tok.unk_token_id:
            ids.add(tid)
    return ids


class ModalityUnit(ABC):
    """One kind of media as the data pipeline and the collator see it.

    Class attributes: `name` (the content-part type `{"type": name, "index": i}` and the key of `Sample.media`),
    `processor_kwarg` (the processor call's keyword its decoded parts go to, e.g. `images`), `catch_all` (True for
    the one unit that owns the processor outputs no other unit claims, see `owns`), `encoder` (the model part its
    inputs run through: units sharing one need one dummy input between them, see `vlmctl.data.collate`).
    """

    name: str
    processor_kwarg: str
    catch_all: bool = False
    encoder: str = "vision"

    @property
    def column(self) -> str:
        """Its column of prepared shards (`images`)."""
        return MEDIA_COLUMNS[self.name]

    @property
    def dummy_counter(self) -> str:
        """The batch counter of its dummy rows (`num_dummy_images`)."""
        return f"num_dummy_{self.column}"

    def template_part(self, processor: Any = None, family: Any = None) -> dict[str, Any]:
        """Its content part in transformers' chat-template form (`{"type": "image"}`). `processor` / `family`: for
        units that write their prompt as text (see `VideoUnit`)."""
        return {"type": self.name}

    def prompt_part(self, processor: Any, family: Any, takers: str) -> dict[str, Any]:
        """`template_part` of a unit that writes its prompt as text: the family's prompt of this modality as a text
        part when a processor is given, else `{"type": <name>}`. Raises DataError, naming `takers` (families that
        take this modality) in the fix, when the family takes none of it."""
        if processor is None:
            return {"type": self.name}
        if family is not None and not self.accepted_by(family):
            article = "an" if self.name[0] in "aeiou" else "a"
            raise DataError(f"family {getattr(family, 'name', family)} takes no {self.name} input, but a sample has {article} {self.name} part",
                            hint=f"drop the {self.name} samples from data.sources, or train a family that takes {self.name} ({takers})")
        return {"type": "text", "text": self.prompt(processor, family)}

    def processor_inputs(self, parts: list[bytes]) -> dict[str, Any]:
        """Keyword arguments of the processor call for encoded `parts`: `{processor_kwarg: decode(parts)}`, plus
        whatever else the modality needs (the video unit adds `video_metadata`)."""
        return {self.processor_kwarg: self.decode(parts)}

    def accepted_by(self, family: Any) -> bool:
        """True when `family` takes this modality: it is a key of the spec's `modalities` map (modality ->
        placeholder token), or the spec has no such map and this is the image unit (also for `family=None`)."""
        table = getattr(family, "modalities", None)
        return self.name in table if table else self.name == "image"

    def prompt(self, processor: Any, family: Any = None) -> str:
        """What a chat template writes for one part: the family spec's prompt of this modality (`family.prompt(name)`,
        or its `<name>_prompt` attribute, e.g. Qwen's `<|vision_start|><|image_pad|><|vision_end|>`), else the
        processor's placeholder token (`<name>_token` of the processor or its tokenizer)."""
        ask = getattr(family, "prompt", None)
        if callable(ask) and self.accepted_by(family):
            return ask(self.name)
        return (getattr(family, f"{self.name}_prompt", None) or getattr(processor, f"{self.name}_token", None)
                or getattr(processor.tokenizer, f"{self.name}_token"))

    def token_ids(self, processor: Any) -> set[int]:
        """Ids of the placeholder tokens the processor expands for this modality."""
        return placeholder_token_ids(processor, self.name)

    def owns(self, key: str) -> bool:
        """True when the processor output `key` is this modality's tensor (the catch-all unit gets the rest)."""
        return False

    @abstractmethod
    def decode(self, parts: list[bytes]) -> list[Any]:
        """Encoded parts -> what the processor takes for them (PIL images, frame arrays, waveforms)."""

    @abstractmethod
    def num_tokens(self, data: bytes, family: Any, processor: Any) -> int:
        """Placeholder tokens one encoded part becomes under `family`'s rule (reads headers only)."""

    @abstractmethod
    def dummy_input(self, processor: Any) -> Any | None:
        """A small blank input for a row that makes a rank run this modality's encoder when its micro-batch has
        none (see `vlmctl.data.collate.dummy_row`); None when the modality needs none."""

    @abstractmethod
    def collate(self, inputs: list[dict[str, Any]], *, packed: bool) -> dict[str, Any]:
        """This modality's processor tensors of several rows (one dict per row, empty for rows without it) ->
        the batch's tensors: for `packed`, the samples of one packed row; else the rows of a padded batch."""
