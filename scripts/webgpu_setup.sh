#!/usr/bin/env bash
# Installs the real WebGPU runtimes that `deform-surgeon placement` and the `webgpu` tests drive:
#   * Debian's chromium (headless browser for onnxruntime-web; it also ships SwiftShader's Vulkan ICD that
#     onnxruntime-node's WebGPU EP uses on a machine without a GPU) and libvulkan1 (the Vulkan loader Dawn dlopens),
#   * the pinned npm packages of deform_surgeon/webgpu/placement/package-lock.json (onnxruntime-web, onnxruntime-node,
#     playwright-core, webgpu), through `deform-surgeon setup` (a per-user cache folder; see deform_surgeon/base/js_runtimes.py).
#
# Idempotent: every step checks first and skips work that is already done, so `make webgpu-setup` is cheap to
# repeat. Never downloads a browser build (`npx playwright install` cannot work here) and never runs npm
# install scripts: onnxruntime-node's postinstall tries to download CUDA EP binaries, which this tool does not
# need (its Linux x64 binary with the WebGPU EP is inside the npm tarball).
#
# Usage: scripts/webgpu_setup.sh [--check]   (--check: only report what is missing; exit 1 if anything is)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
CHECK_ONLY=0
[[ "${1:-}" == "--check" ]] && CHECK_ONLY=1

log() { printf 'webgpu-setup: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

as_root() {
  if [[ "$(id -u)" == 0 ]]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    die "need root (or sudo) to run: $*"
  fi
}

have_vulkan_loader() { ldconfig -p 2>/dev/null | grep 'libvulkan\.so\.1 ' >/dev/null; }  # no -q: SIGPIPE + pipefail

# ---- 1. Debian packages ------------------------------------------------------------------------------------
apt_pkgs=()
[[ -x /usr/bin/chromium && -f /usr/lib/chromium/vk_swiftshader_icd.json ]] || apt_pkgs+=(chromium)
have_vulkan_loader || apt_pkgs+=(libvulkan1)
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  apt_pkgs+=(nodejs npm)
fi

if ((${#apt_pkgs[@]})); then
  if ((CHECK_ONLY)); then
    log "missing Debian packages: ${apt_pkgs[*]}"
  else
    log "installing Debian packages: ${apt_pkgs[*]}"
    start=$SECONDS
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt_pkgs[@]}" >/dev/null
    log "apt-get done in $((SECONDS - start)) s"
  fi
else
  log "Debian packages present (chromium, libvulkan1, node)"
fi

# ---- 2. Node version ---------------------------------------------------------------------------------------
if command -v node >/dev/null; then
  node_major="$(node -p 'process.versions.node.split(".")[0]')"
  # playwright-core 1.65 declares engines.node >= 20
  ((node_major >= 20)) || die "node $(node --version) is too old; playwright-core needs node >= 20"
elif ((!CHECK_ONLY)); then
  die "node is still missing after apt-get"
fi

# ---- 3. npm packages (pinned by package-lock.json): `deform-surgeon setup`, the command a pip install has too --------
# It installs them once per user into $XDG_CACHE_HOME/deform-surgeon/runtimes-<hash of the lock> and checks the files
# the harnesses load; --browser checks the system Chromium as well.
DS="${DEFORM_SURGEON:-$ROOT/.venv/bin/deform-surgeon}"
[[ -x "$DS" ]] || DS="$(command -v deform-surgeon || true)"
[[ -n "$DS" ]] || die "deform-surgeon is not installed (make install, or pip install .)"
if ((CHECK_ONLY)); then
  "$DS" setup --check --browser || die "setup incomplete; run: make webgpu-setup"
else
  "$DS" setup --browser
fi
have_vulkan_loader || die "libvulkan.so.1 is missing (apt-get install libvulkan1)"
log "ready: $(/usr/bin/chromium --version 2>/dev/null | head -1); node $(node --version)"
