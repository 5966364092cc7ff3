from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import ConfigError
from common.spec import Endpoint, load_spec, parse_spec, with_trainer_count

SRC = Path("/tmp/specs/demo.toml")


def test_defaults_make_a_local_cluster() -> None:
    spec = parse_spec({}, SRC)
    assert spec.name == "demo"
    assert spec.ps.num_shards == 2
    assert all(e == Endpoint(host="127.0.0.1", port=0) for e in spec.ps.addresses)
    assert spec.oracle.mode == "bagpipe" and spec.cluster.transport == "h2"
    assert spec.trainers.count == 2 and spec.trainers.pin_cpus
    assert spec.cluster.max_body_bytes == 256 << 20
    assert spec.checkpoint.every == 0 and spec.checkpoint.keep == 2


def test_values_are_read_and_typed() -> None:
    spec = parse_spec(
        {
            "name": "x",
            "seed": 3,
            "cluster": {"transport": "http1", "request_timeout_s": 5, "max_body_mib": 8},
            "oracle": {"mode": "static-cache", "lookahead": 10, "prefetch_lead": 0, "cache_rows": 7},
            "ps": {"shards": 2, "addresses": ["10.0.0.1:7000", "[::1]:7001"]},
            "trainers": {"count": 4, "rendezvous": "host:29500", "pin_cpus": False},
            "train": {"batch_size": 64},
            "model": {"name": "dlrm"},
        },
        SRC,
    )
    assert spec.cluster.request_timeout_s == 5.0 and spec.cluster.max_body_bytes == 8 << 20
    assert spec.oracle.lookahead == 10 and spec.oracle.prefetch_lead == 0
    assert spec.oracle.planner_workers == 1
    assert parse_spec({"oracle": {"planner_workers": 3}}, SRC).oracle.planner_workers == 3
    assert spec.ps.addresses[1] == Endpoint(host="::1", port=7001)
    assert spec.trainers.rendezvous == Endpoint(host="host", port=29500) and not spec.trainers.pin_cpus
    assert spec.sections["model"] == {"name": "dlrm"}
    assert spec.sections["data"] == {}


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"oracle": {"lookahead": -1}}, "oracle.lookahead"),
        ({"oracle": {"mode": "fast"}}, "oracle.mode"),
        ({"oracle": {"cache_rows": "many"}}, "oracle.cache_rows"),
        ({"oracle": {"planner_workers": 0}}, "oracle.planner_workers"),
        ({"oracle": {"planner_workers": 1.5}}, "oracle.planner_workers"),
        ({"oracle": {"lookahed": 3}}, "oracle.lookahed"),
        ({"cluster": {"transport": "h3"}}, "cluster.transport"),
        ({"cluster": {"request_timeout_s": 0}}, "cluster.request_timeout_s"),
        ({"cluster": {"idle_timeout_s": 0}}, "cluster.idle_timeout_s"),
        ({"cluster": {"max_connections": 0}}, "cluster.max_connections"),
        ({"cluster": {"max_concurrent_streams": -1}}, "cluster.max_concurrent_streams"),
        ({"cluster": {"max_resets": 0}}, "cluster.max_resets"),
        ({"cluster": {"reset_window_s": -2.0}}, "cluster.reset_window_s"),
        ({"cluster": {"unauthenticated_rate": 0}}, "cluster.unauthenticated_rate"),
        ({"cluster": {"unauthenticated_burst": 0}}, "cluster.unauthenticated_burst"),
        ({"cluster": {"max_connections": "lots"}}, "cluster.max_connections"),
        ({"cluster": {"auth_timeout_s": 0}}, "cluster.auth_timeout_s"),
        ({"cluster": {"max_unauthenticated_connections": 0}}, "cluster.max_unauthenticated_connections"),
        ({"ps": {"shards": 2, "addresses": ["a:1"]}}, "ps.addresses"),
        ({"ps": {"shards": 1, "addresses": ["nohost"]}}, "ps.addresses[0]"),
        ({"ps": {"shards": 1, "addresses": ["h:99999"]}}, "ps.addresses[0]"),
        ({"trainers": {"count": 0}}, "trainers.count"),
        ({"trainers": {"pin_cpus": "yes"}}, "trainers.pin_cpus"),
        ({"trainers": {"ps_client": "subprocess"}}, "trainers.ps_client"),
        ({"trainers": {"metrics_address": "9400"}}, "trainers.metrics_address"),
        ({"trainers": {"count": 4, "metrics_address": "h:65533"}}, "trainers.metrics_address"),
        ({"cluster": {"metrics_linger_s": -1}}, "cluster.metrics_linger_s"),
        ({"cluster": {"rejoin_timeout_s": 0}}, "cluster.rejoin_timeout_s"),
        ({"trainers": {"count": 2, "min_count": 3}}, "trainers.min_count"),
        ({"trainers": {"count": 2, "min_count": 0}}, "trainers.min_count"),
        ({"trainers": {"count": 2, "max_count": 1}}, "trainers.max_count"),
        ({"trainers": {"count": 2, "max_count": 4}}, "trainers.min_count"),  # elastic without checkpoints
        ({"trainers": {"count": 2, "max_count": 4, "metrics_address": "h:65534"}, "checkpoint": {"every": 5}},
         "trainers.metrics_address"),
        ({"train": {"batch_size": 10}, "trainers": {"count": 3}}, "train.batch_size"),
        ({"train": {"epochs": True}}, "train.epochs"),
        ({"checkpoint": {"restart": "yes"}}, "checkpoint.restart"),
        ({"checkpoint": {"keep": -1}}, "checkpoint.keep"),
        ({"seed": -1}, "spec.seed"),
        ({"extra": {}}, "extra"),
        ({"oracle": 3}, "oracle"),
    ],
)
def test_bad_fields_are_named(raw: dict, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_spec(raw, SRC)
    assert info.value.field == field


def test_load_spec_reports_syntax_errors_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[oracle\nmode = 1\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        load_spec(path)
    with pytest.raises(ConfigError, match="no such file"):
        load_spec(tmp_path / "missing.toml")


def test_token_from_spec_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BAGPIPE_TOKEN", raising=False)
    assert parse_spec({"cluster": {"token": "abc"}}, SRC).token() == "abc"
    with pytest.raises(ConfigError, match="cluster.token"):
        parse_spec({}, SRC).token()
    monkeypatch.setenv("BAGPIPE_TOKEN", "env")
    assert parse_spec({}, SRC).token() == "env"


def test_spec_toml_round_trips(tmp_path: Path) -> None:
    from common.spec import spec_toml

    sections = {"oracle": {"mode": "local", "lookahead": 3}, "data": {"path": 'a "b"\\c', "sizes": [1, 2]},
                "checkpoint": {"restart": True}, "cluster": {"request_timeout_s": 2.5}}
    path = tmp_path / "s.toml"
    path.write_text(spec_toml("n", 4, sections))
    spec = load_spec(path)
    assert (spec.name, spec.seed, spec.oracle.mode, spec.oracle.lookahead) == ("n", 4, "local", 3)
    assert spec.sections["data"] == {"path": 'a "b"\\c', "sizes": [1, 2]}
    assert spec.checkpoint.restart is True and spec.cluster.request_timeout_s == 2.5


def test_cluster_tls_section_names_files_relative_to_the_spec(tmp_path: Path) -> None:
    assert parse_spec({}, SRC).cluster.tls is None
    tls = parse_spec({"cluster": {"tls": {"cert": "certs/node.pem", "key": "/keys/node.key", "ca": "ca.pem"}}},
                     SRC).cluster.tls
    assert tls is not None and not tls.mutual
    assert (tls.cert, tls.key, tls.ca) == (Path("/tmp/specs/certs/node.pem"), Path("/keys/node.key"),
                                           Path("/tmp/specs/ca.pem"))
    spec = tmp_path / "s.toml"
    spec.write_text('[cluster.tls]\ncert = "a.pem"\nkey = "a.key"\nca = "ca.pem"\nmutual = true\n')
    loaded = load_spec(spec).cluster.tls
    assert loaded is not None and loaded.mutual and loaded.cert == tmp_path / "a.pem"


@pytest.mark.parametrize(
    ("tls", "field"),
    [
        ({"key": "k", "ca": "c"}, "cluster.tls.cert"),
        ({"cert": "a", "ca": "c"}, "cluster.tls.key"),
        ({"cert": "a", "key": "k", "ca": ""}, "cluster.tls.ca"),
        ({"cert": "a", "key": "k", "ca": 3}, "cluster.tls.ca"),
        ({"cert": "a", "key": "k", "ca": "c", "mutual": 1}, "cluster.tls.mutual"),
        ({"cert": "a", "key": "k", "ca": "c", "verify": False}, "cluster.tls.verify"),
        ("on", "cluster.tls"),
    ],
)
def test_bad_cluster_tls_fields_are_named(tls: object, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_spec({"cluster": {"tls": tls}}, SRC)
    assert caught.value.field == field


def test_an_elastic_job_goes_on_with_another_count_and_its_document_says_so() -> None:
    spec = parse_spec({"trainers": {"count": 2, "min_count": 1, "max_count": 4}, "checkpoint": {"every": 5},
                       "train": {"batch_size": 12}}, SRC)
    assert spec.trainers.elastic and not parse_spec({}, SRC).trainers.elastic
    smaller = with_trainer_count(spec, 1)
    assert (smaller.trainers.count, smaller.trainers.min_count, smaller.trainers.max_count) == (1, 1, 4)
    assert parse_spec(smaller.document, SRC).trainers == smaller.trainers  # what joined roles are sent
    assert spec.document["trainers"]["count"] == 2  # the original is left alone
    with pytest.raises(ConfigError, match="train.batch_size: 12 is not divisible by trainers.count = 5"):
        with_trainer_count(spec, 5)
