"""Group relative policy optimisation: rewards of rollouts, group-normalised advantages, and the clipped surrogate
loss with the DAPO and GSPO options.

    rewards = score(rewards_from_config, completions, references, meta=metas, completion_tokens=lengths)   # [N]
    adv, zero_std = group_advantages(rewards, group_size=G)                 # [N], [N] (groups of G rollouts)
    out = policy_loss(logps, old_logps, adv, mask, epsilon_low=0.2, epsilon_high=0.28, aggregation="token")
    out.loss.backward(); out.metrics   # clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean, kl

Tensors are over the N = prompts x G rollouts of a step: per-token ones [N, T] over the completion tokens (right
padded; `mask` [N, T] is 1 on real completion tokens), log-probs in nats.

Formulas and sources:

- advantage (GRPO, Shao et al. 2024, arXiv 2402.03300, Sec. 4.1.2, outcome supervision): A_i = (r_i - mean(r_group))
  / (std(r_group) + 1e-4) for every token of rollout i, std with Bessel's correction, as TRL's `GRPOTrainer`
  (scale_rewards="group"); "batch" scales by the std of all rewards, "none" does not scale (Dr. GRPO, arXiv
  2503.20783);
- ratio: token level rho_t = pi(y_t) / pi_old(y_t) (GRPO); sequence level (GSPO, Zheng et al. 2025, arXiv
  2507.18071, Eq. 7) s_i = exp(mean_t log(pi(y_t) / pi_old(y_t))), the same for every token of the rollout;
- clipped surrogate per token: -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) (PPO's, with DAPO's decoupled
  clip range eps_low / eps_high, Yu et al. 2025, arXiv 2503.14476, Eq. 10: "clip-higher");
- KL to the reference, when beta > 0: the k3 estimator exp(ref - logp) - (ref - logp) - 1 per token (Schulman,
  "Approximating KL divergence"; GRPO Eq. 4), added as beta x KL, as TRL;
- aggregation: `sequence` averages each rollout's tokens, then the rollouts (GRPO Eq. 3; TRL loss_type="grpo");
  `token` sums over every token of the batch and divides by the number of tokens (DAPO Eq. 12, token-level policy
  gradient loss; TRL loss_type="bnpo" per micro-batch, "dapo" with `num_tokens` the tokens of the whole
  generation batch);
- dynamic sampling (DAPO Sec. 3.2): `keep_groups` marks the groups whose rewards are not all equal (a group with
  zero variance has zero advantages and gives no gradient), so they can be dropped and refilled.

Built-in rewards (`BUILTIN_REWARDS`): exact_match and vqa_accuracy (`vlmctl.evaluation.metrics`, VQAv2's answer
normalisation), mcq_letter (the option letter of the answer, `extract_option`), format (a regular expression the
whole completion must match, 1 or 0, as DeepSeek-R1's format reward), length_penalty (DAPO's soft overlong
punishment, Eq. 13). A user reward is a function named `module:function` (`load_reward`), imported only when named.
"""

from __future__ import annotations

import importlib
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from vlmctl.config.objective import GRPOSection
from vlmctl.errors import ConfigError, VlmctlError
from vlmctl.train.objectives import MicroLoss, ObjectiveSpec, sample_collator

# The vlmctl modules that load numpy when imported are imported inside the functions that use them: importing vlmctl
# (the CLI's start-up) must not pay for them.

RewardFn = Callable[..., list[float]]
"""`fn(completions: list[str], references: list[list[str]], **kwargs) -> list[float]`, one reward per completion;
kwargs hold `meta` (list of each prompt sample's meta dict: options, answers...) and `completion_tokens` (list of
ints). A function should accept and ignore keywords it does not use (`**kwargs`)."""

AGGREGATIONS = ("sequence", "token")
LEVELS = ("token", "sequence")
SCALES = ("group", "batch", "none")


# --------------------------------------------------------------------------------------------------- advantages


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: str = "group",
                     eps: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-normalised advantages of N = prompts x `group_size` rollouts, rollouts of one prompt consecutive.

    `rewards`: [N] float. Returns (advantages [N], zero_std [N] bool: the std used is 0, i.e. the group (or the
    batch, with scale="batch") had equal rewards). Raises ValueError when N is not a multiple of `group_size`, or
    for an unknown `scale`.
    """
    if scale not in SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; use one of {', '.join(SCALES)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} rollouts")
    rewards = rewards.float()
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1).repeat_interleave(group_size)
    if scale == "batch":
        std = rewards.std().expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = grouped.std(dim=1).repeat_interleave(group_size) if group_size > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + eps)
    return advantages, torch.isclose(std, torch.zeros_like(std))


def keep_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: [N] bool, True for the rollouts of groups whose rewards are not all equal.
    Raises ValueError when N is not a multiple of `group_size`."""
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} rollouts")
    grouped = rewards.view(-1, group_size)
    varied = (grouped != grouped[:, :1]).any(dim=1)
    return varied.repeat_interleave(group_size)


