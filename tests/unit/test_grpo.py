"""GRPO: advantages and loss equal TRL's `GRPOTrainer` on fixed rollouts, rewards and log-probs (grpo, dapo, bnpo,
GSPO's sequence-level ratio, the KL term; float32, rtol 1e-5, atol 1e-6); the built-in rewards and the user
reward loader."""

from __future__ import annotations

import collections
import inspect
import math
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from vlmctl.errors import ConfigError
from vlmctl.train.grpo import (exact_match_reward, format_reward, group_advantages, keep_groups, length_penalty,
                               load_reward, mcq_letter_reward, policy_loss, score, vqa_accuracy_reward)

trl = pytest.importorskip("trl")
from trl.trainer import grpo_trainer  # noqa: E402
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402

TOL = {"rtol": 1e-5, "atol": 1e-6}


def trl_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """TRL's advantage code, run as it is in `GRPOTrainer._generate_and_score_completions` (the block from the
    weighted sum of the rewards to the NaN guard, taken from the installed source) on fixed rewards."""
    src = textwrap.dedent(inspect.getsource(GRPOTrainer._generate_and_score_completions))
    start = src.rindex("\n", 0, src.index('if self.multi_objective_aggregation == "sum_then_normalize":')) + 1
    end = src.index("advantages = torch.nan_to_num(advantages, nan=0.0)")
    block = textwrap.dedent(src[start:end])
    trainer = SimpleNamespace(multi_objective_aggregation="sum_then_normalize", scale_rewards=scale_rewards,
                              reward_weights=torch.ones(1), reward_funcs=[None])
    scope = {"self": trainer, "rewards_per_func": rewards[:, None], "num_generations": num_generations, "device": "cpu",
             "unscorable_mask": torch.zeros(len(rewards), dtype=torch.bool), "torch": torch, "nanstd": grpo_trainer.nanstd}
    exec(compile(block, "trl-advantages", "exec"), scope)
    return scope["advantages"]


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def trl_loss(logps, old_logps, advantages, mask, *, loss_type, level="token", eps_low=0.2, eps_high=0.2, beta=0.0, ref=None):
    """TRL's GRPOTrainer._compute_loss on fixed rollouts: the policy's per-token log-probs are given."""
    t = GRPOTrainer.__new__(GRPOTrainer)
    t.model = torch.nn.Linear(1, 1)
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    t.aux_loss_enabled, t.top_entropy_quantile, t.off_policy_mask_threshold = False, 1.0, None
    t.importance_sampling_level, t.loss_type, t.beta = level, loss_type, beta
    t.epsilon_low, t.epsilon_high, t.use_vllm, t._entropy_bonus_enabled = eps_low, eps_high, False, False
    t.args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    t.accelerator, t.current_gradient_accumulation_steps = _Accelerator(), 1
    t._metrics = {"train": collections.defaultdict(list)}
    n, width = logps.shape
    inputs = {"prompt_ids": torch.ones(n, 2, dtype=torch.long), "prompt_mask": torch.ones(n, 2, dtype=torch.long),
              "completion_ids": torch.ones(n, width, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old_logps, "num_items_in_batch": mask.sum()}
    if beta:
        inputs["ref_per_token_logps"] = ref
    loss = GRPOTrainer._compute_loss(t, t.model, inputs)
    return loss, {k: v[-1] for k, v in t._metrics["train"].items()}


def rollouts(seed, prompts=3, group=4, width=7):
    g = torch.Generator().manual_seed(seed)
    n = prompts * group
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    old = -2 * torch.rand(n, width, generator=g)
    logps = (old + 0.4 * torch.randn(n, width, generator=g)).requires_grad_()  # ratios on both sides of the clip
    ref = old + 0.2 * torch.randn(n, width, generator=g)
    rewards = torch.randint(0, 3, (n,), generator=g).float()
    rewards[:group] = 1.0  # one group with equal rewards: zero advantages
    return logps, old, ref, mask, rewards


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(scale):
    _, _, _, _, rewards = rollouts(0)
    adv, zero_std = group_advantages(rewards, 4, scale=scale)
    torch.testing.assert_close(adv, trl_advantages(rewards, 4, scale), **TOL)
    if scale == "group":
        assert zero_std[:4].all() and not zero_std[4:].all() and float(adv[:4].abs().sum()) == 0
    assert keep_groups(rewards, 4).tolist() == [False] * 4 + [bool((rewards[4:8] != rewards[4]).any())] * 4 + [bool((rewards[8:] != rewards[8]).any())] * 4


SETTINGS = {
    "grpo": ({"loss_type": "grpo"}, {"aggregation": "sequence"}),
    "bnpo": ({"loss_type": "bnpo"}, {"aggregation": "token"}),
    "dapo": ({"loss_type": "dapo", "eps_low": 0.2, "eps_high": 0.28}, {"aggregation": "token", "epsilon_low": 0.2, "epsilon_high": 0.28}),
    "gspo": ({"loss_type": "grpo", "level": "sequence", "eps_low": 3e-4, "eps_high": 4e-4},
             {"aggregation": "sequence", "level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4}),
    "grpo_kl": ({"loss_type": "grpo", "beta": 0.04}, {"aggregation": "sequence", "beta": 0.04}),
    "dapo_kl": ({"loss_type": "dapo", "beta": 0.1, "eps_high": 0.28}, {"aggregation": "token", "beta": 0.1, "epsilon_high": 0.28}),
}


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_loss_gradient_and_clip_metrics_equal_trl(name, seed):
    logps, old, ref, mask, rewards = rollouts(seed)
    adv, _ = group_advantages(rewards, 4)
    trl_kw, our_kw = SETTINGS[name]
    expected, metrics = trl_loss(logps, old, adv, mask, ref=ref, **trl_kw)
    (expected_grad,) = torch.autograd.grad(expected, logps)
    out = policy_loss(logps, old, adv, mask, ref_logps=ref, **our_kw)
    (grad,) = torch.autograd.grad(out.loss, logps)
    torch.testing.assert_close(out.loss, expected, **TOL)
    torch.testing.assert_close(grad, expected_grad, **TOL)
    assert float(grad.abs().sum()) > 0
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl"):
        if key in metrics:
            assert math.isclose(out.metrics[key], metrics[key], rel_tol=1e-5, abs_tol=1e-6), key
    if name == "dapo":
        assert out.metrics["clip_ratio/region_mean"] > 0  # the clip is exercised


def test_on_policy_ratio_is_one_with_the_policy_gradient():
    logps, _, _, mask, rewards = rollouts(2)
    adv, _ = group_advantages(rewards, 4)
    out = policy_loss(logps, None, adv, mask)
    expected, _ = trl_loss(logps, None, adv, mask, loss_type="grpo")
    torch.testing.assert_close(out.loss, expected, **TOL)
    (grad,) = torch.autograd.grad(out.loss, logps)
    # d/dlogp of -A * exp(logp - sg(logp)) averaged per rollout: -A / |y_i| on each real token
    want = -(adv[:, None] * mask) / mask.sum(-1, keepdim=True) / mask.shape[0]
    torch.testing.assert_close(grad, want, **TOL)


def test_builtin_rewards():
    completions = ["Two", "the cat.", "B", "(C) a dog", "<think>x</think> <answer>4</answer>", "four"]
    refs = [["2"], ["Cat"], ["B"], ["B"], ["4"], ["4"]]
    assert exact_match_reward(completions, refs) == [0, 0, 1, 0, 0, 0]
    assert vqa_accuracy_reward(completions, refs) == [1, 1, 1, 0, 0, 1]  # "two" -> "2", "four" -> "4", articles and periods dropped
    assert mcq_letter_reward(completions[2:4], refs[2:4]) == [1, 0]
    assert mcq_letter_reward(["a dog"], [["B"]], meta=[{"options": ["a cat", "a dog"]}]) == [1]
    fmt = format_reward(r"<think>.*</think>\s*<answer>.*</answer>")
    assert fmt(completions, refs) == [0, 0, 0, 0, 1, 0]
    penalty = length_penalty(max_tokens=10, cache_tokens=4)
    assert penalty(["x"] * 4, [[]] * 4, completion_tokens=[6, 8, 10, 11]) == [0, -0.5, -1, -1]
    total = score([(exact_match_reward, 1.0), (penalty, 0.5)], ["B", "B"], [["B"], ["C"]], completion_tokens=[8, 2])
    assert total.tolist() == [0.75, 0.0]
    with pytest.raises(ConfigError, match="not a regular expression"):
        format_reward("(")


def test_user_reward_loader(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def score(completions, references, **kwargs):\n    return [len(c) for c in completions]\n")
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('needs a GPU')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "my_rewards" not in sys.modules
    fn = load_reward("my_rewards:score")
    assert score([(fn, 2.0)], ["ab", "c"], [[], []]).tolist() == [4.0, 2.0]
    with pytest.raises(ConfigError, match=r"train.grpo.rewards\[\].name: module 'my_rewards' has no function 'nope'"):
        load_reward("my_rewards:nope")
    with pytest.raises(ConfigError, match="cannot import 'broken_rewards'.*RuntimeError: needs a GPU"):
        load_reward("broken_rewards:score")
    with pytest.raises(ConfigError, match="neither a built-in reward"):
        load_reward("exact-match")
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        score([(lambda c, r, **k: [1.0], 1.0)], ["a", "b"], [[], []])


def test_config_sections_build_the_rewards(tmp_path, monkeypatch):
    from pydantic import ValidationError

    from vlmctl.config.objective import BUILTIN_REWARD_NAMES, DPOSection, GRPOSection
    from vlmctl.train import grpo

    assert BUILTIN_REWARD_NAMES == grpo.BUILTIN_REWARDS
    (tmp_path / "proj_rewards.py").write_text("def short(completions, references, **kwargs):\n    return [-len(c) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    section = GRPOSection(max_new_tokens=10, rewards=[
        {"name": "exact_match"}, {"name": "format", "pattern": "<a>.*</a>", "weight": 0.5},
        {"name": "length_penalty", "cache_tokens": 4}, {"name": "proj_rewards:short", "weight": 0.1}])
    fns = grpo.build_rewards(section.rewards, section.max_new_tokens)
    total = grpo.score(fns, ["<a>x</a>", "x"], [["<a>x</a>"], ["y"]], completion_tokens=[3, 8])
    assert total.tolist() == pytest.approx([1 + 0.5 + 0 - 0.8, 0 + 0 - 0.5 - 0.1])
    with pytest.raises(ConfigError, match=r"train.grpo.rewards\[0\].name: cannot import 'nowhere'"):
        grpo.build_rewards(GRPOSection(rewards=[{"name": "nowhere:fn"}]).rewards, 10)
    with pytest.raises(ValidationError, match="format reward needs a pattern"):
        GRPOSection(rewards=[{"name": "format"}])
    with pytest.raises(ValidationError, match="neither a built-in reward"):
        GRPOSection(rewards=[{"name": "exactmatch"}])
    with pytest.raises(ValidationError, match="label_smoothing applies to loss_type sigmoid"):
        DPOSection(loss_type="ipo", label_smoothing=0.1)
    assert DPOSection().beta == 0.1 and GRPOSection().epsilon_high is None


def test_unpack_segments_gives_the_padded_layout_of_a_packed_row():
    from vlmctl.train.grpo import unpack_segments

    logps, old, _, mask, rewards = rollouts(4, prompts=2, group=2)
    adv, _ = group_advantages(rewards, 2)
    # pack: each rollout a segment of a 3-token prompt (unlabelled) then its completion tokens
    lens = [3 + int(m.sum()) for m in mask]
    positions = torch.cat([torch.arange(3, n) + sum(lens[:i]) for i, n in enumerate(lens)])
    flat = torch.cat([logps[i, :int(m.sum())] for i, m in enumerate(mask)])
    shuffled = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))  # order of positions does not matter
    padded, got_mask = unpack_segments(flat[shuffled], positions[shuffled], lens)
    width = int(mask.sum(-1).max())
    assert torch.equal(got_mask, mask[:, :width])
    torch.testing.assert_close(padded, (logps * mask)[:, :width])
    out = policy_loss(padded, (old * mask)[:, :width], adv, got_mask, aggregation="token")
    expected = policy_loss(logps, old, adv, mask, aggregation="token")
    torch.testing.assert_close(out.loss, expected.loss, **TOL)
    (g1,) = torch.autograd.grad(out.loss, logps)
    (g2,) = torch.autograd.grad(expected.loss, logps)
    torch.testing.assert_close(g1, g2, **TOL)
