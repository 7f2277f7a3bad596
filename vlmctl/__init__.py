"""vlmctl: build, train and ship vision-language models from one project file (`vlmctl.yaml`)."""

__version__ = "0.1.0"
