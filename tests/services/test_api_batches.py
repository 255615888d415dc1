"""OpenAI's Batch API through the official ``openai`` client against a real stack: files, batches,
request_counts, the output and error files in OpenAI's JSONL shape, cancel, listing."""

from __future__ import annotations

import io
import json
from typing import Any

import openai
import pytest

from tests.services.stack import MODEL_NAME, Stack, wait_for

pytestmark = pytest.mark.timeout(240)


def _line(custom_id: str, prompt: str, **body: Any) -> str:
    request = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, **body}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": request})


def _upload(client: Any, lines: list[str]) -> Any:
    data = ("\n".join(lines) + "\n").encode()
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")


def test_a_batch_runs_its_lines_and_writes_both_files(stack: Stack) -> None:
    client = stack.client()
    lines = [_line(f"ok-{i}", f"Story number {i}:") for i in range(5)]
    lines.insert(2, "{not json")
    lines.append(_line("bad-field", "x", reasoning_effort="high"))
    upload = _upload(client, lines)
    assert upload.purpose == "batch" and upload.bytes > 0
    assert client.files.retrieve(upload.id).id == upload.id
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h", metadata={"run": "t"}
    )
    assert batch.status == "in_progress" and batch.request_counts is not None
    assert batch.request_counts.total == 7

    def finished() -> Any:
        b = client.batches.retrieve(batch.id)
        return b if b.status == "completed" else None

    done = wait_for(finished, 120, interval_s=0.5, message="the batch to complete")
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 5, 2)
    assert done.metadata == {"run": "t"}
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == [f"ok-{i}" for i in range(5)]
    for o in output:
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4
        alone = client.completions.create(
            model=MODEL_NAME, prompt=f"Story number {o['custom_id'][3:]}:", max_tokens=4, temperature=0
        )
        assert body["choices"][0]["text"] == alone.choices[0].text
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    by_id = {e["custom_id"]: e for e in errors}
    assert set(by_id) == {None, "bad-field"}
    assert by_id[None]["response"] is None and by_id[None]["error"]["code"] == "invalid_request"
    refused = by_id["bad-field"]["response"]
    assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "reasoning_effort"
    listed = client.batches.list(limit=100)
    assert done.id in [b.id for b in listed.data]
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


def test_refusals_and_cancel(stack: Stack) -> None:
    client = stack.client()
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    upload = _upload(
        client, [_line(f"c-{i}", "Long story:", max_tokens=200, ignore_eos=True) for i in range(4)]
    )
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")

    def cancelled() -> Any:
        b = client.batches.retrieve(batch.id)
        return b if b.status == "cancelled" else None

    done = wait_for(cancelled, 120, interval_s=0.5, message="the batch to be cancelled")
    assert done.request_counts is not None and done.request_counts.total == 4
    assert done.request_counts.completed + done.request_counts.failed == 4


def test_a_batch_past_its_window_expires(paced_stack: Stack) -> None:
    # Paced engines: 300 tokens take at least 6 s, so the window ends while the lines still run.
    client = paced_stack.client()
    upload = _upload(
        client, [_line(f"e-{i}", "Long story:", max_tokens=300, ignore_eos=True) for i in range(2)]
    )
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    assert batch.expires_at is not None and batch.expires_at - batch.created_at == 24 * 3600
    paced_stack.redis_client().hset(f"inflight:req:{{{batch.id}}}", "expires_at", 1)  # the window is over

    def expired() -> Any:
        b = client.batches.retrieve(batch.id)
        return b if b.status == "expired" else None

    done = wait_for(expired, 120, interval_s=0.5, message="the batch to expire")
    assert done.expired_at is not None and done.request_counts is not None
    assert done.request_counts.failed >= 1
    assert done.request_counts.completed + done.request_counts.failed == 2
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert {e["response"]["body"]["error"]["code"] for e in errors} == {"cancelled"}
