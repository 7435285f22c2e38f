#!/usr/bin/env bash
# A local stand-in for the Dockerfile's CUDA PyTorch base, for machines that cannot pull images: Debian
# bookworm made with debootstrap, its Python 3.11 and pip, and torch from a local CPU wheel, imported as one
# layer. An existing image of that tag is reused (REBUILD_BASE=1 makes it again). Prints the tag on stdout.
#
#   scripts/make_base_image.sh [TAG]
#   TORCH_WHEEL=/path/torch-X+cpu-cp311-cp311-manylinux_2_28_x86_64.whl   (default: the one in /opt/wheels,
#                              pip's find-links or .build/wheels)
#   TORCH_INDEX_URL=URL        where no wheel is found: a pip index with CPU torch wheels (your PyTorch CPU
#                              index); `pip download torch==$TORCH_VERSION --index-url URL` fetches the CPython
#                              3.11 wheel into .build/wheels (TORCH_VERSION=2.13.0, as scripts/setup.sh installs)
#   DEBIAN_MIRROR=URL          default: the first Debian archive in this machine's apt sources (/etc/apt/sources.list,
#   DEBIAN_SECURITY_MIRROR=URL sources.list.d/*.list and *.sources), and likewise its Debian security archive
#
# So that pip inside reaches the package index this machine uses, the image gets this machine's local CA
# certificates (/usr/local/share/ca-certificates) and the index, certificate and timeout settings of its pip
# configuration (no local paths: find-links, constraints and file:// indexes stay behind). Needs root.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
WHEELS="$ROOT/.build/wheels"
log() { printf '[base] %s\n' "$*" >&2; }
die() { printf '[base] error: %s\n' "$*" >&2; exit 1; }

# ---- the torch wheel decides the tag
wheel="${TORCH_WHEEL:-}"
if [ -z "$wheel" ]; then
  dirs="/opt/wheels ${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true) $WHEELS"
  for d in $dirs; do
    d="${d#file://}"
    for w in "$d"/torch-*+cpu-cp311-cp311-manylinux*_x86_64.whl; do [ -f "$w" ] && wheel="$w"; done
  done
fi
if [ -z "$wheel" ] && [ -n "${TORCH_INDEX_URL:-}" ]; then
  log "downloading torch==$TORCH_VERSION for CPython 3.11 from TORCH_INDEX_URL into $WHEELS"
  python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.11 --implementation cp --abi cp311 \
    --platform manylinux_2_28_x86_64 "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL" -d "$WHEELS" \
    || die "pip download torch==$TORCH_VERSION --index-url $TORCH_INDEX_URL failed (its output is above)"
  for w in "$WHEELS"/torch-"$TORCH_VERSION"*-cp311-cp311-manylinux*_x86_64.whl; do [ -f "$w" ] && wheel="$w"; done
fi
[ -n "$wheel" ] && [ -f "$wheel" ] || die "no CPU torch wheel for CPython 3.11 found: set TORCH_WHEEL=/path/to/torch-*+cpu-cp311-*.whl or TORCH_INDEX_URL=<a pip index with CPU torch wheels>, or give the smoke test a base image with torch (BASE=...)"
torch_version="$(basename "$wheel" | cut -d- -f2)"   # 2.13.0+cpu
TAG="${1:-smallstate-lm-base:bookworm-torch${torch_version/+/-}}"

if [ -z "${REBUILD_BASE:-}" ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  log "reusing $TAG"
  echo "$TAG"
  exit 0
fi
[ "$(id -u)" -eq 0 ] || die "debootstrap needs root (or give BASE=an image with Python >= 3.10 and torch)"
command -v debootstrap >/dev/null || die "debootstrap is missing (apt-get install debootstrap)"

# ---- the Debian mirrors: DEBIAN_MIRROR and DEBIAN_SECURITY_MIRROR, else the first of each in this machine's apt
# sources (one-line *.list, deb822 *.sources): the first http(s) `deb` entry with component main whose suite is a
# Debian release (bookworm, stable, ...) or its -updates is the archive; one whose suite is <release>-security
# is the security archive
read -r found_mirror found_security < <(python3 - /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
    /etc/apt/sources.list.d/*.sources <<'EOF'
import re, sys
release = r"(sid|forky|trixie|bookworm|bullseye|buster|stable|testing|unstable|oldstable|oldoldstable)"
entries = []  # (uri, suite) in apt's order
for path in sys.argv[1:]:
    try:
        lines = [line.rstrip() for line in open(path).read().splitlines() if not line.lstrip().startswith("#")]
    except OSError:
        continue  # an unmatched glob, an unreadable file
    if path.endswith(".sources"):  # deb822 stanzas: Types, URIs, Suites, Components, Enabled
        for stanza in re.split(r"\n\s*\n", "\n".join(lines)):
            fields, key = {}, ""
            for line in stanza.splitlines():
                if line[:1].isspace() and key:
                    fields[key] += " " + line.strip()
                elif ":" in line:
                    key, _, value = line.partition(":")
                    key = key.strip().lower()
                    fields[key] = value.strip()
            if ("deb" in fields.get("types", "").split() and "main" in fields.get("components", "").split()
                    and fields.get("enabled", "yes").lower() != "no"):
                entries += [(uri, suite) for uri in fields.get("uris", "").split()[:1]
                            for suite in fields.get("suites", "").split()]
    else:  # deb [options] uri suite component...
        for line in lines:
            words = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
            if len(words) >= 4 and words[0] == "deb" and "main" in words[3:]:
                entries.append((words[1], words[2]))
web = [(uri.rstrip("/"), suite) for uri, suite in entries if uri.startswith(("http://", "https://"))]
archive = next((uri for uri, suite in web if re.fullmatch(release + "(-updates)?", suite)), "-")
security = next((uri for uri, suite in web if re.fullmatch(release + "(-security|/updates)", suite)), "-")
print(archive, security)
EOF
)
MIRROR="${DEBIAN_MIRROR:-${found_mirror#-}}"
SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-${found_security#-}}"
[ -n "$MIRROR" ] || die "no Debian archive found in this machine's apt sources (/etc/apt/sources.list, /etc/apt/sources.list.d/*.list and *.sources): set DEBIAN_MIRROR=<the URL of a Debian mirror>"
[ -n "$SECURITY_MIRROR" ] || log "no Debian security archive in this machine's apt sources and no DEBIAN_SECURITY_MIRROR: the image's apt gets none"

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
${SECURITY_MIRROR:+deb $SECURITY_MIRROR bookworm-security main}
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
