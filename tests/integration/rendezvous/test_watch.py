"""PrefixWatcher against a real etcd: order, restarts, compaction, bad callbacks."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from rendezvous.etcd import EtcdClient, EtcdConfig, KeyValue, WatchEvent, create_client
from rendezvous.etcd.server import EtcdServer
from rendezvous.watch import PrefixWatcher, diff_snapshots
from tests.support.wait import wait_for


class Recorder:
    """Records events and applies them to a model of the prefix."""

    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self.model: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def __call__(self, event: WatchEvent) -> None:
        with self.lock:
            self.events.append(event)
            if event.kind == "put":
                self.model[event.key] = event.value
            else:
                self.model.pop(event.key, None)

    def kinds(self, prefix: str) -> list[tuple[str, str, bytes]]:
        with self.lock:
            return [(e.kind, e.key[len(prefix) :], e.value) for e in self.events]


def etcd_contents(client: EtcdClient, prefix: str) -> dict[str, bytes]:
    kvs, _ = client.get_prefix(prefix)
    return {kv.key: kv.value for kv in kvs}


@pytest.fixture
def restart_client(fresh_etcd: EtcdServer) -> Iterator[EtcdClient]:
    config = EtcdConfig(endpoints=[fresh_etcd.endpoint], timeout_s=2.0, root="/tidal-watch")
    client = create_client(config)
    try:
        yield client
    finally:
        client.close()


def test_the_initial_snapshot_then_every_change_is_delivered_in_order(
    etcd_client: EtcdClient,
) -> None:
    prefix = etcd_client.keys.nodes_prefix()
    etcd_client.put(prefix + "a", b"a0")
    etcd_client.put(prefix + "b", b"b0")
    etcd_client.put(etcd_client.keys.jobs_prefix() + "other", b"not watched")
    recorder = Recorder()
    with PrefixWatcher(etcd_client, prefix, on_event=recorder) as watcher:
        assert watcher.wait_synced(timeout=5)
        assert recorder.kinds(prefix) == [("put", "a", b"a0"), ("put", "b", b"b0")]
        expected = [("put", "a", b"a0"), ("put", "b", b"b0")]
        for i in range(20):
            etcd_client.put(prefix + "c", f"c{i}".encode())
            expected.append(("put", "c", f"c{i}".encode()))
        etcd_client.delete(prefix + "a")
        expected.append(("delete", "a", b""))
        wait_for(lambda: len(recorder.events) >= len(expected), timeout=5, what="all 23 events")
        assert recorder.kinds(prefix) == expected
        revisions = [e.mod_revision for e in recorder.events[2:]]
        assert revisions == sorted(revisions) and len(set(revisions)) == len(revisions)
        assert set(watcher.snapshot()) == {prefix + "b", prefix + "c"}
        assert watcher.snapshot()[prefix + "c"].version == 20
        assert watcher.relists == 0


def test_after_an_etcd_restart_it_relists_and_sees_what_changed_while_blind(
    fresh_etcd: EtcdServer, restart_client: EtcdClient
) -> None:
    client = restart_client
    prefix = client.keys.nodes_prefix()
    for name in ("keep", "change", "remove", "recreate"):
        client.put(prefix + name, b"v0")
    recorder = Recorder()
    blocked, release = threading.Event(), threading.Event()

    def on_event(event: WatchEvent) -> None:
        recorder(event)
        if event.key == prefix + "block":
            # Hold the watcher here, blind, while etcd restarts underneath it.
            blocked.set()
            release.wait(timeout=30)

    watcher = PrefixWatcher(client, prefix, on_event=on_event, backoff_max_s=0.5).start()
    try:
        assert watcher.wait_synced(timeout=5)
        client.put(prefix + "block", b"x")
        assert blocked.wait(timeout=5)
        fresh_etcd.kill()
        fresh_etcd.start()
        client.put(prefix + "change", b"v1")
        client.delete(prefix + "remove")
        client.delete(prefix + "recreate")
        client.put(prefix + "recreate", b"v1")
        client.put(prefix + "new", b"v1")
        release.set()
        wait_for(lambda: watcher.relists >= 1, timeout=15, what="the watcher to re-list")
        wait_for(
            lambda: recorder.model == etcd_contents(client, prefix),
            timeout=10,
            what="the watcher's model to converge on etcd's contents",
        )
        blind = recorder.kinds(prefix)[5:]  # after the 4 initial puts and "block"
        assert blind == [
            ("put", "change", b"v1"),
            ("put", "new", b"v1"),
            ("delete", "recreate", b""),
            ("put", "recreate", b"v1"),
            ("delete", "remove", b""),
        ]
        assert {k: v.value for k, v in watcher.snapshot().items()} == recorder.model
        # And it watches again: a change after the re-list arrives as a real event.
        client.put(prefix + "after", b"v2")
        wait_for(
            lambda: recorder.model.get(prefix + "after") == b"v2",
            timeout=10,
            what="an event after the re-watch",
        )
    finally:
        release.set()
        watcher.stop()


def test_a_compacted_history_makes_it_relist_and_converge(
    etcd_client: EtcdClient, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = etcd_client.keys.jobs_prefix()
    for i in range(5):
        etcd_client.put(prefix + f"k{i}", b"v0")
    recorder = Recorder()
    blocked, release = threading.Event(), threading.Event()

    def on_event(event: WatchEvent) -> None:
        recorder(event)
        if not blocked.is_set():
            # A slow consumer: stuck on the first event of its initial listing,
            # before it could open its watch.
            blocked.set()
            release.wait(timeout=30)

    watcher = PrefixWatcher(etcd_client, prefix, on_event=on_event).start()
    try:
        assert blocked.wait(timeout=5)
        for round_ in range(1, 4):  # churn: history the watcher will need
            for i in range(5):
                etcd_client.put(prefix + f"k{i}", f"v{round_}".encode())
        etcd_client.delete(prefix + "k0")
        revision = etcd_client.put(prefix + "k9", b"new")
        etcd_client.compact(revision)  # the watcher's start revision is gone
        release.set()
        wait_for(lambda: watcher.relists >= 1, timeout=10, what="a re-list after compaction")
        assert "history compacted" in caplog.text
        wait_for(
            lambda: recorder.model == etcd_contents(etcd_client, prefix),
            timeout=10,
            what="convergence after compaction",
        )
        assert recorder.model[prefix + "k1"] == b"v3"
        assert prefix + "k0" not in watcher.snapshot()
        assert watcher.revision >= revision
    finally:
        release.set()
        watcher.stop()


def test_a_raising_callback_is_logged_and_the_watch_goes_on(
    etcd_client: EtcdClient, caplog: pytest.LogCaptureFixture
) -> None:
    prefix = etcd_client.keys.jobs_prefix()
    seen: list[str] = []

    def on_event(event: WatchEvent) -> None:
        seen.append(event.key)
        if event.key.endswith("bad"):
            raise ValueError("consumer bug")

    with PrefixWatcher(etcd_client, prefix, on_event=on_event) as watcher:
        assert watcher.wait_synced(timeout=5)
        etcd_client.put(prefix + "bad", b"1")
        etcd_client.put(prefix + "good", b"2")
        wait_for(lambda: prefix + "good" in seen, timeout=5, what="the event after the bad one")
        assert watcher.callback_errors == 1
        assert prefix + "bad" in watcher.snapshot()  # the cache is updated regardless
        assert watcher.relists == 0
    assert "the callback raised on put" in caplog.text
    assert "consumer bug" in caplog.text


def test_stop_ends_the_thread_promptly(etcd_client: EtcdClient) -> None:
    watcher = PrefixWatcher(etcd_client, etcd_client.keys.jobs_prefix(), on_event=lambda e: None)
    watcher.start()
    assert watcher.wait_synced(timeout=5)
    watcher.stop(timeout=2)
    assert watcher._thread is not None and not watcher._thread.is_alive()


def test_stop_while_another_thread_starts_the_watcher_waits_for_it(
    etcd_client: EtcdClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round leader starts its watcher in its own thread while close() may stop it: a stop
    that came in between must not find a thread not yet started (joining it raises)."""
    watcher = PrefixWatcher(etcd_client, etcd_client.keys.jobs_prefix(),
                            on_event=lambda e: None, name="racing")
    errors: list[BaseException] = []
    stopper_done = threading.Event()
    real_start = threading.Thread.start

    def stop_now() -> None:
        try:
            watcher.stop(timeout=5)
        except BaseException as exc:
            errors.append(exc)
        finally:
            stopper_done.set()

    def start(thread: threading.Thread) -> None:
        if thread.name == "racing":  # the watcher's thread: stop() comes in before it runs
            threading.Thread(target=stop_now, daemon=True).start()
            stopper_done.wait(0.5)  # the unguarded code raised here at once
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    watcher.start()
    assert stopper_done.wait(10), "stop() never returned"
    assert errors == []
    wait_for(lambda: not watcher._thread.is_alive(), timeout=5,  # type: ignore[union-attr]
             what="the watcher's thread to end")