def unpack_segments(values: torch.Tensor, positions: torch.Tensor, seq_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token values of a packed row's labelled tokens, regrouped per segment: `values` [n] at row positions
    `positions` [n] (e.g. minus the losses of `vlmctl.train.kernels.token_losses`: the completion tokens' log-probs
    when prompt + completion rollouts are packed as segments with labels on the completions), `seq_lens` the
    segments' lengths. Returns (padded [S, L] in row order, right-padded with 0; mask [S, L], 1 on real tokens), L
    the most labelled tokens of a segment: the layout `policy_loss` takes. Gradients flow to `values`."""
    lens = torch.as_tensor(list(seq_lens), dtype=torch.long, device=positions.device)
    seg = torch.repeat_interleave(torch.arange(len(lens), device=positions.device), lens)[positions]
    order = torch.argsort(positions)
    seg, values = seg[order], values[order]
    counts = torch.bincount(seg, minlength=len(lens))
    starts = torch.cumsum(counts, 0) - counts
    column = torch.arange(seg.numel(), device=seg.device) - starts[seg]
    width = int(counts.max()) if counts.numel() else 0
    padded = values.new_zeros(len(lens), width).index_put((seg, column), values)
    mask = torch.zeros(len(lens), width, dtype=torch.long, device=seg.device).index_put((seg, column), torch.ones_like(seg))
    return padded, mask


# ---------------------------------------------------------------------------------------------------------- loss


@dataclass
class GRPOOutput:
    """`loss`: scalar with grad; `per_token_loss`: [N, T] (or [N, 1] broadcast for a sequence-level ratio without
    KL); `metrics`: floats for the step line (TRL's names)."""

    loss: torch.Tensor
    per_token_loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    level: str = "token",
    aggregation: str = "sequence",
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
) -> GRPOOutput:
    """The clipped-surrogate loss of a batch of rollouts (see the module docstring for the formulas).

    `logps`: the policy's per-token log-probs of the completion tokens [N, T] (with grad); `old_logps`: those of
    the policy that generated them [N, T] (None: the same policy, one update per generation, so the ratio is 1
    with the policy's gradient); `advantages`: [N] or [N, T]; `mask`: [N, T] 1 on completion tokens;
    `epsilon_high`: None = `epsilon_low` (GRPO's symmetric clip); `level`: token (GRPO) or sequence (GSPO) ratio;
    `aggregation`: sequence (GRPO) or token (DAPO); `beta` with `ref_logps` [N, T]: the KL term; `num_tokens`: the
    divisor of the token aggregation (default: the mask's sum; pass the generation batch's token count for TRL's
    "dapo" normalisation over micro-batches and ranks).
    Raises ValueError for an unknown level or aggregation, or beta > 0 without `ref_logps`.
    """
    _check_loss_settings(level, aggregation, beta, ref_logps)
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    kl = None
    if beta:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + beta * kl
    if aggregation == "sequence":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    else:
        divisor = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=logps.dtype)
        loss = (per_token * mask).sum() / divisor.clamp(min=1.0)
    return GRPOOutput(loss, per_token, _clip_metrics(ratio, advantages, mask, epsilon_low, epsilon_high, kl))


def _check_loss_settings(level: str, aggregation: str, beta: float, ref_logps) -> None:
    if level not in LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; use one of {', '.join(LEVELS)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; use one of {', '.join(AGGREGATIONS)}")
    if beta and ref_logps is None:
        raise ValueError("a KL term (beta > 0) needs the reference's log-probs (ref_logps)")


def _clip_metrics(ratio, advantages, mask, epsilon_low: float, epsilon_high: float, kl) -> dict[str, float]:
    """TRL's clip ratios (the share of tokens clipped below, above, either) and the mean KL, over the mask."""

    def masked_mean(x: torch.Tensor) -> float:
        if x.shape[1] == 1:  # one value per rollout (sequence-level ratio)
            return float(x.float().mean())
        return float((x * mask).sum() / mask.sum().clamp(min=1.0))

    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
        metrics = {"clip_ratio/low_mean": masked_mean(low.float()), "clip_ratio/high_mean": masked_mean(high.float()),
                   "clip_ratio/region_mean": masked_mean((low | high).float())}
        if kl is not None:
            metrics["kl"] = masked_mean(kl)
    return metrics


# ------------------------------------------------------------------------------------------------------- rewards


def _references(refs: Any) -> list[str]:
    return [refs] if isinstance(refs, str) else [str(r) for r in (refs or [])]


def exact_match_reward(completions: list[str], references: list[list[str]], **kwargs: Any) -> list[float]:
    """1.0 when the completion equals a reference after lowercasing and collapsing whitespace
    (`vlmctl.evaluation.metrics.exact_match`), else 0.0."""
    from vlmctl.evaluation.metrics import exact_match

    return [exact_match(c, _references(r)) for c, r in zip(completions, references)]


def vqa_accuracy_reward(completions: list[str], references: list[list[str]], **kwargs: Any) -> list[float]:
    """VQA accuracy (min(#matching references / 3, 1), averaged over leave-one-out subsets; one reference: exact
    match) after VQAv2's answer normalisation (`vlmctl.evaluation.metrics.vqa_accuracy`)."""
    from vlmctl.evaluation.metrics import vqa_accuracy

    return [vqa_accuracy(c, _references(r)) if _references(r) else 0.0 for c, r in zip(completions, references)]


def mcq_letter_reward(completions: list[str], references: list[list[str]], **kwargs: Any) -> list[float]:
    """1.0 when the option letter the completion chooses is the reference's (`extract_option`); the options come
    from each sample's meta `options` when it has them, else the letters A-Z stand alone."""
    from vlmctl.evaluation.metrics import LETTERS, extract_option, mcq_reference_letter

    metas = kwargs.get("meta") or [{}] * len(completions)
    out = []
    for c, r, meta in zip(completions, references, metas):
        options = (meta or {}).get("options") or {letter: "" for letter in LETTERS}
        gold = {mcq_reference_letter(ref, options) for ref in _references(r)} - {None}
        out.append(float(bool(gold) and extract_option(c, options) in gold))
    return out


def format_reward(pattern: str) -> RewardFn:
    """A reward of 1.0 for completions the regular expression `pattern` matches whole (`re.fullmatch`, DOTALL),
    else 0.0, e.g. `<think>.*</think>\\s*<answer>.*</answer>`. Raises ConfigError naming the pattern when it does
    not compile."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ConfigError(f"the format reward's pattern {pattern!r} is not a regular expression: {exc}",
                          hint="fix the pattern (Python `re` syntax)") from None

    def reward(completions: list[str], references: list[list[str]], **kwargs: Any) -> list[float]:
        return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]

    return reward


def length_penalty(max_tokens: int, cache_tokens: int) -> RewardFn:
    """DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13) of a completion of L tokens: 0 for L <= max_tokens -
    cache_tokens, ((max_tokens - cache_tokens) - L) / cache_tokens up to max_tokens (0 down to -1), -1 beyond.
    Needs `completion_tokens`. Raises ConfigError for cache_tokens outside (0, max_tokens]."""
    if not 0 < cache_tokens <= max_tokens:
        raise ConfigError(f"length_penalty needs 0 < cache_tokens <= max_tokens, got cache_tokens={cache_tokens}, max_tokens={max_tokens}",
                          hint="set cache_tokens to the length of the soft zone before max_tokens")
    start = max_tokens - cache_tokens

    def reward(completions: list[str], references: list[list[str]], **kwargs: Any) -> list[float]:
        lengths = kwargs.get("completion_tokens")
        if lengths is None:
            raise ValueError("length_penalty needs the completions' token counts (completion_tokens)")
        return [0.0 if n <= start else -1.0 if n > max_tokens else (start - n) / cache_tokens for n in lengths]

    return reward


BUILTIN_REWARDS = ("exact_match", "vqa_accuracy", "mcq_letter", "format", "length_penalty")


def load_reward(spec: str, *, key: str = "train.grpo.rewards[].name") -> RewardFn:
    """The user reward function `module:function` (the module is imported now, from the project's folder or
    anywhere on sys.path: the user's own code runs). Raises ConfigError naming `key` and the spec when it is not
    `module:function`, the module does not import (with the import error) or has no such callable."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise ConfigError(f"{key}: {spec!r} is neither a built-in reward ({', '.join(BUILTIN_REWARDS)}) nor module:function",
                          hint="name a built-in reward, or your own function as my_rewards:score (my_rewards.py next to vlmctl.yaml)")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything while importing
        raise ConfigError(f"{key}: cannot import {module_name!r} for the reward {spec!r}: {type(exc).__name__}: {exc}",
                          hint="put the module next to vlmctl.yaml or on PYTHONPATH, and fix the error it raises") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ConfigError(f"{key}: module {module_name!r} has no function {func_name!r} (the reward {spec!r})",
                          hint=f"define def {func_name}(completions, references, **kwargs) -> list[float] in {module_name}")
    return fn


