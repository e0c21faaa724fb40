#!/usr/bin/env bash
# Fills wheels/ (git-ignored) with what scripts/gpu_figures.sh installs on a GPU host whose image has an
# older transformers: the transformers installed here, xz-compressed without bytecode (~4 MB; unpacked
# there onto PYTHONPATH), the tokenizers / safetensors / huggingface_hub wheels it needs (for the host's
# Python, default 3.12), and the HumanEval prompts (../shared is not carried). Usage, from the
# repository root: scripts/gpu_wheels.sh [PYTHON_VERSION]
set -euo pipefail
python_version=${1:-3.12}
mkdir -p wheels
site=$(python -c "import os, transformers; print(os.path.dirname(os.path.dirname(transformers.__file__)))")
version=$(python -c "import transformers; print(transformers.__version__)")
tar cJf "wheels/transformers-$version.tar.xz" -C "$site" --exclude=__pycache__ transformers \
    "transformers-$version.dist-info"
# huggingface_hub 1.x: 2.x imports httpx2, which a GPU host's image lacks (transformers 5.24 runs on 1.31)
for package in tokenizers safetensors huggingface_hub; do
    pinned=$(python -c "import importlib.metadata as m; print(m.version('$package'))")
    [ "$package" = huggingface_hub ] && [ "${pinned%%.*}" -ge 2 ] && pinned=1.31.0
    python -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d wheels "$package==$pinned"
done
cp ../shared/data/humaneval.jsonl wheels/
du -sh wheels
