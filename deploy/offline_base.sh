#!/usr/bin/env bash
# A Debian base image with python3 for the reward images, built where Docker Hub is unreachable: debootstrap
# from a Debian mirror, then `docker import`. Needs root, debootstrap and a running Docker engine.
#   deploy/offline_base.sh [IMAGE]      (default rewardflow-base:bookworm; DEBIAN_MIRROR overrides the mirror)
# Then: REWARD_IMAGE_BASE=IMAGE docker compose build
set -euo pipefail
image=${1:-rewardflow-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
command -v debootstrap >/dev/null || { echo "error: debootstrap is missing: apt-get install debootstrap" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "error: debootstrap needs root: sudo $0 $*" >&2; exit 1; }
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" >/dev/null
tar -C "$root" -c . | docker import --change 'CMD ["python3"]' - "$image" >/dev/null
echo "built $image"
