#!/usr/bin/env bash
# Create tidal's etcd users and roles, then turn etcd's authentication on.
#
# Users and what their roles may do (P is the key root, /tidal by default):
#
#   tidal-coordinator  readwrite P/jobs/ P/assignments/ P/drains/ P/events/ P/election/ P/queues/ P/slow/
#                      read      P/nodes/ P/status/
#   tidal-agent        readwrite P/nodes/ P/status/ P/rdzv/
#                      read      P/assignments/ P/jobs/
#   root               everything (etcd requires it before `auth enable`); for
#                      operators and this script only, never for a tidal process
#
# Nobody but the agents may write P/rdzv/: torch keeps its rendezvous state
# there as a pickle, which every agent of a job unpickles (code execution for
# whoever can write it). The coordinator cannot even read it. See
# docs/deploy.md ("etcd users and roles") for why agents share one user.
# An agent reads P/jobs/ to run only assignments of jobs that exist.
#
# The roles have one home, rendezvous/etcd/auth.py (ROLES), which `tidal up`
# applies to its own etcd; the grant lines below must match it
# (tests/unit/rendezvous/etcd/test_auth.py reads them and compares).
#
# Safe to run again: existing users get their password reset from the files,
# existing roles get the permissions granted again. It does not revoke
# permissions granted by hand.
#
# Environment:
#   ETCDCTL_ENDPOINTS         etcd client URLs, comma-separated (etcdctl reads it)
#   ETCDCTL_CACERT / ETCDCTL_CERT / ETCDCTL_KEY
#                             TLS files, when etcd serves https (etcdctl reads them)
#   ETCD_ROOT_PASSWORD_FILE   file holding the password of etcd's root user
#   TIDAL_COORDINATOR_PASSWORD_FILE, TIDAL_AGENT_PASSWORD_FILE
#                             files holding the passwords of the two tidal users
#   TIDAL_ETCD_ROOT           key root (default /tidal), as the processes' --etcd-root
#   ETCDCTL                   the etcdctl to run (default: etcdctl on PATH)
#
# Passwords are read from files and handed to etcdctl on its standard input,
# never on a command line (which every local user can read). etcdctl reads a
# password up to the first blank, so they must not contain any:
# `openssl rand -hex 24` makes good ones.
set -euo pipefail

ETCDCTL=${ETCDCTL:-etcdctl}
ROOT=${TIDAL_ETCD_ROOT:-/tidal}
export ETCDCTL_API=3

die() {
    echo "setup-auth.sh: $*" >&2
    exit 1
}

if [[ ! $ROOT =~ ^(/[A-Za-z0-9][A-Za-z0-9._-]*)+$ ]]; then
    die "TIDAL_ETCD_ROOT ($ROOT) must look like /tidal: it starts with / and does not end with /"
fi
command -v "$ETCDCTL" >/dev/null || die "no etcdctl found (set ETCDCTL to its path)"

# Prints the password held in file $1 (named by variable $2), checked.
read_secret() {
    local file=$1 name=$2 value
    [[ -n $file ]] || die "$name is not set"
    [[ -r $file ]] || die "$name ($file) is not a readable file"
    value=$(<"$file")
    [[ -n $value ]] || die "$name ($file) is empty"
    [[ $value =~ [[:space:]] ]] && die "$name ($file): the password contains a blank"
    printf '%s\n' "$value"
}

ctl() {
    "$ETCDCTL" "$@"
}

# Create user $1 with the password in file $2, or reset the password of an
# existing one.
ensure_user() {
    local user=$1 file=$2 name=$3
    if ctl user get "$user" >/dev/null 2>&1; then
        read_secret "$file" "$name" | ctl user passwd "$user" --interactive=false >/dev/null
        echo "user $user: password reset"
    else
        read_secret "$file" "$name" | ctl user add "$user" --interactive=false >/dev/null
        echo "user $user: created"
    fi
}

ensure_role() {
    ctl role get "$1" >/dev/null 2>&1 || ctl role add "$1" >/dev/null
}

# grant ROLE read|readwrite SUFFIX...: permissions on the prefixes P/SUFFIX/.
grant() {
    local role=$1 perm=$2 suffix
    shift 2
    for suffix in "$@"; do
        ctl role grant-permission "$role" --prefix=true "$perm" "$ROOT/$suffix/" >/dev/null
        echo "role $role: $perm $ROOT/$suffix/"
    done
}

# Validate every input before changing anything.
read_secret "${ETCD_ROOT_PASSWORD_FILE:-}" ETCD_ROOT_PASSWORD_FILE >/dev/null
read_secret "${TIDAL_COORDINATOR_PASSWORD_FILE:-}" TIDAL_COORDINATOR_PASSWORD_FILE >/dev/null
read_secret "${TIDAL_AGENT_PASSWORD_FILE:-}" TIDAL_AGENT_PASSWORD_FILE >/dev/null

# Once auth is on (a second run), act as root. Before, etcd needs no user, and
# etcdctl would warn at every command that auth is not enabled.
if ! ctl user list >/dev/null 2>&1; then
    export ETCDCTL_USER=root
    ETCDCTL_PASSWORD=$(read_secret "$ETCD_ROOT_PASSWORD_FILE" ETCD_ROOT_PASSWORD_FILE)
    export ETCDCTL_PASSWORD
fi

ensure_user root "$ETCD_ROOT_PASSWORD_FILE" ETCD_ROOT_PASSWORD_FILE
ctl user grant-role root root >/dev/null

ensure_role tidal-coordinator
grant tidal-coordinator readwrite jobs assignments drains events election queues slow
grant tidal-coordinator read nodes status
ensure_user tidal-coordinator "$TIDAL_COORDINATOR_PASSWORD_FILE" TIDAL_COORDINATOR_PASSWORD_FILE
ctl user grant-role tidal-coordinator tidal-coordinator >/dev/null

ensure_role tidal-agent
grant tidal-agent readwrite nodes status rdzv
grant tidal-agent read assignments jobs
ensure_user tidal-agent "$TIDAL_AGENT_PASSWORD_FILE" TIDAL_AGENT_PASSWORD_FILE
ctl user grant-role tidal-agent tidal-agent >/dev/null

ctl auth enable >/dev/null
echo "etcd authentication is enabled; tidal users: tidal-coordinator, tidal-agent"
