#!/usr/bin/env bash
# benchmarks/gpu_check.py on a GPU machine without a package index, from a checkout.
#
#   make gpu-wheels                    # on a connected machine: the wheels into .gpu-wheels/
#   (carry the checkout and .gpu-wheels/ to the GPU machine)
#   bash benchmarks/gpu_check.sh       # flags go to gpu_check.py (e.g. --write-docs)
#
# benchmarks/offline_python.sh installs the wheels and sets PYTHONPATH; PYTHON picks the
# interpreter there.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exec bash "$root/benchmarks/offline_python.sh" "$root/benchmarks/gpu_check.py" "$@"
