"""The deployment files in deploy/ are valid, consistent with each other and with tidal.

Offline checks only (no cluster, no Docker daemon, no systemd as PID 1):

* every YAML file parses; the Kubernetes manifests validate against the
  Kubernetes OpenAPI schemas (kubernetes-validate bundles them), strictly, so
  a misspelt field fails; the ServiceMonitors (a CRD) are checked by structure:
  each selects one Service and names ports it has;
* Services select the pods that serve the ports they name; the coordinator runs
  two replicas, ready on /readyz; the agents are a DaemonSet asking for GPUs on
  the host network; `kubectl kustomize` renders every manifest (if kubectl is here);
* every ``TIDAL_*`` variable in the systemd environment files, the compose
  file and the manifests is a real setting of the process that reads it, and
  every ``ETCD_*`` one a flag of etcd (a typo would be ignored silently);
* secrets are never inline: passwords and tokens come from Secrets or files;
* the systemd units pass ``systemd-analyze verify``; the compose file has a
  3-member etcd, the coordinator and two agents; the Dockerfile parses line by
  line (FROM first, torch before the project) and copies only what exists and
  its ignore file lets through; setup-auth.sh is valid bash.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.node.settings import AgentSettings
from rendezvous.errors import EtcdBinaryNotFoundError
from rendezvous.etcd.server import find_etcd_binary
from service.coordinator.settings import CoordinatorSettings

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
# The parts of deploy/ these tests cover (deploy/prometheus and deploy/grafana have their own).
OURS = ("kubernetes", "compose", "systemd", "etcd")
# Kinds with no schema in Kubernetes itself.
CUSTOM_KINDS = {"ServiceMonitor", "Kustomization"}
# Prometheus's job label is the Service's name; the alerts and dashboard use these.
PROMETHEUS_JOBS = {"tidal-coordinator", "tidal-agent"}

AGENT_VARS = {f"TIDAL_{name.upper()}" for name in AgentSettings.model_fields}
COORDINATOR_VARS = {f"TIDAL_{name.upper()}" for name in CoordinatorSettings.model_fields}
SECRET_NAME = re.compile(r"PASSWORD|(^|_)TOKEN$")
SECRET_FILE_NAME = re.compile(r"PASSWORD|(^|_)TOKEN(_FILE)?$")
# Named like secrets, and none: etcd's cluster token only tells clusters apart.
NOT_SECRET = {"ETCD_INITIAL_CLUSTER_TOKEN"}


def _yaml_files() -> list[Path]:
    return sorted(p for part in OURS for p in (DEPLOY / part).rglob("*.y*ml"))


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for i, doc in enumerate(_documents(path)):
            out.append((f"{path.name}#{i} {doc.get('kind')}/{doc['metadata']['name']}"
                        if "metadata" in doc else path.name, doc))
    return out


MANIFESTS = _manifests()


def _of_kind(*kinds: str) -> list[dict[str, Any]]:
    return [doc for _, doc in MANIFESTS if doc.get("kind") in kinds]


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [doc for doc in _of_kind(kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    return list(workload["spec"]["template"]["spec"]["containers"])


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container.get("env", [])}


def _env_file(path: Path) -> dict[str, str]:
    values = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z][A-Z0-9_]*", key), f"{path.name}:{number}: {line!r}"
        values[key] = value
    return values


@pytest.fixture(scope="module")
def etcd_flags() -> set[str]:
    try:
        binary = find_etcd_binary()
    except EtcdBinaryNotFoundError as exc:
        pytest.skip(f"no etcd binary to list its flags: {exc}")
    text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30,
                          check=False)
    return set(re.findall(r"--([a-z0-9-]+)", text.stdout + text.stderr))


def _assert_etcd_vars(env: dict[str, Any], flags: set[str], where: str) -> None:
    for name in env:
        if name.startswith("ETCD_"):
            flag = name[len("ETCD_"):].lower().replace("_", "-")
            assert flag in flags, f"{where}: {name} is no etcd flag (--{flag})"


# YAML and Kubernetes schemas ------------------------------------------------------------


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_file_parses(path: Path) -> None:
    assert _documents(path), f"{path} holds no YAML document"


@pytest.mark.parametrize(
    "doc", [doc for _, doc in MANIFESTS if doc.get("kind") not in CUSTOM_KINDS],
    ids=[name for name, doc in MANIFESTS if doc.get("kind") not in CUSTOM_KINDS],
)
def test_manifest_validates_against_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (test extra) bundles the schemas"
    )
    version = kubernetes_validate.latest_version()
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {exc.message} at "
                    f"{'.'.join(str(p) for p in exc.path)} (Kubernetes {version})")


def test_schema_validation_rejects_a_misspelt_field() -> None:
    """The check above has teeth: strict mode refuses a field Kubernetes does not know."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    deployment = yaml.safe_load(yaml.safe_dump(_one("Deployment", "tidal-coordinator")))
    _containers(deployment)[0]["readinessProb"] = _containers(deployment)[0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessProb"):
        kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)


