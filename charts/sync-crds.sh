#!/usr/bin/env bash
# Copy the CustomResourceDefinitions from crds/ (the one source) into the chart's crds/ folder.
#
#   charts/sync-crds.sh          copy; the chart then holds exactly crds/*.yaml
#   charts/sync-crds.sh --check  exit 1 and list the differences when the copy has drifted
#
# Helm installs charts/kvbridge/crds/ before the templates and never deletes or upgrades it
# (https://helm.sh/docs/chart_best_practices/custom_resource_definitions/); after changing
# crds/, run this script and commit both copies. tests/chart checks that they are identical.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
src="$root/crds"
dst="$root/charts/kvbridge/crds"

shopt -s nullglob
sources=("$src"/*.yaml)
[ "${#sources[@]}" -gt 0 ] || { echo "sync-crds: no CRDs in $src" >&2; exit 1; }

if [ "${1:-}" = "--check" ]; then
    status=0
    for f in "${sources[@]}"; do
        diff -u "$f" "$dst/$(basename "$f")" >&2 || status=1
    done
    for f in "$dst"/*; do
        [ -e "$src/$(basename "$f")" ] || { echo "sync-crds: extra file $f" >&2; status=1; }
    done
    if [ "$status" = 0 ]; then
        echo "sync-crds: $dst matches $src"
    else
        echo "sync-crds: $dst differs from $src; run charts/sync-crds.sh" >&2
    fi
    exit "$status"
elif [ -n "${1:-}" ]; then
    echo "usage: $0 [--check]" >&2
    exit 2
fi

mkdir -p "$dst"
# Drop copies whose source is gone, then copy every source.
for f in "$dst"/*; do
    [ -e "$src/$(basename "$f")" ] || { rm -f "$f"; echo "sync-crds: removed $(basename "$f")"; }
done
for f in "${sources[@]}"; do
    cp "$f" "$dst/"
done
echo "sync-crds: copied ${#sources[@]} file(s) from crds/ to charts/kvbridge/crds/"
