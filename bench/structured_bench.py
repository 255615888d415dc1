"""What grammar-constrained decoding costs: output tok/s of a batch where half the requests carry a JSON
schema, against the same batch with none, and the host time of the grammar masks per step; and what the
first constrained request of a fresh engine costs the others (its grammar compiles off the step loop).

Both runs decode the same number of tokens: the schema asks for an array longer than ``--max-tokens``
allows, so every constrained request is masked on every step and ends by length, like the free ones
(``ignore_eos``). Same prompts, seeds and engine settings; the first run of each kind is a warm-up.

    python -m bench.structured_bench --out bench-results
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

from engine import LLM, SamplingParams
from engine.models.gguf import default_gguf_path
from engine.models.tiny import default_model_path
from engine.structured.spec import StructuredOutput

# Never finished within the run: every constrained row is masked on every step.
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["alpha", "beta", "gamma"]},
        "values": {"type": "array", "items": {"type": "integer"}, "minItems": 4096},
    },
    "required": ["label", "values"],
}


def run(llm: LLM, num_requests: int, max_tokens: int, constrained: bool) -> dict[str, Any]:
    free = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    spec = StructuredOutput.json_schema(LONG_SCHEMA)
    json_params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, structured=spec)
    prompts = [f"Request {i}: list some numbers as JSON." for i in range(num_requests)]
    params = [json_params if constrained and i % 2 == 0 else free for i in range(num_requests)]
    engine = llm.engine
    sampler = engine.runner.sampler
    mask_before, steps_before = sampler.grammar_seconds, engine.metrics.num_steps
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, p)
    start = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.outputs)
    seconds = time.perf_counter() - start
    steps = engine.metrics.num_steps - steps_before
    mask = sampler.grammar_seconds - mask_before
    return {
        "constrained_requests": sum(p.structured is not None for p in params),
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        "output_tok_s": round(tokens / seconds, 1),
        "steps": steps,
        "mask_ms_per_step": round(1e3 * mask / max(steps, 1), 3),
    }


def first_compile(llm: LLM, max_tokens: int) -> dict[str, Any]:
    """The first constrained request of a fresh engine (xgrammar's import, the vocabulary scan, the compile)
    beside a free one already decoding: the free request's longest step and its tokens until the
    constrained one's first token. The compile runs off the step loop, so the free one keeps stepping."""
    engine = llm.engine
    free = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("cold-free", "Count to a hundred:", free)
    engine.step()
    spec = StructuredOutput.json_schema(LONG_SCHEMA)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, structured=spec)
    start = time.perf_counter()
    engine.add_request("cold-json", "A list as JSON:", params)
    steps: list[float] = []
    free_tokens = 0
    while True:
        t = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - t)
        if any(o.request_id == "cold-json" and o.outputs and o.outputs[0].token_ids for o in outputs):
            break
        free_tokens += sum(len(o.outputs[0].token_ids) for o in outputs if o.request_id == "cold-free")
        if not engine.has_unfinished_requests():
            break
    waited = time.perf_counter() - start
    engine.abort_request("cold-free")
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "first_token_s": round(waited, 3),
        "longest_step_ms": round(1e3 * max(steps), 1),
        "steps_meanwhile": len(steps) - 1,
        "free_tokens_meanwhile": free_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the shipped SmolLM2, else tiny)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=None, help="directory for structured_bench.json")
    args = ap.parse_args()
    model = args.model or str(default_gguf_path() or default_model_path())
    llm = LLM(model, max_model_len=512, max_num_seqs=args.num_requests)
    cold = first_compile(llm, max_tokens=400)
    run(llm, args.num_requests, 8, constrained=True)  # warm-up: compiles the schema, fills caches
    run(llm, args.num_requests, 8, constrained=False)
    free = run(llm, args.num_requests, args.max_tokens, constrained=False)
    half = run(llm, args.num_requests, args.max_tokens, constrained=True)
    result = {
        "model": model,
        "vocab_size": llm.engine.config.model.vocab_size,
        "cpu": platform.processor() or platform.machine(),
        "device": str(llm.engine.config.device),
        "free": free,
        "half_json_schema": half,
        "throughput_ratio": round(half["output_tok_s"] / free["output_tok_s"], 3),
        "first_compile": cold,
    }
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "structured_bench.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
