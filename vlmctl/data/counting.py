"""Token counts before `vlmctl model build`: the processor of the configured model, without its weights.

    conf = configured_processor(cfg.model)        # vlmctl.models.build; None when the section names no model
    if conf.needs_training:                         # a random-init preset: its tokenizer is trained on the data
        counter = fit_tokenizer(conf, kept_train, data.max_length, folder, row_budget)
    else:
        counter = counter_in(folder, conf.processor, conf.family)

Where the processor comes from is what `model build` would use; the models layer says it
(`vlmctl.models.build.configured_processor`, which reads configs and tokenizers, never weights) and hands it here as
a `ConfiguredProcessor`:

- `model.base`: the checkpoint's own processor;
- `model.vision` (or `model.audio`) + `model.llm`, or a preset with `model.tokenizer`: the processor over the
  loaded tokenizer;
- a random-init preset without `model.tokenizer`: the build trains a tokenizer on the text of the prepared train
  split (`vlmctl.models.tokenizer.texts_from_prepared`). `fit_tokenizer` trains the same one before the shards
  exist: `ConfiguredProcessor.trained_on` (the build's own function) on the same conversations in the same order
  of the samples that the shards will hold. Which samples those are
  depends on the tokenizer (too_long), so it iterates: train on the kept train samples, count, drop the ones over
  `data.max_length` (or over the packed training row, `pipeline.RowBudget`, when that is smaller), and train again
  until the set no longer changes (one round when nothing is too long, two when some outliers are). The build then
  trains exactly this tokenizer from the shards.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmctl.config.model import ModelSection
from vlmctl.data.checks import SampleInfo
from vlmctl.data.pipeline import RowBudget, token_limit
from vlmctl.data.sample import Sample
from vlmctl.data.tokens import MODEL_INFO, TokenCounter

# transformers is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for
# it.

MAX_ROUNDS = 6
"""Tokenizer training rounds at most; past them the last tokenizer counts (`FitResult.converged` False)."""


@dataclass
class ConfiguredProcessor:
    """The processor `model build` would make for a model section (`vlmctl.models.build.configured_processor`).
    `processor` is None when its tokenizer must be trained on the data: `trained_on(conversations)` then makes the
    processor whose tokenizer is trained on the text of `conversations` (`Sample.messages`, in shard order), or
    None when they hold no text."""

    family: str
    description: str
    processor: Any = None
    plan: Any = None
    trained_on: Callable[[Iterable[list[dict] | None]], Any] | None = None

    @property
    def needs_training(self) -> bool:
        return self.processor is None


@dataclass
class FitResult:
    """A tokenizer trained at prepare time: the counter over it, the rounds it took and whether it converged."""

    counter: TokenCounter
    rounds: int
    converged: bool


def model_configured(model: ModelSection | None) -> bool:
    """True when the section names a model to build (preset, base, or vision / audio + llm)."""
    return model is not None and bool(model.preset or model.base or ((model.vision or model.audio) and model.llm))


ProcessorSource = Callable[[ModelSection], "ConfiguredProcessor | None"]
"""What prepare asks the models layer for: the configured model's processor (`vlmctl.models.build.configured_processor`)."""


def counter_in(folder: Path, processor: Any, family: str) -> TokenCounter:
    """Save `processor` into `folder` (with a `vlmctl_model.json` naming `family`, as a build does) and return the
    counter read back from it: what check workers load."""
    import transformers  # heavy: only where a processor is saved

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    transformers.logging.set_verbosity_error()  # its save reports repeat what vlmctl prints
    processor.save_pretrained(str(folder))
    (folder / MODEL_INFO).write_text(json.dumps({"family": family}) + "\n")
    return TokenCounter.load(folder)


def fit_tokenizer(
    conf: ConfiguredProcessor,
    kept_train: Callable[[], Iterable[tuple[Sample, SampleInfo]]],
    max_length: int,
    folder: Path,
    row_budget: RowBudget | None = None,
) -> FitResult | None:
    """Train the tokenizer `model build` will train, on the train samples the shards will hold, and return its
    counter (saved in `folder`). None when the train split has no text.

    `kept_train()` yields the kept samples of the train split in shard order with their `SampleInfo` (image sizes),
    before the too_long check; it is called twice per round. A sample is left out of the next round when it has
    more than `token_limit(max_length, row_budget)` tokens (text + visual), the limit the too_long check applies
    after. Raises DataError as `train_tokenizer` does.
    """
    limit = token_limit(max_length, row_budget)
    dropped: set[int] = set()
    counter = None
    for rounds in range(1, MAX_ROUNDS + 1):
        processor = conf.trained_on(s.messages for k, (s, _) in enumerate(kept_train()) if k not in dropped)
        if processor is None:
            return None
        counter = counter_in(folder, processor, conf.family)
        too_long = {k for k, (s, info) in enumerate(kept_train())
                    if counter.count(s, list(zip(info.widths, info.heights))) > limit}
        if too_long == dropped:
            return FitResult(counter, rounds, True)
        dropped = too_long
    return FitResult(counter, MAX_ROUNDS, False)
