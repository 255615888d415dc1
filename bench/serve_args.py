"""``bench serve``'s plain parts: the phases, the command lines of ``vllm serve`` and ``vllm bench serve``,
the ShareGPT-shaped dataset, and reading the client's result files into rows and a table.

Nothing here starts a process, so all of it is unit-tested without vLLM (tests/bench/test_serve_args.py);
bench/serve_bench.py runs it.

A run's phases, per dataset, each against both targets:

    burst          all prompts at t = 0                                 -> each target's request rate
    poisson 50%    Poisson arrivals at 50/70/90% of the reference burst rate (vLLM's where it ran:
    poisson 70%    both targets get the same offered load, a fraction of the peer's capacity)
    poisson 90%
    c=1, c=4, ...  a closed loop of that many clients (``--max-concurrency``), all prompts at once
"""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ("random", "sharegpt")
TARGETS = ("inflight", "vllm")
# What each row keeps of the client's result file (its names), besides the counts.
METRICS = (
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "median_e2el_ms",
    "duration",
)


@dataclass(frozen=True)
class Phase:
    """One client run: a dataset at an arrival pattern. ``rate`` math.inf: all at once (a burst, or a
    closed loop of ``concurrency`` clients); ``load``: the fraction of the burst rate it was set from."""

    name: str
    dataset: str
    num_prompts: int
    rate: float = math.inf
    concurrency: int | None = None
    load: float | None = None

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")


def burst_phase(dataset: str, num_prompts: int) -> Phase:
    return Phase(f"{dataset} burst", dataset, num_prompts)


def load_phases(dataset: str, num_prompts: int, burst_rate: float, loads: list[float]) -> list[Phase]:
    """Poisson phases at ``loads`` (fractions) of ``burst_rate`` (requests per second)."""
    if not burst_rate > 0:
        raise ValueError(f"the burst's request rate must be > 0, got {burst_rate}")
    return [
        Phase(f"{dataset} poisson {load:.0%}", dataset, num_prompts, rate=burst_rate * load, load=load)
        for load in loads
    ]


def concurrency_phases(dataset: str, num_prompts: int, levels: list[int]) -> list[Phase]:
    return [Phase(f"{dataset} c={c}", dataset, num_prompts, concurrency=c) for c in levels]


@dataclass(frozen=True)
class ClientSetup:
    """What every client run shares: the server's address and model, the tokenizer the client counts
    tokens with, and the datasets' shapes."""

    base_url: str
    model_name: str
    tokenizer: str
    sharegpt_path: str | None = None
    input_len: int = 128
    output_len: int = 64
    seed: int = 0


def bench_serve_argv(phase: Phase, setup: ClientSetup, result_dir: Path, result_file: str) -> list[str]:
    """``vllm bench serve``'s arguments (after the CLI's own name) for one phase against one server.

    Streams completions (the openai backend: /v1/completions) and ignores EOS, so every request
    produces its full output length on both servers; percentiles p50/p90/p99 of TTFT, TPOT, ITL and
    end-to-end latency; the result JSON with per-request errors (``--save-detailed``)."""
    argv = [
        "bench", "serve",
        "--backend", "openai",
        "--base-url", setup.base_url,
        "--endpoint", "/v1/completions",
        "--model", setup.model_name,
        "--tokenizer", setup.tokenizer,
        "--dataset-name", phase.dataset,
        "--num-prompts", str(phase.num_prompts),
        "--request-rate", "inf" if math.isinf(phase.rate) else f"{phase.rate:.4f}",
        "--seed", str(setup.seed),
        "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed",
        "--result-dir", str(result_dir),
        "--result-filename", result_file,
        "--disable-tqdm",
    ]  # fmt: skip
    if phase.concurrency is not None:
        argv += ["--max-concurrency", str(phase.concurrency)]
    if phase.dataset == "random":
        argv += ["--random-input-len", str(setup.input_len), "--random-output-len", str(setup.output_len)]
    else:
        if setup.sharegpt_path is None:
            raise ValueError("the sharegpt phases need ClientSetup.sharegpt_path")
        argv += ["--dataset-path", setup.sharegpt_path]
    return argv


