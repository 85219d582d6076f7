"""The etcd roles have one home (rendezvous.etcd.auth.ROLES); setup-auth.sh mirrors it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rendezvous.etcd.auth import AGENT_USER, COORDINATOR_USER, ROLES, Role, enable_auth
from rendezvous.keys import InvalidIdentifierError

REPO = Path(__file__).resolve().parents[4]
SETUP_AUTH = REPO / "deploy" / "etcd" / "setup-auth.sh"


def _script_grants() -> dict[str, set[tuple[str, str]]]:
    """``grant ROLE PERM SUFFIX...`` lines of setup-auth.sh, as (permission, suffix) sets."""
    grants: dict[str, set[tuple[str, str]]] = {}
    for line in SETUP_AUTH.read_text().splitlines():
        match = re.fullmatch(r"grant (\S+) (read|readwrite) (.+)", line.strip())
        if match:
            role, permission, suffixes = match.groups()
            grants.setdefault(role, set()).update((permission, s) for s in suffixes.split())
    return grants


def _module_grants() -> dict[str, set[tuple[str, str]]]:
    return {
        role.name: {("readwrite", p) for p in role.readwrite} | {("read", p) for p in role.read}
        for role in ROLES
    }


def test_setup_auth_script_grants_exactly_the_roles_of_the_module() -> None:
    assert _script_grants() == _module_grants()


def test_setup_auth_script_header_lists_the_same_prefixes() -> None:
    header = SETUP_AUTH.read_text().split("set -euo pipefail", 1)[0]
    for role in ROLES:
        for permission, prefixes in (("readwrite", role.readwrite), ("read", role.read)):
            listed = " ".join(f"P/{p}/" for p in prefixes)
            assert re.search(rf"{permission}\s+{re.escape(listed)}\s*$", header, re.M), (
                f"the header of setup-auth.sh does not list {role.name}'s {permission} {listed}"
            )


def test_agents_read_jobs_and_assignments_and_write_neither() -> None:
    agent = next(role for role in ROLES if role.name == AGENT_USER)
    assert {"jobs", "assignments"} <= set(agent.read)
    assert not {"jobs", "assignments"} & set(agent.readwrite)


def test_only_agents_touch_the_rendezvous() -> None:
    coordinator = next(role for role in ROLES if role.name == COORDINATOR_USER)
    assert "rdzv" not in coordinator.read + coordinator.readwrite


def test_grants_are_prefixes_below_the_root_ending_in_a_slash() -> None:
    role = Role("r", readwrite=("jobs",), read=("nodes",))
    assert role.grants("/tidal-x") == [("readwrite", "/tidal-x/jobs/"), ("read", "/tidal-x/nodes/")]


def test_grants_refuse_a_root_ending_in_a_slash() -> None:
    with pytest.raises(InvalidIdentifierError):
        Role("r", readwrite=("jobs",), read=()).grants("/tidal/")


def test_enable_auth_refuses_a_password_with_a_blank_before_running_anything() -> None:
    passwords = {"root": "a b", COORDINATOR_USER: "x" * 16, AGENT_USER: "y" * 16}
    with pytest.raises(ValueError, match="'root' is missing or holds a blank"):
        enable_auth(endpoint="127.0.0.1:1", root="/tidal", passwords=passwords,
                    etcdctl=Path("/nonexistent/etcdctl"))


def test_etcdctl_as_a_pip_target_shim_finds_its_module_through_pythonpath(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pip install --target` (the GPU check's install) leaves ``bin/etcdctl`` a Python
    shim that imports its package from PYTHONPATH; etcdctl runs in a scrubbed
    environment, which must keep PYTHONPATH (the GPU check's first run failed here)."""
    import sys

    from rendezvous.etcd.auth import _Etcdctl

    site = tmp_path / "site"
    (site / "fake_distro").mkdir(parents=True)
    (site / "fake_distro" / "__init__.py").write_text(
        "import os\ndef main():\n    print('etcdctl', os.environ['ETCDCTL_ENDPOINTS'])\n")
    shim = tmp_path / "bin" / "etcdctl"
    shim.parent.mkdir()
    shim.write_text(f"#!{sys.executable}\nfrom fake_distro import main\nmain()\n")
    shim.chmod(0o755)
    monkeypatch.setenv("PYTHONPATH", str(site))
    done = _Etcdctl(shim, "127.0.0.1:2379", timeout_s=10).run("version")
    assert done.stdout.strip() == "etcdctl 127.0.0.1:2379"
