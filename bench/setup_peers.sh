#!/usr/bin/env bash
# Creates bench/_work/peers-venv with every peer loader of the comparison (issue 6) and Zephon
# itself (editable, no deps: apache-beam is not needed on the loader side), so that one
# process can run every loader. Never touches the project's own environment.
#
#   bash bench/setup_peers.sh            # create or update
#   bash bench/setup_peers.sh --fresh    # delete and recreate
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
VENV="$HERE/_work/peers-venv"
PY="${PYTHON:-python3}"

if [[ "${1:-}" == "--fresh" ]]; then rm -rf "$VENV"; fi
if [[ ! -x "$VENV/bin/python" ]]; then "$PY" -m venv "$VENV"; fi
PIP=("$VENV/bin/python" -m pip install --quiet)

# 1. torch first: torch==2.13.0 is the CPU build on local disk; an unpinned torch pulls CUDA.
"${PIP[@]}" torch==2.13.0
CONSTRAINT="$(mktemp)"
trap 'rm -f "$CONSTRAINT"' EXIT
echo "torch==2.13.0" > "$CONSTRAINT"

# 2. the peers, pinned, with torch held where it is.
"${PIP[@]}" -c "$CONSTRAINT" -r "$HERE/requirements-peers.txt"

# 3. torchvision comes in as a dependency of litdata and mosaicml-streaming; the PyPI build is
#    CUDA and crashes beside the CPU torch ("operator torchvision::nms does not exist"), and
#    only streaming.vision imports it (stubbed by bench/peers/common.py). Keep it out.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision 2>/dev/null || true

# 4. Zephon itself, editable, without its deps (apache-beam is only for the Beam job, which
#    bench.compare runs with the interpreter that runs it).
"${PIP[@]}" --no-deps -e "$REPO"

# 5. smoke: every loader imports.
"$VENV/bin/python" - <<'PY'
import importlib, sys, types
sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
failed = []
for mod in ["torch", "streaming", "litdata", "grain", "megatron.energon", "torchdata.stateful_dataloader",
            "torchdata.nodes", "datasets", "tokenizers", "pyarrow", "matplotlib", "loader.config"]:
    try:
        importlib.import_module(mod)
    except Exception as exc:  # report every failure, not just the first
        failed.append(f"{mod}: {type(exc).__name__}: {exc}")
import torch
print("torch", torch.__version__)
if failed:
    print("IMPORT FAILURES:\n  " + "\n  ".join(failed))
    sys.exit(1)
print("peers venv ready:", sys.prefix)
PY