def test_diff_snapshots_reports_changes_deletes_and_recreations() -> None:
    def kv(key: str, create: int, mod: int) -> KeyValue:
        return KeyValue(key, f"{key}@{mod}".encode(), create, mod, mod - create + 1, 0)

    old = {"a": kv("a", 1, 1), "b": kv("b", 2, 2), "c": kv("c", 3, 3), "d": kv("d", 4, 4)}
    new = {"a": kv("a", 1, 1), "b": kv("b", 2, 7), "c": kv("c", 8, 8), "e": kv("e", 9, 9)}
    events = diff_snapshots(old, new, revision=10)
    assert [(e.kind, e.key, e.mod_revision) for e in events] == [
        ("put", "b", 7),
        ("delete", "c", 10),
        ("put", "c", 8),
        ("delete", "d", 10),
        ("put", "e", 9),
    ]
    assert diff_snapshots(new, new, revision=11) == []


def test_resumed_from_a_known_view_it_replays_only_what_changed_since(
    etcd_client: EtcdClient,
) -> None:
    # A round leader taking over starts from the view its predecessor wrote (#24): no
    # listing; the keys it is handed come as puts, then every change after the revision.
    prefix = etcd_client.keys.nodes_prefix()
    etcd_client.put(prefix + "a", b"a0")
    seen = etcd_client.put(prefix + "b", b"b0")
    etcd_client.put(prefix + "c", b"c0")  # after the view: replayed
    etcd_client.delete(prefix + "a")
    view = [KeyValue(prefix + "a", b"a0", 0, 0, 0, 0), KeyValue(prefix + "b", b"b0", 0, 0, 0, 0)]
    recorder = Recorder()
    with PrefixWatcher(etcd_client, prefix, on_event=recorder, resume=(view, seen)) as watcher:
        assert watcher.wait_synced(timeout=5)
        wait_for(lambda: len(recorder.events) >= 4, timeout=5, what="the view and 2 changes")
        assert recorder.kinds(prefix) == [("put", "a", b"a0"), ("put", "b", b"b0"),
                                          ("put", "c", b"c0"), ("delete", "a", b"")]
        assert recorder.model == etcd_contents(etcd_client, prefix)
        assert watcher.relists == 0


def test_resumed_from_a_compacted_revision_it_relists_and_converges(
    etcd_client: EtcdClient,
) -> None:
    prefix = etcd_client.keys.nodes_prefix()
    seen = etcd_client.put(prefix + "a", b"a0")
    etcd_client.put(prefix + "a", b"a1")
    etcd_client.compact(etcd_client.put(prefix + "b", b"b0"))
    recorder = Recorder()
    view = [KeyValue(prefix + "a", b"a0", 0, 0, 0, 0), KeyValue(prefix + "z", b"gone", 0, 0, 0, 0)]
    with PrefixWatcher(etcd_client, prefix, on_event=recorder, resume=(view, seen)) as watcher:
        wait_for(lambda: recorder.model == etcd_contents(etcd_client, prefix), timeout=10,
                 what="convergence after a resume from a compacted revision")
        assert watcher.relists == 1
