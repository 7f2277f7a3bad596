"""DPO on tiny Qwen2.5-VL and tiny LLaVA: the loss and every parameter gradient of vlmctl's packed computation (the
chosen and rejected sequences of each prompt as varlen segments of one packed row, log-probs from the trainer's
chunked `token_losses`) equal TRL's `DPOTrainer._compute_loss` on the same models (policy and a frozen reference),
pairs and settings, where TRL runs its padded [chosen; rejected] batch through its fused LM head. Float32;
tolerance rtol 1e-4, atol 1e-6 on the loss and on each gradient (the two paths use different attention masks:
packed varlen vs padded); the reward margins (beta x differences of nearly equal log-prob sums) within 2e-5."""

from __future__ import annotations

import collections
import io
from types import SimpleNamespace

import pytest
import torch

from vlmctl.data.sample import Sample

trl = pytest.importorskip("trl")
from trl.trainer.dpo_trainer import DPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

TOL = {"rtol": 1e-4, "atol": 1e-6}


def png(color) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (64, 64), (255, 255, 255))
    ImageDraw.Draw(img).rectangle((12, 12, 52, 52), fill=color)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def pairs() -> list[Sample]:
    out = []
    for i, (color, right, wrong) in enumerate([((220, 20, 20), "red", "blue square"), ((20, 20, 220), "a blue one", "green")]):
        user = {"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "What color is the shape?"}]}
        out.append(Sample(id=f"p{i}", messages=[user, {"role": "assistant", "content": [{"type": "text", "text": right}]}],
                          images=[png(color)], rejected={"role": "assistant", "content": [{"type": "text", "text": wrong}]}))
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
    if seed is not None:  # the policy has moved away from the reference
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model, processor, family


def vlmctl_dpo(policy, ref, processor, family, samples, settings):
    from vlmctl.data.collate import PackedCollator, model_inputs
    from vlmctl.train.dpo import dpo_loss, pair_segments, segment_logps_at
    from vlmctl.train.kernels import token_losses

    conversations = [s for pair in samples for s in (pair, pair.rejected_sample())]  # chosen, rejected, chosen, ...
    row = PackedCollator(processor, family, tokens_per_batch=10**6, dummy_image=False)(conversations)
    hook = family.position_hook(policy, getattr(policy.config, "image_token_id", None))
    row = hook(row) if hook else row
    batch = {**model_inputs(row), "labels": row["labels"]}
    assert len(row["seq_lens"]) == 2 * len(samples)

    def sums(model):
        losses, positions = token_losses(model, batch)
        return segment_logps_at(-losses, positions, row["seq_lens"])

    logps, counts = sums(policy)
    with torch.no_grad():
        ref_logps, _ = sums(ref)
    chosen, rejected = pair_segments(logps, len(samples))
    ref_chosen, ref_rejected = pair_segments(ref_logps, len(samples))
    n_chosen, n_rejected = pair_segments(counts, len(samples))
    return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens=n_chosen, rejected_tokens=n_rejected, **settings)


def trl_dpo(policy, ref, processor, family, samples, settings):
    """TRL's loss on its padded batch: chosen rows then rejected rows, right-padded, `completion_mask` on the answer
    tokens (encoded as vlmctl's collator encodes them, so both see the same tokens and pixels)."""
    from vlmctl.data.collate import encode_sample

    encoded = [encode_sample(s, processor, family) for s in samples] + [encode_sample(s.rejected_sample(), processor, family) for s in samples]
    width = max(e.length for e in encoded)
    pad = processor.tokenizer.pad_token_id or 0

    def padded(values, fill):
        return torch.stack([torch.cat([v, torch.full((width - v.shape[0],), fill, dtype=v.dtype)]) for v in values])

    inputs = {"input_ids": padded([e.input_ids for e in encoded], pad),
              "attention_mask": padded([torch.ones_like(e.input_ids) for e in encoded], 0),
              "completion_mask": padded([(e.labels != -100).long() for e in encoded], 0)}
    for key in encoded[0].token_inputs:
        inputs[key] = padded([e.token_inputs[key] for e in encoded], 0)
    for key in encoded[0].image_inputs:
        inputs[key] = torch.cat([e.image_inputs[key] for e in encoded])
    t = DPOTrainer.__new__(DPOTrainer)
    t.model, t.ref_model = policy, ref
    t.accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    t.args = SimpleNamespace(gradient_checkpointing_kwargs=None)
    t.aux_loss_enabled, t.ld_alpha, t.precompute_ref_logps, t.use_weighting = False, None, False, False
    t.f_divergence_type, t.loss_types, t.loss_weights = "reverse_kl", [settings["loss_type"]], [1.0]
    t.beta, t.label_smoothing = settings["beta"], 0.0
    t._metrics, t._total_train_tokens, t._tp_size = {"train": collections.defaultdict(list)}, 0, 1
    loss = DPOTrainer._compute_loss(t, policy, inputs, False)
    return loss, {k: v[-1] for k, v in t._metrics["train"].items()}


