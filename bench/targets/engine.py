"""The engine in process, driven open-loop: requests enter at their arrival time, one step at a time.

The driver adds every request whose arrival time has passed before each step, so a request that
arrives during a long step waits for the next step boundary, exactly as it would behind a server.
Its arrival time is the workload's, not the moment the driver got round to it: that wait is part of
its TTFT.
"""

from __future__ import annotations

import time
from typing import Any

from bench.results import RequestResult, RunResult, StepSample
from bench.targets import TargetConfig
from engine.inputs import EngineRequest
from engine.llm_engine import LLMEngine
from engine.metrics import RequestRecord, StepRecord
from engine.sampling_params import SamplingParams
from inflight.plan.workload import RequestSpec


class EngineTarget:
    def __init__(self, name: str, config: TargetConfig) -> None:
        self.name = name
        self.config = config
        args: dict[str, Any] = dict(
            batching="continuous" if name == "continuous" else "static",
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size,
            num_blocks=config.num_blocks or -(-config.kv_tokens // config.block_size),
            max_model_len=config.max_model_len,
            # Off on both sides: a prefix hit would skip prefill work on one side only by luck of
            # timing, and the random prompts share no prefixes anyway.
            enable_prefix_caching=False,
            dtype="float32",
            seed=config.seed,
        )
        if str(config.model).endswith(".gguf"):
            # The peers read a GGUF's float copy (vLLM cannot run its blocks on a CPU): so does the
            # engine here, so that both multiply the same float weights.
            args["quantization"] = "none"
        args.update(config.engine_args)
        self.engine_args = args
        self.engine = LLMEngine.from_engine_args(config.model, **args)

    def warmup(self, specs: list[RequestSpec]) -> None:
        """Runs ``specs`` at once, unmeasured: first-call allocations and caches happen here."""
        eng = self.engine
        for s in specs:
            eng.add_request(f"warmup-{s.request_id}", list(s.prompt_token_ids), _params(s))
        while eng.has_unfinished_requests():
            eng.step()
        eng.kv.reset_prefix_cache()

    def run(self, specs: list[RequestSpec], label: str, offered_rate: float) -> RunResult:
        return drive(self.engine, specs, self.name, label, offered_rate, config=dict(self.engine_args))

    def close(self) -> None:
        del self.engine


def _params(spec: RequestSpec) -> SamplingParams:
    # Greedy, fixed length: every target generates exactly max_tokens, whatever the random weights say.
    return SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)


class _Recorder:
    """Engine listeners: per-step samples (with the KV block tables read right after the step) and
    per-request timelines."""

    def __init__(self, engine: LLMEngine, t0: float, prompt_lens: dict[str, int]) -> None:
        self.engine = engine
        self.t0 = t0
        self.prompt_lens = prompt_lens
        self.steps: list[StepSample] = []
        self.requests: dict[str, RequestRecord] = {}

    def on_step(self, rec: StepRecord) -> None:
        end = time.monotonic()
        eng = self.engine
        bs = eng.config.block_size
        used = empty = 0
        # Read from the block tables after the step: a request's blocks hold its computed tokens; the
        # rest of its last block is allocated but empty (the sampled token is not computed yet).
        for request in eng.scheduler.running:
            slots = len(eng.kv.req_blocks.get(request.request_id, ())) * bs
            used += slots
            empty += slots - request.num_computed_tokens
        num_decode = sum(
            1
            for rid, n, before in rec.batch
            if n == 1 and before >= self.prompt_lens.get(rid.split("#")[0], 1 << 30)
        )
        st = rec.stats
        self.steps.append(
            StepSample(
                step=rec.step,
                start=rec.start - self.t0,
                end=end - self.t0,
                schedule_time=rec.schedule_time,
                prepare_time=rec.prepare_time,
                execute_time=rec.execute_time,
                num_running=st.num_running,
                num_waiting=st.num_waiting,
                num_scheduled_tokens=st.num_scheduled_tokens,
                num_scheduled_seqs=st.num_scheduled_seqs,
                num_decode_seqs=num_decode,
                kv_usage=st.kv_usage,
                num_free_blocks=st.num_free_blocks,
                step_preemptions=st.step_preemptions,
                kv_slots_used=used,
                kv_slots_empty=empty,
                batch=list(rec.batch),
            )
        )

    def on_request(self, rec: RequestRecord) -> None:
        self.requests[rec.request_id] = rec


def drive(
    engine: LLMEngine,
    specs: list[RequestSpec],
    target: str,
    label: str,
    offered_rate: float,
    *,
    config: dict[str, Any] | None = None,
) -> RunResult:
    """Replay ``specs`` (sorted by arrival) against ``engine`` in real time; see the module docstring."""
    t0 = time.monotonic()
    recorder = _Recorder(engine, t0, {s.request_id: s.num_prompt_tokens for s in specs})
    results = {
        s.request_id: RequestResult(s.request_id, s.arrival, s.num_prompt_tokens, s.max_tokens) for s in specs
    }
    engine.metrics.step_listeners.append(recorder.on_step)
    engine.metrics.request_listeners.append(recorder.on_request)
    try:
        i = 0
        while i < len(specs) or engine.has_unfinished_requests():
            now = time.monotonic() - t0
            while i < len(specs) and specs[i].arrival <= now:
                s = specs[i]
                arrival = t0 + s.arrival
                engine.add_request(
                    EngineRequest(s.request_id, list(s.prompt_token_ids), _params(s), arrival_time=arrival)
                )
                i += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, specs[i].arrival - now))
                continue
            outputs = engine.step()
            t = time.monotonic() - t0
            for out in outputs:
                r = results[out.request_id]
                for c in out.outputs:
                    r.token_times.extend([t] * len(c.token_ids))
                    r.output_token_ids.extend(c.token_ids)
                if out.error:
                    r.error = out.error
                if out.finished:
                    r.finished = t
    finally:
        engine.metrics.step_listeners.remove(recorder.on_step)
        engine.metrics.request_listeners.remove(recorder.on_request)
    for rid, rec in recorder.requests.items():
        if rid not in results:
            continue
        r = results[rid]
        r.first_scheduled = None if rec.first_scheduled is None else rec.first_scheduled - t0
        r.prefill_done = None if rec.prefill_done is None else rec.prefill_done - t0
        r.num_preemptions = rec.num_preemptions
        r.events = [(name, t - t0, dict(attrs)) for name, t, attrs in rec.events]
    cfg = dict(config or {})
    cfg["num_blocks"] = engine.kv.num_total_blocks
    return RunResult(target, label, offered_rate, list(results.values()), recorder.steps, cfg)
