#!/usr/bin/env bash
# Build the CPU image `streamrl:cpu` (deploy/Dockerfile.cpu) from a fresh machine, with no
# image registry: `make image`. Idempotent and cached: each part is made only when missing.
#
#   1. Docker: Debian's docker.io installed when the client or the daemon (dockerd) is missing,
#      and dockerd started when it is not running (root only).
#   2. The base image (STREAMRL_BASE_IMAGE, default streamrl-base:bookworm): when absent, Debian
#      bookworm (Python 3.11, as the wheelhouse) made with debootstrap from Debian's package
#      mirror (DEBIAN_MIRROR) and loaded with `docker import`.
#   3. The wheelhouse (build/wheelhouse): exactly the distributions streamrl[cpu] runs on in
#      .venv (scripts/wheelhouse.py), so the build installs without an index.
#   4. `docker build` (its layer cache makes a rebuild after a code change take seconds).
#
# Settings (environment): STREAMRL_IMAGE (default streamrl:cpu), STREAMRL_BASE_IMAGE,
# DEBIAN_MIRROR (default http://deb.debian.org/debian), VENV (default .venv), DOCKERD_LOG (the
# log of a dockerd started here, default /var/log/dockerd.log).
# Sourced instead of run, it defines the functions only (tests/unit/deploy/test_image_script.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-.venv}"
[[ "$VENV" == /* ]] || VENV="$ROOT/$VENV"
IMAGE="${STREAMRL_IMAGE:-streamrl:cpu}"
BASE="${STREAMRL_BASE_IMAGE:-streamrl-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DOCKERD_LOG="${DOCKERD_LOG:-/var/log/dockerd.log}"
# What the base carries: Python (venv, headers), certificates, libnuma and g++ (vLLM's CPU kernels;
# torch's inductor compiles some even in eager mode), bubblewrap and libseccomp (the box for
# model-written code). A base made from another list is made again.
BASE_PACKAGES=python3,python3-venv,python3-dev,ca-certificates,libnuma1,g++,bubblewrap,libseccomp2
PACKAGES_LABEL=org.streamrl.base-packages

ROOTFS=""  # debootstrap's folder while the base is made
trap 'rm -rf "${ROOTFS:-/nonexistent}"' EXIT

say() { printf '==> %s\n' "$*"; }
die() { printf 'image: %s\n' "$*" >&2; exit 1; }

apt_install() {
    [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null \
        || die "$* missing; install it (Debian/Ubuntu: sudo apt-get install $*) and run again"
    say "installing $*"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

ensure_docker() {
    command -v docker >/dev/null || apt_install docker.io
    docker info >/dev/null 2>&1 && return 0
    [[ $(id -u) -eq 0 ]] || die "the Docker daemon is not running; start it (sudo systemctl start docker)"
    command -v dockerd >/dev/null || apt_install docker.io  # a Docker client without its daemon
    say "starting dockerd (log: $DOCKERD_LOG)"
    setsid dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && return 0
        sleep 1
    done
    die "dockerd did not start; see $DOCKERD_LOG"
}

ensure_base() {
    local made
    if [[ "$BASE" != streamrl-base:* ]]; then  # the user's own base
        docker image inspect "$BASE" >/dev/null 2>&1 \
            || die "base image $BASE is not here and no registry is reachable; load it or unset STREAMRL_BASE_IMAGE"
        return 0
    fi
    made="$(docker image inspect -f "{{index .Config.Labels \"$PACKAGES_LABEL\"}}" "$BASE" 2>/dev/null || true)"
    [[ "$made" == "$BASE_PACKAGES" ]] && { say "base image $BASE present"; return 0; }
    command -v debootstrap >/dev/null || apt_install debootstrap
    ROOTFS="$(mktemp -d)"
    local rootfs="$ROOTFS"
    say "making $BASE: debootstrap bookworm from $MIRROR (about a minute)"
    debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" "$MIRROR" \
        >"$ROOT/build/debootstrap.log" 2>&1 || die "debootstrap failed; log: build/debootstrap.log"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import -c 'ENV LANG=C.UTF-8' \
        -c "LABEL $PACKAGES_LABEL=$BASE_PACKAGES" - "$BASE" >/dev/null
    rm -rf "$rootfs"
}

main() {
    [[ -x "$VENV/bin/python" ]] || die "no $VENV; run: make setup"
    mkdir -p "$ROOT/build"
    ensure_docker
    ensure_base
    local have want
    have="$(docker run --rm --entrypoint python3 "$BASE" -c 'import sys; print(*sys.version_info[:2], sep=".")')"
    want="$("$VENV/bin/python" -c 'import sys; print(*sys.version_info[:2], sep=".")')"
    [[ "$have" == "$want" ]] || die "$BASE has Python $have, the wheelhouse is for $want ($VENV)"
    (cd "$ROOT" && "$VENV/bin/python" scripts/wheelhouse.py build/wheelhouse)
    say "building $IMAGE on $BASE"
    DOCKER_BUILDKIT=0 docker build -f "$ROOT/deploy/Dockerfile.cpu" --build-arg BASE_IMAGE="$BASE" \
        -t "$IMAGE" "$ROOT" >"$ROOT/build/image.log" 2>&1 \
        || { tail -n 30 "$ROOT/build/image.log" >&2; die "docker build failed; log: build/image.log"; }
    # The image this build replaced, now untagged.
    docker image prune -f --filter label=org.opencontainers.image.title=streamrl >/dev/null
    say "$IMAGE built ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.1f GB", $1 / 1e9}'))"
}

[[ "${BASH_SOURCE[0]}" != "$0" ]] || main "$@"