def _selected(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _workloads() -> list[dict[str, Any]]:
    return _of_kind("Deployment", "DaemonSet", "StatefulSet", "Job")


def test_every_service_selects_pods_that_serve_its_ports() -> None:
    for service in _of_kind("Service"):
        name = service["metadata"]["name"]
        selector = service["spec"]["selector"]
        pods = [w for w in _workloads()
                if _selected(selector, w["spec"]["template"]["metadata"]["labels"])]
        assert pods, f"Service {name} selects no pods"
        for workload in pods:
            served = {p["name"] for c in _containers(workload) for p in c.get("ports", [])}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in served, (
                    f"Service {name} port {port['name']}: {workload['metadata']['name']} "
                    f"has no container port {port['targetPort']!r}"
                )


def test_service_monitors_select_one_service_and_scrape_its_named_ports() -> None:
    monitors = _of_kind("ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == PROMETHEUS_JOBS
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        spec = monitor["spec"]
        namespace = monitor["metadata"]["namespace"]
        assert spec["namespaceSelector"]["matchNames"] == [namespace]
        services = [s for s in _of_kind("Service")
                    if s["metadata"]["namespace"] == namespace
                    and _selected(spec["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert len(services) == 1, f"{monitor['metadata']['name']} selects {len(services)}"
        service = services[0]
        # Prometheus names the job after the Service.
        assert service["metadata"]["name"] == monitor["metadata"]["name"]
        ports = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert endpoint["port"] in ports
            assert endpoint["path"] == "/metrics"


def test_coordinator_runs_two_replicas_ready_on_readyz() -> None:
    deployment = _one("Deployment", "tidal-coordinator")
    assert deployment["spec"]["replicas"] == 2
    (container,) = _containers(deployment)
    assert container["args"] == ["coordinator"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = _env(container)
    assert int(env["TIDAL_PORT"]["value"]) == ports["http"] == 8470
    assert env["TIDAL_HOST"]["value"] == "0.0.0.0"
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}


def test_agents_are_a_daemonset_with_gpus_on_the_host_network() -> None:
    daemonset = _one("DaemonSet", "tidal-agent")
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # etcd's service names resolve
    (container,) = pod["containers"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    env = _env(container)
    assert env["TIDAL_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["TIDAL_ADDRESS"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(env["TIDAL_METRICS_PORT"]["value"]) == ports["metrics"]
    assert _one("Service", "tidal-agent")["spec"]["clusterIP"] == "None"


def test_etcd_statefulset_has_three_members_named_in_its_initial_cluster(
    etcd_flags: set[str],
) -> None:
    statefulset = _one("StatefulSet", "tidal-etcd")
    assert statefulset["spec"]["replicas"] == 3
    (container,) = _containers(statefulset)
    env = _env(container)
    members = env["ETCD_INITIAL_CLUSTER"]["value"].split(",")
    assert [m.split("=")[0] for m in members] == [f"tidal-etcd-{i}" for i in range(3)]
    _assert_etcd_vars(env, etcd_flags, "etcd.yaml")
    for workload in _of_kind("Deployment", "DaemonSet"):
        endpoints = _env(_containers(workload)[0])["TIDAL_ETCD_ENDPOINTS"]["value"].split(",")
        assert endpoints == [f"tidal-etcd-{i}.tidal-etcd-peer.tidal.svc:2379" for i in range(3)]


def test_manifests_set_only_real_settings() -> None:
    for workload, known in ((_one("Deployment", "tidal-coordinator"), COORDINATOR_VARS),
                            (_one("DaemonSet", "tidal-agent"), AGENT_VARS)):
        names = {n for n in _env(_containers(workload)[0]) if n.startswith("TIDAL_")}
        assert names <= known, f"{workload['metadata']['name']}: unknown {names - known}"


def test_secrets_come_from_secret_references_never_inline() -> None:
    assert not _of_kind("Secret"), "Secrets are created by the operator (docs/deploy.md)"
    for workload in _workloads():
        pod = workload["spec"]["template"]["spec"]
        secret_volumes = {v["name"] for v in pod.get("volumes", []) if "secret" in v}
        for container in pod["containers"]:
            where = f"{workload['metadata']['name']}/{container['name']}"
            secret_dirs = [m["mountPath"] for m in container.get("volumeMounts", [])
                           if m["name"] in secret_volumes]
            for name, item in _env(container).items():
                if not SECRET_FILE_NAME.search(name) or name in NOT_SECRET:
                    continue
                if name.endswith("_FILE"):  # a path: it must lie in a mounted Secret
                    assert any(item["value"].startswith(d + "/") for d in secret_dirs), (
                        f"{where}: {name} ({item['value']}) is not in a Secret volume")
                else:
                    assert "value" not in item, f"{where}: {name} is inline"
                    assert "secretKeyRef" in item["valueFrom"], f"{where}: {name}"


def test_kustomization_lists_every_manifest_and_renders() -> None:
    (kustomization,) = _documents(KUBERNETES / "kustomization.yaml")
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in KUBERNETES.glob("*.yaml")} - {"kustomization.yaml"}
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the rendering is not checked")
    result = subprocess.run([kubectl, "kustomize", str(KUBERNETES)], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    rendered = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    expected = [doc for _, doc in MANIFESTS if doc.get("kind") != "Kustomization"]
    assert len(rendered) == len(expected)
    assert all(doc["metadata"].get("namespace", "tidal") == "tidal" for doc in rendered
               if doc["kind"] != "Namespace")


# compose -------------------------------------------------------------------------------


def test_compose_has_three_etcd_members_a_coordinator_and_two_agents(
    etcd_flags: set[str],
) -> None:
    (compose,) = _documents(COMPOSE)
    services = compose["services"]
    assert sorted(services) == ["agent-1", "agent-2", "coordinator", "etcd-1", "etcd-2",
                                "etcd-3"]
    for name in ("etcd-1", "etcd-2", "etcd-3"):
        env = services[name]["environment"]
        assert env["ETCD_NAME"] == name
        assert name in env["ETCD_INITIAL_CLUSTER"]
        _assert_etcd_vars(env, etcd_flags, f"compose {name}")
    for name, known in (("coordinator", COORDINATOR_VARS), ("agent-1", AGENT_VARS),
                        ("agent-2", AGENT_VARS)):
        service = services[name]
        env = service["environment"]
        assert set(env) <= known, f"compose {name}: unknown {set(env) - known}"
        assert env["TIDAL_ETCD_ENDPOINTS"].split(",") == [f"etcd-{i}:2379" for i in (1, 2, 3)]
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (COMPOSE.parent / service["build"]["context"] / "deploy" / "Dockerfile").exists()
        assert not [k for k in env if SECRET_NAME.search(k)], f"compose {name}: inline secret"
    coordinator = services["coordinator"]
    assert coordinator["command"] == ["coordinator"]
    assert coordinator["environment"]["TIDAL_TOKEN_FILE"] == "/run/secrets/api_token"
    assert coordinator["secrets"] == ["api_token"]
    assert {services[a]["environment"]["TIDAL_NODE_ID"] for a in ("agent-1", "agent-2")} == {
        "agent-1", "agent-2"}


# systemd -------------------------------------------------------------------------------


def _units() -> list[Path]:
    return sorted(SYSTEMD.glob("*.service"))


@pytest.fixture
def verifiable_units(tmp_path: Path) -> Iterator[list[Path]]:
    """Copies of the units whose ExecStart names an executable stub: verify checks
    that the binary exists, and tidal and etcd are not installed where a
    machine would have them."""
    stub = tmp_path / "stub"
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    copies = []
    for unit in _units():
        text = re.sub(r"^ExecStart=\S+", f"ExecStart={stub}", unit.read_text(), flags=re.M)
        copy = tmp_path / unit.name
        copy.write_text(text)
        copies.append(copy)
    yield copies


def test_systemd_units_pass_systemd_analyze_verify(verifiable_units: list[Path]) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed: the units are not verified")
    result = subprocess.run([analyze, "verify", *map(str, verifiable_units)],
                            capture_output=True, text=True, timeout=60, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # Unknown keys and sections are only warnings ("ignoring"): fail on them too.
    complaints = [line for line in output.splitlines()
                  if any(unit.name in line for unit in verifiable_units)]
    assert not complaints, "\n".join(complaints)


def test_tidal_units_read_the_shared_environment_file() -> None:
    for name, role in (("tidal-coordinator.service", "coordinator"),
                       ("tidal-agent.service", "agent")):
        text = (SYSTEMD / name).read_text()
        assert "EnvironmentFile=/etc/tidal/tidal.env\n" in text
        assert f"EnvironmentFile=-/etc/tidal/{role}.env\n" in text
        assert re.search(rf"^ExecStart=\S+/tidal {role}$", text, flags=re.M)
        assert not re.search(r"^Environment=.*(PASSWORD|TOKEN=)", text, flags=re.M)


def test_environment_files_set_only_real_settings_and_etcd_flags(etcd_flags: set[str]) -> None:
    shared = _env_file(SYSTEMD / "tidal.env.example")
    assert set(shared) <= AGENT_VARS & COORDINATOR_VARS, "tidal.env is read by both"
    for name, known in (("coordinator.env.example", COORDINATOR_VARS),
                        ("agent.env.example", AGENT_VARS)):
        values = _env_file(SYSTEMD / name)
        assert set(values) <= known, f"{name}: unknown {set(values) - known}"
        for key, value in values.items():
            if SECRET_NAME.search(key):
                assert value == "CHANGE-ME", f"{name}: {key} must be a placeholder"
    assert "TIDAL_TOKEN" not in _env_file(SYSTEMD / "coordinator.env.example")
    etcd_env = _env_file(SYSTEMD / "etcd.env.example")
    assert all(key.startswith("ETCD_") for key in etcd_env)
    _assert_etcd_vars(etcd_env, etcd_flags, "etcd.env.example")


# Dockerfile and scripts ----------------------------------------------------------------

DOCKERFILE_INSTRUCTIONS = {
    "FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
    "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL",
}


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        pending += " " + stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            word, _, args = pending.strip().partition(" ")
            out.append((word, args.strip()))
            pending = ""
    assert not pending, f"{path}: the last instruction ends in a line continuation"
    return out


def test_dockerfile_parses_with_from_first_and_torch_before_the_project() -> None:
    instructions = _instructions(DOCKERFILE)
    words = [word for word, _ in instructions]
    assert words[0] == "FROM", f"the first instruction is {words[0]}, not FROM"
    unknown = [w for w in words if w.upper() not in DOCKERFILE_INSTRUCTIONS or w != w.upper()]
    assert not unknown, f"unknown or lower-case instructions: {unknown}"
    runs = [args for word, args in instructions if word == "RUN"]
    torch = next(i for i, args in enumerate(runs) if "torch==" in args)
    project = next(i for i, args in enumerate(runs) if re.search(r"pip install \.( |$)", args))
    assert torch < project, "torch must be installed before the project"
    assert "--index-url" in runs[torch]
    entrypoint = next(args for word, args in instructions if word == "ENTRYPOINT")
    assert entrypoint == '["tidal"]'


def test_dockerfile_copies_only_what_exists_and_is_not_ignored() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for word, args in _instructions(DOCKERFILE):
        if word != "COPY":
            continue
        *sources, _ = [a for a in args.split() if not a.startswith("--")]
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: no such path in the repository"
            assert source.rstrip("/") in allowed, f"COPY {source}: Dockerfile.dockerignore drops it"


def test_setup_auth_script_is_valid_bash() -> None:
    script = DEPLOY / "etcd" / "setup-auth.sh"
    assert script.stat().st_mode & 0o111, "setup-auth.sh is not executable"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    shellcheck = shutil.which("shellcheck")
    if shellcheck is not None:
        result = subprocess.run([shellcheck, str(script)], capture_output=True, text=True,
                                timeout=60, check=False)
        assert result.returncode == 0, result.stdout
