# vlmctl on GPUs: CUDA PyTorch base + vlmctl with the gpu (liger-kernel) and deepspeed extras.
#
# Build:  docker build -t vlmctl .
# Run:    docker run --gpus all --ipc=host -v "$PWD":/work -w /work vlmctl train
#         docker run --gpus all --ipc=host -v "$PWD":/work -w /work -e HF_TOKEN vlmctl push --dry-run
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-devel

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    DS_BUILD_OPS=0

WORKDIR /opt/vlmctl
COPY pyproject.toml setup.py README.md ./
COPY vlmctl ./vlmctl
COPY templates ./templates
# torch >= 2.10 brings torch.nn.attention.varlen (packed training without a flash-attn build).
RUN pip install "torch>=2.10" ".[gpu,deepspeed]"

WORKDIR /work
ENTRYPOINT ["vlmctl"]
CMD ["--help"]
