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
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from vlmctl.errors import ConfigError

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
    if level not in LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; use one of {', '.join(LEVELS)}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {aggregation!r}; use one of {', '.join(AGGREGATIONS)}")
    if beta and ref_logps is None:
        raise ValueError("a KL term (beta > 0) needs the reference's log-probs (ref_logps)")
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
    metrics: dict[str, float] = {}
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

    def masked_mean(x: torch.Tensor) -> float:
        if x.shape[1] == 1:  # one value per rollout (sequence-level ratio)
            return float(x.float().mean())
        return float((x * mask).sum() / mask.sum().clamp(min=1.0))

    with torch.no_grad():
        low = (ratio < 1 - epsilon_low) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
        metrics["clip_ratio/low_mean"] = masked_mean(low.float())
        metrics["clip_ratio/high_mean"] = masked_mean(high.float())
        metrics["clip_ratio/region_mean"] = masked_mean((low | high).float())
        if kl is not None:
            metrics["kl"] = masked_mean(kl)
    return GRPOOutput(loss, per_token, metrics)


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
    for i, spec in enumerate(specs):
        if spec.name in simple:
            fn = simple[spec.name]
        elif spec.name == "format":
            fn = format_reward(spec.pattern)
        elif spec.name == "length_penalty":
            fn = length_penalty(max_new_tokens, spec.cache_tokens)
        else:
            fn = load_reward(spec.name, key=f"train.grpo.rewards[{i}].name")
        out.append((fn, spec.weight))
    return out
