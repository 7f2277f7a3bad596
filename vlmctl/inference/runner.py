"""The decoding engine's model runner: prefill one prompt into a cache slot, then decode every active slot one token
per step, with the step's shapes fixed per (batch, length) bucket so that on a GPU it is captured once in a CUDA graph
and replayed.

    runner = ModelRunner(model, family, slots=32, max_len=4096)
    first = runner.prefill(inputs, [0])         # processor outputs of prompts -> their logits and next positions
    runner.admit_rows([0], [token], first.positions, [length], **params_rows)
    tokens = runner.step()                      # one token per slot [slots]; only admitted slots are meaningful

**Prefill** runs the model's own forward (`model(**inputs)`), so each family computes its visual / audio features,
merges them into the prompt's embeddings and derives its position ids (Qwen's multimodal RoPE) exactly as in
training and `generate` (where that merge would wait on the device, the engine gives the forward the merged
embeddings instead: `vlmctl.inference.features`); a forward pre-hook on the language model catches the arguments
it is called with (`inputs_embeds`, `position_ids`, `attention_mask`, family extras) and stops the call there. The
runner then calls the language model itself on those arguments with the slot cache (`kv_cache.SlotCache`), in
chunks of `prefill_chunk` tokens for a long prompt whose arguments are all sequence-aligned, so the encoders run once
per request and a long prompt never holds more than one chunk's activations. The next position a row decodes at is
one past the largest prefill position (for multimodal RoPE the largest of the three sections: what transformers'
`rope_deltas` encode).

**Decode** runs, for B rows (a power-of-two bucket covering every active slot) and L cached positions (a bucket
covering the longest row): the input embeddings of each row's last token, the language model with per-row
position ids, an explicit [B, 1, 1, L] mask (each row attends to its own positions; sliding-window layers to the
last `sliding_window` of them) and the slot cache, the LM head on the last hidden state, then `sampling.sample`
with each row's own parameters; the new tokens become the next step's inputs and the counters advance, all on the
device. Every input lives in a preallocated buffer, so the whole step is one CUDA graph per bucket
(`torch.cuda.CUDAGraph`): one launch instead of hundreds of kernels per token. Families and models whose step
cannot be captured decode eagerly; `mode` and `reason` say which and why. On the CPU the same code runs eagerly.

Logits are softcapped where the language model's config asks for it (`final_logit_softcapping`, Gemma), as the
family's own forward does.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, NamedTuple

from vlmctl.errors import ModelError
from vlmctl.inference.inputs import to_device
from vlmctl.inference.kv_cache import SlotCache

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.

_CACHE_KEYS = ("past_key_values", "cache", "use_cache", "cache_position", "return_dict", "output_attentions",
               "output_hidden_states")
MIN_LENGTH_BUCKET = 128
PREFILL_MIN_BUCKET = 32
PREFILL_GRAPH_TOKENS = 4096
"""The most tokens (rows x length, bucketed) a prefill replays from a CUDA graph: past it the GPU's work outweighs
the host's launches, and each graph keeps its own activations."""
PREFILL_CAPTURE_AT = 2
"""The use of a prefill bucket at which its graph is captured (the uses before run padded, eagerly): a capture costs
about three prefills, which a shape seen once never pays back (a batch job's last, partial batch)."""


class _Captured(Exception):
    """Raised by the language model's pre-hook once its arguments are caught (the rest of the forward is skipped)."""


class Prefilled(NamedTuple):
    """What `ModelRunner.prefill` returns per row: `logits` [B, V] float32 of its last token, `positions` (the
    position its next token takes), `first` (its first cache index: padding before it), `ends` (one past its last
    token: where decoding writes next) and `tokens` (its prompt length)."""

    logits: "torch.Tensor"
    positions: list[float]
    first: list[int]
    ends: list[int]
    tokens: list[int]


def bucket(n: int, cap: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, `floor`), at most `cap` (`cap` itself when over)."""
    size = max(int(floor), 1)
    while size < n:
        size *= 2
    return min(size, int(cap))


DECODE_ATTENTION = "vlmctl_decode"
"""The attention implementation the language model uses during decode steps (`decode_attention`)."""


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     softcap: float | None = None, **kwargs):
    """transformers attention function for one new token per row over its cached keys: query [B, H, 1, D], key and
    value [B, H_kv, L, D] (grouped-query heads: H = G x H_kv), and the decode mask `decode_mask` made: additive,
    in the model's dtype, [B x H_kv, 1, 1, L] (0 attends, -inf not).

    The G query heads of each key/value head attend as one [G, D] x [D, L] product, so the cache is read once per
    key/value head rather than copied G times (`repeat_kv`, which transformers' sdpa path does whenever a mask is
    given); the scale and the mask ride on the product (`baddbmm`), the softmax accumulates in float32, and the output
    comes back already in the [B, 1, H, D] layout the attention module reshapes, so a layer's attention is three
    kernels. Returns (output [B, 1, H, D], None). A query of more than one token (a prefill chunk) goes to
    transformers' sdpa function as it is.
    """
    import torch

    batch, heads, q_len, dim = query.shape
    if q_len != 1:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    kv_heads, length = key.shape[1], key.shape[2]
    groups = batch * kv_heads
    q = query.reshape(groups, heads // kv_heads, dim)
    k = key.reshape(groups, length, dim)  # [B, H_kv] merge into one strided batch dimension: a view of the cache
    scale = scaling if scaling is not None else dim ** -0.5
    mask = attention_mask.reshape(groups, 1, -1)[..., :length].to(q.dtype)
    if softcap:
        scores = torch.bmm(q, k.transpose(1, 2)).float() * scale
        scores = torch.tanh(scores / softcap) * softcap + mask.float()
    else:
        scores = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scale)
    # a 16-bit softmax accumulates in float32 and rounds once, as float32 then a cast would: one kernel fewer
    probs = torch.softmax(scores, dim=-1)
    if probs.dtype != value.dtype:
        probs = probs.to(value.dtype)
    out = torch.bmm(probs, value.reshape(groups, length, value.shape[-1]))  # [B x H_kv, G, D]
    return out.view(batch, 1, heads, value.shape[-1]), None


def register_decode_attention() -> None:
    """Register `DECODE_ATTENTION` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(DECODE_ATTENTION, decode_attention)
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)
    except ImportError:  # the engine passes its own masks; the name only has to be known
        pass


