"""The processor in worker processes, for `vlmctl serve --processor-workers N`.

    preparer = PromptPreparer(model_dir, workers=4, video=settings.video)
    prepared = preparer(rendered)        # the processor's tensors for this prompt alone, on the host
    engine.submit(rendered, params, prepared=prepared)
    preparer.close()

At admission the decoding engine calls the processor on the prompts it prefills together (resizing and patching
pictures, tokenizing), on the thread that also launches every decode step: under many clients that is a share of
each round during which no row decodes. With processor workers, each request's prompt is processed alone in one of
N processes (started with `spawn`, each loading the model folder's processor once) while the request is read, and
the engine only batches the tensors (`inference.inputs.collate_inputs`), for the families whose processor batches
that way (`FamilySpec.collate_prompts`). Where the family computes a prompt's position ids on the host
(`FamilySpec.prompt_positions`: Qwen-VL's multimodal RoPE, a Python loop over each prompt's tokens and pictures),
the worker computes them too, and the engine batches them (`inputs.collate_positions`). Processes, not threads: the
processor's Python would otherwise hold the interpreter lock the engine's thread needs between steps. Tensors come
back as numpy arrays (pickled by value), not through torch's shared-memory file descriptors. Pictures go to the
workers as the encoded bytes the request brought where they are still undecoded (`portable_image`), so the server's
process neither decodes them nor pickles their pixels.
"""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

from vlmctl.inference.prompt import RenderedRequest

log = logging.getLogger("vlmctl.serve")

# torch, transformers (through the processor and vlmctl's loaders), multiprocessing's pool and vlmctl's error types are
# imported inside the functions that use them: importing vlmctl (the CLI's start-up) must not pay for them, and a
# worker process imports only what its processor needs.

_PROCESSOR: Any = None  # a worker process's processor (`_load`)
_POSITIONS: Any = None  # and its family's prompt position function, where the family has one (`prompt_positions`)


def _load(model_dir: str) -> None:
    """A worker's start: the processor of `model_dir`, with the pad token the decoding engine gives it, and the
    family's position function (`prompt_positions`)."""
    global _PROCESSOR, _POSITIONS
    from vlmctl.models import load_processor

    _PROCESSOR = load_processor(model_dir)
    tok = _PROCESSOR.tokenizer
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    _POSITIONS = prompt_positions(Path(model_dir))


def prompt_positions(model_dir: Path):
    """The function of a prompt's processor tensors that gives its position ids on the host (`FamilySpec.
    prompt_positions`: Qwen-VL's multimodal RoPE positions, from the model's own `compute_3d_position_ids`), bound to
    a copy of the model without weights (`build_empty_model`: parameters on the meta device; the positions read only
    the config and the prompt's tensors). None where the family has no such function or the copy cannot be made (the
    engine then computes the positions at admission)."""
    from vlmctl.families.spec import FamilySpec
    from vlmctl.inference import folder_family

    try:
        family = folder_family(model_dir)
        if family is None or type(family).prompt_positions is FamilySpec.prompt_positions:
            return None
        from vlmctl.models.load import build_empty_model

        model, _, family = build_empty_model(model_dir)
        return family.prompt_positions(model)
    except Exception as exc:  # noqa: BLE001 - positions are an optimization: the engine computes them without
        log.warning("processor worker: no prompt positions (%s: %s); the engine computes them", type(exc).__name__, exc)
        return None


def _ready() -> bool:
    return _PROCESSOR is not None


def portable_image(image: Any) -> Any:
    """What a worker is sent for one rendered picture: the encoded bytes it is still to be decoded from, where it is a
    picture opened from bytes (`data.images.open_image`, as a served request's are) whose pixels are not decoded yet
    and that needs no conversion (RGB); else the picture itself. Pickling a PIL picture decodes it and copies its
    pixels (`Image.__getstate__`), on the server's thread that feeds the pool, which holds the interpreter lock the
    decoding thread needs; the bytes are a fraction of the size, and the worker decodes them."""
    fp = getattr(image, "fp", None)
    if isinstance(fp, io.BytesIO) and getattr(image, "mode", None) == "RGB" and getattr(image, "tile", None):
        return fp.getvalue()
    return image


def _prepare(text: str, images: list, audios: list, videos: list, video: Any) -> dict[str, Any] | None:
    """In a worker: the processor's tensors for one rendered prompt as numpy arrays, with its `position_ids` where
    the family computes them on the host (`prompt_positions`), or None when one of its outputs is not a tensor (the
    engine then calls the processor itself). The processor's errors propagate."""
    from vlmctl.inference.inputs import processor_inputs
    from vlmctl.inference.prompt import _to_rgb

    images = [_to_rgb(i) for i in images]  # `portable_image`'s bytes decoded as rendering decodes a request's
    out = processor_inputs(_PROCESSOR, [text], images, audios, videos, video)
    if not all(hasattr(v, "numpy") for v in out.values()):
        return None
    arrays = {k: v.numpy() for k, v in out.items()}
    if _POSITIONS is not None:
        try:
            positions = _POSITIONS(out)
        except Exception:  # noqa: BLE001 - the prompt is still served: the engine computes its positions at admission
            positions = None
        if positions is not None and hasattr(positions, "numpy"):
            arrays["position_ids"] = positions.numpy()
    return arrays


class PromptPreparer:
    """`workers` processes running the processor of `model_dir` on one prompt each (module docstring). `video`: the
    `data.video` settings videos are sampled with. The processes start at once (each imports transformers and loads
    the processor: a few seconds); with `wait` (default) this returns once every one has its processor, otherwise
    `wait_ready()` does, so their start can overlap other work (the engine's graph captures). Raises ModelError when
    the folder's processor cannot be loaded."""

    def __init__(self, model_dir: Path, workers: int, video: Any = None, *, wait: bool = True):
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.workers, self.video = int(workers), video
        self.pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_load, initargs=(str(model_dir),))
        self.broken = ""  # why the workers stopped, once they have
        # one task per worker at once: every process starts (and loads its processor) now, not at a first request
        self._starting = [self.pool.submit(_ready) for _ in range(self.workers)]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Return once every worker has loaded its processor; raise ModelError (the workers shut down) when one
        could not."""
        try:
            if not all(f.result() for f in self._starting):
                raise RuntimeError("a processor worker started without its processor")
        except Exception as exc:
            self.close(wait=False)
            from vlmctl.errors import ModelError

            raise ModelError(f"the processor workers could not start: {type(exc).__name__}: {exc}",
                             hint="serve with --processor-workers 0") from None

    def __call__(self, rendered: RenderedRequest) -> dict[str, Any] | None:
        """The processor's tensors for `rendered` alone (torch tensors on the host), or None when the workers
        stopped (`broken` says why; the engine then calls the processor). The processor's own errors propagate."""
        if self.broken:
            return None
        from concurrent.futures.process import BrokenProcessPool

        try:
            arrays = self.pool.submit(_prepare, rendered.text, [portable_image(i) for i in rendered.images],
                                      list(rendered.audios), list(rendered.videos), self.video).result()
        except BrokenProcessPool as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            log.error("the processor workers stopped (%s); the engine processes prompts from now on", self.broken)
            return None
        if arrays is None:
            return None
        import torch

        return {k: torch.from_numpy(v) for k, v in arrays.items()}

    def close(self, wait: bool = True) -> None:
        """Stop the workers; `wait`: until they have exited."""
        self.pool.shutdown(wait=wait, cancel_futures=True)


__all__ = ["PromptPreparer", "portable_image", "prompt_positions"]
