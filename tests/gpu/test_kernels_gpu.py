"""GPU-only units, in-process on one GPU: varlen attention against sdpa with the segment mask (text, GQA, the
vision tower's windows), the CUDA RNG in checkpoints, CUDA-event step timing, GPU memory and FLOP figures, and the
device choices `auto` makes on a GPU.

Tolerances: bf16 attention outputs against sdpa in bf16: atol 2e-2 (the kernels accumulate in fp32 but round
their outputs to bf16, 8 bits of mantissa)."""

from __future__ import annotations

import pytest
import torch


def _segments_qkv(lengths, heads=4, kv_heads=2, dim=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, heads, total, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, kv_heads, total, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, kv_heads, total, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu


class _Causal(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_varlen_text_attention_equals_sdpa_with_the_segment_mask(heads, kv_heads):
    from vlmctl.distributed.sequence import segment_attention
    from vlmctl.train.kernels import varlen_attention_forward

    q, k, v, cu = _segments_qkv([37, 5, 200, 64], heads, kv_heads)
    got, _ = varlen_attention_forward(_Causal(), q, k, v, None, scaling=0.125, packed_cu_seqlens=cu, packed_max_seqlen=200)
    want, _ = segment_attention(_Causal(), q, k, v, None, scaling=0.125, packed_cu_seqlens=cu)
    assert got.shape == want.shape == (1, q.shape[2], heads, 64)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)


def test_varlen_attention_under_autocast_takes_fp32_inputs():
    # fp32 master weights without FSDP: rotary embeddings arrive in fp32 inside a bf16 autocast region
    from vlmctl.distributed.sequence import segment_attention
    from vlmctl.train.kernels import varlen_attention_forward

    q, k, v, cu = _segments_qkv([30, 70])
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, _ = varlen_attention_forward(_Causal(), q.float(), k.float(), v.float(), None, scaling=0.125, packed_cu_seqlens=cu)
    want, _ = segment_attention(_Causal(), q, k, v, None, scaling=0.125, packed_cu_seqlens=cu)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=0)


def test_qwen_vision_windows_through_varlen_equal_sdpa(built):
    from vlmctl.models import load_model
    from vlmctl.train.kernels import register_varlen_attention, set_attention, VARLEN_NAME

    model, processor, family = load_model(built / "tiny-qwen2.5-vl", dtype=torch.bfloat16)
    model = model.cuda().eval()
    grid = torch.tensor([[1, 8, 8], [1, 4, 12]], device="cuda")
    patch = model.config.vision_config
    width = patch.in_channels * patch.temporal_patch_size * patch.patch_size ** 2
    pixels = torch.randn(int(grid.prod(-1).sum()), width, device="cuda", dtype=torch.bfloat16)
    visual = model.model.visual
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = visual(pixels, grid_thw=grid).pooler_output.float()
        register_varlen_attention()
        set_attention(model, VARLEN_NAME, vision_varlen=family.vision_varlen)
        assert family.vision_varlen
        got = visual(pixels, grid_thw=grid).pooler_output.float()
    torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)


def test_a_restored_cuda_rng_state_draws_the_same_numbers():
    from vlmctl.train.checkpoint import rng_state, set_rng_state

    torch.cuda.manual_seed(3)
    state = rng_state()
    assert "cuda" in state
    first = torch.rand(1000, device="cuda")
    dropped = torch.nn.functional.dropout(torch.ones(1000, device="cuda"), 0.5)
    set_rng_state(state)
    assert torch.equal(torch.rand(1000, device="cuda"), first)
    assert torch.equal(torch.nn.functional.dropout(torch.ones(1000, device="cuda"), 0.5), dropped)