def score(rewards: Sequence[tuple[RewardFn, float]], completions: list[str], references: list[list[str]],
          **kwargs: Any) -> torch.Tensor:
    """The weighted sum of the rewards of each completion: [N] float32. `rewards`: (function, weight) pairs.
    Raises ValueError when a function returns a number of rewards other than N, or a value that is not a number."""
    total = torch.zeros(len(completions), dtype=torch.float32)
    for fn, weight in rewards:
        values = list(fn(completions, references, **kwargs))
        name = getattr(fn, "__qualname__", repr(fn))
        if len(values) != len(completions):
            raise ValueError(f"reward {name} returned {len(values)} values for {len(completions)} completions")
        try:
            total += weight * torch.tensor([float(v) for v in values], dtype=torch.float32)
        except (TypeError, ValueError):
            raise ValueError(f"reward {name} returned a value that is not a number: {values!r}") from None
    return total


def build_rewards(specs: Sequence[Any], max_new_tokens: int) -> list[tuple[RewardFn, float]]:
    """(function, weight) pairs of `train.grpo.rewards` (`vlmctl.config.objective.RewardSpec`s): built-in rewards by
    name, user functions loaded now (`load_reward`, errors naming `train.grpo.rewards[i].name`); length_penalty
    counts from `max_new_tokens`. Raises ConfigError as `load_reward`, `format_reward` and `length_penalty` do."""
    simple = {"exact_match": exact_match_reward, "vqa_accuracy": vqa_accuracy_reward, "mcq_letter": mcq_letter_reward}
    out = []
    for i, reward in enumerate(specs):
        if reward.name in simple:
            fn = simple[reward.name]
        elif reward.name == "format":
            fn = format_reward(reward.pattern)
        elif reward.name == "length_penalty":
            fn = length_penalty(max_new_tokens, reward.cache_tokens)
        else:
            fn = load_reward(reward.name, key=f"train.grpo.rewards[{i}].name")
        out.append((fn, reward.weight))
    return out


# ----------------------------------------------------------------------------------------------------- objective

ROLLOUT_KEYS = ("advantages", "num_rollouts", "old_logps", "rollout_logps")
"""Keys a rollout row adds to `PackedCollator`'s packed row (not model inputs)."""

HTML_STEPS = 32
"""Steps of sampled rollouts kept in run_dir/rollouts.html (the latest ones)."""


class PromptCollator:
    """Samples -> a micro-batch of prompts: {"prompts": [Sample], "num_prompts": n}. The GRPO objective turns it
    into a packed row of rollouts (`GRPOObjective.prepare_window`) before the loop reads any token count."""

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        return {"prompts": list(samples), "num_prompts": len(samples)}


def encode_prompt(sample: Any, processor, family: Any = None):
    """The prompt of `sample` as training encodes it (`vlmctl.data.collate.encode_sample`'s processor call, media
    tensors and per-token inputs) with the chat template's generation prompt appended: its messages before the last
    assistant turn (`vlmctl.inference.request_from_sample`), so the ids are those `generate_rollouts` continues.
    Returns an `Encoded` whose labels are all -100. Raises DataError as `template_media` does."""
    from vlmctl.data.collate import Encoded, _media_kwargs, split_processor_outputs, template_media
    from vlmctl.data.modalities import media_token_ids
    from vlmctl.data.sample import Sample
    from vlmctl.inference.prompt import request_from_sample

    request = request_from_sample(sample)
    prompt = Sample(id=sample.id, messages=request.messages, media=sample.media)
    messages, media = template_media(prompt, processor, family)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[text], **_media_kwargs(media, processor), return_tensors="pt", add_special_tokens=False)
    if hasattr(family, "processor_outputs"):
        out = family.processor_outputs(out, processor)
    ids = out["input_ids"][0].to(torch.long)
    token_inputs, media_inputs = split_processor_outputs(out)
    visual = torch.isin(ids, torch.tensor(sorted(media_token_ids(processor)), dtype=torch.long))
    return Encoded(ids, torch.full_like(ids, -100), media_inputs, {k: len(v) for k, v in media.items()},
                   num_visual_tokens=int(visual.sum()), token_inputs=token_inputs)


def rollout_rows(prompts: Sequence[Any], prompt_index: Sequence[int], completion_ids: Sequence[Sequence[int]]) -> list[Any]:
    """One `Encoded` per rollout: its prompt's tokens (`encode_prompt`, media and per-token inputs) followed by the
    generated tokens, labelled on the generated tokens only (the end-of-sequence token included), so a packed row's
    labelled positions are exactly the completion tokens `policy_loss` sums over. Per-token inputs (Qwen-VL's
    `mm_token_type_ids`) are 0 (text) on the completion."""
    from vlmctl.data.collate import Encoded

    rows = []
    for k, completion in zip(prompt_index, completion_ids):
        p = prompts[k]
        c = torch.tensor(list(completion), dtype=torch.long)
        rows.append(Encoded(torch.cat([p.input_ids, c]), torch.cat([torch.full_like(p.input_ids, -100), c]),
                            p.media_inputs, p.media_counts, p.num_visual_tokens,
                            {key: torch.cat([v, v.new_zeros(len(c))]) for key, v in p.token_inputs.items()}))
    return rows


