#!/bin/sh
# Install this colibri-desktop bundle for the current user (no root, no Python needed):
#   ~/.local/bin/colibri                     -> this folder's colibri executable
#   ~/.local/share/applications/colibri-desktop.desktop   (Exec = that absolute path)
#   ~/.local/share/icons/hicolor/{256x256,scalable}/apps/colibri-desktop.{png,svg}
# The bundle itself stays where it was unpacked (it may be read-only). `./install.sh --uninstall`
# removes the three entries again (never the bundle, the models or the chats).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
data=${XDG_DATA_HOME:-$HOME/.local/share}
bin=$HOME/.local/bin
apps=$data/applications
icons=$data/icons/hicolor
if [ "${1:-}" = "--uninstall" ]; then
    rm -f "$bin/colibri" "$apps/colibri-desktop.desktop" \
          "$icons/256x256/apps/colibri-desktop.png" "$icons/scalable/apps/colibri-desktop.svg"
    echo "colibri-desktop: launcher, menu entry and icon removed (models and chats are kept)"
    exit 0
fi
mkdir -p "$bin" "$apps" "$icons/256x256/apps" "$icons/scalable/apps"
ln -sf "$here/colibri" "$bin/colibri"
cp "$here/colibri-desktop.png" "$icons/256x256/apps/colibri-desktop.png"
cp "$here/colibri-desktop.svg" "$icons/scalable/apps/colibri-desktop.svg"
tmp="$apps/.colibri-desktop.desktop.tmp"
sed "s|^Exec=.*|Exec=\"$here/colibri\"|" "$here/colibri-desktop.desktop" > "$tmp"
mv "$tmp" "$apps/colibri-desktop.desktop"
command -v update-desktop-database >/dev/null 2>&1 && update-desktop-database "$apps" >/dev/null 2>&1 || true
echo "colibri-desktop installed: menu entry 'colibri', command $bin/colibri"
case ":$PATH:" in *":$bin:"*) ;; *) echo "note: $bin is not on your PATH";; esac