@dataclass(frozen=True)
class ServerSetup:
    """Both servers: the same checkpoint, dtype, batch limits, KV capacity and compute threads."""

    model_dir: str
    model_name: str
    dtype: str = "float32"
    threads: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 1024
    # KV capacity in tokens, the same on both: 48 random requests at once hold 48 x 192 = 9,216; the
    # ShareGPT-shaped ones about 250 each on average. 16,384 float32 tokens of SmolLM2-135M are 0.7 GiB.
    kv_tokens: int = 16_384


INFLIGHT_BLOCK = 16
VLLM_BLOCK = 32  # vLLM's CPU attention takes multiples of 32 only


def inflight_env(server: ServerSetup) -> dict[str, str]:
    """The stack's settings: the worker's engine on ``threads`` torch threads, no prefix caching."""
    engine_args = {
        "dtype": server.dtype,
        "max_num_seqs": server.max_num_seqs,
        "max_num_batched_tokens": server.max_num_batched_tokens,
        "block_size": INFLIGHT_BLOCK,
        "num_blocks": -(-server.kv_tokens // INFLIGHT_BLOCK),
        "enable_prefix_caching": False,
    }
    return {
        "INFLIGHT_SERVED_MODEL_NAME": server.model_name,
        "INFLIGHT_TORCH_THREADS": str(server.threads),
        "INFLIGHT_MAX_MODEL_LEN": str(server.max_model_len),
        "INFLIGHT_ENGINE_ARGS": json.dumps(engine_args, sort_keys=True),
    }


def vllm_serve_argv(server: ServerSetup, port: int) -> list[str]:
    """``vllm serve``'s arguments (after the CLI's own name): eager, as ``bench peers`` runs it."""
    num_blocks = -(-server.kv_tokens // VLLM_BLOCK)
    return [
        "serve", server.model_dir,
        "--served-model-name", server.model_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", server.dtype,
        "--max-num-seqs", str(server.max_num_seqs),
        "--max-num-batched-tokens", str(server.max_num_batched_tokens),
        "--max-model-len", str(server.max_model_len),
        "--block-size", str(VLLM_BLOCK),
        "--num-gpu-blocks-override", str(num_blocks + 1),  # + vLLM's null block
        "--no-enable-prefix-caching",
        "--enforce-eager",
    ]  # fmt: skip


def vllm_serve_env(server: ServerSetup, binding: str, kv_gib: int) -> dict[str, str]:
    """vLLM's OpenMP threads bound to ``binding`` (``threads`` CPUs), its KV space in GiB."""
    return {
        "VLLM_CPU_OMP_THREADS_BIND": binding,
        "OMP_NUM_THREADS": str(server.threads),
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
    }


# ---- the ShareGPT-shaped dataset ------------------------------------------------------------------
# ShareGPT's first turns: prompts and answers of widely spread lengths, answers longer than prompts.
# Log-normal lengths with medians and spreads of that shape, cut to what a 2-core host serves in
# minutes; in words, which this model's tokenizer turns into about 1.3 tokens each.
SHAREGPT_PROMPT_WORDS = (60.0, 1.0, 8, 400)  # median, sigma, min, max
SHAREGPT_OUTPUT_WORDS = (80.0, 0.8, 8, 200)
_WORDS = tuple(
    " ".join(
        [
            "the model answers a question about the weather in spring and explains why rain falls more",
            "often near mountains than in the plains while a small river carries the water to the sea",
            "past old towns with markets bridges gardens and stone houses where people talk about books",
            "music history science",
        ]
    ).split()
)


def _lognormal_int(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(rng.lognormvariate(math.log(median), sigma))))


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def sharegpt_dataset(num_conversations: int, seed: int = 0) -> list[dict[str, Any]]:
    """Conversations in ShareGPT's format (``vllm bench serve --dataset-name sharegpt`` reads it): a
    human turn, then a gpt turn whose token count the client takes as the request's output length."""
    rng = random.Random(seed)
    data = []
    for i in range(num_conversations):
        prompt = _text(rng, _lognormal_int(rng, *SHAREGPT_PROMPT_WORDS))
        answer = _text(rng, _lognormal_int(rng, *SHAREGPT_OUTPUT_WORDS))
        data.append(
            {
                "id": f"synthetic-{i}",
                "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}],
            }
        )
    return data


# ---- results ----------------------------------------------------------------------------------------
def result_row(result: dict[str, Any], *, target: str, phase: Phase, repeat: int) -> dict[str, Any]:
    """One client run as a row: its counts, the metrics above, and a few of its distinct errors."""
    completed = int(result.get("completed", 0))
    failed = int(result.get("failed", result.get("num_prompts", phase.num_prompts) - completed))
    errors = [e for e in result.get("errors", []) if e]
    row: dict[str, Any] = {
        "target": target,
        "phase": phase.name,
        "dataset": phase.dataset,
        "rate": None if math.isinf(phase.rate) else phase.rate,
        "concurrency": phase.concurrency,
        "load": phase.load,
        "repeat": repeat,
        "num_prompts": phase.num_prompts,
        "completed": completed,
        "failed": failed,
        "errors": sorted(set(errors))[:3],
    }
    for key in METRICS:
        value = result.get(key)
        row[key] = float(value) if isinstance(value, int | float) else None
    return row


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per phase and target, in the order first seen: the median of the repeats of each metric, and the
    failures summed over them; ``vs_vllm`` the ratios of inflight's medians to vLLM's where both ran."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["phase"], row["target"]), []).append(row)
    out: list[dict[str, Any]] = []
    for (phase, target), runs in groups.items():
        summary: dict[str, Any] = {
            "phase": phase,
            "target": target,
            "repeats": len(runs),
            "failed": sum(r["failed"] for r in runs),
            "requests": sum(r["num_prompts"] for r in runs),
        }
        for key in METRICS:
            values = [r[key] for r in runs if r[key] is not None]
            summary[key] = statistics.median(values) if values else None
        out.append(summary)
    by_key = {(s["phase"], s["target"]): s for s in out}
    for s in out:
        peer = by_key.get((s["phase"], "vllm"))
        if s["target"] == "inflight" and peer is not None:
            s["vs_vllm"] = {
                key: s[key] / peer[key] if s[key] is not None and peer[key] else None
                for key in ("output_throughput", "p99_ttft_ms", "median_tpot_ms")
            }
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(summaries: list[dict[str, Any]]) -> str:
    """A Markdown table: one line per phase and target."""
    header = ["phase", "target", "failed", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms"]
    lines = ["| " + " | ".join([*header, "tok/s vs vLLM"]) + " |", "|---" * (len(header) + 1) + "|"]
    for s in summaries:
        ratio = s.get("vs_vllm", {}).get("output_throughput")
        cells = [
            s["phase"],
            s["target"],
            f"{s['failed']}/{s['requests']}",
            _fmt(s["output_throughput"]),
            _fmt(s["request_throughput"], 2),
            _fmt(s["median_ttft_ms"], 0),
            _fmt(s["p99_ttft_ms"], 0),
            _fmt(s["median_tpot_ms"]),
            f"{ratio:.2f}x" if ratio else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reference_rate(bursts: dict[str, float]) -> float:
    """The burst rate the Poisson phases are set from: vLLM's where it ran, else inflight's."""
    if "vllm" in bursts:
        return bursts["vllm"]
    return bursts["inflight"]


def target_order(targets: list[str], repeat: int) -> list[str]:
    """Repeats alternate which target goes first, so a slow minute of the host hits both."""
    return list(targets) if repeat % 2 == 0 else list(reversed(targets))
