#!/bin/bash
# Build dist/providerd_<version>_all.deb with debhelper + dh-python (pybuild, pyproject).
# Usage: packaging/build-deb.sh OUTDIR [VERSION]
#   VERSION (optional) adds a changelog entry on top, for upgrade tests.
# The source tree is copied (tracked and unignored files only) and packaging/debian
# becomes debian/ in the copy; the checkout itself is never written to.
set -euo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin   # no pyenv shims: pybuild must find Debian's python3
export LC_ALL=C.UTF-8 DEB_BUILD_OPTIONS=nocheck
out=${1:?usage: build-deb.sh OUTDIR [VERSION]}
version=${2:-}
src=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)

work=$(mktemp -d /var/tmp/providerd-deb.XXXXXX)
trap 'rm -rf "$work"' EXIT
tree=$work/providerd
mkdir -p "$tree"
(cd "$src" && git ls-files -z -co --exclude-standard | xargs -0 -r cp -a --parents -t "$tree" 2>/dev/null) || true
[[ -f $tree/pyproject.toml ]] || { echo "build-deb: $src is not a providerd checkout" >&2; exit 1; }
cp -a "$src/packaging/debian" "$tree/debian"

deb_version=$(dpkg-parsechangelog -l "$tree/debian/changelog" -S Version)
py_version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$tree/pyproject.toml")
if [[ ${deb_version%%[-+~]*} != "$py_version" ]]; then
    echo "build-deb: packaging/debian/changelog says $deb_version but pyproject.toml says $py_version; add a changelog entry" >&2
    exit 1
fi
if [[ -n $version ]]; then
    {
        printf 'providerd (%s) unstable; urgency=medium\n\n  * Rebuild for upgrade tests.\n\n' "$version"
        printf ' -- providerd maintainers <providerd@example.org>  %s\n\n' "$(date -R)"
        cat "$tree/debian/changelog"
    } >"$work/changelog" && mv "$work/changelog" "$tree/debian/changelog"
    deb_version=$version
fi

# What exists of the documentation is installed; the lists are written here so that
# the package follows the tree.
for f in README.md docs/manifest.md docs/architecture.md docs/kubernetes.md docs/metrics.md docs/keys.md; do
    if [[ -f $tree/$f ]]; then echo "$f"; fi
done >"$tree/debian/providerd.docs"
mkdir -p "$tree/docs/man" "$tree/examples"
(cd "$tree" && find docs/man -maxdepth 1 -type f -name '*.[1-8]' | sort) >"$tree/debian/providerd.manpages"
(cd "$tree" && find examples -mindepth 1 -maxdepth 1 ! -name '*.pyc' ! -name __pycache__ | sort) >"$tree/debian/providerd.examples"
for f in units/providerd-generator units/provider@.socket units/provider@.service units/provider-worker@.service; do
    [[ -f $tree/$f ]] || echo "build-deb: warning: $f is missing; the package will not work without it" >&2
done
if [[ ! -f $tree/units/providerd-generator ]]; then
    # Keep the package buildable while the generator is being written.
    sed -i "/providerd-generator/d" "$tree/debian/rules"
fi

(cd "$tree" && dpkg-buildpackage -us -uc -b --no-sign) >"$work/build.log" 2>&1 || {
    tail -n 40 "$work/build.log" >&2
    echo "build-deb: dpkg-buildpackage failed; full log above" >&2
    exit 1
}
deb=$work/providerd_${deb_version}_all.deb
[[ -f $deb ]] || { echo "build-deb: $deb was not produced" >&2; ls "$work" >&2; exit 1; }
mv -f "$deb" "$out/"
echo "$out/providerd_${deb_version}_all.deb"
