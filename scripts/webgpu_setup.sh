#!/usr/bin/env bash
# Installs the real WebGPU runtimes that `deform-surgeon placement` and the `webgpu` tests drive:
#   * Debian's chromium (headless browser for onnxruntime-web; it also ships SwiftShader's Vulkan ICD that
#     onnxruntime-node's WebGPU EP uses on a machine without a GPU) and libvulkan1 (the Vulkan loader Dawn dlopens),
#   * the pinned npm packages of deform_surgeon/placement/package-lock.json (onnxruntime-web, onnxruntime-node,
#     playwright-core, webgpu) into deform_surgeon/placement/node_modules (git-ignored).
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
PKG_DIR="$ROOT/deform_surgeon/placement"
STAMP="$PKG_DIR/node_modules/.deform-surgeon-setup.sha256"
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

# ---- 3. npm packages (pinned by package-lock.json) ---------------------------------------------------------
lock_sum="$(sha256sum "$PKG_DIR/package-lock.json" | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$lock_sum" ]]; then
  log "npm packages already installed for this package-lock.json"
elif ((CHECK_ONLY)); then
  log "npm packages not installed (or package-lock.json changed): deform_surgeon/placement/node_modules"
  npm_missing=1
else
  log "installing npm packages into deform_surgeon/placement/node_modules (npm ci --ignore-scripts)"
  start=$SECONDS
  (cd "$PKG_DIR" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)
  echo "$lock_sum" >"$STAMP"
  log "npm ci done in $((SECONDS - start)) s"
fi

# ---- 4. Verify what the harnesses load ----------------------------------------------------------------------
missing=()
for f in \
  node_modules/onnxruntime-web/dist/ort.webgpu.min.mjs \
  node_modules/onnxruntime-web/dist/ort.min.mjs \
  node_modules/onnxruntime-web/dist/ort.all.min.mjs \
  node_modules/onnxruntime-node/bin/napi-v6/linux/x64/onnxruntime_binding.node \
  node_modules/onnxruntime-node/bin/napi-v6/linux/x64/libonnxruntime.so.1 \
  node_modules/playwright-core/package.json \
  node_modules/webgpu/dist/linux-x64/dawn.node; do
  [[ -f "$PKG_DIR/$f" ]] || missing+=("$f")
done
[[ -x /usr/bin/chromium ]] || missing+=(/usr/bin/chromium)
[[ -f /usr/lib/chromium/vk_swiftshader_icd.json ]] || missing+=(/usr/lib/chromium/vk_swiftshader_icd.json)
have_vulkan_loader || missing+=(libvulkan.so.1)

if ((${#missing[@]})) || ((${npm_missing:-0})); then
  for m in "${missing[@]}"; do log "missing: $m"; done
  ((CHECK_ONLY)) && die "setup incomplete; run: make webgpu-setup"
  die "setup finished but files are missing (see above)"
fi
log "ready: $(/usr/bin/chromium --version 2>/dev/null | head -1); node $(node --version); onnxruntime-web/-node $(
  node -p "require('$PKG_DIR/node_modules/onnxruntime-node/package.json').version")"
