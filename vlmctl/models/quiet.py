"""transformers kept quiet while vlmctl loads and saves models (vlmctl shows its own progress)."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator

# transformers is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for
# it.


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Within the block: transformers' logger at error level and no third-party progress bars (transformers'
    "Loading weights" / "Writing model shards", huggingface_hub's downloads); the previous verbosity and bar
    settings are restored afterwards. vlmctl shows its own progress; a library that embeds vlmctl keeps its own.

    Also keeps transformers' "`XImageProcessor` requires torchvision ... falling back to `XImageProcessorPil`"
    notice (a `warning_once`) out of vlmctl's output: that fallback is expected on CPU installs.
    """

    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        # huggingface_hub warns when HF_HUB_DISABLE_PROGRESS_BARS pins the setting; it then keeps its own value
        warnings.simplefilter("ignore")
        if bars:
            hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                hf_logging.enable_progress_bar()