@contextmanager
def scaled_logits(model, temperature: float):
    """While open, the LM head of `model` (any wrapper) computes logits / `temperature`: log-probs of the
    distribution the rollouts were sampled from (TRL divides the logits by the sampling temperature too). The
    head's input is divided (a forward pre-hook), so the chunked loss head (`kernels.chunked_loss_head`) and the
    wrappers' hooks see it. Raises ConfigError for an LM head with a bias (logits / T is then not the head of
    the scaled input)."""
    if temperature == 1.0:
        yield
        return
    from vlmctl.train.kernels import unwrapped

    head = unwrapped(model).get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ConfigError(f"train.grpo.temperature {temperature}: the log-probs are scaled through the LM head's input, "
                          "but this model's LM head has a bias", hint="set train.grpo.temperature: 1.0")
    handle = head.register_forward_pre_hook(lambda module, args: (args[0] / temperature, *args[1:]))
    try:
        yield
    finally:
        handle.remove()


def completion_logps(model, inputs: dict[str, Any], batch: dict[str, Any], temperature: float = 1.0):
    """(log-probs [S, L] float32, mask [S, L]) of every sequence's labelled (completion) tokens under `model`, at
    `temperature` (`scaled_logits`): a packed row's segments from the chunked LM-head cross-entropy, a padded
    batch's rows from its logits (`objectives.labelled_logps`), regrouped by `unpack_segments`; S = the rollouts,
    then any dummy rows."""
    from vlmctl.train.objectives import labelled_logps

    with scaled_logits(model, temperature):
        values, positions, seq_lens = labelled_logps(model, inputs, batch)
    if positions.numel() == 0:  # no labelled token: keep the graph (every rank runs the same collectives)
        return values.sum().reshape(1, 1).expand(len(seq_lens), 1) * 0.0, torch.zeros(len(seq_lens), 1, dtype=torch.long)
    return unpack_segments(values, positions, seq_lens)


def _seed(seed: int, step: int, rank: int, micro: int) -> int:
    """A generation seed from (run seed, step, data-parallel rank, micro-batch): the same rollouts after a resume."""
    value = seed
    for part in (step, rank, micro):
        value = (value * 1_000_003 + part) % (2**63 - 1)
    return value


