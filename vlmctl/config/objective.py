"""Sections of the post-training objectives: `train.dpo` (preference pairs) and `train.grpo` (rollouts and rewards).

Each is an `ObjectiveSection`: besides its own keys it says which settings of the rest of the train section its
objective cannot train with (`refuse`, checked when the train section is validated: before any process starts)
and its settings in the words of a model card (`card`). `OBJECTIVE_NAMES` lists the values of `train.objective`;
what the run does with each is the objective's `ObjectiveSpec` (`vlmctl.train.registry`).

    train:
      objective: dpo
      dpo: {beta: 0.1, loss_type: sigmoid, reference: frozen}
    train:
      objective: grpo
      grpo:
        group_size: 8
        rewards: [{name: exact_match}, {name: format, pattern: "<answer>.*</answer>", weight: 0.2}]

The formulas are in `vlmctl.train.dpo` and `vlmctl.train.grpo`; each field below names its source.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from vlmctl.config.base import Section

BUILTIN_REWARD_NAMES = ("exact_match", "vqa_accuracy", "mcq_letter", "format", "length_penalty")

OBJECTIVE_NAMES = ("sft", "dpo", "grpo", "orpo")
"""The values of `train.objective` (one `vlmctl.train.registry` entry each)."""


class ObjectiveSection(Section):
    """The settings section of an objective (`train.<objective>`)."""

    def refuse(self, train: Any) -> str | None:
        """Why this objective cannot train with the rest of `train` (a TrainSection), with the key to change; None
        when it can."""
        return None

    def loss_terms(self) -> str:
        """What the logged `loss` of this objective's steps sums, in words ("" for a plain loss)."""
        return ""

    @classmethod
    def card(cls, settings: dict[str, Any]) -> str:
        """The settings (`train.<objective>` of a run's config.yaml, as a dict: read leniently, an older run's
        keys may differ) in a model card's words, after the objective's name."""
        return ""

    @classmethod
    def setting(cls, settings: dict[str, Any], key: str) -> Any:
        """`settings[key]`, else the field's default."""
        return settings.get(key, cls.model_fields[key].default)


def whole_rows(name: str, train: Any, what: str) -> str | None:
    """The refusal of sequence parallelism for an objective that reads `what` from one rank's row, and of tensor
    parallelism (its logits split over the vocabulary) for one that reads it from whole logits."""
    if train.sequence_parallel > 1:
        return f"train.objective {name} reads {what} from one rank's row: set train.sequence_parallel: 1"
    if getattr(train, "tensor_parallel", 1) > 1:
        return (f"train.objective {name} reads {what} from whole logits, which tensor parallelism splits over the "
                "vocabulary: set train.tensor_parallel: 1")
    return None


class DPOSection(ObjectiveSection):
    """Direct preference optimisation on prepared preference pairs (`data.kind: preference`)."""

    beta: float = Field(0.1, gt=0, description="beta: how far the policy may move from the reference. sigmoid: the loss is -log sigma(beta h), h = the chosen minus the rejected log-ratio to the reference (DPO, arXiv 2305.18290, Eq. 7); ipo: the target margin is 1/(2 beta) (tau of IPO, arXiv 2310.12036, Eq. 17); hinge: max(0, 1 - beta h) (SLiC, arXiv 2305.10425).")
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field("sigmoid", description="sigmoid (DPO), ipo (IPO, with each log-ratio divided by its answer's tokens, TRL's form) or hinge (SLiC); see vlmctl/train/dpo.py.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="sigmoid only: the assumed probability that a pair's preference is flipped; the loss becomes -(1 - eps) log sigma(beta h) - eps log sigma(-beta h) (conservative DPO, Mitchell 2023). 0 = plain DPO.")
    rpo_alpha: float = Field(0.0, ge=0, description="Weight of a negative log-likelihood term on the chosen answer added to each pair's loss: loss + rpo_alpha x (-log pi(y_w|x) / |y_w|), the chosen answer's mean token NLL (RPO, Pang et al. 2024, arXiv 2404.19733, Eq. 3; TRL's rpo_alpha, which averages the NLL over the batch's chosen tokens instead of per pair). Keeps the chosen answers likely while the margin grows; 0 = plain DPO.")
    reference: Literal["frozen", "adapter_disabled", "precomputed"] = Field("frozen", description="Where the reference log-probs come from: frozen (a frozen copy of the starting model, forward only, sharded like the policy), adapter_disabled (under LoRA: the base model with the adapter switched off, no second copy), precomputed (computed once over the data before training, no reference model in memory while training).")

    @model_validator(mode="after")
    def _smoothing_for_sigmoid(self) -> "DPOSection":
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"train.dpo.label_smoothing applies to loss_type sigmoid, not {self.loss_type}: set it to 0")
        return self

    def loss_terms(self) -> str:
        """The pair loss, with RPO's NLL term when `rpo_alpha` adds it: the loss is then not the DPO loss alone."""
        words = f"the {self.loss_type} DPO loss"
        if self.rpo_alpha:
            words += f" + rpo_alpha {self.rpo_alpha:g} x the chosen answers' mean token NLL (nll_loss)"
        return words

    def refuse(self, train: Any) -> str | None:
        """A pair's answers are summed over one rank's row; the adapter-disabled reference needs an adapter."""
        if self.reference == "adapter_disabled" and train.lora is None:
            return ("train.dpo.reference adapter_disabled is the base model under a LoRA adapter: set train.lora, "
                    "or train.dpo.reference: frozen (or precomputed)")
        return whole_rows("dpo", train, "each answer's log-probability")

    @classmethod
    def card(cls, settings: dict[str, Any]) -> str:
        return (f"{cls.setting(settings, 'loss_type')}, beta {cls.setting(settings, 'beta')}, "
                f"reference {cls.setting(settings, 'reference')}; arXiv 2305.18290")


