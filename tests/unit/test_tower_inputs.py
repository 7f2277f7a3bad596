"""`vlmctl.train.tower_inputs`: a Qwen-VL vision tower's grid-derived inputs computed on the host by the batch hook,
staged by the engine and handed to the tower's forward by its pre-hook, give the loss and gradients the tower gives
computing them itself; inputs staged for another batch are not used; they never reach the model as inputs."""

from __future__ import annotations

import pytest
import torch

from convert_helpers import TEXTS


def _png(w: int, h: int, color) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, "PNG")
    return buf.getvalue()


def _setup(name: str):
    from vlmctl.config import ModelSection
    from vlmctl.data.collate import PackedCollator
    from vlmctl.data.sample import Sample
    from vlmctl.families import get_family
    from vlmctl.models.build import make_model, make_processor, plan_build

    spec = get_family(name)
    plan = plan_build(ModelSection(preset=spec.tiny_preset, init="random", dtype="fp32"))
    processor = make_processor(plan, tokenizer_texts=TEXTS)
    torch.manual_seed(0)
    model = make_model(plan, processor).train()

    def sample(i: int, sizes) -> Sample:
        user = [{"type": "image", "index": k} for k in range(len(sizes))] + [{"type": "text", "text": "What color?"}]
        return Sample(id=str(i), images=[_png(w, h, (60 * i % 255, 100, 200)) for w, h in sizes], messages=[
            {"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": "red"}]}])

    collate = PackedCollator(processor, spec, tokens_per_batch=4096)
    hook = spec.position_hook(model, processor.tokenizer.convert_tokens_to_ids(spec.image_token))
    batches = [hook(collate([sample(0, [(64, 64)]), sample(1, [(100, 60), (37, 211)])])),
               hook(collate([sample(2, [(120, 90)])]))]
    return spec, model, batches


class Recorder:
    """A second pre-hook on the tower (after the one under test): the keyword arguments each forward got."""

    def __init__(self, tower):
        self.calls = []
        self.handle = tower.register_forward_pre_hook(lambda m, a, kw: self.calls.append(sorted(kw)), with_kwargs=True)


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen2_vl"])
def test_precomputed_tower_inputs_give_the_towers_own_loss_and_gradients(name):
    from vlmctl.data.collate import model_inputs
    from vlmctl.distributed.engine import TorchEngine
    from vlmctl.train.objectives import loss_sum
    from vlmctl.train.tower_inputs import KEY, install_tower_inputs, stage

    spec, model, batches = _setup(name)
    engine = TorchEngine(model, torch.optim.SGD(model.parameters(), lr=0.0), None, max_grad_norm=0.0, device=torch.device("cpu"))
    tower = model.model.visual

    def loss_and_grads(batch):
        model.zero_grad(set_to_none=True)
        loss = loss_sum(model, batch, inputs=engine.inputs(batch))
        loss.backward()
        return float(loss.detach()), [p.grad.clone() for p in tower.parameters() if p.grad is not None]

    want = [loss_and_grads(b) for b in batches]  # no hook yet: the tower computes its inputs itself
    [hooked] = install_tower_inputs(model, spec)
    recorder = Recorder(tower)
    try:
        prepared = [hooked.prepare(b) for b in batches]
        for batch in prepared:
            inputs = batch[KEY]
            assert {"position_ids", "cu_seqlens", "max_seqlen"} <= set(inputs) and KEY not in model_inputs(batch)
            assert all(v.device.type == "cpu" for v in inputs.values() if torch.is_tensor(v))
            assert inputs["position_ids"].shape[0] == batch["pixel_values"].shape[0]  # one row per patch
        got = [loss_and_grads(b) for b in prepared]
        assert all("position_ids" in kw and "cu_seqlens" in kw for kw in recorder.calls)  # the tower got them
        for (loss, grads), (want_loss, want_grads) in zip(got, want):
            assert loss == want_loss and all(torch.equal(a, b) for a, b in zip(grads, want_grads))

        # staged for the first batch, a forward of the second (other patches) gets none of them
        recorder.calls.clear()
        stage(prepared[0])
        with torch.no_grad():
            loss = float(loss_sum(model, batches[1], inputs=model_inputs(batches[1])))
        assert len(recorder.calls) == 1 and not {"position_ids", "cu_seqlens"} & set(recorder.calls[0])
        assert loss == want[1][0]
    finally:
        recorder.handle.remove()
        hooked.remove()


def test_a_batch_without_images_is_left_as_it_is_and_clears_what_was_staged():
    from vlmctl.train import tower_inputs

    spec, model, batches = _setup("qwen2_5_vl")
    [hooked] = tower_inputs.install_tower_inputs(model, spec)
    try:
        text_only = {k: v for k, v in batches[0].items() if k not in ("pixel_values", "image_grid_thw")}
        assert hooked.prepare(text_only) is text_only
        tower_inputs.stage(hooked.prepare(batches[0]))
        tower_inputs.stage(text_only)
        assert tower_inputs._STAGED[0] is None
    finally:
        hooked.remove()


def test_to_device_and_pinning_reach_the_nested_tower_inputs():
    from vlmctl.train.loop import to_device

    batch = {"input_ids": torch.ones(1, 3, dtype=torch.long), "vision_tower_inputs": {"cu_seqlens": torch.arange(3), "max_seqlen": 2}}
    moved = to_device(batch, torch.device("cpu"))
    assert torch.equal(moved["vision_tower_inputs"]["cu_seqlens"], torch.arange(3)) and moved["vision_tower_inputs"]["max_seqlen"] == 2
