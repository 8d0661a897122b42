#!/usr/bin/env bash
# Prepares what `make test-compose` needs and this machine may lack, skipping every
# step that is already done (a second run only checks). Nothing here starts a daemon:
# scripts/compose/run_stack_test.py starts (and always stops) its own.
#
#   1. containerd, runc and docker-init (tini): Debian's docker.io package, when missing.
#   2. A Docker Engine >= 25 and Compose v2 >= 2.24 (docker-compose.yml uses
#      healthcheck.start_interval and `!reset`): the ones on PATH when new enough,
#      else dockerd 26 and the Compose 2.26 plugin unpacked (not installed) from
#      Debian trixie's packages into $CLM_COMPOSE_WORK/bin.
#   3. Base images without a registry: a Debian bookworm root file system made by
#      debootstrap (python3.11 + venv, and redis-server for the Redis image), saved as
#      $CLM_COMPOSE_WORK/rootfs.tar for `docker import`. Skipped when
#      CLM_COMPOSE_USE_REGISTRY=1 (a machine that can pull python:3.11-slim and redis).
#
# Prints the tools it chose as KEY=VALUE lines (read by run_stack_test.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${CLM_COMPOSE_WORK:-$PWD/var/compose}
SUITE=${CLM_COMPOSE_DEBIAN_SUITE:-bookworm}
MIRROR=${CLM_COMPOSE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
mkdir -p "$WORK/bin" "$WORK/cli-plugins"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
log() { echo "==> $*" >&2; }

version_at_least() {  # version_at_least 26.1.5 25.0 -> true
  [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]
}

apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then $SUDO apt-get update -qq >&2; apt_updated=1; fi
  log "apt-get install $*"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "$@" >&2
}

# 1. the engine's runtime parts
if ! command -v containerd >/dev/null || ! command -v runc >/dev/null \
   || { ! command -v docker-init >/dev/null && [ ! -x /usr/sbin/docker-init ] && [ ! -x /usr/libexec/docker/docker-init ]; } \
   || ! command -v docker >/dev/null; then
  apt_install docker.io
fi

# 2. engine >= 25 and compose v2 >= 2.24
trixie_debs() {
  local dir="$WORK/trixie"
  mkdir -p "$dir/lists/partial"
  echo "deb $MIRROR trixie main" > "$dir/sources.list"
  local opts=(-o "Dir::Etc::sourcelist=$dir/sources.list" -o Dir::Etc::sourceparts=- -o "Dir::State::Lists=$dir/lists")
  if [ ! -s "$dir/lists/.updated" ]; then
    log "reading Debian trixie's package lists (nothing is installed)"
    apt-get "${opts[@]}" update -qq >&2
    date > "$dir/lists/.updated"
  fi
  (cd "$dir" && apt-get "${opts[@]}" download "$@" >&2)
}

DOCKERD=$(command -v dockerd || true)
if [ -n "$DOCKERD" ] && version_at_least "$("$DOCKERD" --version | sed -E 's/.*version ([0-9.]+).*/\1/')" 25.0; then
  log "using $DOCKERD ($("$DOCKERD" --version))"
elif [ -x "$WORK/bin/dockerd" ]; then
  DOCKERD=$WORK/bin/dockerd
else
  trixie_debs docker.io
  rm -rf "$WORK/trixie/docker.io"
  dpkg -x "$WORK"/trixie/docker.io_*.deb "$WORK/trixie/docker.io"
  cp "$WORK/trixie/docker.io/usr/sbin/dockerd" "$WORK/bin/dockerd"
  DOCKERD=$WORK/bin/dockerd
  log "unpacked $("$DOCKERD" --version)"
fi

compose_ok() { docker compose version --short 2>/dev/null | grep -Eq '^v?2\.(2[4-9]|[3-9][0-9])'; }
if DOCKER_CONFIG="$WORK" compose_ok; then
  :
elif compose_ok; then
  # the user's own plugin works: make it visible through our DOCKER_CONFIG too
  plugin=$(docker info --format '{{range .ClientInfo.Plugins}}{{if eq .Name "compose"}}{{.Path}}{{end}}{{end}}' 2>/dev/null || true)
  [ -n "$plugin" ] && ln -sf "$plugin" "$WORK/cli-plugins/docker-compose"
fi
if ! DOCKER_CONFIG="$WORK" compose_ok; then
  trixie_debs docker-compose
  rm -rf "$WORK/trixie/docker-compose"
  dpkg -x "$WORK"/trixie/docker-compose_2*.deb "$WORK/trixie/docker-compose"
  cp "$WORK/trixie/docker-compose/usr/libexec/docker/cli-plugins/docker-compose" "$WORK/cli-plugins/docker-compose"
  log "unpacked compose $(DOCKER_CONFIG="$WORK" docker compose version --short)"
fi

# 3. base root file system (no registry)
if [ "${CLM_COMPOSE_USE_REGISTRY:-0}" != 1 ] && [ ! -s "$WORK/rootfs.tar" ]; then
  command -v debootstrap >/dev/null || apt_install debootstrap
  log "debootstrap $SUITE (python3.11, redis-server) from $MIRROR"
  rm -rf "$WORK/rootfs"
  $SUDO debootstrap --variant=minbase \
    --include=python3.11,python3.11-venv,python3-distutils,python3-pip,python-is-python3,ca-certificates,redis-server,libnuma1 \
    "$SUITE" "$WORK/rootfs" "$MIRROR" >&2
  $SUDO rm -rf "$WORK/rootfs/var/lib/apt/lists"/* "$WORK/rootfs/var/cache/apt"/*.bin
  $SUDO tar -C "$WORK/rootfs" -cf "$WORK/rootfs.tar.part" .
  mv "$WORK/rootfs.tar.part" "$WORK/rootfs.tar"
  $SUDO rm -rf "$WORK/rootfs"
fi

echo "DOCKERD=$DOCKERD"
echo "DOCKER_CONFIG=$WORK"
echo "ROOTFS_TAR=$([ -s "$WORK/rootfs.tar" ] && echo "$WORK/rootfs.tar")"