def test_cuda_event_step_timing_measures_the_device_work():
    import time

    from vlmctl.train.loop import StepTimer

    timer = StepTimer(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    host = time.perf_counter()
    start = timer.mark()
    for _ in range(50):
        a = (a @ a).clamp_(-1, 1)
    timer.span(start)
    measured = timer.compute_s()
    host = time.perf_counter() - host
    assert 0 < measured <= host * 1.05 and measured >= 0.5 * host


def test_gpu_figures_and_auto_choices():
    from vlmctl.config.train import TrainSection
    from vlmctl.distributed.fsdp import rank_memory_bytes
    from vlmctl.train.metrics import peak_flops
    from vlmctl.config.plan import DeviceFacts, build_plan

    device = torch.device("cuda", 0)
    assert peak_flops(device) and peak_flops(device) > 1e14, torch.cuda.get_device_name(device)
    assert rank_memory_bytes("cuda") == torch.cuda.get_device_properties(device).total_memory
    here = DeviceFacts.here()
    assert here.memory_bytes == torch.cuda.get_device_properties(device).total_memory
    assert build_plan(TrainSection(), here).precision.value == "bf16"
    assert build_plan(TrainSection(packing=True), here).attention.value == "varlen"
    assert build_plan(TrainSection(packing=True, precision="fp32"), here).attention.value == "sdpa"  # flash kernels: bf16
    assert here.gpus == torch.cuda.device_count()
    assert build_plan(TrainSection(), here).nproc_per_node.value == torch.cuda.device_count()


def test_the_allocator_gets_expandable_segments_even_after_cuda_started(monkeypatch):
    # a GPU query before the process group exists starts CUDA, after which the variable is no longer read
    from vlmctl.distributed.env import configure_cuda_allocator

    torch.zeros(1, device="cuda")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    configure_cuda_allocator()
    x = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    assert any(seg.get("is_expandable") for seg in torch.cuda.memory_snapshot())
    del x


def test_selective_checkpointing_keeps_the_varlen_attention_output():
    # `activation_checkpointing: op` and `keep_attention` recompute a layer's other work, not its attention kernel:
    # the packed rows' varlen kernel runs once per layer in forward and backward together (twice under full
    # checkpointing), and the gradients are the unchecked model's
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from vlmctl.distributed.checkpointing import apply_activation_checkpointing
    from vlmctl.train.kernels import VARLEN_NAME, register_varlen_attention, set_attention

    class Count(TorchDispatchMode):
        runs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.torch_attn._varlen_attn.default:
                Count.runs += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16).train()
    register_varlen_attention()
    set_attention(model, VARLEN_NAME)
    ids = (torch.arange(1, 97, device="cuda").view(1, 96) * 7) % 128
    grads, runs = {}, {}
    for mode in ("off", "full", "op", "keep_attention"):
        apply_activation_checkpointing([list(model.model.layers)], mode)
        model.zero_grad(set_to_none=True)
        Count.runs = 0
        with Count():
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        runs[mode], grads[mode] = Count.runs, [p.grad.float().clone() for p in model.parameters()]
    assert runs == {"off": 3, "full": 6, "op": 3, "keep_attention": 3}
    for mode in ("op", "keep_attention"):
        for got, want in zip(grads[mode], grads["off"]):
            torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_dynamic_blocks_do_not_recompile_for_fewer_rows():
    # `compile_layers`' dynamic compiles on a vision block's shape (1,280 wide): traced at 8,192 rows, then run at
    # 2,048. A plain dynamic compile guards on inductor's mix-order reduction checks (at least 4,096 rows) and
    # recompiles; with `dynamic_compile_options` nothing is guarded on them.
    from types import SimpleNamespace

    import torch._dynamo

    from vlmctl.distributed.parallelize import compile_layers

    class Block(torch.nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.norm = torch.nn.RMSNorm(width, eps=1e-6)
            self.proj = torch.nn.Linear(width, width)

        def forward(self, x):
            return x + self.proj(self.norm(x))

    def recompiles(block) -> list[str]:
        torch._dynamo.reset()
        reasons = []
        for rows in (8192, 2048, 8192):
            x = torch.randn(rows, 1280, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            with torch._dynamo.config.patch(error_on_recompile=True):
                try:
                    block(x).float().square().mean().backward()
                except torch._dynamo.exc.RecompileError as exc:
                    reasons.append(str(exc))
        return reasons

    torch.manual_seed(0)
    plain = Block(1280).to("cuda", torch.bfloat16)
    plain.compile(dynamic=True)
    assert recompiles(plain), "a plain dynamic compile did not recompile: this torch has no such guard to show"
    block = Block(1280).to("cuda", torch.bfloat16)
    compile_layers(SimpleNamespace(decoder_layers=[], vision_layers=[block]),
                   SimpleNamespace(compile="off", packing=True, compile_vision="blocks"))
    assert recompiles(block) == []


def test_the_fused_loss_compiles_in_no_step_after_its_warm_up():
    # liger's cross-entropy kernel takes the count of labelled tokens as a plain int and the labels as a pointer, and
    # Triton compiles it once per class of each (1, a multiple of 16, any other; aligned to 16 bytes or not). Called
    # as liger's patched forwards call it (labels shifted by liger, so they start 8 bytes into their buffer), after
    # `warm_fused_loss` no count compiles it again.
    pytest.importorskip("liger_kernel")
    from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel
    from liger_kernel.transformers.model.loss_utils import LigerForCausalLMLoss

    from vlmctl.train.kernels import warm_fused_loss

    def variants() -> int:
        caches = getattr(liger_cross_entropy_kernel, "device_caches", None)
        if caches is None:
            pytest.skip("this Triton keeps its compiled kernels elsewhere")
        return sum(len(entry[0]) for entry in caches.values())

    vocab, width, tokens = 3080, 64, 300  # a vocabulary no other test compiles the kernel for

    def loss(count: int, dtype) -> None:
        hidden = torch.randn(1, tokens, width, device="cuda", dtype=dtype, requires_grad=True)
        weight = torch.randn(vocab, width, device="cuda", dtype=dtype)
        labels = torch.randint(0, vocab, (1, tokens), device="cuda")
        labels[:, count + 1:] = -100  # shifted by one: `count` labelled tokens
        LigerForCausalLMLoss(hidden_states=hidden, lm_head_weight=weight, labels=labels, hidden_size=width,
                             num_items_in_batch=1)

    before = variants()
    loss(100, torch.float16)  # a dtype no warm-up met: the kernel compiles, so the count sees compiles
    assert variants() > before
    warm_fused_loss(vocab, torch.bfloat16, "cuda")
    warmed = variants()
    for count in (1, 2, 16, 48, 100, 255, 256, 299):
        loss(count, torch.bfloat16)
    assert variants() == warmed
