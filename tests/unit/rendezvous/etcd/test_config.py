"""Endpoint parsing and EtcdConfig validation (no etcd needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rendezvous.etcd import EtcdConfig, parse_endpoint, prefix_range_end


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:2379", ("127.0.0.1", 2379)),
        ("localhost:1", ("localhost", 1)),
        ("http://etcd-0.svc:2379", ("etcd-0.svc", 2379)),
        ("https://10.0.0.1:65535/", ("10.0.0.1", 65535)),
        ("[::1]:2379", ("::1", 2379)),
        ("http://[fe80::1]:2380", ("fe80::1", 2380)),
        ("  127.0.0.1:2379  ", ("127.0.0.1", 2379)),
    ],
)
def test_parse_endpoint_accepts_host_port_forms(text: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("127.0.0.1", "has no port"),
        ("127.0.0.1:", "port in 1-65535"),
        (":2379", "port in 1-65535"),
        ("127.0.0.1:0", "port in 1-65535"),
        ("127.0.0.1:65536", "port in 1-65535"),
        ("127.0.0.1:abc", "port in 1-65535"),
        ("unix://sock:1", "scheme must be http or https"),
        ("grpc://h:1", "scheme must be http or https"),
    ],
)
def test_parse_endpoint_rejects_malformed_endpoints_naming_them(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_endpoint(text)
    assert repr(text) in str(info.value)


def test_config_defaults() -> None:
    config = EtcdConfig()
    assert config.endpoints == ["127.0.0.1:2379"]
    assert config.timeout_s == 5.0
    assert config.root == "/tidal"
    assert not config.secure


def test_config_is_frozen_and_forbids_unknown_fields() -> None:
    config = EtcdConfig()
    with pytest.raises(ValidationError):
        config.timeout_s = 1.0
    with pytest.raises(ValidationError, match="extra"):
        EtcdConfig(endpoint="127.0.0.1:2379")  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"endpoints": []}, "endpoints"),
        ({"endpoints": ["nope"]}, "endpoints"),
        ({"endpoints": ["h:1", "h"]}, "endpoints"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": -1}, "timeout_s"),
        ({"timeout_s": 301}, "timeout_s"),
        ({"root": "tidal"}, "root"),
        ({"root": "/tidal/"}, "root"),
        ({"root": "/ti dal"}, "root"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        EtcdConfig(**kwargs)  # type: ignore[arg-type]
    assert field in str(info.value)


def test_config_with_a_ca_certificate_is_secure_and_hides_the_password() -> None:
    config = EtcdConfig(ca_cert=Path("/ca.pem"), user="u", password="s3cret")  # type: ignore[arg-type]
    assert config.secure
    assert "s3cret" not in repr(config)
    assert "s3cret" not in config.model_dump_json()


def test_prefix_range_end_covers_exactly_the_prefix() -> None:
    assert prefix_range_end("/tidal/nodes/") == b"/tidal/nodes0"
    assert prefix_range_end("a\xff") == b"a\xc3\xc0"  # "ÿ" is c3 bf in UTF-8
    assert prefix_range_end("/tidal/nodes/") > b"/tidal/nodes/zzz"
    assert prefix_range_end("/tidal/nodes/") <= b"/tidal/nodes0"
