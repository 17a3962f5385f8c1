#!/usr/bin/env bash
# Run one of silod's Python scripts on a machine without a package index (an offline GPU image),
# from a checkout:
#
#   make gpu-wheels                                   # on a connected machine: wheels into .gpu-wheels/
#   (carry the checkout and .gpu-wheels/ to the other machine)
#   bash benchmarks/offline_python.sh benchmarks/live_scale.py --nodes 1000 ...
#
# The wheels of benchmarks/gpu_wheels.txt are installed once into .gpu-wheels/site-<python>
# (pip install --no-index --no-deps --target), and the script runs with that folder and the
# checkout on PYTHONPATH; every process it starts inherits both. PYTHON picks the interpreter
# (default: python3 on PATH, named by its full path: on such machines it is a virtual
# environment's, and the jobs' command lines must name the same one).
set -euo pipefail

if (($# == 0)); then
  echo "usage: bash benchmarks/offline_python.sh SCRIPT.py [ARGS...]" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=$(command -v "${PYTHON:-python3}") || { echo "offline_python.sh: no ${PYTHON:-python3} on PATH (set PYTHON=...)" >&2; exit 1; }
wheels=${GPU_WHEELS:-$root/.gpu-wheels}
tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
site=$wheels/site-$tag

shopt -s nullglob
found=("$wheels"/*.whl)
if ((${#found[@]})); then
  # Installed again when a wheel is newer than the last install (a fresh `make gpu-wheels`).
  if [[ ! -f $site/.installed ]] || [[ -n $(find "$wheels" -maxdepth 1 -name '*.whl' -newer "$site/.installed") ]]; then
    echo "offline_python.sh: installing ${#found[@]} wheels from $wheels into $site"
    rm -rf "$site"
    "$python" -m pip install --quiet --no-index --no-deps --target "$site" "${found[@]}"
    touch "$site/.installed"
  fi
  export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "offline_python.sh: no wheels in $wheels (run \`make gpu-wheels\` on a connected machine and carry the" \
       "folder here); using what $python has" >&2
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi
script=$1
shift
cd "$root"
exec "$python" "$script" "$@"
