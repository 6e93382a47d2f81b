#!/bin/sh
# From a fresh Debian to the first streamed token, timed: a Debian stable chroot (debootstrap,
# minbase + python3: no X libraries, no numba cache, no pip cache), the README's first command
# in it, then the app's window under Xvfb. Needs root, debootstrap and the Debian and PyPI
# mirrors; no container daemon.
#
#   sudo sh tools/fresh_machine.sh [WORKDIR]        (default /var/tmp/colibri-fresh)
#
# Phases, each timed into WORKDIR/times.txt (and printed):
#   base       debootstrap of the base system (not part of the user's wait)
#   nodisplay  `colibri` in the base system + the project's venv but no X libraries and no
#              display: the one message saying what is missing (exit code 3)
#   readme     the README's first command, its last word `colibri` replaced by
#              `colibri run --prompt "What does json.dumps do?"` so that the first streamed token
#              can be timed (tools/first_token.py): apt-get, venv, the install (its words as the
#              README says them), the default model's conversion and the kernels (the pre-built
#              ones copied in, or compiled) all inside; apt and the install timed apart
#   nolibs     a second fresh root: the venv without the README's apt line, under Xvfb: the one
#              message naming the missing libraries
#   pip-faster pip again with its cache warm, and uv with a cold and a warm cache
#   window     in the first root, with xvfb + x11-utils installed: `colibri` (the app) under
#              Xvfb; seconds until its window is mapped, and a screenshot (xwd)
# The times are the machine's share for the script's session: on a shared machine, raise it
# first (`echo -20 > /proc/self/autogroup` in the shell) to time it as on a machine of its own,
# or not, to time it beside the other jobs. apt runs here without its progress pty
# (Dpkg::Use-Pty=0), so that dpkg stays in the script's session and priority; the CPU seconds
# tools/first_token.py prints do not depend on the load.
# Set KEEP=1 to reuse WORKDIR/base (the debootstrap) between runs, ONLY=readme to stop after
# the readme phase, ONLY=install after its install step (the root stays for a later run),
# SKIP=pip-faster to leave that phase out.
set -eu
W=${1:-/var/tmp/colibri-fresh}
REPO=$(cd "$(dirname "$0")/.." && pwd)
SUITE=${SUITE:-stable}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
Q="What does json.dumps do?"
mkdir -p "$W"
T="$W/times.txt"
: > "$T"
note() { echo "$*" | tee -a "$T"; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

if [ ! -d "$W/base" ] || [ "${KEEP:-0}" != 1 ]; then
    rm -rf "$W/base"
    t=$(now)
    debootstrap --variant=minbase --include=python3,sudo,ca-certificates "$SUITE" "$W/base" "$MIRROR" > "$W/debootstrap.log" 2>&1
    note "base: debootstrap $SUITE minbase + python3: $(since "$t") s"
fi

ROOTS=""
cleanup() {
    for r in $ROOTS; do
        for m in dev/pts dev proc sys; do umount -l "$r/$m" 2>/dev/null || true; done
    done
}
trap cleanup EXIT INT TERM

# a fresh copy of the base with the project in /home/user/colibri-desktop (its tracked files)
newroot() {
    r="$W/$1"
    for m in dev/pts dev proc sys; do umount -l "$r/$m" 2>/dev/null || true; done
    rm -rf "$r"
    cp -a "$W/base" "$r"
    cp /etc/resolv.conf "$r/etc/resolv.conf"
    # a network behind a TLS-inspecting proxy: the chroot trusts the CAs this machine added
    if ls /usr/local/share/ca-certificates/*.crt > /dev/null 2>&1; then
        cp /usr/local/share/ca-certificates/*.crt "$r/usr/local/share/ca-certificates/"
        chroot "$r" update-ca-certificates > /dev/null 2>&1
    fi
    mkdir -p "$r/home/user/colibri-desktop"
    git -C "$REPO" ls-files -z | (cd "$REPO" && xargs -0 tar cf -) | tar xf - -C "$r/home/user/colibri-desktop"
    cp "$REPO/tools/first_token.py" "$r/home/user/first_token.py"
    mount -t proc proc "$r/proc"; mount -t sysfs sys "$r/sys"
    mount --bind /dev "$r/dev"; mount --bind /dev/pts "$r/dev/pts"
    ROOTS="$ROOTS $r"
}
inroot() {  # inroot ROOT COMMAND: a login-like shell in the project folder, no display
    chroot "$W/$1" env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        LANG=C.UTF-8 TERM=dumb DEBIAN_FRONTEND=noninteractive PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
        UV_NATIVE_TLS=1 UV_SYSTEM_CERTS=1 sh -c "cd /home/user/colibri-desktop && $2"
}

README_APT=$(sed -n 's/^    sudo apt-get install -y \(.*\) && python3 -m venv .*/\1/p' "$REPO/README.md" | head -1)
[ -n "$README_APT" ] || { echo "the README's first command was not found" >&2; exit 1; }
# the install words between the venv's activation and `colibri` (pip, or uv installed by pip)
README_INSTALL=$(sed -n 's/^    sudo apt-get install -y .* && \. \.venv\/bin\/activate && \(.*\) && colibri$/\1/p' "$REPO/README.md" | head -1)
[ -n "$README_INSTALL" ] || { echo "the README's install step was not found" >&2; exit 1; }

newroot readme
t0=$(now)
inroot readme "apt-get update -q > /dev/null && sudo apt-get install -o Dpkg::Use-Pty=0 -y $README_APT" > "$W/readme-apt.log" 2>&1
note "readme: apt-get update + install (README's packages): $(since "$t0") s"
t=$(now)
inroot readme "python3 -m venv .venv" > "$W/readme-venv.log" 2>&1
note "readme: python3 -m venv .venv: $(since "$t") s"
t=$(now)
inroot readme ". .venv/bin/activate && SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt $README_INSTALL" > "$W/readme-pip.log" 2>&1
note "readme: $README_INSTALL (download + install): $(since "$t") s"
[ "${ONLY:-}" = install ] && { note "install: load average $(cut -d' ' -f1-3 /proc/loadavg)"; exit 0; }
t=$(now)
inroot readme ". .venv/bin/activate && python /home/user/first_token.py -- colibri run --prompt '$Q'" \
    > "$W/readme-run.log" 2>&1 || true
note "readme: colibri run (convert + compile + answer): $(since "$t") s; $(tail -1 "$W/readme-run.log")"
note "readme: the whole command to its end: $(since "$t0") s"
t=$(now)
inroot readme ". .venv/bin/activate && python /home/user/first_token.py -- colibri run --prompt '$Q'" \
    > "$W/readme-run2.log" 2>&1 || true
note "readme: second colibri run (warm): $(tail -1 "$W/readme-run2.log")"
note "readme: load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
[ "${ONLY:-}" = readme ] && { echo "times in $T, logs in $W"; exit 0; }
if [ "${SKIP:-}" != pip-faster ]; then
cat > "$W/readme/home/user/pipcut.sh" <<'EOF'
# what would cut pip's phase: pip again with its cache warm, then uv (cold and warm cache)
t() { s=$(date +%s.%N); "$@" > /tmp/pipcut.log 2>&1; rc=$?; awk -v a=$s -v b=$(date +%s.%N) -v r=$rc 'BEGIN { printf "%.1f s (rc %d)", b - a, r }'; }
rm -rf /tmp/v1 /tmp/v2 /tmp/v3 /tmp/uvcache
python3 -m venv /tmp/v1
echo "pip-faster: pip install -e . with pip's cache warm: $(t /tmp/v1/bin/pip install -e .)"
python3 -m venv /tmp/v2 && /tmp/v2/bin/pip install -q uv
python3 -m venv /tmp/v3
echo "pip-faster: uv pip install -e . with a cold cache: $(t env UV_CACHE_DIR=/tmp/uvcache /tmp/v2/bin/uv pip install --python /tmp/v3/bin/python -e .)"
rm -rf /tmp/v3; python3 -m venv /tmp/v3
echo "pip-faster: uv pip install -e . with its cache warm: $(t env UV_CACHE_DIR=/tmp/uvcache /tmp/v2/bin/uv pip install --python /tmp/v3/bin/python -e .)"
EOF
inroot readme "SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt sh /home/user/pipcut.sh" | tee -a "$T"
fi
inroot readme ". .venv/bin/activate && colibri; echo exit code \$?" > "$W/nodisplay.log" 2>&1 || true
note "nodisplay: colibri without a display: $(tr '\n' ' ' < "$W/nodisplay.log" | cut -c1-300)"

newroot nolibs
inroot nolibs "apt-get update -q > /dev/null && apt-get install -y python3-venv xvfb xauth > /dev/null 2>&1 && python3 -m venv .venv && . .venv/bin/activate && pip install -q -e ." > "$W/nolibs-setup.log" 2>&1
inroot nolibs ". .venv/bin/activate && xvfb-run -a colibri; echo exit code \$?" > "$W/nolibs.log" 2>&1 || true
note "nolibs: colibri under Xvfb without the README's libraries: $(tr '\n' ' ' < "$W/nolibs.log" | cut -c1-600)"

inroot readme "apt-get install -y xvfb xauth x11-utils x11-apps > /dev/null 2>&1"
cat > "$W/readme/home/user/window.sh" <<'EOF'
# the app under this X server: seconds until a top-level window named colibri is mapped
. .venv/bin/activate
t0=$(date +%s.%N)
colibri > /home/user/app.log 2>&1 &
pid=$!
while kill -0 $pid 2>/dev/null; do
    if xwininfo -root -tree 2>/dev/null | grep -qi '"colibri'; then
        echo "window mapped after $(awk -v a=$t0 -v b=$(date +%s.%N) 'BEGIN { printf "%.1f", b - a }') s"
        break
    fi
    sleep 0.2
done
sleep 20  # the model opens (already converted and compiled by the run before)
xwd -root -silent > /home/user/window.xwd
kill $pid 2>/dev/null; wait $pid; echo "app exit code $?"
EOF
inroot readme "xvfb-run -a -s '-screen 0 1400x900x24' sh /home/user/window.sh" > "$W/window.log" 2>&1 || true
cp "$W/readme/home/user/window.xwd" "$W/window.xwd" 2>/dev/null || true
note "window: $(tr '\n' ' ' < "$W/window.log" | cut -c1-300)"
echo "times in $T, logs in $W"
