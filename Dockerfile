# flashsplit image: the router, prefill and decode entry points of one package.
# GPU hosts: build with --build-arg TORCH_SPEC="torch==2.11.0" --build-arg EXTRAS="[gpu]" on a
# CUDA base image (e.g. --build-arg BASE=nvidia/cuda:13.0.0-runtime-ubuntu24.04 plus python3).
ARG BASE=python:3.11-slim
FROM ${BASE}
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
WORKDIR /app
ENV PYTHONUNBUFFERED=1
RUN pip install --no-cache-dir --index-url ${TORCH_INDEX} "${TORCH_SPEC}"
COPY pyproject.toml README.md ./
COPY common ./common
COPY prefill_service ./prefill_service
COPY decode_service ./decode_service
COPY router ./router
RUN pip install --no-cache-dir ".${EXTRAS}"
EXPOSE 50051 50061 50062
CMD ["flashsplit-router", "--help"]
