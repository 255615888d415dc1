"""With API keys on, a job is visible and cancellable only with the key that created it.

On the paced stack, the job (1,800 tokens: at least 36 s) runs through the whole test on any host: bob's
DELETE meets a job it could wrongly cancel, and alice's finds one to cancel, not one already finished.
"""

from __future__ import annotations

import httpx
import pytest

from harness.stack import ServiceProcess
from tests.services.conftest import ExtraGateway
from tests.services.stack import MODEL_NAME

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def guarded(paced_gateway: ExtraGateway) -> ServiceProcess:
    return paced_gateway(INFLIGHT_API_KEYS="alice-key,bob-key")


def test_jobs_belong_to_their_key(guarded: ServiceProcess) -> None:
    alice, bob = ({"Authorization": f"Bearer {k}"} for k in ("alice-key", "bob-key"))
    params = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1800, "ignore_eos": True}
    body = {"endpoint": "/v1/completions", "body": params}
    with httpx.Client(base_url=guarded.url, timeout=30) as http:
        created = http.post("/v1/jobs", json=body, headers=alice)
        assert created.status_code == 202, created.text
        job = created.json()["id"]
        for method, path in (("GET", ""), ("GET", "/events"), ("DELETE", "")):
            resp = http.request(method, f"/v1/jobs/{job}{path}", headers=bob)
            assert resp.status_code == 404, (method, path, resp.text)
            assert resp.json()["error"]["code"] == "not_found"
        # Bob's DELETE changed nothing: the job is not cancelled.
        assert http.get(f"/v1/jobs/{job}", headers=alice).json()["status"] != "cancelled"
        assert http.delete(f"/v1/jobs/{job}", headers=alice).status_code == 200
        final = http.get(f"/v1/jobs/{job}", headers=alice).json()
        assert final["status"] in ("cancelling", "cancelled"), final["error"]
