"""The records in etcd: what older readers of them still accept."""

from __future__ import annotations

import json

from rendezvous.records import Assignment


def test_an_assignment_without_preloads_is_written_as_before_the_field_existed() -> None:
    plain = Assignment(job_id="j1", command=["python", "train.py"], min_nodes=1, max_nodes=2)
    assert "zygote_preload" not in json.loads(plain.model_dump_json())
    assert Assignment.model_validate_json(plain.model_dump_json()) == plain


def test_an_assignment_with_preloads_carries_them() -> None:
    framed = Assignment(job_id="j1", command=["python", "train.py"], min_nodes=1, max_nodes=2,
                        zygote_preload=["lightning", "my_pkg.models"])
    assert json.loads(framed.model_dump_json())["zygote_preload"] == ["lightning", "my_pkg.models"]
    assert Assignment.model_validate_json(framed.model_dump_json()) == framed
