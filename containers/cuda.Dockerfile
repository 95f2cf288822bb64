# CUDA image: vLLM's CUDA build (it brings its torch and the CUDA libraries as wheels) and Molt,
# for the GPU recipes. Build from the repository root:
#   docker build -f containers/cuda.Dockerfile -t molt-cuda .
#   docker run --rm --gpus all --ipc=host --shm-size=32g -v "$PWD/runs:/molt/runs" \
#     -v "$HOME/.cache/huggingface:/root/.cache/huggingface" molt-cuda
# --ipc=host / --shm-size: NCCL and the /dev/shm refit path need shared memory (Docker's default
# /dev/shm is 64 MB). The model (Qwen/Qwen2.5-1.5B-Instruct in pipelines/gsm8k_gpu.yaml) comes from the
# Hugging Face cache mounted above or from the hub. Unverified: never built here (no Docker engine,
# no GPU with vLLM); linted by tests/test_containers.py (hadolint). With Ray installed, the same image
# serves slurm/molt.sbatch on every node (e.g. through Pyxis/enroot: srun --container-image=molt-cuda).
FROM python:3.11-slim
WORKDIR /molt
ENV PYTHONUNBUFFERED=1
COPY . .
RUN python -m pip install --no-cache-dir -e '.[ray]' 'vllm==0.32.0'
ENTRYPOINT ["molt"]
CMD ["run", "pipelines/gsm8k_gpu.yaml", "--run-dir", "runs/gsm8k"]