@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny"])
def test_packed_dpo_loss_and_gradients_equal_trl_dpo_trainer(built, preset):
    policy, processor, family = load(built / preset, seed=0)
    ref, _, _ = load(built / preset)
    ref.requires_grad_(False)
    policy.train()
    for model in (policy, ref):
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))  # TRL's own forward
    samples = pairs()
    for settings in ({"loss_type": "sigmoid", "beta": 0.1}, {"loss_type": "ipo", "beta": 0.5}, {"loss_type": "hinge", "beta": 2.0}):
        policy.zero_grad()
        out = vlmctl_dpo(policy, ref, processor, family, samples, settings)
        out.loss.backward()
        ours = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        policy.zero_grad()
        expected, metrics = trl_dpo(policy, ref, processor, family, samples, settings)
        expected.backward()
        theirs = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        torch.testing.assert_close(out.loss, expected.detach(), **TOL)
        # margins are beta x differences of nearly equal sums of log-probs: compared in absolute terms
        assert out.metrics["rewards/margins"] == pytest.approx(metrics["rewards/margins"], abs=2e-5)
        assert set(ours) == set(theirs) and any("visual" in n or "vision" in n for n in ours)
        for name in ours:
            torch.testing.assert_close(ours[name], theirs[name], **TOL, msg=lambda m, name=name: f"{settings} {name}: {m}")
        assert sum(float(g.abs().sum()) for g in ours.values()) > 0


def objective_loss(objective, model, processor, family, samples):
    """The DPO objective's loss of `samples` packed by the pair collator, through an engine that feeds `model`."""
    from vlmctl.data.collate import PairCollator, model_inputs

    row = PairCollator(processor, family, tokens_per_batch=10**6, dummy_image=False)(samples)
    hook = family.position_hook(model, getattr(model.config, "image_token_id", None))
    row = hook(row) if hook else row
    engine = SimpleNamespace(model=model, module=model, inputs=model_inputs)
    return objective.loss(engine, row), row


@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny"])
def test_the_dpo_objective_on_pair_rows_equals_trl_dpo_trainer(built, preset):
    from vlmctl.config.objective import DPOSection
    from vlmctl.train.dpo import DPOObjective

    policy, processor, family = load(built / preset, seed=0)
    ref, _, _ = load(built / preset)
    ref.requires_grad_(False)
    policy.train()
    samples = pairs()
    settings = {"loss_type": "sigmoid", "beta": 0.1}
    objective = DPOObjective(DPOSection(**settings), reference=ref)
    assert objective.models == {"reference": ref}
    micro, row = objective_loss(objective, policy, processor, family, samples)
    assert row["num_pairs"] == len(samples) and micro.tokens == len(samples)
    mean = micro.loss / micro.tokens  # the loop divides by the global batch's pairs
    mean.backward()
    ours = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad()
    for model in (policy, ref):
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    expected, metrics = trl_dpo(policy, ref, processor, family, samples, settings)
    expected.backward()
    torch.testing.assert_close(mean.detach(), expected.detach(), **TOL)
    logged = objective.metrics({k: float(v) for k, v in micro.metrics.items()}, micro.tokens)
    assert logged["rewards/margins"] == pytest.approx(metrics["rewards/margins"], abs=2e-5)
    assert logged["rewards/accuracies"] == pytest.approx(metrics["rewards/accuracies"])
    for name, grad in ours.items():
        torch.testing.assert_close(grad, policy.get_parameter(name).grad, **TOL)


