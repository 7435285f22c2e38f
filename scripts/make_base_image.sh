#!/usr/bin/env bash
# A local stand-in for the Dockerfile's CUDA PyTorch base, for machines that cannot pull images: Debian
# bookworm made with debootstrap, its Python 3.11 and pip, and torch from a local CPU wheel, imported as one
# layer. An existing image of that tag is reused (REBUILD_BASE=1 makes it again). Prints the tag on stdout.
#
#   scripts/make_base_image.sh [TAG]
#   TORCH_WHEEL=/path/torch-X+cpu-cp311-cp311-manylinux_2_28_x86_64.whl   (default: the one in /opt/wheels or
#                                                     pip's find-links; https://download.pytorch.org/whl/cpu has them)
#   DEBIAN_MIRROR=http://deb.debian.org/debian
#
# So that pip inside reaches the package index this machine uses, the image gets this machine's local CA
# certificates (/usr/local/share/ca-certificates) and the index, certificate and timeout settings of its pip
# configuration (no local paths: find-links, constraints and file:// indexes stay behind). Needs root.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
log() { printf '[base] %s\n' "$*" >&2; }
die() { printf '[base] error: %s\n' "$*" >&2; exit 1; }

# ---- the torch wheel decides the tag
wheel="${TORCH_WHEEL:-}"
if [ -z "$wheel" ]; then
  dirs="/opt/wheels ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true)"
  for d in $dirs; do
    d="${d#file://}"
    for w in "$d"/torch-*+cpu-cp311-cp311-manylinux*_x86_64.whl; do [ -f "$w" ] && wheel="$w"; done
  done
fi
[ -n "$wheel" ] && [ -f "$wheel" ] || die "no CPU torch wheel for CPython 3.11 found: set TORCH_WHEEL=/path/to/torch-*+cpu-cp311-*.whl (https://download.pytorch.org/whl/cpu), or give the smoke test a base image with torch (BASE=...)"
torch_version="$(basename "$wheel" | cut -d- -f2)"   # 2.13.0+cpu
TAG="${1:-smallstate-lm-base:bookworm-torch${torch_version/+/-}}"

if [ -z "${REBUILD_BASE:-}" ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  log "reusing $TAG"
  echo "$TAG"
  exit 0
fi
[ "$(id -u)" -eq 0 ] || die "debootstrap needs root (or give BASE=an image with Python >= 3.10 and torch)"
command -v debootstrap >/dev/null || die "debootstrap is missing (apt-get install debootstrap)"

work="$(mktemp -d /var/tmp/smallstate-base.XXXXXX)"
trap 'umount "$work/rootfs/proc" 2>/dev/null || true; rm -rf "$work"' EXIT
rootfs="$work/rootfs"

t0=$SECONDS
log "debootstrap bookworm (minbase + python3, pip, CA certificates) from $MIRROR"
if ! debootstrap --variant=minbase --include=python3,python3-pip,ca-certificates bookworm "$rootfs" "$MIRROR" \
     >"$work/debootstrap.log" 2>&1; then
  tail -n 20 "$work/debootstrap.log" >&2
  die "debootstrap failed (log above)"
fi
cat >"$rootfs/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
# as in Debian's official images: dpkg without fsync (nothing in an image build needs crash safety), no translations
echo force-unsafe-io >"$rootfs/etc/dpkg/dpkg.cfg.d/docker-apt-speedup"
echo 'Acquire::Languages "none";' >"$rootfs/etc/apt/apt.conf.d/docker-no-languages"
# this machine's CA certificates and pip settings (see the header)
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
fi
chroot "$rootfs" update-ca-certificates >/dev/null 2>&1
python3 - "$rootfs/etc/pip.conf" <<'EOF'
import subprocess, sys
out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
keep = {}
for line in out.splitlines():
    key, _, value = line.partition("=")
    section, _, name = key.partition(".")
    if section != "global":
        continue  # ":env:" lines are this shell's PIP_* variables
    value = value.strip().strip("'\"")
    if name in ("index-url", "extra-index-url"):
        value = " ".join(u for u in value.split() if u.startswith(("http://", "https://")))
    elif name == "cert":
        value = "/etc/ssl/certs/ca-certificates.crt"  # the image's bundle, which has this machine's CAs
    elif name not in ("timeout", "trusted-host", "retries"):
        continue
    if value:
        keep[name] = value
with open(sys.argv[1], "w") as f:
    f.write("[global]\n" + "".join(f"{k} = {v}\n" for k, v in keep.items()))
EOF
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
mount -t proc proc "$rootfs/proc"
log "installing $(basename "$wheel") (and its dependencies from the package index)"
cp "$wheel" "$rootfs/tmp/"
# torch's own dependencies at the versions the project's tests use
cat >"$rootfs/tmp/constraints.txt" <<'EOF'
filelock==4.3.1
fsspec==2026.9.0
jinja2==3.1.6
markupsafe==3.0.4
mpmath==1.3.0
networkx==3.6.1
setuptools==84.2.1
sympy==1.14.0
typing-extensions==4.16.0
EOF
if ! chroot "$rootfs" env PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
     python3 -m pip install -q -c /tmp/constraints.txt "/tmp/$(basename "$wheel")" >"$work/pip.log" 2>&1; then
  tail -n 20 "$work/pip.log" >&2
  die "installing torch in the base failed (log above)"
fi
chroot "$rootfs" python3 -c "import torch; print('[base] torch', torch.__version__)" >&2
umount "$rootfs/proc"
rm -rf "$rootfs"/tmp/* "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* "$rootfs/etc/resolv.conf"
: >"$rootfs/etc/resolv.conf"
log "importing as $TAG"
tar -C "$rootfs" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' \
  -m "debootstrap bookworm + python3 + torch $torch_version (scripts/make_base_image.sh)" - "$TAG" >/dev/null
log "made $TAG in $((SECONDS - t0)) s ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
echo "$TAG"
