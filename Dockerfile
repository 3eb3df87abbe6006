# syntax=docker/dockerfile:1.7
# One image for the Crossflow broker (crossflow-broker), node agent (crossflow-agent) and HTTP
# gateway (crossflow-gateway): the package's console scripts, all installed by the one wheel. The
# Helm chart picks the process with `command:`; each runs as UID 10001 on a read-only root.
#   docker build -t ghcr.io/crossflow/crossflow:0.1.0 .

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY crossflow_ctl ./crossflow_ctl
COPY agents ./agents
COPY kernels ./kernels
# Wheels of the package and its runtime dependencies only (no dev, kernels or sim extras:
# the calibration path imports torch lazily and runs from a separate image when needed).
RUN pip wheel --wheel-dir /wheels . \
    && pip wheel --wheel-dir /wheels opentelemetry-exporter-otlp-proto-grpc

FROM python:${PYTHON_VERSION}-slim AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels crossflow opentelemetry-exporter-otlp-proto-grpc \
    && groupadd --system --gid 10001 crossflow \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin crossflow
USER 10001:10001
WORKDIR /tmp
# gRPC (broker), Prometheus /metrics (broker, agent), HTTP (gateway: OpenAI API and /metrics).
EXPOSE 50051 9464 9465 8000
CMD ["crossflow-broker", "--help"]
