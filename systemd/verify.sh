#!/usr/bin/env bash
# Checks the systemd units with `systemd-analyze verify`, on a machine where neither
# /usr/local/bin/fantom-sidecar nor the fantom-sidecar user exists (CI):
#
#   bash systemd/verify.sh target/debug/fantom-sidecar
#
# The units are copied into a temporary directory with the binary's path rewritten to $1 (and
# /bin/kill to $1 too where this machine has no /bin/kill: verify only checks that it is an
# executable), then verified there; the hub's unit is verified a second time with the etcd
# drop-in (fantom-sidecar-hub-etcd.conf) installed beside it as the docs say. Fails on a
# non-zero exit and on any output line about our units or the drop-in; lines about other units
# of the host (some hosts ship units verify complains about) are printed and ignored. Also runs `systemd-analyze security --offline=yes` when this systemd has
# it, to print the exposure scores (informational, never fatal).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
units=(fantom-sidecar-agent.service fantom-sidecar-hub.service)
installed=/usr/local/bin/fantom-sidecar

if [ $# -ne 1 ]; then
  echo "usage: $0 PATH-TO-fantom-sidecar" >&2
  exit 2
fi
if [ ! -f "$1" ] || [ ! -x "$1" ]; then
  echo "verify.sh: $1 is not an executable file (build it first)" >&2
  exit 2
fi
binary="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
command -v systemd-analyze >/dev/null || {
  echo "verify.sh: systemd-analyze is missing (Debian: apt-get install systemd)" >&2
  exit 2
}

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

kill_bin=/bin/kill
[ -x "$kill_bin" ] || kill_bin="$binary"

for unit in "${units[@]}"; do
  [ -f "$here/$unit" ] || { echo "verify.sh: $here/$unit is missing" >&2; exit 1; }
  # '|' never occurs in a path we accept here.
  case "$binary$kill_bin" in *'|'*) echo "verify.sh: '|' in a path" >&2; exit 2 ;; esac
  sed -e "s|$installed|$binary|g" -e "s|^ExecReload=/bin/kill |ExecReload=$kill_bin |" \
    "$here/$unit" >"$work/$unit"
  grep -q "^ExecStart=$binary " "$work/$unit" || {
    echo "verify.sh: $unit: ExecStart does not run $installed" >&2
    exit 1
  }
done

man_flag=()
if systemd-analyze verify --help 2>/dev/null | grep -q -- '--man'; then
  man_flag=(--man=no)
fi

# verify DIR UNIT...: fails on a non-zero exit or on any line about our units or drop-in.
verify() {
  local dir="$1" status=0 out ours=""
  shift
  out="$(cd "$dir" && SYSTEMD_LOG_COLOR=0 systemd-analyze verify "${man_flag[@]}" "${@/#/$dir/}" 2>&1)" || status=$?
  if [ -n "$out" ]; then
    echo "systemd-analyze verify said:"
    printf '%s\n' "$out" | sed 's/^/  /'
    ours="$(printf '%s\n' "$out" | grep -E 'fantom-sidecar(-agent|-hub)?\.service' || true)"
  fi
  if [ "$status" -ne 0 ] || [ -n "$ours" ]; then
    echo "FAIL: systemd-analyze verify (exit $status)${ours:+; about our units:}" >&2
    [ -z "$ours" ] || printf '%s\n' "$ours" | sed 's/^/  /' >&2
    exit 1
  fi
}

verify "$work" "${units[@]}"

# The hub's etcd drop-in, installed as the docs say: the hub unit with it is verified again
# (systemd reads UNIT.d/*.conf beside the unit; a line about the drop-in names its path).
ha="$work/ha"
mkdir -p "$ha/fantom-sidecar-hub.service.d"
cp "$work/fantom-sidecar-hub.service" "$ha/"
sed -e "s|$installed|$binary|g" "$here/fantom-sidecar-hub-etcd.conf" \
  >"$ha/fantom-sidecar-hub.service.d/etcd.conf"
grep -q "^ExecStart=$binary hub " "$ha/fantom-sidecar-hub.service.d/etcd.conf" || {
  echo "verify.sh: fantom-sidecar-hub-etcd.conf: ExecStart does not run $installed hub" >&2
  exit 1
}
verify "$ha" fantom-sidecar-hub.service
echo "ok: ${units[*]} (and the hub with fantom-sidecar-hub-etcd.conf) verify cleanly ($(systemd-analyze --version | sed -n 1p))"

if systemd-analyze security --help 2>/dev/null | grep -q -- '--offline'; then
  for unit in "${units[@]}"; do
    score="$(cd "$work" && systemd-analyze security --offline=yes --no-pager "$work/$unit" 2>/dev/null |
      grep -E 'Overall exposure level' || true)"
    echo "security $unit: ${score:-(no score)}"
  done
fi
