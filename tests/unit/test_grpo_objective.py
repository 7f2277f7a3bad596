"""`train.grpo.GRPOObjective` on a tiny LLaVA: its loss on fixed rollouts (packed rows of prompt + completion)
equals `policy_loss` on the completion log-probs of each rollout run alone through a plain padded forward (value and
gradients, both aggregations, with and without the KL term); `prepare_window` generates seeded rollouts (the same
for the same step and rank), scores them, normalises advantages per group, drops zero-variance groups on request
and writes rollouts.html."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from vlmctl.data.sample import Sample

TEXTS = ["What color is the square?", "Name a primary color.", "How many sides?", "red blue green"]
TOL = {"rtol": 1e-5, "atol": 1e-6}


def png(rgb) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), rgb).save(buf, format="PNG")
    return buf.getvalue()


def samples() -> list[Sample]:
    answer = lambda t: {"role": "assistant", "content": [{"type": "text", "text": t}]}  # noqa: E731
    return [Sample(id="img", messages=[{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": TEXTS[0]}]},
                                       answer("red")], images=[png((200, 30, 30))]),
            Sample(id="txt", messages=[{"role": "user", "content": [{"type": "text", "text": TEXTS[1]}]}, answer("blue")])]


@pytest.fixture(scope="module")
def built(tiny_llava):
    return tiny_llava


def load(folder, seed=None):
    from vlmctl.models import load_model

    model, processor, family = load_model(folder, dtype=torch.float32)
    model.set_attn_implementation("sdpa")
    if seed is not None:  # moved away from the reference
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model, processor, family


def objective_for(processor, family, reference=None, rewards=(), **settings):
    from vlmctl.config.objective import GRPOSection
    from vlmctl.train.grpo import GRPOObjective, build_rewards

    section = GRPOSection(**{"group_size": 2, "max_new_tokens": 5, **settings})
    specs = list(rewards) or section.rewards
    return GRPOObjective(settings=section, rewards=build_rewards(specs, section.max_new_tokens),
                         reward_names=[r.name for r in specs], processor=processor, family=family, reference=reference)


def fixed_row(processor, family, packed: bool = True):
    """Two prompts x two fixed completions packed as the objective packs them (or padded, as it pads them without
    packing), and each rollout's own inputs."""
    from vlmctl.data.collate import Collator, PackedCollator
    from vlmctl.train.grpo import encode_prompt, rollout_rows

    tok = processor.tokenizer
    prompts = [encode_prompt(s, processor, family) for s in samples()]
    completions = [tok("red", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                   tok("blue green red", add_special_tokens=False)["input_ids"],
                   tok("sides", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
                   tok("blue", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    rows = rollout_rows(prompts, [0, 0, 1, 1], completions)
    row = PackedCollator(processor, family, tokens_per_batch=10**6).pack(rows) if packed else Collator(processor, family).pad(rows)
    row["advantages"] = torch.tensor([0.9, -0.9, 0.3, -0.3])
    row["num_rollouts"] = 4
    return row, rows


def alone_logps(model, rows, temperature: float = 1.0):
    """[N, L] log-probs of each rollout's labelled tokens from its own forward (full logits / `temperature`), and
    the mask."""
    out, width = [], max(int((r.labels != -100).sum()) for r in rows)
    for r in rows:
        logits = model(input_ids=r.input_ids[None], **r.image_inputs, use_cache=False).logits[0].float() / temperature
        pos = (r.labels != -100).nonzero().squeeze(1)
        lp = torch.log_softmax(logits[pos - 1], -1).gather(1, r.labels[pos][:, None]).squeeze(1)
        out.append(torch.cat([lp, lp.new_zeros(width - len(lp))]))
    mask = torch.tensor([[1] * int((r.labels != -100).sum()) + [0] * (width - int((r.labels != -100).sum())) for r in rows])
    return torch.stack(out), mask


@pytest.mark.parametrize("aggregation,beta,packed", [("sequence", 0.0, True), ("token", 0.0, True), ("sequence", 0.04, True),
                                                    ("token", 0.04, False)])
def test_the_objectives_loss_on_fixed_rollouts_equals_policy_loss(built, aggregation, beta, packed):
    from vlmctl.data.collate import model_inputs
    from vlmctl.train.grpo import policy_loss

    policy, processor, family = load(built, seed=1)
    ref = load(built)[0].requires_grad_(False) if beta else None
    objective = objective_for(processor, family, reference=ref, aggregation=aggregation, beta=beta, epsilon_high=0.28)
    row, rows = fixed_row(processor, family, packed)
    assert row["num_dummy_images"] == 0 and (len(row["seq_lens"]) if packed else row["input_ids"].shape[0]) == 4
    engine = SimpleNamespace(model=policy, module=policy, inputs=model_inputs)
    micro = objective.loss(engine, row)
    got = micro.loss / objective.label_tokens(row)
    got.backward()
    ours = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad()
    logps, mask = alone_logps(policy, rows)
    ref_logps = alone_logps(ref, rows)[0].detach() if beta else None
    expected = policy_loss(logps, None, row["advantages"], mask, epsilon_high=0.28, aggregation=aggregation, beta=beta, ref_logps=ref_logps)
    expected.loss.backward()
    assert objective.label_tokens(row) == (4 if aggregation == "sequence" else int(mask.sum()))
    torch.testing.assert_close(got.detach(), expected.loss.detach(), **TOL)
    if beta:
        assert float(got.detach()) > 1e-4  # the KL term: the policy moved away from the reference
        assert micro.metrics["kl"] / micro.metrics["completion_tokens"] == pytest.approx(expected.metrics["kl"], rel=1e-4)
    theirs = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    assert set(ours) == set(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")
    assert sum(float(g.abs().sum()) for g in ours.values()) > 0


def test_temperature_scales_the_scored_log_probs(built):
    from vlmctl.data.collate import model_inputs
    from vlmctl.train.grpo import completion_logps

    policy, processor, family = load(built, seed=1)
    row, rows = fixed_row(processor, family)
    inputs = model_inputs(row)
    with torch.no_grad():
        warm, mask = completion_logps(policy, inputs, row, temperature=2.0)
        expected, expected_mask = alone_logps(policy, rows, temperature=2.0)
        plain, _ = completion_logps(policy, inputs, row, temperature=1.0)
    assert torch.equal(mask, expected_mask)
    torch.testing.assert_close(warm * mask, expected, **TOL)
    assert not torch.allclose(warm * mask, plain * mask)
    assert not policy.lm_head._forward_pre_hooks  # the hook is gone after scoring


def _engine(model):
    engine = SimpleNamespace(model=model, module=model)
    engine.forward = lambda objective, batch: objective.loss(engine, batch)
    return engine


def test_prepare_window_generates_seeded_scored_rollouts_and_logs_them(built, tmp_path, monkeypatch):
    from vlmctl.config.objective import RewardSpec
    from vlmctl.train.grpo import PromptCollator, group_advantages

    (tmp_path / "lengthy.py").write_text("def score(completions, references, **kwargs):\n    return [float(len(c)) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model, processor, family = load(built)
    objective = objective_for(processor, family, rewards=[RewardSpec(name="exact_match"), RewardSpec(name="lengthy:score", weight=0.5)],
                              group_size=3, temperature=1.5)
    objective.run_dir = tmp_path
    window = [PromptCollator()(samples())]
    first = objective.prepare_window(_engine(model), window, step=3)
    stats = objective.metrics({}, 0.0)
    again = objective.prepare_window(_engine(model), window, step=3)
    other = objective.prepare_window(_engine(model), window, step=4)
    (row,), (row2,), (row3,) = first, again, other
    assert row["num_rollouts"] == 6 and row["num_samples"] == 6 and len(row["seq_lens"]) == 6  # images in the batch: no dummy
    assert torch.equal(row["input_ids"], row2["input_ids"]) and torch.equal(row["advantages"], row2["advantages"])
    assert not torch.equal(row["input_ids"], row3["input_ids"])  # another step draws other rollouts
    assert not objective._warned  # training's prompt tokens are the ones generation continued
    # rewards: the completions' lengths (exact match is 0 on a random model); advantages normalised per group
    labels = row["labels"][0]
    ends = torch.tensor(row["seq_lens"]).cumsum(0).tolist()
    completions = [labels[a:b][labels[a:b] != -100].tolist() for a, b in zip([0, *ends[:-1]], ends)]
    texts = [processor.tokenizer.decode(c, skip_special_tokens=True).strip() for c in completions]
    rewards = torch.tensor([0.5 * len(t) for t in texts])
    torch.testing.assert_close(row["advantages"], group_advantages(rewards, 3)[0])
    assert stats["reward"] == pytest.approx(float(rewards.mean()), rel=1e-5) and stats["rewards/exact_match/mean"] == 0.0
    assert stats["rollouts"] == 6 and stats["time/rollout_s"] > 0
    assert stats["completions/mean_length"] == pytest.approx(sum(len(c) for c in completions) / 6)
    html = (tmp_path / "rollouts.html").read_text()
    assert html.count("<h3>step") == 3 and "step 5" in html and "reference</b>: red" in html

    # DAPO's dynamic sampling: exact match alone gives every group zero variance; nothing is left to train on
    dropping = objective_for(processor, family, group_size=2, drop_zero_variance_groups=True)
    (empty,) = dropping.prepare_window(_engine(model), window, step=0)
    assert empty["num_rollouts"] == 0 and empty["num_samples"] == 0 and empty["num_dummy_images"] == 1
    from vlmctl.data.collate import model_inputs

    micro = dropping.loss(SimpleNamespace(model=model, module=model, inputs=model_inputs), empty)
    assert micro.tokens == 0 and float(micro.loss.detach()) == 0.0 and dropping.metrics({}, 0.0)["frac_reward_zero_std"] == 1.0


def test_without_packing_the_rollouts_train_as_a_padded_micro_batch(built):
    """train.packing: false (or a family that cannot pack): each micro-batch's rollouts are one padded batch, rows
    in rollout order, as TRL pads them; the loss trains through it."""
    from vlmctl.data.collate import model_inputs
    from vlmctl.train.grpo import PromptCollator
    from vlmctl.train.objectives import check_batch

    model, processor, family = load(built)
    objective = objective_for(processor, family, group_size=2)
    objective.packed = False
    (row,) = objective.prepare_window(_engine(model), [PromptCollator()(samples())], step=0)
    assert "seq_lens" not in row and row["input_ids"].shape[0] == row["num_rollouts"] == 4
    assert row["attention_mask"].shape == row["input_ids"].shape and row["advantages"].shape == (4,)
    check_batch(objective, row)  # the keys the loop asks of the first window
    micro = objective.loss(SimpleNamespace(model=model, module=model, inputs=model_inputs), row)
    micro.loss.backward()
    assert micro.tokens == 4 and any(p.grad is not None for p in model.parameters())


def test_a_packed_row_without_rollouts_trains_as_zero_advantage_rollouts(built):
    """The GPU batch-size probe passes the training's packed SFT rows: they run forward and backward."""
    from vlmctl.data.collate import PackedCollator, model_inputs

    policy, processor, family = load(built)
    objective = objective_for(processor, family)
    row = PackedCollator(processor, family, tokens_per_batch=10**6)(samples())
    micro = objective.loss(SimpleNamespace(model=policy, module=policy, inputs=model_inputs), row)
    micro.loss.backward()
    assert micro.tokens == objective.label_tokens(row) == 2 and float(micro.loss.detach()) == 0.0
    assert any(p.grad is not None for p in policy.parameters())


def test_settings_grpo_cannot_train_are_refused_before_any_process_starts(tmp_path):
    from vlmctl.config import load_config
    from vlmctl.errors import ConfigError
    from vlmctl.train.registry import get_objective

    (tmp_path / "vlmctl.yaml").write_text("project: {name: g}\ndata: {prepared_dir: data}\nmodel: {preset: tiny}\n"
                                          "train: {objective: grpo}\n")
    # the config refuses them when it is read: the launcher reads it before it starts anything
    for override, message in {"train.eval_steps=5": "a grpo run has no validation loss",
                              "train.sequence_parallel=2": "set train.sequence_parallel: 1"}.items():
        with pytest.raises(ConfigError, match=message):
            load_config(tmp_path / "vlmctl.yaml", overrides=[override])
    # a reward that does not import: the launcher's preflight imports it
    cfg = load_config(tmp_path / "vlmctl.yaml", overrides=["train.grpo.rewards=[{name: 'nowhere_mod:fn'}]"])
    with pytest.raises(ConfigError, match=r"rewards\[0\].name"):
        get_objective("grpo").preflight(cfg)
    get_objective("grpo").preflight(load_config(tmp_path / "vlmctl.yaml"))  # the built-in reward passes


def test_a_failing_reward_stops_the_run_naming_it(built, tmp_path, monkeypatch):
    from vlmctl.config.objective import RewardSpec
    from vlmctl.errors import VlmctlError
    from vlmctl.train.grpo import PromptCollator

    (tmp_path / "flaky.py").write_text("def score(completions, references, **kwargs):\n    return {}['judge']\n"
                                       "def short(completions, references, **kwargs):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model, processor, family = load(built)
    for name, message in (("flaky:score", "flaky:score: it raised KeyError: 'judge'"), ("flaky:short", "flaky:short: .*returned 1 values for 4")):
        objective = objective_for(processor, family, rewards=[RewardSpec(name=name)], max_new_tokens=2)
        with pytest.raises(VlmctlError, match=message):
            objective.prepare_window(_engine(model), [PromptCollator()(samples())], step=0)


@pytest.mark.parametrize("aggregation,loss_type", [("sequence", "grpo"), ("token", "dapo")])
def test_reused_rollouts_use_the_generation_time_log_probs_as_trl_does(built, aggregation, loss_type):
    """num_iterations > 1: the old log-probs are the generating policy's, computed in the packed layout; after an
    update the ratio differs from 1, and the loss and clip ratios equal TRL's `_compute_loss` with
    `old_per_token_logps`."""
    from vlmctl.data.collate import model_inputs

    pytest.importorskip("trl")
    from test_grpo import trl_loss

    old_policy, processor, family = load(built, seed=2)  # the policy when the rollouts were generated
    policy = load(built, seed=1)[0]  # the policy after an update
    objective = objective_for(processor, family, aggregation=aggregation, epsilon_low=0.02, epsilon_high=0.03, num_iterations=2)
    row, rows = fixed_row(processor, family)
    row["old_logps"] = objective._old_logps(SimpleNamespace(model=old_policy, module=old_policy, inputs=model_inputs), row)
    old, mask = alone_logps(old_policy, rows)
    torch.testing.assert_close(row["old_logps"][:, :old.shape[1]] * mask, old.detach() * mask, **TOL)
    micro = objective.loss(SimpleNamespace(model=policy, module=policy, inputs=model_inputs), row)
    got = micro.loss / objective.label_tokens(row)
    logps, _ = alone_logps(policy, rows)
    kw = {"eps_low": 0.02, "eps_high": 0.03}
    expected, metrics = trl_loss(logps, old.detach(), row["advantages"], mask, loss_type=loss_type, **kw)
    torch.testing.assert_close(got.detach(), expected.detach(), **TOL)
    tokens = micro.metrics["completion_tokens"]
    for key in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert micro.metrics[key] / tokens == pytest.approx(float(metrics[key]), abs=1e-6), key
    assert micro.metrics["clip_ratio/region_mean"] > 0  # the clip acts once old != current


def test_the_buffered_generation_round_trips_through_a_weights_only_file(built, tmp_path):
    """num_iterations = 3: after the generation step and one reuse, `state_dict` (saved as a checkpoint saves it and
    read back weights-only) gives a fresh objective the rows, old log-probs, advantages and statistics the next reuse
    step trains on; once no reuse is left, nothing is kept."""
    from vlmctl.checkpoints import load_tensors
    from vlmctl.data.collate import model_inputs
    from vlmctl.train.grpo import PromptCollator

    model, processor, family = load(built)
    engine = _engine(model)
    engine.inputs = model_inputs
    objective = objective_for(processor, family, num_iterations=3, group_size=3, temperature=1.5)
    assert objective.state_dict() == {}  # nothing generated yet
    objective.prepare_window(engine, [PromptCollator()(samples())], step=0)
    assert objective.reuses_window(1)
    objective.prepare_window(engine, None, step=1)
    torch.save(objective.state_dict(), tmp_path / "objective-0.pt")
    expected = objective.prepare_window(engine, None, step=2)  # the uninterrupted run's last reuse step
    stats = objective.metrics({}, 0.0)
    assert objective.state_dict() == {}  # the next step generates: no buffer to keep

    resumed = objective_for(processor, family, num_iterations=3, group_size=3, temperature=1.5)
    resumed.load_state_dict(load_tensors(tmp_path / "objective-0.pt"))
    assert resumed.reuses_window(2)
    (got,), (row,) = resumed.prepare_window(engine, None, step=2), expected
    assert set(got) == set(row) and row["old_logps"].shape[0] == row["num_rollouts"] == 6
    for key, value in row.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key
    timing = ("time/train_s",)
    assert {k: v for k, v in resumed.metrics({}, 0.0).items() if k not in timing} == {k: v for k, v in stats.items() if k not in timing}
    assert resumed.state_dict() == {} and not resumed.reuses_window(3)
