#!/usr/bin/env bash
# Build the documentation site (mkdocs.yml, docs/) strictly: a broken link or anchor, or a page
# left out of the nav, fails the build. The site goes to a temporary folder that is then removed.
#   bash scripts/docs.sh            (CI runs it after the tests)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -m mkdocs --version >/dev/null 2>&1; then
  python -m pip install -q "mkdocs>=1.6,<2"  # the range of pyproject.toml's `docs` extra
fi
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
if ! out=$(python -m mkdocs build --strict --site-dir "$site" 2>&1); then
  printf '%s\n' "$out" | grep -v '^INFO' >&2
  echo "docs: mkdocs build --strict failed (above: what to fix)" >&2
  exit 1
fi
echo "docs: mkdocs build --strict passed ($(find "$site" -name '*.html' | wc -l) pages)"
