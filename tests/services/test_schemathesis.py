"""Property-based fuzzing of the gateway's OpenAPI spec (schemathesis): no input yields a 500.

Bodies are generated from the published schema, valid and invalid alike, and sent to a live gateway
backed by the real broker, Redis and a worker. The gateway here caps the context at 64 tokens so
that valid requests finish quickly; ``model`` is set to the served name in half of the cases, so the
generation path is fuzzed too, not only the 404 for an unknown model.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from harness.stack import ServiceProcess
from tests.services.conftest import ExtraGateway
from tests.services.stack import MODEL_NAME

pytestmark = pytest.mark.timeout(240)

EXAMPLES_PER_OPERATION = 20


@pytest.fixture(scope="module")
def fuzz_gateway(extra_gateway: ExtraGateway) -> ServiceProcess:
    return extra_gateway(INFLIGHT_MAX_MODEL_LEN="64")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(fuzz_gateway: ServiceProcess, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{fuzz_gateway.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "POST /v1/jobs",
    }
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode), use_model=st.booleans())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,  # the same cases every run: a failure reproduces
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def check(case: Any, use_model: bool) -> None:
            if use_model and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL_NAME
            response = case.call(base_url=fuzz_gateway.url, timeout=60)
            case.validate_response(response, checks=[not_a_server_error])
            if response.status_code >= 400 and response.headers.get("content-type") == "application/json":
                assert set(response.json()["error"]) >= {"message", "type", "param", "code"}

        try:
            check()
        except Unsatisfiable:
            # Negative mode on an operation whose every input is valid (GET /v1/models): nothing to send.
            assert mode is GenerationMode.NEGATIVE
