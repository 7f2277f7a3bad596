"""A small byte-level BPE tokenizer trained locally, for random-init presets that have no pretrained tokenizer.

Trained with the `tokenizers` library (`BpeTrainer` over a `ByteLevel` pre-tokenizer, as GPT-2 / Qwen2 do) on the
text of the prepared data (Parquet shards, schema in `vlmctl.data.sample`) or on given texts. The result is a
`PreTrainedTokenizerFast` with ChatML special tokens, the family's image tokens, a `<pad>` token and a ChatML chat
template (https://github.com/openai/openai-python/blob/v0.28.1/chatml.md) whose assistant turns are wrapped in
`{% generation %}` so `apply_chat_template(..., return_assistant_tokens_mask=True)` marks the tokens to train on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from vlmctl.errors import DataError

# pyarrow, tokenizers and transformers are imported inside the functions that use them: importing vlmctl (the CLI's
# start-up) must not pay for them.

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set ns = namespace(text='') -%}"
    "{%- if message['content'] is string -%}{%- set ns.text = message['content'] -%}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "__MEDIA__"
    "{%- if part['type'] == 'text' -%}{%- set ns.text = ns.text + part['text'] -%}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{% generation %}{{- ns.text + '<|im_end|>' -}}{% endgeneration %}{{- '\\n' -}}"
    "{%- else -%}{{- ns.text + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML with list-of-parts content; `__MEDIA__` becomes one test per media part type (see `chatml_template`)."""


def chatml_template(image_prompt: str = "<image>", *, prompts: Mapping[str, str] | None = None) -> str:
    """The ChatML chat template writing, for each media part, its modality's prompt: `prompts` maps a part type
    (image, video, audio) to its text (e.g. {"image": "<image>", "video": "<video>"}); without it, `image_prompt`
    for image parts only (e.g. `<image>` for LLaVA). Other part types are left out of the text."""
    prompts = {"image": image_prompt} if prompts is None else dict(prompts)
    tests = "".join("{%- if part['type'] == '" + kind + "' -%}{%- set ns.text = ns.text + '" + text.replace("'", "\\'")
                    + "' -%}{%- endif -%}" for kind, text in prompts.items())
    return CHATML_TEMPLATE.replace("__MEDIA__", tests)


TEXT_LIMIT = 200_000
"""At most this many text parts train a tokenizer (the first ones of the train split, in shard order)."""


def texts_from_prepared(prepared_dir: Path, limit: int = TEXT_LIMIT) -> Iterator[str]:
    """Text parts of the samples in `prepared_dir/train/*.parquet` (at most `limit` texts).

    Raises DataError when there are no shards.
    """
    import pyarrow.parquet as pq

    shards = sorted((Path(prepared_dir) / "train").glob("*.parquet"))
    if not shards:
        raise DataError(
            f"no Parquet shards under {Path(prepared_dir) / 'train'} to train a tokenizer on",
            hint="run `vlmctl data prepare` first, or set model.tokenizer to an existing tokenizer",
        )

    def conversations() -> Iterator[list[dict]]:
        for shard in shards:
            # Record batches of the one column: `pq.read_table` imports pyarrow.dataset and holds the whole shard.
            for batch in pq.ParquetFile(shard).iter_batches(columns=["messages"]):
                yield from batch.column(0).to_pylist()

    yield from conversation_texts(conversations(), limit)


def conversation_texts(conversations: Iterable[list[dict] | None], limit: int = TEXT_LIMIT) -> Iterator[str]:
    """The non-empty text parts of canonical conversations (`Sample.messages`), in order, at most `limit` of them.

    What `texts_from_prepared` yields for train shards holding these conversations in this order, so a tokenizer
    trained on it before the shards exist (`vlmctl data prepare` of a random-init preset) is the one `model build`
    trains on the shards afterwards.
    """
    n = 0
    for messages in conversations:
        for m in messages or []:
            for part in m["content"] or []:
                if part.get("type") == "text" and part.get("text"):
                    yield part["text"]
                    n += 1
                    if n >= limit:
                        return


def train_tokenizer(
    texts: Iterable[str],
    *,
    vocab_size: int = 512,
    special_tokens: Iterable[str] = ("<|im_start|>", "<|im_end|>", "<image>", "<pad>"),
    image_token: str | None = "<image>",
    image_prompt: str = "<image>",
    extra_special_tokens: dict[str, str] | None = None,
):
    """Train a byte-level BPE on `texts` and wrap it as a transformers fast tokenizer.

    `vocab_size` counts the 256 byte symbols, the special tokens and the learned merges (fewer when the text is too
    small to learn that many). `<|im_end|>` is the EOS token, `<pad>` the padding token, `image_token` is exposed as
    `tokenizer.image_token` (what the processors read; None for a family that takes no images). Raises DataError
    when `texts` is empty.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [t for t in texts if t]
    if not texts:
        raise DataError("no text to train the tokenizer on", hint="prepare some data first (`vlmctl data prepare`)")
    specials = list(dict.fromkeys(t for t in ["<pad>", "<|im_start|>", "<|im_end|>", image_token, *special_tokens] if t))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 256 + len(specials)),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    # The chat template's scaffolding is text too: make "user", "assistant", "\n" cheap tokens.
    tok.train_from_iterator([*texts, *["user\n", "assistant\n", "system\n"] * 10], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<pad>",
        extra_special_tokens={**({"image_token": image_token} if image_token else {}), **(extra_special_tokens or {})},
        chat_template=chatml_template(image_prompt),
        model_max_length=1 << 30,
    )
