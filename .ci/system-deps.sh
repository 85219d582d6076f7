#!/usr/bin/env bash
# Installs the Debian packages tidal's tests use, when they are missing.
# Idempotent; needs root (CI and developer machines run as root) or sudo.
set -euo pipefail
need=()
command -v etcd >/dev/null 2>&1 && etcd --version 2>/dev/null | grep -q "etcd Version: 3.4" || need+=(etcd-server)
# The metrics tests scrape a running tidal with a real Prometheus and check
# deploy/prometheus/ with promtool; Debian's package ships both binaries.
{ command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; } || need+=(prometheus)
# The multi-host tests build network namespaces, veth pairs and netem qdiscs.
{ command -v ip >/dev/null 2>&1 && command -v tc >/dev/null 2>&1; } || need+=(iproute2)
# The web page's tests (tests/browser) drive a real headless chromium through
# chromedriver; Selenium is given both paths and never downloads either.
[ -x /usr/bin/chromium ] || need+=(chromium)
[ -x /usr/bin/chromedriver ] || need+=(chromium-driver)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "installing Debian packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null || $SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
# Debian starts the etcd and prometheus services on install; tidal starts its
# own etcd and Prometheus on free ports, so stop the system ones where a
# service manager runs them.
if command -v systemctl >/dev/null 2>&1; then
  for unit in etcd prometheus; do
    if systemctl is-active --quiet "$unit" 2>/dev/null; then
      $SUDO systemctl stop "$unit" || true
    fi
  done
fi
for tool in prometheus promtool; do
  command -v "$tool" >/dev/null 2>&1 || { echo "$tool is not on PATH after installing prometheus" >&2; exit 1; }
done
