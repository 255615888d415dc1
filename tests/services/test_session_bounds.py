"""The worker's Kafka session timeout is fitted to the broker's group session bounds.

Apache Kafka refuses a JoinGroup whose session lies outside ``group.min.session.timeout.ms`` /
``group.max.session.timeout.ms`` (6 s / 30 min by default), and the project's default session is 2 s:
without fitting, a worker against a stock broker could never join its group. No Apache Kafka runs
here, so the bounds themselves are checked on the pure function, and the real tansu broker (which
does not answer DescribeConfigs for a broker) checks that reading them never fails a start-up.
"""

from __future__ import annotations

import logging

import pytest

from harness.servers import ServerProcess
from services.common.kafka import broker_session_timeout_ms, fit_session
from services.common.settings import Settings


def test_a_session_below_the_brokers_minimum_is_raised_to_it_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="services.common.kafka"):
        assert fit_session(2_000, 6_000, 1_800_000) == 6_000
    assert "group.min.session.timeout.ms" in caplog.text


def test_a_session_inside_the_bounds_or_without_bounds_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="services.common.kafka"):
        assert fit_session(2_000, 1_000, 1_800_000) == 2_000
        assert fit_session(2_000, None, None) == 2_000
    assert caplog.text == ""
    assert fit_session(60_000, 1_000, 30_000) == 30_000


async def test_a_broker_that_does_not_describe_its_bounds_leaves_the_setting(kafka: ServerProcess) -> None:
    settings = Settings(kafka_bootstrap=kafka.address, kafka_session_timeout_ms=2_500)
    assert await broker_session_timeout_ms(settings) == 2_500


async def test_an_unreachable_broker_leaves_the_setting() -> None:
    settings = Settings(kafka_bootstrap="127.0.0.1:1", kafka_session_timeout_ms=2_500)
    assert await broker_session_timeout_ms(settings) == 2_500
