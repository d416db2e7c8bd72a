# One image for the whole cluster: `cachetier serve` and `cachetier agent` (see docker-compose.yml).
#
# torch is installed first, from TORCH_INDEX_URL when given. Left empty, pip's default index is
# used, whose Linux x86-64 torch wheel is a CUDA build: what the GPU agents need. For an image that
# only runs the service or CPU agents, point it at a CPU-only torch wheel index (same version, a
# fraction of the size):
#   docker build --build-arg TORCH_INDEX_URL=<CPU-only torch index> -t cachetier:latest .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=""
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# Triton compiles a small C launcher the first time a kernel runs on a GPU.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/cachetier
COPY requirements.lock ./
# The lock's torch pin from its index, then the rest of the lock (that torch already satisfies it).
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
        "$(grep '^torch==' requirements.lock)" \
    && pip install -r requirements.lock

COPY pyproject.toml README.md ./
COPY cachetier ./cachetier
COPY index ./index
COPY gpu_pool ./gpu_pool
COPY eviction ./eviction
COPY kernels ./kernels
RUN pip install --no-deps .

RUN useradd --system --no-create-home cachetier
USER cachetier
EXPOSE 7400
CMD ["cachetier", "--help"]