class RewardSpec(Section):
    """One reward: a built-in one or the user's function, with its weight in the sum."""

    name: str = Field(..., description="A built-in reward (exact_match, vqa_accuracy: VQAv2's normalised accuracy, mcq_letter: the option letter, format: `pattern` matches the whole completion, length_penalty: DAPO's soft overlong punishment, arXiv 2503.14476 Eq. 13) or your function as module:function, fn(completions, references, **kwargs) -> list[float] (imported only when named).")
    weight: float = Field(1.0, description="Weight of this reward in the sum that is normalised per group (TRL's reward_weights).")
    pattern: str | None = Field(None, description="format: the regular expression (Python re, DOTALL) a completion must match whole to score 1.")
    cache_tokens: int | None = Field(None, gt=0, description="length_penalty: the soft zone before grpo.max_new_tokens in which the penalty falls linearly from 0 to -1 (DAPO's L_cache).")

    @model_validator(mode="after")
    def _fits_its_name(self) -> "RewardSpec":
        if self.name not in BUILTIN_REWARD_NAMES and ":" not in self.name:
            raise ValueError(f"reward {self.name!r} is neither a built-in reward ({', '.join(BUILTIN_REWARD_NAMES)}) nor module:function")
        if self.name == "format" and not self.pattern:
            raise ValueError("the format reward needs a pattern (the regular expression a completion must match)")
        if self.name == "length_penalty" and self.cache_tokens is None:
            raise ValueError("the length_penalty reward needs cache_tokens (the soft zone before grpo.max_new_tokens)")
        return self


