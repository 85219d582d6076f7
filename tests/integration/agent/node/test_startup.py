"""A real ``tidal agent`` started before etcd answers waits for it, then registers.

An agent may start before etcd (a machine's units in any order), or while etcd is too
loaded to answer within the client's timeout: a full test run saw an agent's first
status call time out after 5 s and the agent exit, so its node never registered.
"""

from __future__ import annotations

from pathlib import Path

from rendezvous.etcd import EtcdConfig, create_client
from rendezvous.etcd.server import EtcdServer, free_port
from rendezvous.registry import NodeRegistry
from tests.support.agents import AgentCluster
from tests.support.processes import ProcessGroupRegistry
from tests.support.wait import wait_for


def test_an_agent_started_before_etcd_registers_once_etcd_answers(
    tmp_path: Path, etcd_root: str, procs: ProcessGroupRegistry,
) -> None:
    port = free_port()
    agents = AgentCluster(etcd_endpoint=f"127.0.0.1:{port}", etcd_root=etcd_root,
                          workdir=tmp_path, procs=procs)
    agent = agents.start_agent("early", extra=("--no-warm-runner",))
    log = tmp_path / "agent-early.log"

    def tried() -> bool:
        if agent.poll() is not None:
            raise AssertionError(f"the agent exited with {agent.returncode}\n"
                                 f"{agents.log_tails()}")
        return "trying again" in log.read_text()

    wait_for(tried, timeout=60, what="the agent's first failed try logged")
    assert agent.poll() is None, agents.log_tails()
    server = EtcdServer(data_dir=tmp_path / "etcd", client_port=port)
    try:
        server.start()
        config = EtcdConfig(endpoints=[server.endpoint], timeout_s=5.0, root=etcd_root)
        with create_client(config) as client:
            registry = NodeRegistry(client)
            wait_for(lambda: registry.get("early"), timeout=90,
                     what=f"node early registered\n{agents.log_tails()}")
        # Registered, then serving its metrics and watching its assignments: ready.
        wait_for(lambda: " ready (run dir " in log.read_text(), timeout=60,
                 what=f"the agent ready\n{agents.log_tails()}")
        assert agent.poll() is None, agents.log_tails()
    finally:
        procs.stop_all()
        server.cleanup()