@dataclass
class GRPOObjective:
    """Group relative policy optimisation on vlmctl's loop (formulas and sources: the module docstring).

    Each step, `prepare_window` turns the window's micro-batches of prompts into packed rows of rollouts: the
    policy (`engine.module`, eval mode, no gradient, in the engine's precision) samples `group_size` answers per
    prompt (`rollouts.generate_rollouts`, seeded from (train.seed, step, data-parallel rank, micro-batch), so a
    resumed run draws the same rollouts); the rewards score them; advantages are normalised per group
    (`group_advantages`; scale "batch" uses the std over every rollout of the step on all data-parallel ranks);
    DAPO's filter drops zero-variance groups when asked; each micro-batch's rollouts (prompt + completion, labels
    on the completion) become one packed row (`PackedCollator.pack`, with the dummy rows that keep sharded encoders
    in step), or with `packed` False (`train.packing: false`, or a family that cannot pack) one padded micro-batch
    (`Collator.pad`, as TRL pads its rollouts), with `advantages` [rollouts] and `num_rollouts`.

    `loss` computes the completion tokens' log-probs through `engine.model` and `policy_loss`; with one update per
    generation (GRPO's mu = 1) the old log-probs are the detached current ones (ratio 1); with `num_iterations` mu > 1 the
    generation step stores each row's `old_logps` [rollouts, T] (`_old_logps`, the generating policy, no gradient)
    and keeps the rows, which the mu - 1 following steps train on again (`reuses_window`: the loop then draws no
    prompts; `generated` 0, `rollouts` 0 and `time/rollout_s` 0 on those steps). Each checkpoint keeps this rank's
    buffer while reuse steps of it remain (`state_dict`, objective-<rank>.pt), so a run resumed inside a
    generation's iterations trains on the same rows as the uninterrupted run. The loop's normalisation
    gives the aggregation: `label_tokens` counts rollouts (aggregation "sequence": each micro-batch's loss is the sum
    of its rollouts' token means, the step's the mean over every rollout) or completion tokens ("token": the sum of
    per-token losses over the tokens of the whole step, DAPO). With `beta` > 0 the reference (`models["reference"]`,
    frozen, parallelized by the worker) gives the KL term.

    Metrics per step: reward (mean), reward_std (mean of the groups' stds), rewards/<name>/mean, frac_reward_zero_std,
    completions/mean_length, completions/clipped_ratio (cut at max_new_tokens), clip_ratio/{low,high,region}_mean,
    kl (beta > 0), generated (1 on a generation step, 0 on a reuse step), rollouts_per_s, time/rollout_s
    (generation, rewards and packing; mean over data-parallel ranks) and time/train_s (the rest of the step on this rank: forward, backward, optimizer step)."""

    settings: Any  # config.objective.GRPOSection
    rewards: list  # (function, weight) pairs (`build_rewards`)
    reward_names: list[str]
    processor: Any
    family: Any
    hook: Any = None  # the family's packed-row hook (Qwen-VL's mRoPE positions), or None
    seed: int = 0
    dp_rank: int = 0
    dp_group: Any = None
    video: Any = None  # data.video settings (generation samples videos as prepared)
    run_dir: Path | None = None  # rank 0's run folder: rollouts.html
    reference: Any = None
    packed: bool = True  # each micro-batch's rollouts as one packed row (train.packing), else a padded micro-batch
    name: str = "grpo"
    batch_keys: tuple[str, ...] = ("input_ids", "labels", "advantages", "num_rollouts")
    models: dict[str, Any] = field(default_factory=dict)
    _stats: dict[str, float] = field(default_factory=dict, init=False)
    _train_start: float = field(default=0.0, init=False)
    _samples: list = field(default_factory=list, init=False)
    _warned: bool = field(default=False, init=False)
    _buffer: list | None = field(default=None, init=False)  # the rows of the latest generation (num_iterations > 1)
    _reuses_left: int = field(default=0, init=False)  # steps still to train on `_buffer`
    prompts_per_micro_batch: int = 8  # sizes the rollout engine's slots (prompts x group_size)
    _rollout_engine: Any = field(default=None, init=False)
    _told: bool = field(default=False, init=False)
    _gap_max: float = field(default=0.0, init=False)

    def __post_init__(self):
        if self.reference is not None:
            self.models = {"reference": self.reference}
        self.collator = None

    # ---- the loop's protocol

    def label_tokens(self, batch: dict[str, Any]) -> int:
        return _rollouts(batch) if self.settings.aggregation == "sequence" else batch["num_label_tokens"]

    def loss(self, engine, batch: dict[str, Any]):
        s = self.settings
        inputs = {k: v for k, v in engine.inputs(batch).items() if k not in ROLLOUT_KEYS}
        n = _rollouts(batch)
        logps, mask = completion_logps(engine.model, inputs, batch, s.temperature)
        ref = None
        if s.beta:
            with torch.no_grad():
                ref, _ = completion_logps(self.models["reference"], inputs, batch, s.temperature)
        names = ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", *(["kl"] if s.beta else []), "completion_tokens"]
        if n == 0:  # every group of this micro-batch was dropped: a forward for the collectives, nothing added
            return MicroLoss(loss=logps.sum() * 0.0, tokens=0, metrics={k: 0.0 for k in names})
        logps, mask = logps[:n], mask[:n]
        advantages = batch["advantages"] if "advantages" in batch else torch.zeros(n)
        old = batch.get("old_logps")
        old = None if old is None else old[:n].to(device=logps.device, dtype=logps.dtype)
        out = policy_loss(logps, old, advantages.to(logps.device), mask, epsilon_low=s.epsilon_low,
                          epsilon_high=s.epsilon_high, level=s.importance_sampling_level, aggregation=s.aggregation,
                          beta=s.beta, ref_logps=None if ref is None else ref[:n].to(logps.dtype),
                          num_tokens=1.0 if s.aggregation == "token" else None)
        tokens = float(mask.sum())
        # a sum over the micro-batch: rollouts' means (sequence) or tokens' losses (token); the loop divides
        total = out.loss * n if s.aggregation == "sequence" else out.loss
        metrics = {k: out.metrics[k] * tokens for k in names[:-1]}
        metrics["completion_tokens"] = tokens
        if "rollout_logps" in batch:  # the rollout's log-probs against the trainer's, token by token
            sampled = batch["rollout_logps"][:n].to(device=logps.device, dtype=torch.float32)
            width = min(sampled.shape[1], logps.shape[1])
            gap = (logps.detach().float()[:, :width] - sampled[:, :width]).abs() * mask[:, :width]
            metrics["logprob_gap_sum"] = float(gap.sum())
            self._gap_max = max(self._gap_max, float(gap.max()) if gap.numel() else 0.0)
        return MicroLoss(loss=total, tokens=n if s.aggregation == "sequence" else int(tokens), metrics=metrics)

    def metrics(self, sums: dict[str, float], label_tokens: float) -> dict[str, float]:
        """The rollout statistics of the step (reduced in `prepare_window`), the token means of the clip ratios
        and KL, and the step's train seconds on this rank."""
        out = dict(self._stats)
        tokens = sums.get("completion_tokens", 0.0)
        for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"):
            if key in sums:
                out[key] = sums[key] / tokens if tokens else 0.0
        out["time/train_s"] = round(time.perf_counter() - self._train_start, 4)
        if "logprob_gap_sum" in sums:
            out["logprob_gap/mean"] = sums["logprob_gap_sum"] / tokens if tokens else 0.0
            out["logprob_gap/max"] = self._gap_max
        return out

    # ---- rollouts

    def reuses_window(self, step: int) -> bool:
        """Whether `step` (0-based) trains again on the latest generation's rows instead of new prompts: with
        num_iterations = mu, generation happens on steps 0, mu, 2 mu, ... and the mu - 1 steps after each reuse its
        rows (TRL's `_buffered_inputs`; after a resume, the rows `load_state_dict` restored). False when nothing is
        buffered: a run resumed inside a generation's iterations from a checkpoint without this rank's rows (written
        by another number of ranks) generates anew at that step, with a warning."""
        mu = self.settings.num_iterations
        if mu > 1 and step % mu != 0 and self._buffer is None:
            import warnings

            warnings.warn(f"train.grpo.num_iterations={mu}: resumed at step {step + 1}, inside a generation's iterations, "
                          "without that generation's rollouts (the checkpoint holds none for this rank), so this step "
                          "generates new ones", stacklevel=2)
        return mu > 1 and step % mu != 0 and self._buffer is not None

    def state_dict(self) -> dict[str, Any]:
        """This rank's buffered generation while reuse steps of it remain (num_iterations > 1), else {}: what a
        checkpoint keeps (`train.checkpoint`, objective-<rank>.pt) so that a resumed run reuses it exactly.
        {"rows": the packed rows as `prepare_window` returned them, CPU tensors (input_ids/labels [1, T], the image
        inputs, advantages [rollouts] float32, old_logps [rollouts, L] float32) and counts; "stats": the generation
        step's metrics, which its reuse steps log again; "reuses_left": reuse steps still to come}."""
        if self._buffer is None or self._reuses_left <= 0:
            return {}
        rows = [{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in row.items()} for row in self._buffer]
        return {"rows": rows, "stats": dict(self._stats), "reuses_left": self._reuses_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s buffer ({} restores nothing). The rows stay on the CPU, as `prepare_window` keeps
        them: the loop moves each row to the device (`loop.to_device`) and `loss` moves old_logps."""
        if state:
            self._buffer, self._stats = list(state["rows"]), dict(state["stats"])
            self._reuses_left = int(state["reuses_left"])

    def prepare_window(self, engine, window: list[dict[str, Any]], step: int = 0) -> list[dict[str, Any]]:
        """The window's micro-batches of prompts -> packed rows of scored rollouts (see the class docstring).
        Collective under several ranks (generation with synced_gpus, one all-reduce of the statistics).
        Raises VlmctlError naming a reward function that fails or returns a wrong number of values."""
        start = time.perf_counter()
        s = self.settings
        if window is None:  # a reuse step: the buffered rows, with their old log-probs; no rollout time
            return self._reuse()
        G = s.group_size
        device = next(engine.module.parameters()).device
        self._gap_max = 0.0
        generated = self._generate(engine, window, step, device)
        # rewards of every rollout of the window
        per_reward, totals, references = [], [], []
        for batch, rollouts in zip(window, generated):
            refs, values = self._score(batch["prompts"], rollouts)
            references.append(refs)
            per_reward.append(values)
            totals.append(sum(w * v for (_, w), v in zip(self.rewards, values)) if values else torch.zeros(len(rollouts.texts)))
        everything = torch.cat(totals) if totals else torch.zeros(0)
        batch_std = self._batch_std(everything) if s.scale_rewards == "batch" else None
        rows, stats = [], _Stats(len(self.rewards))
        for j, (batch, rollouts, total) in enumerate(zip(window, generated, totals)):
            scale = "none" if batch_std is not None else s.scale_rewards
            advantages, zero_std = group_advantages(total, G, scale=scale)
            if batch_std is not None:
                advantages = advantages / (batch_std + 1e-4)
                zero_std = torch.full_like(zero_std, batch_std == 0)
            keep = keep_groups(total, G) if s.drop_zero_variance_groups else torch.ones_like(total, dtype=torch.bool)
            prompts = [encode_prompt(p, self.processor, self.family) for p in batch["prompts"]]
            self._check_prompts(prompts, rollouts)
            index = [i for i in range(len(total)) if keep[i]]
            encoded = rollout_rows(prompts, [rollouts.prompt_index[i] for i in index], [rollouts.completion_ids[i] for i in index])
            row = self._rows(encoded)
            row["advantages"] = advantages[keep].to(torch.float32)
            row["num_rollouts"] = len(index)
            if rollouts.logprobs is not None:
                row["rollout_logps"] = _padded([rollouts.logprobs[i] for i in index])
            if s.num_iterations > 1:
                row["old_logps"] = self._old_logps(engine, row)
            rows.append(row)
            stats.add(total, per_reward[j], zero_std, rollouts, G)
            if j == 0 and self.run_dir is not None:
                self._sample(step, batch["prompts"][0], references[j], rollouts, total, advantages, G)
        seconds = time.perf_counter() - start
        self._stats = {**stats.reduce(seconds, self.reward_names, self.dp_group, device), "generated": 1.0}
        self._buffer, self._reuses_left = (rows, s.num_iterations - 1) if s.num_iterations > 1 else (None, 0)
        if self.run_dir is not None and self._samples:
            write_rollouts_html(self.run_dir / "rollouts.html", self._samples)
        self._train_start = time.perf_counter()
        return rows

    def _reuse(self) -> list[dict[str, Any]]:
        """A reuse step of `num_iterations`: the buffered rows of the last generation, its statistics with no rollouts."""
        self._stats = {**self._stats, "time/rollout_s": 0.0, "rollouts_per_s": 0.0, "rollouts": 0.0, "generated": 0.0}
        self._reuses_left -= 1
        self._train_start = time.perf_counter()
        return self._buffer

    def _generate(self, engine, window: list[dict[str, Any]], step: int, device) -> list[Any]:
        """The rollouts of each micro-batch of prompts, seeded by (seed, step, rank, micro-batch): through the
        decoding engine on a replica of the policy (`rollouts.RolloutEngine`; its weights refreshed here, collective
        under several ranks, then no collective while decoding), or where it cannot be used through transformers'
        `generate` on the policy (collective under several ranks: synced_gpus; a rank with text-only prompts adds
        blank-image requests)."""
        import torch.distributed as dist

        sharded = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        sampler = self._sampler()
        use_engine = sampler.refresh(engine.module)
        if not use_engine and not self._told:
            self._told = True
            import warnings

            warnings.warn(f"train.objective grpo: rollouts through transformers' generate ({sampler.unavailable})", stacklevel=2)
        s = self.settings
        generated = []
        for j, batch in enumerate(window):
            requests = [_request(p) for p in batch["prompts"]]
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(_seed(self.seed, step, self.dp_rank, j))
                if use_engine:
                    generated.append(sampler.generate(requests, group_size=s.group_size, max_new_tokens=s.max_new_tokens,
                                                      temperature=s.temperature, top_p=s.top_p))
                else:
                    extra = self._blank_requests(requests) if sharded else []
                    generated.append(engine.forward(_Generate(self, requests, extra), None))
        return generated

    def _sampler(self):
        """The run's `RolloutEngine` (made at the first generation step; its replica at its first refresh)."""
        from vlmctl.train.rollouts import RolloutEngine

        if self._rollout_engine is None:
            s = self.settings
            self._rollout_engine = RolloutEngine(self.processor, self.family, video=self.video,
                                                 max_slots=max(s.group_size * self.prompts_per_micro_batch, s.group_size))
        return self._rollout_engine

    def _old_logps(self, engine, row: dict[str, Any]) -> torch.Tensor:
        """The completion tokens' log-probs [rollouts, T] under the policy at generation time (no gradient), in the
        layout `loss` computes the current ones in (the same packed row through `engine.model`), so that the ratio
        exp(logp - old_logp) lines up token by token (TRL's `old_per_token_logps`, computed when num_iterations > 1).
        The row stays on the CPU (the loop moves it for the loss); a copy on the policy's device is scored."""
        from vlmctl.train.loop import to_device

        row = to_device(row, next(engine.module.parameters()).device)
        inputs = {k: v for k, v in engine.inputs(row).items() if k not in ROLLOUT_KEYS}
        with torch.no_grad():
            logps, _ = completion_logps(engine.model, inputs, row, self.settings.temperature)
        return logps[:_rollouts(row)].detach().float().cpu()

    def _collator(self):
        from vlmctl.data.collate import Collator, PackedCollator

        if self.collator is None:  # the row budget is the rollouts': G x (prompt + completion) per prompt
            self.collator = (PackedCollator(self.processor, self.family, tokens_per_batch=2**62) if self.packed
                             else Collator(self.processor, self.family))
        return self.collator

    def _rows(self, encoded: list[Any]) -> dict[str, Any]:
        """The rollouts of one micro-batch as one packed row (with the family's packed-row hook) or one padded
        micro-batch, the dummy rows after them."""
        if not self.packed:
            return self._collator().pad(encoded)
        row = self._collator().pack(encoded)
        return self.hook(row) if self.hook is not None else row

    def _blank_requests(self, requests) -> list:
        """A blank-image request when none of `requests` has an image and the family takes images (see
        `generate_rollouts`' extra_requests)."""
        from vlmctl.data.modalities import get_unit
        from vlmctl.inference.prompt import GenerationRequest

        unit = get_unit("image")
        if any(r.images for r in requests) or not unit.accepted_by(self.family):
            return []
        blank = unit.dummy_input(self.processor)
        if blank is None:
            return []
        return [GenerationRequest(messages=[{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "."}]}],
                                  images=[blank], id="blank")]

    def generate(self, engine, requests, extra):
        """`generate_rollouts` with the policy (`engine.module`), under the engine's precision context."""
        from vlmctl.train.rollouts import generate_rollouts

        s = self.settings
        return generate_rollouts(engine.module, self.processor, requests, group_size=s.group_size, max_new_tokens=s.max_new_tokens,
                                 temperature=s.temperature, top_p=s.top_p, family=self.family, video=self.video,
                                 extra_requests=extra)

    def _score(self, prompts, rollouts) -> tuple[list[list[str]], list[torch.Tensor]]:
        """(references of each rollout, [the rewards of each function, [N] float32])."""
        from vlmctl.evaluation.runner import references_of

        refs = [references_of(prompts[k]) for k in rollouts.prompt_index]
        metas = [prompts[k].meta for k in rollouts.prompt_index]
        lengths = [len(c) for c in rollouts.completion_ids]
        values = []
        for (fn, _), name in zip(self.rewards, self.reward_names):
            try:
                values.append(score([(fn, 1.0)], rollouts.texts, refs, meta=metas, completion_tokens=lengths))
            except Exception as exc:  # noqa: BLE001 - the user's function may raise anything
                detail = str(exc) if isinstance(exc, ValueError) else f"it raised {type(exc).__name__}: {exc}"
                raise VlmctlError(f"train.grpo reward {name}: {detail}",
                                  hint="a reward returns one number per completion: fn(completions, references, **kwargs) -> list[float]") from None
        return refs, values

    def _batch_std(self, rewards: torch.Tensor) -> float:
        """The std (Bessel) of every rollout's reward of the step over the data-parallel ranks."""
        import torch.distributed as dist

        every = [rewards.tolist()]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.dp_group) > 1:
            every = [None] * dist.get_world_size(self.dp_group)
            dist.all_gather_object(every, rewards.tolist(), group=self.dp_group)
        values = torch.tensor([v for part in every for v in part], dtype=torch.float32)
        return float(values.std()) if values.numel() > 1 else 0.0

    def _check_prompts(self, prompts, rollouts) -> None:
        """Warn once when training's prompt tokens differ from those generation continued (a processor that
        renders a batch otherwise than one prompt): the rollouts are then scored on other prompt tokens."""
        if self._warned:
            return
        for k, ids in zip(rollouts.prompt_index, rollouts.prompt_ids):
            if prompts[k].input_ids.tolist() != ids:
                import warnings

                self._warned = True
                warnings.warn("train.objective grpo: the prompt tokens of a rollout differ from the ones its answer was "
                              "generated after (the processor renders a batch otherwise than one prompt)", stacklevel=2)
                return

    def _sample(self, step, prompt, references, rollouts, total, advantages, G) -> None:
        """Keep the first prompt's group of this step for rollouts.html (the latest `HTML_STEPS` steps)."""
        from vlmctl.inference.prompt import request_from_sample

        messages = request_from_sample(prompt).messages
        question = " ".join(p.get("text", f"<{p['type']}>") for m in messages for p in m["content"])
        self._samples.append({"step": step + 1, "id": prompt.id, "prompt": question, "references": references[0] if references else [],
                              "completions": rollouts.texts[:G], "rewards": total[:G].tolist(), "advantages": advantages[:G].tolist()})
        del self._samples[:-HTML_STEPS]


