"""GRPO on tiny Qwen2.5-VL and tiny LLaVA: the loss and every parameter gradient of vlmctl's computation (each
rollout, prompt + completion, a varlen segment of one packed row; completion log-probs from the trainer's chunked
`token_losses`, regrouped by `unpack_segments`) equal TRL's `GRPOTrainer._compute_loss`, which runs its own
forward (`_get_per_token_logps_and_entropies`, left-padded prompts + right-padded completions, fused LM head) on the
same model, fixed rollouts, rewards, old and reference log-probs. Float32; rtol 1e-4, atol 1e-6."""

from __future__ import annotations

import collections
import contextlib
import io
from types import SimpleNamespace

import pytest
import torch

from vlmctl.data.sample import Sample

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

TOL = {"rtol": 1e-4, "atol": 1e-6}
COMPLETIONS = [["red", "a blue square"], ["green", "it is blue"]]
REWARDS = [1.0, 0.0, 0.0, 1.0]


def png(color) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (64, 64), (255, 255, 255))
    ImageDraw.Draw(img).ellipse((10, 10, 54, 54), fill=color)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def rollouts() -> list[Sample]:
    """Two prompts x a group of two fixed completions, each rollout as the conversation it is trained on."""
    out = []
    for i, (color, group) in enumerate(zip([(220, 20, 20), (20, 20, 220)], COMPLETIONS)):
        user = {"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "What color is it?"}]}
        for j, text in enumerate(group):
            out.append(Sample(id=f"r{i}{j}", messages=[user, {"role": "assistant", "content": [{"type": "text", "text": text}]}],
                              images=[png(color)]))
    return out


@pytest.fixture(scope="module")
def built(tiny_models):
    """The folder holding the session's tiny models by preset name (`tiny_models`)."""
    tiny_models("tiny-qwen2.5-vl")
    return tiny_models("tiny").parent


def load(folder, seed=None):
    from vlmctl.models import load_model

    model, processor, family = load_model(folder, dtype=torch.float32)
    model.set_attn_implementation("sdpa")
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model, processor, family


def packed_completion_logps(model, processor, family, samples):
    """vlmctl: the rollouts packed into one row; their completion tokens' log-probs as [N, C] and the mask."""
    from vlmctl.data.collate import PackedCollator, model_inputs
    from vlmctl.train.grpo import unpack_segments
    from vlmctl.train.kernels import token_losses

    row = PackedCollator(processor, family, tokens_per_batch=10**6, dummy_image=False)(samples)
    hook = family.position_hook(model, getattr(model.config, "image_token_id", None))
    row = hook(row) if hook else row
    losses, positions = token_losses(model, {**model_inputs(row), "labels": row["labels"]})
    return unpack_segments(-losses, positions, row["seq_lens"])


def trl_inputs(processor, family, samples):
    """TRL's rollout batch: prompt ids left-padded, completion ids (the labelled answer tokens) right-padded."""
    from vlmctl.data.collate import encode_sample

    encoded = [encode_sample(s, processor, family) for s in samples]
    prompts, completions, types = [], [], []
    for e in encoded:
        labelled = (e.labels != -100).nonzero().squeeze(1)
        first, last = int(labelled[0]), int(labelled[-1])
        assert int(labelled.numel()) == last - first + 1  # one contiguous answer
        prompts.append(e.input_ids[:first])
        completions.append(e.input_ids[first:last + 1])
        types.append(e.token_inputs.get("mm_token_type_ids", torch.zeros_like(e.input_ids))[:last + 1])
    p_width, c_width = max(len(p) for p in prompts), max(len(c) for c in completions)
    pad = processor.tokenizer.pad_token_id or 0

    def left(v, width, fill):
        return torch.cat([torch.full((width - len(v),), fill, dtype=v.dtype), v])

    def right(v, width, fill):
        return torch.cat([v, torch.full((width - len(v),), fill, dtype=v.dtype)])

    inputs = {
        "prompt_ids": torch.stack([left(p, p_width, pad) for p in prompts]),
        "prompt_mask": torch.stack([left(torch.ones_like(p), p_width, 0) for p in prompts]),
        "completion_ids": torch.stack([right(c, c_width, pad) for c in completions]),
        "completion_mask": torch.stack([right(torch.ones_like(c), c_width, 0) for c in completions]),
        "num_images": [1] * len(samples),
    }
    if "mm_token_type_ids" in encoded[0].token_inputs:
        inputs["mm_token_type_ids"] = torch.stack([right(left(t[:len(p)], p_width, 0), p_width + c_width, 0)
                                                   for t, p in zip(types, prompts)])
    for key in encoded[0].image_inputs:
        inputs[key] = torch.cat([e.image_inputs[key] for e in encoded])
    return inputs


def trl_loss(model, inputs, *, loss_type, level, eps_low, eps_high, beta):
    t = GRPOTrainer.__new__(GRPOTrainer)
    t.model = model
    t.accelerator = SimpleNamespace(autocast=contextlib.nullcontext, num_processes=1, sync_gradients=True, is_main_process=True,
                                    gather=lambda x: x, gather_for_metrics=lambda x: x, reduce=lambda x, reduction="sum": x)
    t.aux_loss_enabled, t.top_entropy_quantile, t.off_policy_mask_threshold = False, 1.0, None
    t.importance_sampling_level, t.loss_type, t.beta = level, loss_type, beta
    t.epsilon_low, t.epsilon_high, t.use_vllm, t._entropy_bonus_enabled = eps_low, eps_high, False, False
    t.args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    t.current_gradient_accumulation_steps = 1
    t._metrics = {"train": collections.defaultdict(list)}
    return GRPOTrainer._compute_loss(t, model, {**inputs, "num_items_in_batch": inputs["completion_mask"].sum()})


@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny"])
def test_grpo_loss_and_gradients_equal_trl_grpo_trainer(built, preset):
    from vlmctl.train.grpo import group_advantages, policy_loss

    policy, processor, family = load(built / preset, seed=1)
    old, _, _ = load(built / preset)  # the policy that generated the rollouts, also the reference
    old.requires_grad_(False)
    policy.train()
    add_fused_lm_head(policy, outputs=("log_probs", "entropy"))  # TRL's own forward
    samples = rollouts()
    advantages, _ = group_advantages(torch.tensor(REWARDS), group_size=2)
    with torch.no_grad():
        old_logps, mask = packed_completion_logps(old, processor, family, samples)
    inputs = trl_inputs(processor, family, samples)
    assert torch.equal(mask, inputs["completion_mask"])
    inputs.update(advantages=advantages, old_per_token_logps=old_logps, ref_per_token_logps=old_logps)
    cases = [  # (TRL settings, vlmctl settings)
        ({"loss_type": "grpo", "level": "token", "eps_low": 0.2, "eps_high": 0.2, "beta": 0.04}, {"aggregation": "sequence", "beta": 0.04}),
        ({"loss_type": "dapo", "level": "token", "eps_low": 0.2, "eps_high": 0.28, "beta": 0.0}, {"aggregation": "token", "epsilon_high": 0.28}),
        ({"loss_type": "grpo", "level": "sequence", "eps_low": 3e-4, "eps_high": 4e-4, "beta": 0.0},
         {"aggregation": "sequence", "level": "sequence", "epsilon_low": 3e-4, "epsilon_high": 4e-4}),
    ]
    for trl_kw, ours_kw in cases:
        policy.zero_grad()
        logps, got_mask = packed_completion_logps(policy, processor, family, samples)
        out = policy_loss(logps, old_logps, advantages, got_mask, ref_logps=old_logps, **ours_kw)
        out.loss.backward()
        ours = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        policy.zero_grad()
        expected = trl_loss(policy, inputs, **trl_kw)
        expected.backward()
        theirs = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        torch.testing.assert_close(out.loss, expected.detach(), **TOL)
        assert set(ours) == set(theirs) and any("visual" in n or "vision" in n for n in ours)
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], **TOL, msg=lambda m, name=name: f"{trl_kw} {name}: {m}")
        assert sum(float(g.abs().sum()) for g in ours.values()) > 0
