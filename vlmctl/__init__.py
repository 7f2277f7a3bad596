"""vlmctl: build, train and ship vision-language models from one project file (`vlmctl.yaml`)."""

import logging as _logging

__version__ = "0.1.0"

# transformers imports torchao (when installed: the stochastic-rounding AdamW) with its model code; torchao then warns
# about each prebuilt kernel library the installed torch cannot load (its low-precision GEMMs, which vlmctl does not
# use). Its errors still show.
_logging.getLogger("torchao").setLevel(_logging.ERROR)


class _TorchaoEnumNotice(_logging.Filter):
    """Drops torch's notice that torchao still registers its Enums as pytree constants (newer torch handles Enums
    natively), printed twice whenever transformers imports torchao; it asks nothing of vlmctl's users."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


_logging.getLogger("torch.utils._pytree").addFilter(_TorchaoEnumNotice())
