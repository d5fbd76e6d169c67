#!/usr/bin/env bash
# Copies the console's screenshot that the browser test wrote (target/console.png, by
# `cargo test --test fleet console::an_operator_runs_the_fleet_from_the_console_in_a_real_browser`)
# to docs/console.png, where the README shows it.
set -euo pipefail
cd "$(dirname "$0")/.."
src="${CARGO_TARGET_DIR:-target}/console.png"
if [ ! -f "$src" ]; then
  echo "no $src: run the console's browser test first (see this script's header)" >&2
  exit 1
fi
cp "$src" docs/console.png
echo "docs/console.png updated from $src"
