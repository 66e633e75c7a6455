#!/usr/bin/env bash
# Download the wheels a GPU host without network needs to run specd's services, gateway and
# tests (scripts/gpu_check.py installs them into /tmp/site): the packages its image lacks, at
# the versions this project's environment runs. torch, transformers, numpy and safetensors
# come with the GPU image. Pure-Python wheels or CPython 3.12 manylinux x86_64 ones, no
# dependencies resolved (every one is listed). Usage: scripts/gpu_wheels.sh DIR
set -euo pipefail
dest=${1:?usage: scripts/gpu_wheels.sh DIR}
python=${PYTHON:-python3}
packages=(
  # Services and gateway.
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 uvicorn==0.54.0 h11==0.16.0 click==8.5.1
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 anyio==4.16.0 sniffio==1.3.1 idna==3.20
  llguidance==1.9.1 gguf==0.19.0 asyncio-throttle==1.0.2 prometheus-client==0.26.0
  grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2
  googleapis-common-protos==1.76.0
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-semantic-conventions==0.66b2
  # specd bench and the tests' clients.
  httpx==0.28.1 httpcore==1.0.9 certifi==2026.10.19.post1 tqdm==4.70.1
  requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.2
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0
  # The tests.
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0 pytest-timeout==2.4.0
  hypothesis==6.170.17 sortedcontainers==2.4.0 attrs==26.1.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  pyyaml==6.0.4 psutil==7.2.2 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
)
mkdir -p "$dest"
"$python" -m pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
  -d "$dest" "${packages[@]}"
du -sh "$dest"