class GRPOSection(ObjectiveSection):
    """Group relative policy optimisation on prompts with reference answers (any SFT data: the assistant turn is the
    reference)."""

    group_size: int = Field(8, ge=2, description="G: rollouts generated per prompt; advantages are normalised within each group (GRPO, arXiv 2402.03300, Sec. 4.1.2).")
    max_new_tokens: int = Field(256, gt=0, description="Tokens generated per rollout at most.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts (and of the log-probs they are scored with).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of the rollouts.")
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="exact_match")], description="The rewards, summed with their weights.")
    scale_rewards: Literal["group", "batch", "none"] = Field("group", description="A_i = (r_i - mean(group)) / (std + 1e-4) with the group's std (GRPO), the batch's std, or none (mean-centred only: Dr. GRPO, arXiv 2503.20783).")
    epsilon_low: float = Field(0.2, gt=0, lt=1, description="Lower clip: the ratio is clipped at 1 - epsilon_low (PPO/GRPO).")
    epsilon_high: float | None = Field(None, gt=0, description="Upper clip, 1 + epsilon_high; None = epsilon_low. DAPO's clip-higher uses 0.28 with epsilon_low 0.2 (arXiv 2503.14476, Eq. 10).")
    importance_sampling_level: Literal["token", "sequence"] = Field("token", description="token: one ratio per token (GRPO); sequence: exp(mean over the rollout's tokens of the log-ratio), one per rollout (GSPO, arXiv 2507.18071, Eq. 7; use clip ranges near 3e-4 / 4e-4).")
    aggregation: Literal["sequence", "token"] = Field("sequence", description="sequence: mean over each rollout's tokens, then over rollouts (GRPO Eq. 3); token: sum over all tokens of the batch / their number (DAPO's token-level policy gradient loss, Eq. 12).")
    drop_zero_variance_groups: bool = Field(False, description="Leave out groups whose rollouts all got the same reward (zero advantage, no gradient): DAPO's dynamic sampling, arXiv 2503.14476 Sec. 3.2.")
    beta: float = Field(0.0, ge=0, description="Weight of the KL term to the reference model, k3 estimator exp(ref - logp) - (ref - logp) - 1 per token (GRPO Eq. 4; TRL). 0 = no reference model.")
    num_iterations: int = Field(1, ge=1, description="Optimizer steps per generation batch (GRPO's mu, arXiv 2402.03300; TRL's num_iterations): the mu - 1 steps after a generation draw no prompts and retrain on its rollouts against their generation-time log-probs (the clip acts); with 1 the old policy is the current one and the ratio is 1.")

    @model_validator(mode="after")
    def _dapo_defaults(self) -> "GRPOSection":
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon_low and self.importance_sampling_level == "token":
            raise ValueError(f"train.grpo.epsilon_high ({self.epsilon_high}) is below epsilon_low ({self.epsilon_low}): "
                             "clip-higher raises the upper bound; leave it unset for the symmetric clip")
        return self

    def loss_terms(self) -> str:
        return ("the clipped surrogate: about 0 by construction (advantages are mean-centred per group); the "
                "reward is the figure of progress")

    def refuse(self, train: Any) -> str | None:
        """A rollout's log-probs come from one rank's row; a grpo run has no validation loss."""
        if train.eval_steps:
            return ("train.eval_steps: a grpo run has no validation loss; remove train.eval_steps and evaluate the "
                    "exported model with `vlmctl eval`")
        return whole_rows("grpo", train, "each rollout's log-probs")

    @classmethod
    def card(cls, settings: dict[str, Any]) -> str:
        rewards = ", ".join(str(r.get("name")) for r in settings.get("rewards") or [] if isinstance(r, dict)) or "exact_match"
        return f"{cls.setting(settings, 'group_size')} rollouts per prompt, rewards: {rewards}; arXiv 2402.03300"


def objective_card(train: dict[str, Any]) -> str:
    """A run's `train.objective` and its settings in a model card's words, from its train section as a dict (sft
    when unset: older runs), e.g. "dpo (sigmoid, beta 0.1, reference frozen; arXiv 2305.18290)"."""
    name = str(train.get("objective") or "sft")
    section = SECTIONS.get(name)
    if section is None:  # an objective without settings: next-token cross-entropy
        return f"{name} (next-token cross-entropy on the assistant turns)"
    settings = train.get(name)
    return f"{name} ({section.card(settings if isinstance(settings, dict) else {})})"


class ORPOSection(ObjectiveSection):
    """Odds ratio preference optimisation on prepared preference pairs (`data.kind: preference`), without a reference
    model."""

    beta: float = Field(0.1, gt=0, description="lambda of ORPO: the weight of the odds-ratio term -log sigma(log odds(chosen) - log odds(rejected)) added to the chosen answer's mean token NLL (Hong et al. 2024, arXiv 2403.07691, Eq. 6; TRL's ORPOConfig.beta); odds from the answers' length-normalised log-probabilities.")

    def loss_terms(self) -> str:
        return f"the chosen answers' mean token NLL + beta {self.beta:g} x the odds-ratio loss"

    def refuse(self, train: Any) -> str | None:
        """A pair's answers are summed over one rank's row."""
        return whole_rows("orpo", train, "each answer's log-probability")

    @classmethod
    def card(cls, settings: dict[str, Any]) -> str:
        return f"beta {cls.setting(settings, 'beta')}, no reference model; arXiv 2403.07691"


SECTIONS: dict[str, type[ObjectiveSection]] = {"dpo": DPOSection, "grpo": GRPOSection, "orpo": ORPOSection}
"""The objectives that have a settings section: train.<name>."""


__all__ = ["BUILTIN_REWARD_NAMES", "DPOSection", "GRPOSection", "OBJECTIVE_NAMES", "ORPOSection", "ObjectiveSection",
           "RewardSpec", "SECTIONS", "objective_card", "whole_rows"]
