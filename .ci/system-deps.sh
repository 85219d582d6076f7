#!/usr/bin/env bash
# Installs the Debian packages tidal's tests use, when they are missing.
# Idempotent; needs root (CI and developer machines run as root) or sudo.
set -euo pipefail
need=()
command -v etcd >/dev/null 2>&1 && etcd --version 2>/dev/null | grep -q "etcd Version: 3.4" || need+=(etcd-server)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "installing Debian packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null || $SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
# Debian starts the etcd service on install; tidal starts its own etcd on free
# ports, so stop the system one where a service manager runs it.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null; then
  $SUDO systemctl stop etcd || true
fi
