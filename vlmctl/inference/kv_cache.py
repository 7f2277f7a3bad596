"""The decoding engine's KV cache: one preallocated tensor pair per decoder layer, in slots (one slot per sequence
being generated), that the language model's attention layers write through the `Cache.update` call every
transformers decoder makes (`past_key_values.update(key_states, value_states, layer_idx)`).

    cache = SlotCache(slots=32, max_len=4096)
    cache.prefill(slots, start=0)         # the next forward writes positions [start, start + T) of slots [B]
    lm(inputs_embeds=..., past_key_values=cache, ...)
    cache.decode(write_pos, kv_len=512)   # the next forward writes one position per row, write_pos [B]
    lm(inputs_embeds=..., past_key_values=cache, ...)

Keys and values of layer i are `[slots, kv_heads, max_len, head_dim]` in the model's dtype, allocated at the first
write of that layer (its heads and head size are the key states'), so their addresses never change afterwards: a
decode step captured in a CUDA graph keeps reading and writing the same memory. A token's keys sit at its index in
its sequence (storage index = token index); which positions a row may attend to is the attention mask's business
(the engine builds it from each row's length), so a slot that is reused needs no clearing: a stale position beyond
a row's length is masked, and is written again before the row first attends to it.

Unlike transformers' `StaticCache` (one `cache_position` for every row), each row of a decode step writes its own
position (`write_pos`), which is what continuous batching needs: rows joined at different times have different
lengths. Sliding-window layers keep every position too (the mask applies the window), which costs memory on long
rows but keeps one layout for all layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for it.


class SlotCache:
    """Keys and values of `slots` sequences of at most `max_len` tokens, per decoder layer (module docstring).

    Two modes, set before each forward: `prefill(slots, start)` (row b of the forward's keys [B, H, T, D] goes to
    positions [start, start + T) of slot slots[b]; attention sees positions [0, start + T) of those slots) and `decode(write_pos,
    kv_len)` (row b of the forward's keys [B, H, 1, D] goes to position write_pos[b] of slot b; attention sees
    positions [0, kv_len) of slots [0, B)). Raises ValueError for a write past `max_len`.
    """

    is_compileable = True  # read by transformers' generation utilities; the engine compiles its own step

    def __init__(self, slots: int, max_len: int):
        self.slots, self.max_len = int(slots), int(max_len)
        self.keys: list["torch.Tensor"] = []
        self.values: list["torch.Tensor"] = []
        self._mode = "decode"
        self._slots: "torch.Tensor | None" = None
        self._start = 0
        self._write_pos: "torch.Tensor | None" = None
        self._kv_len = 0

    # ---- modes

    def prefill(self, slots: "torch.Tensor", start: int) -> None:
        """The next forward writes a chunk of prompts (row b into slot `slots[b]`, [B] int64) from position `start`."""
        self._mode, self._slots, self._start = "prefill", slots, int(start)

    def decode(self, write_pos: "torch.Tensor", kv_len: int) -> None:
        """The next forward writes one token per row b at position write_pos[b] ([B] int64) of slot b and attends to
        positions [0, kv_len)."""
        self._mode, self._write_pos, self._kv_len = "decode", write_pos, kv_len  # a traced size under torch.compile

    # ---- transformers' cache interface

    def update(self, key_states: "torch.Tensor", value_states: "torch.Tensor", layer_idx: int, *args, **kwargs):
        """Store the layer's new keys and values ([B, H, T, D]) and return the keys and values attention reads."""
        if layer_idx >= len(self.keys):
            self._allocate(layer_idx, key_states, value_states)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._mode == "prefill":
            end = self._start + key_states.shape[2]
            if end > self.max_len:
                raise ValueError(f"a prompt of {end} tokens does not fit the cache's {self.max_len} positions")
            keys[self._slots, :, self._start:end] = key_states
            values[self._slots, :, self._start:end] = value_states
            if self._start == 0:  # the first chunk attends to itself only: no gather of what it just wrote
                return key_states, value_states
            return keys[self._slots, :, :end], values[self._slots, :, :end]
        rows = key_states.shape[0]
        index = self._write_pos.view(rows, 1, 1, 1).expand(rows, keys.shape[1], 1, keys.shape[3])
        keys[:rows].scatter_(2, index, key_states)
        values[:rows].scatter_(2, index, value_states)
        return keys[:rows, :, :self._kv_len], values[:rows, :, :self._kv_len]

    def _allocate(self, layer_idx: int, key_states: "torch.Tensor", value_states: "torch.Tensor") -> None:
        import torch

        while len(self.keys) <= layer_idx:  # layers are written in order; allocate any skipped one like this one
            shape = (self.slots, key_states.shape[1], self.max_len, key_states.shape[3])
            vshape = (self.slots, value_states.shape[1], self.max_len, value_states.shape[3])
            self.keys.append(torch.zeros(shape, dtype=key_states.dtype, device=key_states.device))
            self.values.append(torch.zeros(vshape, dtype=value_states.dtype, device=value_states.device))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions the next forward's first token follows (prefill: `start`; decode: not defined per batch, 0).
        The engine always passes position ids, so a model never derives them from this."""
        return self._start if self._mode == "prefill" else 0

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (the choices of one prompt share its
        prefill)."""
        for keys, values in zip(self.keys, self.values):
            keys[dst, :, :length] = keys[src, :, :length]
            values[dst, :, :length] = values[src, :, :length]

    @property
    def bytes(self) -> int:
        """Bytes held by the keys and values allocated so far."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def __len__(self) -> int:
        return len(self.keys)


def bytes_per_token(text_config, dtype_bytes: int = 2) -> int:
    """Bytes of keys and values one token takes over all decoder layers: 2 x layers x kv_heads x head_dim x
    `dtype_bytes`, from the language model's config (`num_key_value_heads`, else `num_attention_heads`;
    `head_dim`, else hidden_size / heads)."""
    heads = getattr(text_config, "num_attention_heads", 1) or 1
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return 2 * int(text_config.num_hidden_layers) * int(kv_heads) * int(head_dim) * dtype_bytes


__all__ = ["SlotCache", "bytes_per_token"]
