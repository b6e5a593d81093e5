#!/usr/bin/env bash
# Collect, on a machine that can reach PyPI, the wheels that a GPU machine without network access
# (x86-64 Linux, Python 3.12, torch/CuPy/pytest/hypothesis already installed) lacks for cukern's
# tests and benchmarks: asv and what it imports, pytest-xdist, and Liger-Kernel (a peer of the
# bench). Extra package names given as arguments are collected too (e.g. transformers and its
# needs).
#
#   bash tools/fetch_wheels.sh [NAME ...]      # -> .whl/*.whl and .whl/install.sh
#
# On the GPU machine, from the project root:  bash .whl/install.sh && export PYTHONPATH=/tmp/site:$PWD
# (tools/gpu_check.sh does this itself)
# .whl/ is in .gitignore. docs/development.md has the whole recipe.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dest=.whl
mkdir -p "$dest"

# Runtime needs only: asv runs in the existing environment there (--python=same), so its
# build-time and environment-creation dependencies are fetched but never used.
wanted=(asv asv-runner json5 pympler tabulate "importlib-metadata<9" virtualenv distlib platformdirs
        python-discovery pytest-xdist execnet liger-kernel "$@")
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
    "${platforms[@]}" --dest "$dest" "${wanted[@]}"

cat > "$dest/install.sh" <<'SCRIPT'
#!/usr/bin/env bash
# Install the wheels beside this script into /tmp/site: offline, no dependency resolution
# (the machine's own packages stay as they are). Then: export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ./*.whl
SCRIPT
chmod +x "$dest/install.sh"
du -sh "$dest"
ls "$dest"