class ModelRunner:
    """Prefill and decode steps over a `SlotCache` of `slots` rows x `max_len` positions (module docstring).

    `model`: a loaded `*ForConditionalGeneration` (or any wrapper that keeps its modules: peft), in eval mode.
    `graphs`: capture each decode bucket in a CUDA graph (None: on CUDA devices). `kernels`: fewer kernels per
    decoder layer, which is what a decode step's time is made of: `"liger"` (liger-kernel's fused RMSNorm, RoPE and
    SwiGLU, patched into the model as training patches them), `"compile"` (each decoder layer through
    torch.compile, one compiled code for all layers; slower to start), `"none"`, or None (liger on CUDA where it is
    installed and has the family, else none). `prefill_chunk`: the longest piece of a prompt one prefill
    forward takes (tokens). `suppress`: token ids never sampled. `fuse`: the language model's query/key/value and
    gate/up projections each run as one product while decoding (`fused.fuse_projections`; `fused` counts the groups;
    not with compiled layers). `prefill_graphs`: a prefill of at most `PREFILL_GRAPH_TOKENS` (rows x length, both
    bucketed) whose language model takes only embeddings, positions and a padding mask runs padded to its bucket,
    replayed from a CUDA graph on CUDA devices (None: when `graphs`; True on a CPU pads without graphs, for tests):
    a short prompt's prefill is otherwise mostly the host launching some 25 kernels per layer; a bucket is captured
    at its second use (`PREFILL_CAPTURE_AT`), so a one-off shape costs no capture. `encoder_graphs`: the vision
    towers that take their grid-derived inputs precomputed (`EncoderSpec.graph_inputs`: Qwen2-VL, Qwen2.5-VL) run
    from a CUDA graph per image-grid layout (`vlmctl.inference.encoder_graphs`; None: when `graphs`). `merge`:
    where the model's forward would read values back from the device to merge its visual features (Qwen2-VL,
    Qwen2.5-VL), the engine merges them itself (`vlmctl.inference.features`; `merged_prefills` counts the prefills).
    Raises ModelError when the family's language model
    or LM head is not found on `model`.
    """

    def __init__(self, model, family, *, slots: int, max_len: int, graphs: bool | None = None, kernels: str | None = None,
                 prefill_chunk: int = 4096, suppress: tuple[int, ...] = (), fuse: bool = True,
                 prefill_graphs: bool | None = None, encoder_graphs: bool | None = None):
        import torch

        from vlmctl.inference.fused import GROUPS, fuse_projections

        from vlmctl.families.spec import _find_prefix

        self.model, self.family = model, family
        self.lm = model.get_submodule(_find_prefix(model, family.language_model))
        self.head = model.get_submodule(_find_prefix(model, family.lm_head))
        self.embed = model.get_input_embeddings()
        config = model.config
        self.text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.softcap = getattr(self.text_config, "final_logit_softcapping", None)
        self._lm_signature = inspect.signature(self.lm.forward)  # what `_capture` binds the caught arguments to
        params = self._lm_signature.parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.device = next(model.parameters()).device
        self.slots, self.max_len, self.prefill_chunk = int(slots), int(max_len), int(prefill_chunk)
        # one slot more than rows are decoded in: the padded rows of a graphed prefill write there (never attended)
        self.scratch = self.slots
        self.cache = SlotCache(self.slots + 1, self.max_len)
        self.windows = self._windows()
        heads = getattr(self.text_config, "num_attention_heads", 1) or 1
        self.kv_heads = int(getattr(self.text_config, "num_key_value_heads", None) or heads)
        self.vocab = int(self.head.weight.shape[0])
        dev, n = self.device, self.slots
        # the step's buffers: inputs and per-row parameters, written by the host between steps, read by the graph
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.write_pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.first = torch.zeros(n, dtype=torch.long, device=dev)  # first cache index of each row (padding before)
        self.active = torch.zeros(n, dtype=torch.bool, device=dev)
        self.temperature = torch.zeros(n, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(n, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(n, dtype=torch.long, device=dev)
        self.penalty = torch.ones(n, dtype=torch.float32, device=dev)
        self.seeds = torch.zeros(n, dtype=torch.long, device=dev)
        self.steps = torch.zeros(n, dtype=torch.long, device=dev)
        self.seen = torch.zeros(n, self.vocab, dtype=torch.bool, device=dev)
        self.next_tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.logits = torch.zeros(n, self.vocab, dtype=torch.float32, device=dev)
        self.key_range = torch.arange(self.max_len, device=dev)
        self.suppress = None
        if suppress:
            self.suppress = torch.zeros(self.vocab, dtype=torch.bool, device=dev)
            self.suppress[[i for i in suppress if 0 <= i < self.vocab]] = True
        on_cuda = dev.type == "cuda"
        self.use_graphs = on_cuda if graphs is None else bool(graphs) and on_cuda
        # short prefills run padded to a (rows, length) bucket, each bucket one CUDA graph (`_prefill_padded`)
        self.pad_prefill = self.use_graphs if prefill_graphs is None else bool(prefill_graphs)
        self._prefill_buffers: dict[tuple, dict[str, Any]] = {}
        self.prefill_graphs = 0  # prefills replayed from a graph
        self.padded_prefills = 0  # prefills run padded to a bucket (replayed or, off CUDA, eager)
        self.rope_routed: list[str] = []  # modeling modules whose RoPE now runs as liger's one kernel (`route_rope`)
        self.kernels = self._apply_kernels(kernels)
        # liger's SwiGLU copies strided inputs into contiguous ones: a gate/up slice would cost more than it saves;
        # compiled layers fuse what they trace themselves (and would guard on the groups' Python state)
        groups = GROUPS[:1] if self.kernels == "liger" else GROUPS
        self.fused = fuse_projections(self.lm, groups) if fuse and self.kernels != "compile" else 0
        register_decode_attention()
        self.encoders_varlen = encoder_varlen(model, family, self.device)
        self._graphs: dict[tuple, Any] = {}
        self._pool = None
        # the vision towers' forwards replayed from CUDA graphs, per image-grid layout (`encoder_graphs`)
        from vlmctl.inference.encoder_graphs import install_encoder_graphs

        self.encoder_graphs = install_encoder_graphs(model, family, self._capture_run,
                                                     self.use_graphs and (encoder_graphs is None or bool(encoder_graphs)))
        # the visual features merged by the engine, without the forward's reads from the device (`features`)
        from vlmctl.inference.features import merge_for

        self.merge = merge_for(model, family)
        self.merged_prefills = 0  # prefills whose features `merge` merged
        self.mode = "cuda-graphs" if self.use_graphs else "eager"
        self.reason = "" if self.use_graphs else ("not a CUDA device" if not on_cuda else "CUDA graphs turned off")
        self.captures = 0
        self.prefill_reason = ""

    # ---- masks

    def _windows(self) -> dict[str, int | None] | int | None:
        """How the language model masks its layers: None (every layer causal), an int (every layer a sliding window
        of that many positions) or {layer type: window or None} for models with both kinds (`config.layer_types`)."""
        tc = self.text_config
        window = getattr(tc, "sliding_window", None)
        types = getattr(tc, "layer_types", None)
        if types is not None:
            kinds = set(types)
            if window and "sliding_attention" in kinds:
                return {kind: (window if kind == "sliding_attention" else None) for kind in kinds}
            return None
        if window and getattr(tc, "use_sliding_window", True):
            return int(window)
        return None

    def _mask(self, allowed_fn):
        """The attention mask(s) for the language model from `allowed_fn(window) -> bool tensor`: one tensor, or a
        dict per layer type; bool for sdpa, additive (0 / dtype min) for the eager implementation."""
        import torch

        impl = getattr(self.text_config, "_attn_implementation", None) or "sdpa"

        def convert(allowed):
            if impl != "eager":
                return allowed
            dtype = self.embed.weight.dtype
            return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)

        if isinstance(self.windows, dict):
            return {kind: convert(allowed_fn(w)) for kind, w in self.windows.items()}
        return convert(allowed_fn(self.windows))

    def _prefill_mask(self, captured, start: int, end: int, valid: "torch.Tensor"):
        """The mask of prompt chunk [start, end) ([B, 1, end - start, end]): the model's own 4D mask(s) sliced where
        it built one (bidirectional image tokens, Gemma 3), else causal over each row's tokens (`valid` [B, T] bool,
        False on padding, on either side), with each layer's window. A padding position attends to itself only, so
        no row of the softmax is empty (its output is never read)."""
        import torch

        if isinstance(captured, dict):
            return {k: v[:, :, start:end, :end] for k, v in captured.items()}
        if captured is not None and hasattr(captured, "ndim") and captured.ndim == 4:
            return captured[:, :, start:end, :end]
        q = torch.arange(start, end, device=self.device)[None, :, None]
        k = torch.arange(end, device=self.device)[None, None, :]
        keys = valid[:, None, :end] | (k == q)

        def allowed(window):
            m = (k <= q) & keys
            if window:
                m = m & (k > q - window)
            return m[:, None]

        return self._mask(allowed)

    def _decode_mask(self, write_pos: "torch.Tensor", key_range: "torch.Tensor"):
        """The decode step's mask(s) in `decode_attention`'s layout: additive, in the model's dtype, [B x H_kv, 1, 1, L], 0 where row b
        attends (its positions up to write_pos[b], within the layer's window), -inf elsewhere; one per layer type
        where the model has several."""
        import torch

        k, q = key_range[None, :], write_pos[:, None]
        kv_heads = self.kv_heads
        dtype = self.embed.weight.dtype  # the queries' dtype: `decode_attention` adds it to the scores without a cast
        first = self.first[: write_pos.shape[0], None]

        def additive(window):
            allowed = (k <= q) & (k >= first)
            if window:
                allowed = allowed & (k > q - window)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))
            return mask.repeat_interleave(kv_heads, dim=0)[:, None, None, :]  # 4D (transformers passes it as it is)

        if isinstance(self.windows, dict):
            return {kind: additive(w) for kind, w in self.windows.items()}
        return additive(self.windows)

    # ---- prefill

    def _capture(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """The keyword arguments the model's forward calls its language model with for `inputs` (module docstring)."""
        caught: dict[str, Any] = {}
        signature = self._lm_signature

        def hook(module, args, kwargs):
            caught.update(signature.bind_partial(*args, **kwargs).arguments)
            extra = caught.pop("kwargs", None)  # a **kwargs parameter binds as one dict
            if isinstance(extra, dict):
                caught.update(extra)
            raise _Captured

        handle = self.lm.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            self.model(**inputs, use_cache=False)
        except _Captured:
            pass
        finally:
            handle.remove()
        if not caught:
            raise ModelError(f"{type(self.model).__name__}'s forward never called its language model ({self.family.language_model})",
                             hint="check model.family matches the checkpoint")
        return caught

    def prefill(self, inputs: dict[str, Any], slots: list[int], host: dict[str, Any] | None = None) -> "Prefilled":
        """Run a batch of prompts (`inputs`: processor outputs of B rows, padded on either side as the processor
        pads, on the model's device) into `slots` (one per row, in order). Each row keeps the cache positions of its
        padded row: its tokens sit where the processor put them, the padding before them is never attended to
        (`admit_rows`'s `first`), and decoding writes from just after its last token. `host`: the same tensors on the
        host where the caller has them (`attention_mask`, and `position_ids` where it computed them,
        `FamilySpec.prompt_positions`): each row's extent and next position are then read from them, so nothing
        waits for the device before the language model's forward is launched.

        Returns a `Prefilled`: logits of each row's last token [B, V] float32, the position each row's next token
        takes (an int, or a float for a family with fractional positions), each row's first and next cache index,
        and its prompt length in tokens. Raises ValueError when a row does not fit the cache.
        """
        import torch

        host = host or {}
        for graphs in self.encoder_graphs.values():  # the pictures' grids as the host has them: read without a wait
            for key in ("image_grid_thw", "video_grid_thw"):
                if inputs.get(key) is not None and host.get(key) is not None and tuple(host[key].shape) == tuple(inputs[key].shape):
                    graphs.hint(inputs[key], host[key])
        try:
            merged = self.merge(inputs, host) if self.merge is not None else None
            if merged is not None:
                self.merged_prefills += 1
            kw = self._capture(merged if merged is not None else inputs)
        finally:
            for graphs in self.encoder_graphs.values():
                graphs.hints.clear()
        embeds, ids = kw.pop("inputs_embeds", None), kw.pop("input_ids", None)
        seq = embeds if embeds is not None else ids
        rows, width = int(seq.shape[0]), int(seq.shape[1])
        if width > self.max_len:
            raise ValueError(f"a prompt of {width} tokens does not fit the cache's {self.max_len} positions")
        pad = inputs.get("attention_mask")
        valid = pad.bool() if pad is not None and pad.ndim == 2 else torch.ones(rows, width, dtype=torch.bool, device=self.device)
        host_pad = host.get("attention_mask")
        if host_pad is not None and tuple(host_pad.shape) == (rows, width) and pad is not None and pad.ndim == 2:
            host_valid = host_pad.bool()
        else:
            host_valid = None if pad is not None else torch.ones(rows, width, dtype=torch.bool)
        on_host = host_valid if host_valid is not None else valid
        index = torch.arange(width, device=on_host.device)
        first = torch.where(on_host, index, width).amin(dim=1)
        last = torch.where(on_host, index, -1).amax(dim=1)
        first_list, ends, tokens = first.tolist(), last.tolist(), on_host.sum(dim=1).tolist()
        positions = kw.pop("position_ids", None)
        host_positions = host.get("position_ids")
        if positions is None:  # what generate derives for padded rows: each row's tokens count from 0
            positions = (valid.long().cumsum(dim=1) - 1).clamp_min(0)
            host_positions = (on_host.long().cumsum(dim=1) - 1).clamp_min(0) if host_valid is not None else None
        elif host_positions is not None and tuple(host_positions.shape) != tuple(positions.shape):
            host_positions = None
        mask = kw.pop("attention_mask", None)
        for key in _CACHE_KEYS:
            kw.pop(key, None)
        if host_positions is not None and host_valid is not None:
            next_positions = self._next_positions(host_positions, host_valid)
        else:
            next_positions = self._next_positions(positions, valid)
        slot_index = to_device(torch.tensor(slots), self.device)
        key = self._prefill_key(embeds, positions, mask, kw, rows, width)
        if key is not None:
            logits = self._prefill_padded(key, embeds, positions, valid, slot_index, to_device(last, self.device))
            if logits is not None:
                return Prefilled(logits, next_positions, first_list, [i + 1 for i in ends], tokens)
        # a prompt is cut into chunks only when every argument is sequence-aligned (embeddings, positions, mask)
        step = self.prefill_chunk if (embeds is not None and not kw) else width
        logits = torch.empty(rows, self.vocab, dtype=torch.float32, device=self.device)
        for start in range(0, width, max(step, 1)):
            end = min(start + step, width)
            self.cache.prefill(slot_index, start)
            piece = {"inputs_embeds": embeds[:, start:end]} if embeds is not None else {"input_ids": ids}
            out = self.lm(**piece, position_ids=positions[..., start:end], attention_mask=self._prefill_mask(mask, start, end, valid),
                          use_cache=True, **{self.cache_arg: self.cache}, **kw)
            done = [(b, i - start) for b, i in enumerate(ends) if start <= i < end]
            if done:
                rows_done = to_device(torch.tensor([b for b, _ in done]), self.device)
                hidden = out[0][rows_done, to_device(torch.tensor([i for _, i in done]), self.device)]
                logits[rows_done] = self._head(hidden)
        return Prefilled(logits, next_positions, first_list, [i + 1 for i in ends], tokens)

    def _prefill_key(self, embeds, positions, mask, kw: dict, rows: int, width: int) -> tuple | None:
        """The (rows, length) bucket a prefill runs padded in, or None when it runs as it is: padding off, family
        extras for the language model, a mask the model built itself, fractional positions, or more than
        `PREFILL_GRAPH_TOKENS` once bucketed."""
        if not self.pad_prefill or embeds is None or kw or positions.is_floating_point() or width > self.prefill_chunk:
            return None
        if mask is not None and not (hasattr(mask, "ndim") and mask.ndim == 2):
            return None
        b = bucket(rows, self.slots)
        t = bucket(width, min(self.max_len, self.prefill_chunk), PREFILL_MIN_BUCKET)
        if b * t > PREFILL_GRAPH_TOKENS or b < rows or t < width:
            return None
        return ("prefill", b, t, tuple(positions.shape[:-2]), embeds.dtype)

    def _prefill_padded(self, key: tuple, embeds, positions, valid, slot_index, last) -> "torch.Tensor | None":
        """Prefill `rows` prompts padded to bucket `key` = (_, B, T, position sections, dtype): the rows past
        `rows` write the scratch slot, the positions past each prompt attend to themselves only (and are written
        again before a decode step reads them). On CUDA the bucket is one graph, captured at its use number
        `PREFILL_CAPTURE_AT` (the uses before run eagerly). Returns
        the logits of each row's last token [rows, V] float32, or None (the graph could not be captured: `reason`
        says why; the prefill then runs as it is)."""
        import torch

        rows, width = int(embeds.shape[0]), int(embeds.shape[1])
        _, b, t, sections, dtype = key
        buf = self._prefill_buffers.get(key)
        if buf is None:
            dev = self.device
            buf = self._prefill_buffers[key] = {
                "embeds": torch.zeros(b, t, embeds.shape[2], dtype=dtype, device=dev),
                "positions": torch.zeros(*sections, b, t, dtype=positions.dtype, device=dev),
                "valid": torch.zeros(b, t, dtype=torch.bool, device=dev),
                "slots": torch.full((b,), self.scratch, dtype=torch.long, device=dev),
                "last": torch.zeros(b, dtype=torch.long, device=dev),
                "logits": torch.zeros(b, self.vocab, dtype=torch.float32, device=dev),
            }
        buf["embeds"][:rows, :width].copy_(embeds)
        buf["positions"][..., :rows, :width].copy_(positions)
        buf["valid"].zero_()
        buf["valid"][:rows, :width].copy_(valid)
        buf["slots"].fill_(self.scratch)
        buf["slots"][:rows].copy_(slot_index)
        buf["last"].zero_()
        buf["last"][:rows].copy_(last)
        self.padded_prefills += 1
        graph = self._graphs.get(key)
        uses = buf["uses"] = buf.get("uses", 0) + 1
        if not self.use_graphs or (graph is None and uses < PREFILL_CAPTURE_AT):
            self._prefill_step(buf)
            return buf["logits"][:rows].clone()
        if graph is None:
            graph = self._capture_prefill(key, buf)
            if graph is None:
                return None
        graph.replay()
        self.prefill_graphs += 1
        return buf["logits"][:rows].clone()

    def _prefill_step(self, buf: dict[str, Any]) -> None:
        """One padded prefill over the buffers of its bucket: every device op, no host synchronization."""
        import torch

        b, t = buf["valid"].shape
        self.cache.prefill(buf["slots"], 0)
        out = self.lm(inputs_embeds=buf["embeds"], position_ids=buf["positions"],
                      attention_mask=self._prefill_mask(None, 0, t, buf["valid"]), use_cache=True, **{self.cache_arg: self.cache})
        hidden = out[0][torch.arange(b, device=self.device), buf["last"]]
        buf["logits"].copy_(self._head(hidden))

    def _capture_prefill(self, key: tuple, buf: dict[str, Any]):
        """Capture the padded prefill of bucket `key` in a CUDA graph after two warm-up runs (which already leave
        this prefill's keys, values and logits in place: the same work); None after a failure, with prefill graphs
        off from then on and `reason` saying why."""
        try:
            return self._record(key, lambda: self._prefill_step(buf))
        except Exception as exc:  # noqa: BLE001 - a prefill that cannot be captured runs eagerly, and says why
            self.pad_prefill = False
            self.prefill_reason = f"prefill graph capture failed: {type(exc).__name__}: {str(exc)[:200]}"
            return None

    def _record(self, key: tuple, run):
        """Capture `run()` in a CUDA graph (`_capture_run`) and keep it under `key`. Capture errors propagate."""
        graph = self._capture_run(run)
        self._graphs[key] = graph
        self.captures += 1
        return graph

    def _capture_run(self, run):
        """Capture `run()` (device work only, its outputs copied into buffers allocated outside the capture, so the
        graphs sharing the runner's pool share only their intermediates) in a CUDA graph from the runner's pool,
        after two warm-up runs on a side stream (which also compile, when on). Capture errors propagate."""
        import torch

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                run()
        except BaseException:
            release_capturing_generator(self.device)
            raise
        return graph

    def _next_positions(self, positions: "torch.Tensor", valid: "torch.Tensor") -> list[float]:
        """One past each row's largest position among its valid tokens (positions [B, T], or [S, B, T] for
        multimodal RoPE; with four sections the first holds text positions and is left out)."""
        rope = positions[1:] if positions.ndim == 3 and positions.shape[0] == 4 else positions
        if rope.is_floating_point() and not self.positions.is_floating_point():
            # fractional positions (Qwen3-Omni's video timestamps): keep them exact; graphs of integer ones are stale
            self.positions = self.positions.to(rope.dtype)
            self._graphs.clear()
        import torch

        low = torch.finfo(rope.dtype).min if rope.is_floating_point() else torch.iinfo(rope.dtype).min
        top = rope.masked_fill(~valid, low).amax(dim=-1)
        top = top.amax(dim=0) if top.ndim == 2 else top
        return [v + 1 if rope.is_floating_point() else int(v) + 1 for v in top.tolist()]

    def _head(self, hidden: "torch.Tensor") -> "torch.Tensor":
        import torch

        logits = self.head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def grow(self, max_len: int) -> None:
        """Make room for `max_len` positions per slot: the cache is copied into larger buffers (rows in flight keep
        their keys) and the CUDA graphs, bound to the old buffers, are dropped (captured again on use)."""
        import torch

        if max_len <= self.max_len:
            return
        for layer in range(len(self.cache.keys)):
            for store in (self.cache.keys, self.cache.values):
                old = store[layer]
                new = torch.zeros(*old.shape[:2], max_len, old.shape[3], dtype=old.dtype, device=old.device)
                new[:, :, : self.max_len] = old
                store[layer] = new
        self.cache.max_len = self.max_len = int(max_len)
        self.key_range = torch.arange(self.max_len, device=self.device)
        self._graphs.clear()

    # ---- rows

    def admit_rows(self, slots: list[int], tokens: "list[int] | torch.Tensor", positions: list[float], lengths: list[int], *,
                   temperature: list[float], top_p: list[float], top_k: list[int], penalty: list[float], seeds: list[int],
                   steps: list[int], seen: list["torch.Tensor | None"], first: list[int]) -> None:
        """Make `slots` active, one list entry per slot, in order: its next input token at rope position, written at
        cache index `lengths`, with its sampling parameters and first `steps`; `seen`: the token ids the repetition
        penalty counts (prompt and first token) or None; `first`: its first cache index (the prefill's padding before
        it is never attended to). Each buffer is written with one copy from the host, not one small kernel per slot
        and value; `tokens` may be a tensor on the device [len(slots)] (first tokens the host has not read yet).
        Raises ValueError for a slot whose length leaves no position to write."""
        import torch

        for slot, length in zip(slots, lengths):
            if length >= self.max_len:
                raise ValueError(f"slot {slot} is full ({length} of {self.max_len} positions)")
        index = to_device(torch.tensor(slots, dtype=torch.long), self.device)
        for buf, values in ((self.tokens, tokens), (self.positions, positions), (self.write_pos, lengths), (self.first, first),
                            (self.temperature, temperature), (self.top_p, top_p), (self.top_k, top_k),
                            (self.penalty, penalty), (self.seeds, seeds), (self.steps, steps)):
            if isinstance(values, torch.Tensor):
                buf.index_copy_(0, index, values.to(self.device, buf.dtype))
                continue
            buf.index_copy_(0, index, to_device(torch.tensor(values, dtype=buf.dtype), self.device))
        self.seen.index_fill_(0, index, False)
        for slot, marks in zip(slots, seen):
            if marks is not None:
                self.seen[slot].index_fill_(0, to_device(marks, self.device), True)
        self.active.index_fill_(0, index, True)

    def release(self, slot: int) -> None:
        """Free `slot`: it decodes no more (its buffers stay in bounds for the rows beside it). Each buffer's entry is
        filled by a kernel taking the value as an argument: `buffer[slot] = 0` copies a host scalar and, on CUDA, waits
        for the decode step in flight."""
        for buf, value in ((self.active, False), (self.write_pos, 0), (self.first, 0), (self.positions, 0)):
            buf[slot:slot + 1].fill_(value)

    # ---- decode

    def _forward_logits(self, tokens, positions, write_pos, key_range):
        """Logits [B, V] float32 of the next token of each row (tokens [B], positions [B], write_pos [B], key_range
        [L]), the language model attending through `decode_attention`."""
        self.cache.decode(write_pos, key_range.shape[0])
        embeds = self.embed(tokens[:, None])
        mask = self._decode_mask(write_pos, key_range)
        config, implementation = self.text_config, self.text_config._attn_implementation_internal
        config._attn_implementation_internal = DECODE_ATTENTION
        try:
            out = self.lm(inputs_embeds=embeds, position_ids=positions[:, None], attention_mask=mask, use_cache=True,
                          **{self.cache_arg: self.cache})
        finally:
            config._attn_implementation_internal = implementation
        return self._head(out[0][:, -1])

    def _apply_kernels(self, kernels: str | None) -> str:
        """Apply the decode kernels asked for (class docstring); returns what was applied ("liger", "compile" or
        "none")."""
        from vlmctl.families.spec import decoder_layers
        from vlmctl.train.kernels import liger_available

        if kernels not in (None, "liger", "compile", "none"):
            raise ValueError(f"kernels must be liger, compile, none or None, got {kernels!r}")
        if kernels in (None, "liger") and liger_available(self.device.type) and self.family.liger_patch:
            import liger_kernel.transformers as lk

            patch = getattr(lk, self.family.liger_patch, None)
            if patch is not None:
                patch(model=self.model, fused_linear_cross_entropy=False, cross_entropy=False, rope=True, rms_norm=True, swiglu=True)
                from liger_kernel.transformers.rope import liger_rotary_pos_emb

                self.rope_routed = route_rope(self.lm, liger_rotary_pos_emb, self.text_config, self.device, self.embed.weight.dtype)
                return "liger"
        if kernels == "compile":
            for layer in decoder_layers(self.model, self.family):
                layer.compile(dynamic=True)
            return "compile"
        return "none"

    def _step(self, rows: int, kv_len: int, greedy_only: bool) -> None:
        """One decode step of slots [0, rows) attending to [0, kv_len): all device work, no host synchronization."""
        import torch

        from vlmctl.inference.sampling import sample

        active = self.active[:rows]
        logits = self._forward_logits(self.tokens[:rows], self.positions[:rows], self.write_pos[:rows], self.key_range[:kv_len])
        self.logits[:rows].copy_(logits)
        penalized = None if greedy_only else self.seen[:rows]
        nxt = sample(logits, self.temperature[:rows], self.top_p[:rows], self.top_k[:rows], self.seeds[:rows], self.steps[:rows],
                     penalty=None if greedy_only else self.penalty[:rows], seen=penalized, suppress=self.suppress,
                     greedy_only=greedy_only)
        self.next_tokens[:rows].copy_(nxt)
        self.tokens[:rows].copy_(torch.where(active, nxt, self.tokens[:rows]))
        inc = active.long()
        self.positions[:rows].add_(inc)
        self.write_pos[:rows].add_(inc)
        self.steps[:rows].add_(inc)
        if penalized is not None:
            index = torch.arange(rows, device=self.device)
            penalized[index, nxt] = penalized[index, nxt] | active

    def step(self, rows: int, kv_len: int, greedy_only: bool) -> "torch.Tensor":
        """Run one decode step over slots [0, `rows`) (bucketed here) with `kv_len` cached positions needed by the
        longest active row; returns the new tokens of every slot [slots] (on the device; inactive slots' are
        meaningless)."""
        b = bucket(rows, self.slots)
        length = bucket(kv_len, self.max_len, MIN_LENGTH_BUCKET)
        key = (b, length, bool(greedy_only))
        if self.use_graphs:
            graph = self._graphs.get(key) or self._capture_graph(key)
            if graph is not None:
                graph.replay()
                return self.next_tokens
        self._step(*key)
        return self.next_tokens

    def capture_decode(self, up_to: int) -> int:
        """Capture, before any request, the decode step of every bucket a row of at most `up_to` cached positions can
        use: each row bucket (powers of two up to `slots`) at each length bucket up to the one covering `up_to`,
        greedy and sampling. A bucket first met while rows decode stalls all of them for its capture (two warm-up
        runs, which compile Triton kernels for a new row count, then the capture: hundreds of ms on a 3B model).
        Returns the graphs captured (0 off CUDA, with graphs off, or when a capture failed: then `mode` and `reason`
        say so). Rows being decoded keep their state (`_capture_graph` puts the buffers back)."""
        if not self.use_graphs:
            return 0
        before = self.captures
        rows = sorted({bucket(r, self.slots) for r in range(1, self.slots + 1)})
        lengths = [bucket(1, self.max_len, MIN_LENGTH_BUCKET)]
        while lengths[-1] < min(int(up_to), self.max_len):
            lengths.append(bucket(lengths[-1] + 1, self.max_len, MIN_LENGTH_BUCKET))
        for key in ((b, length, greedy) for length in lengths for b in rows for greedy in (True, False)):
            if key not in self._graphs and self._capture_graph(key) is None:
                break
        return self.captures - before

    def _capture_graph(self, key: tuple):
        """Capture the step of bucket `key` in a CUDA graph (after a warm-up that also compiles, when on); the live
        rows' buffers are put back as they were. On a failure the runner decodes eagerly from then on and `reason`
        says why."""
        state = [self.tokens, self.positions, self.write_pos, self.steps, self.seen, self.next_tokens, self.logits]
        saved = [t.clone() for t in state]
        try:
            return self._record(key, lambda: self._step(*key))
        except Exception as exc:  # noqa: BLE001 - any capture failure means: decode eagerly, and say why
            self.use_graphs = False
            self.mode, self.reason = "eager", f"CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:200]}"
            return None
        finally:
            for t, s in zip(state, saved):
                t.copy_(s)

    @property
    def graph_count(self) -> int:
        """CUDA graphs held: decode steps, prefill buckets and the vision towers' layouts."""
        return len(self._graphs) + sum(g.graph_count for g in self.encoder_graphs.values())


def release_capturing_generator(device) -> None:
    """Leave `device`'s default CUDA generator as a capture that failed midway found it, not capturing.

    `torch.cuda.CUDAGraph.capture_begin` marks the default generator as capturing and only `capture_end`'s epilogue
    clears the mark; when the capture fails (the callable raises, or a synchronizing call invalidated the stream so
    that `cudaStreamEndCapture` errs) the epilogue never runs, and every later draw from that generator outside a
    graph raises "Offset increment outside graph capture encountered unexpectedly" (CUDAGeneratorImpl.cpp,
    `CUDAGeneratorState::increase`) - eager sampling on that GPU included. The generator's state is replaced by a
    clone (`Generator.clone_state`: the same seed and Philox offset, no capture), which `graphsafe_set_state`
    installs without touching the seed."""
    import torch

    index = torch.device(device).index
    generator = torch.cuda.default_generators[torch.cuda.current_device() if index is None else index]
    generator.graphsafe_set_state(generator.clone_state())


def encoder_varlen(model, family, device) -> list[str]:
    """Run the encoders of `family` that attend within per-image windows or segments (`EncoderSpec.varlen`: Qwen-VL,
    Pixtral) with PyTorch's varlen kernel, all windows of a prefill in one call per layer, as training runs them
    (`vlmctl.train.kernels.set_attention`); with sdpa transformers splits each layer's query, key and value per window,
    reading the window lengths back to the host first (`lengths.tolist()` in modeling_qwen2_5_vl.py): one wait for
    the GPU per layer, which is most of a short prompt's encoder time. Only on CUDA, with torch's varlen kernel, for
    encoders computing in bf16/fp16 (what the kernel takes). Returns the sub-config keys switched."""
    if device.type != "cuda":
        return []
    import torch

    from vlmctl.train.kernels import VISION_VARLEN_NAME, _has_varlen, register_varlen_attention

    if not _has_varlen() or model.dtype not in (torch.bfloat16, torch.float16):
        return []
    subs = getattr(model.config, "sub_configs", {}) or {}
    switched = []
    for enc in getattr(family, "encoders", {}).values():
        sub = getattr(model.config, enc.config_key, None) if enc.config_key in subs else None
        if not enc.varlen or enc.attention is None or sub is None:
            continue
        register_varlen_attention()
        sub._attn_implementation_internal = VISION_VARLEN_NAME
        switched.append(enc.config_key)
    return switched


ROPE_SIGNATURE = ("q", "k", "cos", "sin", "unsqueeze_dim")
"""The parameters of transformers' rotate-half `apply_rotary_pos_emb` that `route_rope` can stand in for."""


def route_rope(lm, candidate, text_config, device, dtype) -> list[str]:
    """Route the `apply_rotary_pos_emb` of each modeling module whose attention layers `lm` holds through `candidate`
    (liger-kernel's fused RoPE: one kernel for a layer's queries and keys, where transformers' function launches ten:
    two `rotate_half` cats and negations, four products, two sums), in place, module-wide, as liger's own patches do.

    liger's patch for Qwen2-VL / Qwen2.5-VL replaces `apply_multimodal_rotary_pos_emb`, which transformers 5 no longer
    calls: it merges the multimodal sections once in the rotary embedding and its attention calls the plain
    `apply_rotary_pos_emb(q, k, cos, sin)` (modeling_qwen2_5_vl.py), so the patch leaves RoPE unfused. A module is
    routed only when its function takes exactly `ROPE_SIGNATURE` and `candidate` gives its result on a probe on the
    model's device and dtype (queries [2, heads, 3, head_dim], keys [2, kv heads, 3, head_dim], cos/sin [2, 3,
    head_dim] with both halves equal, as rotary embeddings make them; within 2e-2 in 16-bit floats, 1e-5 in fp32):
    a partial, interleaved or otherwise different RoPE keeps its own function. Returns the routed modules' names.
    """
    import sys

    import torch

    heads = int(getattr(text_config, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text_config, "head_dim", None) or (text_config.hidden_size // max(heads, 1)))
    if not heads or head_dim % 2:
        return []
    modules = {}
    for layer in lm.modules():
        name = type(layer).__module__
        mod = sys.modules.get(name)
        if "Attention" in type(layer).__name__ and callable(getattr(mod, "apply_rotary_pos_emb", None)):
            modules[name] = mod
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    done: list[str] = []
    for name, mod in modules.items():
        own = mod.apply_rotary_pos_emb
        if getattr(own, "_vlmctl_routed", False) or (getattr(own, "__module__", "") or "").startswith("liger_kernel"):
            continue
        try:
            if tuple(inspect.signature(own).parameters) != ROPE_SIGNATURE:
                continue
        except (TypeError, ValueError):
            continue
        gen = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randn(2, heads, 3, head_dim, generator=gen).to(device, dtype)
        k = torch.randn(2, kv_heads, 3, head_dim, generator=gen).to(device, dtype)
        angle = torch.randn(2, 3, head_dim // 2, generator=gen) * 3
        cos, sin = (torch.cat([f, f], dim=-1).to(device, dtype) for f in (angle.cos(), angle.sin()))
        try:
            with torch.no_grad():
                want = own(q.clone(), k.clone(), cos, sin)
                got = candidate(q.clone(), k.clone(), cos, sin)
            same = all(torch.allclose(g.float(), w.float(), atol=tol, rtol=tol) for g, w in zip(got, want))
        except Exception:  # noqa: BLE001 - a function the candidate cannot stand in for keeps running as it is
            same = False
        if not same:
            continue

        def routed(q, k, cos, sin, unsqueeze_dim=1, _candidate=candidate):
            return _candidate(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

        routed._vlmctl_routed = True
        routed.__wrapped__ = own
        mod.apply_rotary_pos_emb = routed
        done.append(name.rsplit(".", 1)[-1])
    return done


def kv_budget_slots(free_bytes: int, per_token: int, max_len: int, cap: int) -> int:
    """How many slots of `max_len` tokens fit in `free_bytes` at `per_token` bytes each (at least 1, at most `cap`)."""
    return max(1, min(int(cap), int(free_bytes // max(per_token * max_len, 1))))


__all__ = ["ModelRunner", "bucket", "kv_budget_slots", "route_rope"]
