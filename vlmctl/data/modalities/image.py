"""The image unit: encoded image bytes -> PIL images for the processor, visual-token counts from the family
spec, the blank dummy image, and how the processor's image tensors are batched."""

from __future__ import annotations

from typing import Any

from vlmctl.data.modalities.base import ModalityUnit, placeholder_token_ids

# PIL and torch are imported inside the functions that use them: importing vlmctl (the CLI's start-up) must not pay
# for them.
# Light vlmctl modules are imported next to their use as well.

DUMMY_SIDE = 56
"""Side in pixels of the dummy image when the processor has no fixed input size: the smallest image Qwen-VL
processors accept (their `size` is in pixels of area, not a side)."""


def decode_images(images: list[bytes]) -> list:
    """Encoded images -> RGB PIL images, in order."""
    from vlmctl.data.images import open_image

    out = []
    for data in images:
        img = open_image(data)
        out.append(img.convert("RGB") if img.mode != "RGB" else img)
    return out


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels of an encoded image, from its header."""
    from vlmctl.data.images import open_image

    return open_image(data).size


def image_token_ids(processor: Any) -> set[int]:
    """Ids of the processor's image placeholder token(s)."""
    return placeholder_token_ids(processor, "image")


def image_side(processor: Any) -> int:
    """A small side for the dummy image: the fixed input size where the processor resizes to one (LLaVA), else
    `DUMMY_SIDE`."""
    size = getattr(getattr(processor, "image_processor", None), "size", None)
    # a plain dict, or transformers' SizeDict (attributes, unset ones None)
    height = size.get("height") if isinstance(size, dict) else getattr(size, "height", None)
    return height if isinstance(height, int) else DUMMY_SIDE


def stack_images(inputs: list[dict[str, Any]], *, packed: bool = False) -> dict[str, Any]:
    """Image tensors of a batch, from each row's (or packed sample's) image tensors.

    Most processors return images along dim 0 ([N_images, ...]; Qwen-VL: patches along dim 0 plus
    `image_grid_thw` [N_images, 3]): concatenated, images of different sizes ([N, 3, H, W] with H, W per sample:
    Pixtral keeps each image's size and passes the real ones as `image_sizes`) zero-padded to the largest first.
    Idefics3-style processors return [1, N, 3, H, W] per sample: stacked to [B, N_max, ...], zero-padded (all-zero
    images are skipped by those models), or for one packed row concatenated along dim 1 to [1, sum N, ...].
    """
    import torch

    keys = sorted({k for inp in inputs for k in inp})
    per_sample = any(inp.get("pixel_values") is not None and inp["pixel_values"].ndim == 5 for inp in inputs)
    out = {}
    for k in keys:
        idx = [i for i, inp in enumerate(inputs) if k in inp]
        present = [inputs[i][k] for i in idx]
        # images of different sizes (Idefics2 keeps the aspect ratio, Pixtral the size): zero-padded to the largest
        present = _pad_trailing(present)
        if not per_sample or packed:
            out[k] = torch.cat(present, dim=1 if per_sample else 0)
            continue
        n = max(t.shape[1] for t in present)
        ref = present[0]
        stacked = torch.zeros((len(inputs), n, *ref.shape[2:]), dtype=ref.dtype)
        for i, t in zip(idx, present):
            stacked[i, : t.shape[1]] = t[0]
        out[k] = stacked
    return out


def _pad_trailing(tensors: list) -> list:
    """Zero-pad dims 2.. of [1, N, ...] or [N, C, ...] tensors to their largest sizes: pixels [1, N, 3, H, W] get
    black borders and `pixel_attention_mask` [1, N, H, W] zeros there, which is how the Idefics2/3 processors pad a
    batch; pixels [N, 3, H, W] get zeros right and below, as `PixtralImageProcessor` pads a batch."""
    if len({tuple(t.shape[2:]) for t in tensors}) <= 1:
        return tensors
    sizes = [max(t.shape[d] for t in tensors) for d in range(2, tensors[0].ndim)]
    out = []
    for t in tensors:
        padded = t.new_zeros((*t.shape[:2], *sizes))
        padded[(slice(None), slice(None), *(slice(0, n) for n in t.shape[2:]))] = t
        out.append(padded)
    return out


class ImageUnit(ModalityUnit):
    """Images: `{"type": "image", "index": i}` parts, the processor's `images=`; it owns every processor output
    that no other unit claims (`pixel_values`, `image_grid_thw`, `pixel_attention_mask`, ...)."""

    name = "image"
    processor_kwarg = "images"
    catch_all = True

    def decode(self, parts: list[bytes]) -> list:
        return decode_images(parts)

    def size(self, data: bytes) -> tuple[int, int]:
        """(width, height) in pixels, from the header."""
        return image_size(data)

    def num_tokens(self, data: bytes, family: Any, processor: Any) -> int:
        """`family.num_visual_tokens(width, height, processor)` of the image (see each family's visual-token rule)."""
        width, height = image_size(data)
        return int(family.num_visual_tokens(width, height, processor))

    def dummy_input(self, processor: Any):
        """A black RGB square of `image_side(processor)` pixels."""
        from PIL import Image

        side = image_side(processor)
        return Image.new("RGB", (side, side), (0, 0, 0))

    def collate(self, inputs: list[dict[str, Any]], *, packed: bool) -> dict[str, Any]:
        return stack_images(inputs, packed=packed)
