"""Token counts before `vlmctl model build`: the processor of the configured model, without its weights.

    conf = configured_processor(cfg.model)        # None when the model section names no model
    if conf.needs_training:                         # a random-init preset: its tokenizer is trained on the data
        counter = fit_tokenizer(conf, kept_train, data.max_length, folder, row_budget)
    else:
        counter = counter_in(folder, conf.processor, conf.family)

Where the processor comes from is what `model build` would use (`vlmctl.models.build.plan_build`, which reads
configs and tokenizers, never weights):

- `model.base`: the checkpoint's own processor (`vlmctl.models.load.load_processor`);
- `model.vision` (or `model.audio`) + `model.llm`, or a preset with `model.tokenizer`: `make_processor` over the
  loaded tokenizer;
- a random-init preset without `model.tokenizer`: the build trains a tokenizer on the text of the prepared train
  split (`vlmctl.models.tokenizer.texts_from_prepared`). `fit_tokenizer` trains the same one before the shards
  exist: the same function (`make_processor`) on the same texts in the same order
  (`vlmctl.models.tokenizer.conversation_texts`) of the samples that the shards will hold. Which samples those are
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

MAX_ROUNDS = 6
"""Tokenizer training rounds at most; past them the last tokenizer counts (`FitResult.converged` False)."""


@dataclass
class ConfiguredProcessor:
    """The processor `model build` would make for a model section. `processor` is None when its tokenizer must be
    trained on the data (`plan` then holds the build plan)."""

    family: str
    description: str
    processor: Any = None
    plan: Any = None

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


def configured_processor(model: ModelSection) -> ConfiguredProcessor | None:
    """The processor of the configured model, or the build plan when its tokenizer must be trained; None when the
    section names no model. Loads configs, tokenizers and image-processor settings only (never weights).

    Raises ConfigError / ModelError as `plan_build` does (an incomplete section, an id that cannot be resolved).
    """
    if not model_configured(model):
        return None
    from vlmctl.models.build import make_processor, plan_build
    from vlmctl.models.load import load_processor

    plan = plan_build(model)
    family = plan.family.name
    if plan.mode == "base":
        processor = load_processor(plan.base_ref, trust_remote_code=plan.trust_remote_code)
        return ConfiguredProcessor(family, f"the processor of model.base {plan.base_ref}", processor=processor)
    encoder = f"model.audio {plan.audio_ref}" if plan.audio_ref else f"model.vision {plan.vision_ref}"
    what = f"model.preset {plan.preset}" if plan.preset else f"{encoder} + model.llm {plan.llm_ref}"
    if plan.tokenizer is None:
        return ConfiguredProcessor(family, f"{what}, tokenizer trained on the prepared train split as `model build` does", plan=plan)
    return ConfiguredProcessor(family, f"{what} (not built yet)", processor=make_processor(plan))


def counter_in(folder: Path, processor: Any, family: str) -> TokenCounter:
    """Save `processor` into `folder` (with a `vlmctl_model.json` naming `family`, as a build does) and return the
    counter read back from it: what check workers load."""
    from vlmctl.models.load import silence_transformers

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    silence_transformers()
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
    from vlmctl.models.build import make_processor
    from vlmctl.models.tokenizer import conversation_texts

    limit = token_limit(max_length, row_budget)
    dropped: set[int] = set()
    counter = None
    for rounds in range(1, MAX_ROUNDS + 1):
        texts = list(conversation_texts(s.messages for k, (s, _) in enumerate(kept_train()) if k not in dropped))
        if not texts:
            return None
        counter = counter_in(folder, make_processor(conf.plan, tokenizer_texts=texts), conf.family)
        too_long = {k for k, (s, info) in enumerate(kept_train())
                    if counter.count(s, list(zip(info.widths, info.heights))) > limit}
        if too_long == dropped:
            return FitResult(counter, rounds, True)
        dropped = too_long
    return FitResult(counter, MAX_ROUNDS, False)
