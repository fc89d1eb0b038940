# syntax=docker/dockerfile:1
# The batchd loader server.
#
#   docker build -t batchd .
#   docker run --rm -p 50051:50051 -p 50052:50052 --shm-size=2g \
#     -v "$PWD/examples/fashion_mnist.yaml:/etc/batchd/config.yaml:ro" \
#     -v /usr/share/datasets/fashion-mnist:/usr/share/datasets/fashion-mnist:ro \
#     batchd
#
# Two ports: gRPC on 50051 and the data plane on 50052 (the gRPC port + 1, its default), which
# carries remote trainers' batch bytes beside their calls. A client dials the data port number the
# server announces, so publish it under the same number. Both speak plain TCP unless the config has
# a tls block, and anyone who reaches them can read the datasets unless it has auth (docs/deployment.md).
#
# No torch and no tqdm: the server never imports them (tests/deploy/test_imports.py); they belong to the
# client extra (batchd[client]), which examples/Dockerfile.trainer installs.
# docker-compose.yml runs this image together with the example trainer.

ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: a virtual environment with batchd and its coco extra (pycocotools: masks of kind: coco) ----
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
# a C compiler and jpeglib.h: the region JPEG decoder (server/data/_jpeg_region.c, an optional extension)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libjpeg62-turbo-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY batchd/ batchd/
COPY proto/ proto/
COPY server/ server/
COPY client/ client/
RUN pip install ".[coco]" && batchd --help >/dev/null

# ---- runtime -------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# libjpeg-turbo: its TurboJPEG library (scaled decoding through PyTurboJPEG) and its libjpeg (the region
# decoder built above); server/data/scaled_jpeg.py
RUN apt-get update && apt-get install -y --no-install-recommends libturbojpeg0 libjpeg62-turbo \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --system --user-group --uid 10001 --create-home --home-dir /home/batchd \
        --shell /usr/sbin/nologin batchd \
    && mkdir -p /etc/batchd /run/batchd && chown batchd:batchd /run/batchd
COPY --from=build /opt/venv /opt/venv
# Dataset indexes are cached under ~/.cache/batchd, i.e. /home/batchd/.cache/batchd.
# /run/batchd: the unix socket of a sidecar (docker-compose.yml shares it through a named volume,
# which Docker first fills from this directory, so it belongs to the batchd user).
USER batchd
WORKDIR /home/batchd
EXPOSE 50051 50052
# gRPC health protocol (grpc.health.v1): `batchd health` exits 0 iff the server says SERVING.
# It assumes the server listens on port 50051; override it (docker run --health-cmd, or a
# compose healthcheck) for another address.
HEALTHCHECK --interval=15s --timeout=10s --start-period=60s --retries=3 \
    CMD ["batchd", "health", "127.0.0.1:50051", "--timeout", "5"]
ENTRYPOINT ["batchd"]
# 0.0.0.0: a server bound to the container's loopback could not be reached through EXPOSE;
# --address overrides the address in the config file.
CMD ["serve", "--config", "/etc/batchd/config.yaml", "--address", "0.0.0.0:50051"]
