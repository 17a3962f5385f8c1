#!/usr/bin/env bash
# Make sure a Debian package a group of tests needs is present (`make test` runs this for
# Chromium and Prometheus). It installs the package when it is missing and the machine allows
# it (root with apt-get); otherwise it says why and leaves the decision to the tests, which skip
# locally and fail under CI=true, as for PostgreSQL.
#
#   ensure_debian_package.sh PACKAGE "WHAT NEEDS IT" LOG COMMAND...
#
# The package counts as present when one of the COMMANDs is on PATH.
set -uo pipefail
package=$1 purpose=$2 log=$3
shift 3
for name in "$@"; do
  command -v "$name" >/dev/null 2>&1 && exit 0
done

if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "$package is missing and cannot be installed here (needs root and apt-get):" \
       "$purpose will skip (and fail under CI=true)"
  exit 0
fi

echo "installing Debian's $package for $purpose (log: $log)"
if { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$package"; } \
     >"$log" 2>&1; then
  exit 0
fi
tail -20 "$log"
echo "installing $package failed (full log: $log): $purpose will skip (and fail under CI=true)"
exit 0
