"""Workloads: when each request arrives, its prompt, and exactly how many tokens it generates.

The planner simulates and validates on them (``plan simulate --trace`` reads the trace format below);
the benchmarks (bench/) replay the same lists on real targets.

A workload is a plain list of ``RequestSpec``; every target replays the same list, so arrival times,
prompt tokens and output lengths are identical across targets. Output lengths are fixed per request
(``max_tokens`` with EOS ignored): a throughput difference can then only come from scheduling, never
from one target happening to stop earlier.

Arrival processes, for a mean rate ``rate`` (requests/s):
  * poisson: exponential gaps, mean 1/rate (coefficient of variation 1);
  * gamma:   gamma gaps with mean 1/rate and a chosen CV; CV > 1 is bursty (shape k = 1/CV^2, so
             CV 2 gives k = 0.25: many near-zero gaps, then long silences), CV < 1 more regular;
  * burst:   every request at t = 0 (rate = inf), the offline "saturation" case;
  * trace:   a JSONL file, one request per line (see ``load_trace``).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Token ids below this are the tiny checkpoints' special tokens (bos, eos, ChatML markers): a random
# prompt avoids them so no target treats part of a prompt specially.
_FIRST_PLAIN_TOKEN = 4


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    arrival: float  # seconds after the run starts
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # generated exactly: EOS is ignored

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class LengthMix:
    """Prompt and output lengths: short questions mixed with long documents, outputs log-uniform.

    Defaults follow the seed's experiment (prompts 16-512, outputs 8-256): a quarter of the prompts
    are documents of 256-512 tokens, the rest questions of 16-128; output lengths are log-uniform so
    short answers are common and long ones still occur, which is what makes early finishes matter.
    """

    short_prompt: tuple[int, int] = (16, 128)
    long_prompt: tuple[int, int] = (256, 512)
    long_fraction: float = 0.25
    output: tuple[int, int] = (8, 256)

    def __post_init__(self) -> None:
        for name in ("short_prompt", "long_prompt", "output"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= low <= high, got {(lo, hi)}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")

    def prompt_len(self, rng: random.Random) -> int:
        lo, hi = self.long_prompt if rng.random() < self.long_fraction else self.short_prompt
        return rng.randint(lo, hi)

    def output_len(self, rng: random.Random) -> int:
        lo, hi = self.output
        return min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))


def arrival_times(
    num_requests: int, rate: float, *, process: str = "poisson", cv: float = 1.0, seed: int = 0
) -> list[float]:
    """Arrival instants (seconds, non-decreasing, the first gap included) of a renewal process."""
    if num_requests < 0:
        raise ValueError("num_requests must be >= 0")
    if process == "burst" or math.isinf(rate):
        return [0.0] * num_requests
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    if process == "poisson":
        gaps = [rng.expovariate(rate) for _ in range(num_requests)]
    elif process == "gamma":
        if cv <= 0:
            raise ValueError(f"cv must be > 0, got {cv}")
        shape = 1.0 / (cv * cv)  # a gamma's CV is 1/sqrt(shape)
        gaps = [rng.gammavariate(shape, 1.0 / (rate * shape)) for _ in range(num_requests)]
    else:
        raise ValueError(f"unknown arrival process {process!r}; use poisson, gamma or burst")
    times, t = [], 0.0
    for gap in gaps:
        t += gap
        times.append(t)
    return times


def random_prompt(length: int, vocab_size: int, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(_FIRST_PLAIN_TOKEN, vocab_size) for _ in range(length))


def synthetic(
    num_requests: int,
    rate: float,
    vocab_size: int,
    *,
    process: str = "poisson",
    cv: float = 1.0,
    mix: LengthMix | None = None,
    seed: int = 0,
    prefix: str = "req",
) -> list[RequestSpec]:
    """A reproducible workload. Lengths and prompts come from their own seeded stream, so the same
    seed gives the same requests at every rate: a rate sweep changes only when they arrive."""
    mix = mix or LengthMix()
    times = arrival_times(num_requests, rate, process=process, cv=cv, seed=seed)
    rng = random.Random(seed + 1_000_003)
    specs = []
    for i, arrival in enumerate(times):
        prompt_len, output_len = mix.prompt_len(rng), mix.output_len(rng)
        specs.append(
            RequestSpec(f"{prefix}-{i}", arrival, random_prompt(prompt_len, vocab_size, rng), output_len)
        )
    return specs


def load_trace(
    path: str | Path,
    vocab_size: int,
    *,
    encode: Any = None,
    time_scale: float = 1.0,
    seed: int = 0,
) -> list[RequestSpec]:
    """Requests from a JSONL trace, one object a line (blank lines and ``#`` comments skipped):

        {"arrival": 0.12, "prompt_len": 300, "output_len": 64}
        {"arrival": 0.50, "prompt": "Summarise this ...", "output_len": 32, "id": "q7"}
        {"arrival": 0.61, "prompt_token_ids": [12, 99, 7], "max_tokens": 16}

    ``arrival`` is seconds from the start (``timestamp`` is accepted too; the earliest becomes 0)
    and is multiplied by ``time_scale`` (0.5 replays twice as fast). A text ``prompt`` needs
    ``encode`` (text -> ids); a ``prompt_len`` gets seeded random tokens. ``output_len`` and
    ``max_tokens`` are synonyms. Requests are returned in arrival order.
    """
    rng = random.Random(seed)
    rows: list[tuple[float, int, dict[str, Any]]] = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not JSON: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{lineno}: expected an object")
        when = obj.get("arrival", obj.get("timestamp"))
        if not isinstance(when, int | float):
            raise ValueError(f"{path}:{lineno}: needs a numeric 'arrival' (or 'timestamp')")
        rows.append((float(when), lineno, obj))
    if not rows:
        raise ValueError(f"{path}: no requests")
    start = min(r[0] for r in rows)
    specs = []
    # Sorted by time, file order breaking ties, so a trace need not be written in order.
    for when, lineno, obj in sorted(rows, key=lambda r: (r[0], r[1])):
        where = f"{path}:{lineno}"
        ids = _trace_prompt(obj, vocab_size, encode, rng, where)
        out = obj.get("output_len", obj.get("max_tokens"))
        if not isinstance(out, int) or out < 1:
            raise ValueError(f"{where}: needs an integer 'output_len' (or 'max_tokens') >= 1")
        request_id = str(obj.get("id", f"trace-{lineno}"))
        specs.append(RequestSpec(request_id, (when - start) * time_scale, ids, out))
    if len({s.request_id for s in specs}) != len(specs):
        raise ValueError(f"{path}: request ids are not unique")
    return specs


def _trace_prompt(
    obj: dict[str, Any], vocab_size: int, encode: Any, rng: random.Random, where: str
) -> tuple[int, ...]:
    if "prompt_token_ids" in obj:
        ids = obj["prompt_token_ids"]
        if not ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of ids < {vocab_size}")
        return tuple(ids)
    if "prompt" in obj:
        if encode is None:
            raise ValueError(f"{where}: a text prompt needs a tokenizer")
        ids = list(encode(str(obj["prompt"])))
        if not ids:
            raise ValueError(f"{where}: the prompt encodes to no tokens")
        return tuple(ids)
    length = obj.get("prompt_len")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"{where}: needs 'prompt', 'prompt_token_ids' or an integer 'prompt_len' >= 1")
    return random_prompt(length, vocab_size, rng)


def save_trace(specs: Sequence[RequestSpec], path: str | Path) -> None:
    """Write a workload as a trace that ``load_trace`` reads back identically."""
    with Path(path).open("w", encoding="utf-8") as f:
        for s in specs:
            row = asdict(s)
            f.write(
                json.dumps(
                    {
                        "id": row["request_id"],
                        "arrival": row["arrival"],
                        "prompt_token_ids": list(row["prompt_token_ids"]),
                        "max_tokens": row["max_tokens"],
                    }
                )
                + "\n"
            )


def describe(specs: Sequence[RequestSpec]) -> dict[str, float]:
    """Shape of a workload, for the results JSON."""
    if not specs:
        return {"num_requests": 0}
    prompts = [s.num_prompt_tokens for s in specs]
    outputs = [s.max_tokens for s in specs]
    span = specs[-1].arrival - specs[0].arrival
    return {
        "num_requests": len(specs),
        "prompt_tokens_mean": sum(prompts) / len(prompts),
        "prompt_tokens_max": max(prompts),
        "output_tokens_mean": sum(outputs) / len(outputs),
        "output_tokens_max": max(outputs),
        "arrival_span_s": span,
        "offered_rate": (len(specs) - 1) / span if span > 0 else math.inf,
    }


def warmup_specs(vocab_size: int, max_model_len: int) -> list[RequestSpec]:
    """A short prompt, a medium one and a long one, a few tokens each: every code path runs once."""
    import random

    rng = random.Random(12345)
    lengths = [max(1, min(n, max_model_len - 8)) for n in (24, 130, 500)]
    return [RequestSpec(f"w{i}", 0.0, random_prompt(n, vocab_size, rng), 4) for i, n in enumerate(lengths)]


def bench_model_path() -> Path:
    """The benchmark checkpoint (tiny.py's "bench" preset, ~50M parameters, float32), written once
    in the model cache (``engine.paths.models_dir``) and renamed into place, so a concurrent run
    sees either none or a complete one."""
    from engine.models.tiny import write_tiny_checkpoint
    from engine.paths import models_dir

    target = models_dir() / "bench-llama"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".bench-llama-", dir=target.parent))
    try:
        write_tiny_checkpoint(tmp, preset="bench", dtype="float32")
        tmp.chmod(0o755)
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