@pytest.mark.parametrize("preset", ["tiny-qwen2.5-vl", "tiny"])
def test_padded_pairs_train_as_their_packed_rows(built, preset):
    """train.packing: false (the tiny template's setting, or a family that cannot pack): pairs as consecutive padded
    rows give the packed rows' loss, metrics and gradients (full logits instead of the chunked head)."""
    from vlmctl.config.objective import DPOSection
    from vlmctl.data.collate import PaddedPairCollator, model_inputs
    from vlmctl.train.dpo import DPOObjective
    from vlmctl.train.objectives import check_batch

    policy, processor, family = load(built / preset, seed=0)
    ref, _, _ = load(built / preset)
    ref.requires_grad_(False)
    objective = DPOObjective(DPOSection(loss_type="sigmoid", beta=0.1, rpo_alpha=0.5), reference=ref)
    packed, _ = objective_loss(objective, policy, processor, family, pairs())
    packed.loss.backward()
    want = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad()
    batch = PaddedPairCollator(processor, family, dummy_image=False)(pairs())
    assert batch["input_ids"].shape[0] == 4 and batch["num_pairs"] == 2 and batch["pair_ids"] == ["p0", "p1"]
    check_batch(objective, batch)  # the keys the loop asks of the first window
    padded = objective.loss(SimpleNamespace(model=policy, module=policy, inputs=model_inputs), batch)
    padded.loss.backward()
    torch.testing.assert_close(padded.loss, packed.loss, **TOL)
    for key in ("rewards/margins", "rewards/accuracies", "nll_loss"):
        assert float(padded.metrics[key]) == pytest.approx(float(packed.metrics[key]), abs=2e-5), key
    for name, grad in want.items():
        torch.testing.assert_close(policy.get_parameter(name).grad, grad, **TOL)


def test_the_adapter_disabled_reference_is_the_lora_base(built):
    """Under LoRA the reference is the trained model with its adapter off: the same loss as a frozen copy of the
    base, with no second model."""
    from peft import LoraConfig, get_peft_model

    from vlmctl.config.objective import DPOSection
    from vlmctl.train.dpo import DPOObjective

    base, processor, family = load(built / "tiny")
    frozen, _, _ = load(built / "tiny")
    frozen.requires_grad_(False)
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    settings = DPOSection(loss_type="sigmoid", beta=0.5, reference="adapter_disabled")
    with_adapter_off, _ = objective_loss(DPOObjective(settings), policy, processor, family, pairs())
    with_copy, _ = objective_loss(DPOObjective(settings, reference=frozen), policy, processor, family, pairs())
    torch.testing.assert_close(with_adapter_off.loss, with_copy.loss, rtol=1e-6, atol=1e-7)
    assert float(with_adapter_off.metrics["rewards/margins"]) != 0.0  # the adapter moved the policy off its base


def test_the_pair_collator_keeps_pairs_whole_and_refuses_plain_samples(built):
    from vlmctl.data.collate import PairCollator
    from vlmctl.errors import DataError

    _, processor, family = load(built / "tiny")
    samples = pairs()
    one = PairCollator(processor, family, tokens_per_batch=10**6, dummy_image=False)([samples[0]])
    budget = sum(one["seq_lens"]) + 1  # room for the first pair, not for a second
    with pytest.warns(UserWarning, match="does not fit"):
        row = PairCollator(processor, family, tokens_per_batch=budget, dummy_image=False)(samples)
    assert row["num_pairs"] == 1 and row["seq_lens"] == one["seq_lens"]
    plain = Sample(id="sft", messages=samples[0].messages, images=samples[0].images)
    with pytest.raises(DataError, match="no rejected answer"):
        PairCollator(processor, family, tokens_per_batch=10**6)([plain])


def test_rpo_alpha_adds_each_chosen_answers_mean_token_nll(built):
    """RPO (arXiv 2404.19733): each pair's loss gains rpo_alpha x the chosen answer's NLL per token, checked against
    each chosen conversation's own cross-entropy (padded collator, full logits)."""
    from vlmctl.config.objective import DPOSection
    from vlmctl.data.collate import Collator, model_inputs
    from vlmctl.train.dpo import DPOObjective
    from vlmctl.train.objectives import token_loss_sum

    policy, processor, family = load(built / "tiny", seed=0)
    ref, _, _ = load(built / "tiny")
    samples = pairs()
    plain, _ = objective_loss(DPOObjective(DPOSection(beta=0.1), reference=ref), policy, processor, family, samples)
    rpo, _ = objective_loss(DPOObjective(DPOSection(beta=0.1, rpo_alpha=0.5), reference=ref), policy, processor, family, samples)
    nll = []
    with torch.no_grad():
        for sample in samples:
            chosen = Collator(processor, family, dummy_image=False)([sample])  # a pair encodes as its chosen answer
            summed = token_loss_sum(policy(**model_inputs(chosen)).logits, chosen["labels"])
            nll.append(float(summed) / chosen["num_label_tokens"])
    torch.testing.assert_close(rpo.loss - plain.loss, torch.tensor(0.5 * sum(nll)), rtol=1e-4, atol=1e-5)
    assert float(rpo.metrics["nll_loss"]) == pytest.approx(sum(nll), rel=1e-4)