def _padded(rows: list[list[float]]) -> torch.Tensor:
    """Lists of floats as one [len(rows), longest] float32 tensor, right-padded with 0 (the `completion_logps`
    layout)."""
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros(len(rows), max(width, 1), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def _rollouts(batch: dict[str, Any]) -> int:
    """The rollouts of a packed row. A row without them (the GPU batch-size probe's packed SFT rows,
    `train.autotune`) trains as rollouts with zero advantages: a rollout row's memory and time."""
    return int(batch["num_rollouts"]) if "num_rollouts" in batch else int(batch["num_samples"])


def _request(sample: Any):
    from vlmctl.inference.prompt import request_from_sample

    return request_from_sample(sample)


class _Generate:
    """An 'objective' whose loss is the rollouts: `engine.forward` runs it under the engine's precision context."""

    def __init__(self, objective: GRPOObjective, requests, extra):
        self.objective, self.requests, self.extra = objective, requests, extra

    def loss(self, engine, batch):
        return self.objective.generate(engine, self.requests, self.extra)


class _Stats:
    """Sums of a step's rollout statistics on this rank, all-reduced over the data-parallel ranks by `reduce`."""

    def __init__(self, num_rewards: int):
        # reward sum, groups' std sum, groups, zero-std groups, rollouts, completion tokens, truncated, per reward sums
        self.values = [0.0] * (7 + num_rewards)

    def add(self, total: torch.Tensor, per_reward: list[torch.Tensor], zero_std: torch.Tensor, rollouts, G: int) -> None:
        v = self.values
        grouped = total.view(-1, G)
        v[0] += float(total.sum())
        v[1] += float(grouped.std(dim=1).sum())
        v[2] += grouped.shape[0]
        v[3] += float(zero_std.view(-1, G)[:, 0].sum())
        v[4] += total.numel()
        v[5] += rollouts.completion_tokens
        v[6] += sum(1 for f in rollouts.finished if not f)
        for i, r in enumerate(per_reward):
            v[7 + i] += float(r.sum())

    def reduce(self, seconds: float, names: list[str], group, device=None) -> dict[str, float]:
        """The window's sums over the data-parallel `group` (one all-reduce, on `device`: NCCL takes CUDA tensors
        only) as the step's metrics."""
        import torch.distributed as dist

        values = torch.tensor([*self.values, seconds, 1.0], dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(values, group=group)
        v = values.tolist()
        n, groups, ranks = max(v[4], 1.0), max(v[2], 1.0), v[-1]
        rollout_s = v[-2] / ranks
        out = {"reward": v[0] / n, "reward_std": v[1] / groups, "frac_reward_zero_std": v[3] / groups,
               "completions/mean_length": v[5] / n, "completions/clipped_ratio": v[6] / n}
        for i, name in enumerate(names):
            out[f"rewards/{name}/mean"] = v[7 + i] / n
        out["rollouts"] = v[4]
        out["rollouts_per_s"] = v[4] / rollout_s if rollout_s > 0 else 0.0
        out["time/rollout_s"] = round(rollout_s, 4)
        return out


def write_rollouts_html(path: Path, samples: list[dict[str, Any]]) -> None:
    """A page of sampled rollouts (latest step first): each prompt, its references, and every completion of its group
    with its reward and advantage. Written to a temporary file and renamed (a reader never sees half a page)."""
    from html import escape

    parts = ["<!doctype html><meta charset='utf-8'><title>rollouts</title>",
             "<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse;margin-bottom:1.5em}"
             "td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}"
             "td.c{white-space:pre-wrap;font-family:monospace}</style>",
             f"<h1>Rollouts of {escape(path.parent.name)}</h1><p>The first prompt's group of each step (rank 0), latest first.</p>"]
    for rec in reversed(samples):
        parts.append(f"<h3>step {rec['step']} &middot; {escape(str(rec['id']))}</h3><p><b>prompt</b>: {escape(rec['prompt'])}<br>"
                     f"<b>reference</b>: {escape(' | '.join(rec['references']))}</p>")
        parts.append("<table><tr><th>#</th><th>completion</th><th>reward</th><th>advantage</th></tr>")
        for i, (text, reward, adv) in enumerate(zip(rec["completions"], rec["rewards"], rec["advantages"])):
            parts.append(f"<tr><td>{i}</td><td class='c'>{escape(text)}</td><td>{reward:.3f}</td><td>{adv:+.3f}</td></tr>")
        parts.append("</table>")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text("\n".join(parts) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def build_grpo_objective(tm, train, ctx, cfg=None, run_dir: Path | None = None, reference_model=None) -> GRPOObjective:
    """The objective of `train.objective: grpo` (`GRPOObjective`): the rewards of `train.grpo.rewards` (user
    functions imported now), a frozen reference when `train.grpo.beta` > 0 (`reference_model` when given, e.g.
    `vlmctl bench`'s copy of its synthetic model, else `reference.load_reference` from `cfg`, the project config),
    packed or padded rollouts as `train.packing` (resolved) says, and the family's packed-row hook, which the
    objective applies to its rows: the loop's prefetch sees prompts, so the hook is taken from `tm` (`tm.prepare`
    becomes None). `run_dir` (rank 0's): where rollouts.html goes; generation samples videos as `cfg.data.video`.

    Raises ConfigError as `build_rewards` does; VlmctlError when a reference must be loaded and `cfg` is None."""
    s = train.grpo
    import sys

    if os.getcwd() not in sys.path:  # a reward module next to vlmctl.yaml, where `vlmctl train` was started
        sys.path.insert(0, os.getcwd())
    rewards = build_rewards(s.rewards, s.max_new_tokens)
    reference = None
    if s.beta > 0:
        from vlmctl.train.reference import load_reference

        if reference_model is None and cfg is None:
            raise VlmctlError("the grpo objective's KL reference needs the project config (its model source)")
        reference = reference_model if reference_model is not None else load_reference(cfg, train, ctx)
    hook, tm.prepare = tm.prepare, None
    data = getattr(cfg, "data", None)
    return GRPOObjective(settings=s, rewards=rewards, reward_names=[r.name for r in s.rewards], processor=tm.processor,
                         family=tm.family, hook=hook, seed=train.seed, dp_rank=ctx.dims.dp_rank, dp_group=ctx.dims.dp_group,
                         video=getattr(data, "video", None), run_dir=Path(run_dir) if run_dir is not None and ctx.env.is_main else None,
                         reference=reference, packed=bool(train.packing),
                         prompts_per_micro_batch=train.micro_batch_size if isinstance(train.micro_batch_size, int) else 8)


def prompt_collator(processor, family, *, packed: bool, tokens_per_batch: int | None = None,
                    max_length: int | None = None, grouped: bool = False) -> PromptCollator:
    """The training collator of grpo: the sampler's micro-batches of `train.micro_batch_size` prompts (any SFT data:
    the last assistant turn, or meta `answers`, is the reference) go to the objective as samples; it packs (or
    pads) their rollouts itself."""
    return PromptCollator()


def check_rewards(cfg) -> None:
    """Build `train.grpo.rewards` once in the launcher (user functions imported from the project's folder), so that
    a reward that does not import or does not exist is refused before any process starts. Raises ConfigError as
    `build_rewards` does."""
    import sys

    folder = os.getcwd()  # where `vlmctl train` was started, as the ranks look there (`build_grpo_objective`)
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        build_rewards(cfg.train.grpo.rewards, cfg.train.grpo.max_new_tokens)
    finally:
        if added:
            sys.path.remove(folder)


def bench_words(train) -> str:
    """`vlmctl bench`'s words for grpo's workload."""
    g = train.grpo
    size = train.micro_batch_size if isinstance(train.micro_batch_size, int) else 1
    return (f"grpo: {size} prompts per micro-batch x {g.group_size} rollouts of at most {g.max_new_tokens} tokens "
            f"(temperature {g.temperature}, top_p {g.top_p})" + (f", KL beta {g.beta}" if g.beta else ""))


def bench_settings(train):
    """`vlmctl bench`'s synthetic answers are random text: every group's rewards are equal (0), and DAPO's filter
    would leave no rollout to train on; the bench keeps them all (a step whose every group varies)."""
    if not train.grpo.drop_zero_variance_groups:
        return train, None
    return (train.model_copy(update={"grpo": train.grpo.model_copy(update={"drop_zero_variance_groups": False})}),
            "train.grpo.drop_zero_variance_groups: off in the bench (random answers earn equal rewards; every group is "
            "trained on, as in a step where all of them vary)")


SPEC = GRPOObjective.spec = ObjectiveSpec(
    name="grpo", objective=GRPOObjective, build=build_grpo_objective, collator=prompt_collator,
    probe_collator=sample_collator, packs_samples=False, workload="prompts",
    frozen=lambda train: ("reference",) if train.grpo.beta > 0 else (),
    hooks=frozenset({"prepare_window", "reuses_window", "state"}), section=GRPOSection,
    step_line=(("reward", "reward {:.3f}"), ("reward_std", "std {:.3f}"), ("kl", "kl {:.4f}"),
               ("clip_ratio/region_mean", "clipped {:.3f}"), ("completions/mean_length", "length {:.1f}"),
               ("time/rollout_s", "rollout {:.2f}s"), ("time/train_s", "train {:.2f}s"),
               ("logprob_gap/mean", "logp gap {:.4f}")),
    curves=(("reward", "reward_std"), "kl", "completions/mean_length"), plots_loss=False, describe=bench_words,
    preflight=check_rewards, bench_settings=bench_settings)
