from __future__ import annotations

import pytest

from common.prometheus import Registry


def test_registry_renders_prometheus_text() -> None:
    reg = Registry()
    reg.inc("requests_total", labels={"route": "/v1/fetch"}, help="Requests served")
    reg.inc("requests_total", 2, labels={"route": "/v1/fetch"})
    reg.set("waiting", 3)
    reg.observe("wait_seconds", 0.25)
    reg.observe("wait_seconds", 0.5)
    text = reg.render()
    assert "# HELP bagpipe_requests_total Requests served\n" in text
    assert "# TYPE bagpipe_requests_total counter\n" in text
    assert 'bagpipe_requests_total{route="/v1/fetch"} 3\n' in text
    assert "bagpipe_waiting 3\n" in text
    assert "bagpipe_wait_seconds_sum 0.75\nbagpipe_wait_seconds_count 2\n" in text
    assert reg.value("requests_total", {"route": "/v1/fetch"}) == 3


def test_a_counter_handle_counts_into_the_registry() -> None:
    reg = Registry()
    fetches = reg.counter("requests_total", {"op": "fetch"}, help="Requests served")
    fetches.inc()
    reg.inc("requests_total", 2, labels={"op": "fetch"})
    fetches.inc(3)
    assert reg.value("requests_total", {"op": "fetch"}) == 6
    reg.set_total("requests_total", 10, labels={"op": "fetch"})
    fetches.inc()
    assert reg.value("requests_total", {"op": "fetch"}) == 11
    assert "# HELP bagpipe_requests_total Requests served\n" in reg.render()


def test_label_values_are_escaped() -> None:
    reg = Registry("x")
    reg.inc("n", labels={"path": 'a"b\\c\nd'})
    assert 'x_n{path="a\\"b\\\\c\\nd"} 1' in reg.render()


def test_a_name_keeps_its_kind() -> None:
    reg = Registry()
    reg.inc("n")
    with pytest.raises(ValueError, match="counter"):
        reg.set("n", 1)


def test_totals_kept_elsewhere_are_counters_and_special_values_are_spelled_out() -> None:
    reg = Registry()
    reg.set_total("rows_total", 5, help="Rows")
    reg.set_total("rows_total", 7)  # a later copy replaces the earlier one
    reg.set("rate", float("nan"))
    reg.set("up", float("inf"), labels={"side": "up"})
    reg.set("up", float("-inf"), labels={"side": "down"})
    text = reg.render()
    assert "# TYPE bagpipe_rows_total counter\nbagpipe_rows_total 7\n" in text
    assert "bagpipe_rate NaN\n" in text
    assert 'bagpipe_up{side="up"} +Inf\nbagpipe_up{side="down"} -Inf\n' in text
