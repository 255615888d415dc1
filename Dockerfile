# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target gateway -t inflight-gateway .   slim Python, no torch (its venv: ~330 MB)
#   docker build --target worker  -t inflight-worker  .   CUDA runtime + torch + triton
# Both run as an unprivileged user (uid 10001), work with a read-only root filesystem (caches go to
# /tmp and /cache, which the chart and compose mount as volumes) and start with `inflight <role>`.
# `make images` builds both with buildah, without Docker or the registries, and runs them as the chart
# does (scripts/images.sh; docs/operations.md).

ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG TORCH_VERSION=2.13.0
# Where torch comes from: PyPI by default (its Linux wheel is the CUDA build). A CPU-only image, such as
# the stand-in that scripts/images.sh builds and runs, passes TORCH_VERSION=<version>+cpu with either
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu or TORCH_FIND_LINKS=<a wheel folder mounted in>.
ARG TORCH_INDEX_URL=""
ARG TORCH_FIND_LINKS=""

# ---- wheel: the project itself, built once for both images ----------------------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md* ./
COPY engine ./engine
COPY services ./services
COPY inflight ./inflight
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- gateway-build: a venv with the gateway's dependencies and the project, without torch ---------
FROM ${PYTHON_IMAGE} AS gateway-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
COPY deploy/requirements-gateway.txt /tmp/requirements-gateway.txt
RUN pip install --no-cache-dir -r /tmp/requirements-gateway.txt
COPY --from=wheel /wheels /wheels
# --no-deps keeps torch out; the CLI must start without it (fails the build otherwise).
RUN pip install --no-cache-dir --no-deps /wheels/*.whl \
    && inflight --help > /dev/null

# ---- gateway ------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS gateway
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp \
    INFLIGHT_GATEWAY_PORT=8000
RUN groupadd --system --gid 10001 inflight \
    && useradd --system --uid 10001 --gid inflight --no-create-home --shell /usr/sbin/nologin inflight
COPY --from=gateway-build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
ENTRYPOINT ["inflight"]
CMD ["gateway"]

# ---- worker -------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS worker
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ARG TORCH_FIND_LINKS
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp XDG_CACHE_HOME=/cache HF_HOME=/cache/huggingface TRITON_CACHE_DIR=/cache/triton \
    INFLIGHT_CPU_EXT_DIR=/opt/inflight/cpu_ext INFLIGHT_WORKER_PORT=8001
# Triton compiles its kernel launchers with the C compiler against Python's headers at run time, so gcc
# and python3-dev belong in the runtime image; g++ builds the C++ CPU kernels below (and again at run
# time only if they could not be built here). Versions come with the pinned Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ libc6-dev \
        ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 inflight \
    && useradd --system --uid 10001 --gid inflight --no-create-home --shell /usr/sbin/nologin inflight \
    && mkdir -p /cache /models \
    && chown 10001:10001 /cache /models
RUN python3 -m venv /opt/venv \
    && if [ -n "$TORCH_INDEX_URL" ]; then export PIP_INDEX_URL="$TORCH_INDEX_URL"; fi \
    && if [ -n "$TORCH_FIND_LINKS" ]; then export PIP_FIND_LINKS="$TORCH_FIND_LINKS"; fi \
    && pip install --no-cache-dir "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
# The gpu extra asks for triton. torch's CUDA wheel brings the triton build it was made with, which
# satisfies it; the CPU build brings none, so pip adds one. The import check keeps it that way.
RUN pip install --no-cache-dir "$(echo /wheels/inflight-*.whl)[gpu]" \
    && rm -rf /wheels \
    && python -c "import torch, triton" \
    && inflight --help > /dev/null
# The C++ CPU kernels, built into the image (INFLIGHT_CPU_EXT_DIR, outside the /cache volume) so that a
# CPU worker starts without compiling: they choose their AVX-512 paths from the CPU they run on, not
# this build host's, and load from the read-only root filesystem (engine/kernels/cpu). The command
# never fails: where they cannot be built (another architecture) the worker runs the torch path.
RUN python -m engine.kernels.cpu \
    && chmod -R a+rX /opt/inflight
USER 10001:10001
EXPOSE 8001
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8001/healthz', timeout=4)"]
ENTRYPOINT ["inflight"]
CMD ["worker"]
