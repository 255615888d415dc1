"""HF transformers as peers, on the same checkpoint, dtype and threads as the engine.

hf-batch: transformers' own continuous batching, the manager that ``model.generate_batch`` drives.
``generate_batch`` itself takes every prompt at t = 0 with one ``max_new_tokens``; the workload needs
arrivals over time and a length per request, so the driver feeds the same manager with
``add_request`` at each arrival (exactly what ``generate_batch`` does, minus the all-at-once).

hf-generate: the static peer. Whenever the model is idle, the requests that have arrived (up to
``max_num_seqs``) form one batch, left-padded to its longest prompt, and ``generate`` runs it to the
longest ``max_tokens`` of the batch; each request is credited with its own ``max_tokens`` only.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from bench.results import RequestResult, RunResult
from bench.targets import TargetConfig
from inflight.plan.workload import RequestSpec

# HF page size (tokens per whole-model block) stays at its default; only the capacity is matched.
_HF_PAGE_SIZE = 256
_POLL_S = 0.02


def _load_model(path: str) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


class HFBatchTarget:
    name = "hf-batch"

    def __init__(self, config: TargetConfig) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.config = config
        self.model = _load_model(config.model)
        # eos -1: never stop on a token; every request runs to its own max_new_tokens.
        self.gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=1)
        self.cb_config = ContinuousBatchingConfig(
            page_size=_HF_PAGE_SIZE,
            num_blocks=-(-config.kv_tokens // _HF_PAGE_SIZE),
            max_batch_tokens=config.max_num_batched_tokens,
            max_requests_per_batch=config.max_num_seqs,
            allow_block_sharing=False,  # prefix caching off, as on the engine side
            seed=config.seed,
        )
        self._manager_cm = self.model.continuous_batching_context_manager(
            generation_config=self.gen_config, continuous_batching_config=self.cb_config, warmup=False
        )
        self.manager = self._manager_cm.__enter__()

    def warmup(self, specs: list[RequestSpec]) -> None:
        self._drive(specs, "warmup-")

    def run(self, specs: list[RequestSpec], label: str, offered_rate: float) -> RunResult:
        results = self._drive(specs, "")
        cfg = {
            "page_size": _HF_PAGE_SIZE,
            "num_blocks": self.cb_config.num_blocks,
            "max_batch_tokens": self.cb_config.max_batch_tokens,
            "max_requests_per_batch": self.cb_config.max_requests_per_batch,
            "attn_implementation": self.model.config._attn_implementation,
        }
        return RunResult(self.name, label, offered_rate, results, config=cfg)

    def _drive(self, specs: list[RequestSpec], prefix: str) -> list[RequestResult]:
        mgr = self.manager
        t0 = time.perf_counter()
        results = {
            prefix + s.request_id: RequestResult(s.request_id, s.arrival, s.num_prompt_tokens, s.max_tokens)
            for s in specs
        }
        i, done = 0, 0
        while done < len(specs):
            now = time.perf_counter() - t0
            while i < len(specs) and specs[i].arrival <= now:
                s = specs[i]
                mgr.add_request(
                    list(s.prompt_token_ids),
                    request_id=prefix + s.request_id,
                    max_new_tokens=s.max_tokens,
                    record_timestamps=True,
                    eos_token_id=-1,
                )
                i += 1
            # Wake up for the next arrival or a result, whichever comes first.
            wait = _POLL_S if i >= len(specs) else min(_POLL_S, max(0.0, specs[i].arrival - now))
            out = mgr.get_result(timeout=max(wait, 1e-3))
            if out is None:
                if not mgr.is_running():
                    raise RuntimeError("the HF continuous batching loop died")
                continue
            if not out.is_finished():
                continue
            r = results[out.request_id]
            # Per-token timestamps are taken on the generation thread as each token is produced.
            r.token_times = [t - t0 for t in (out.timestamps or [])]
            if out.lifespan[0] > 0:
                r.first_scheduled = out.lifespan[0] - t0
            if out.lifespan[1] > 0:
                r.finished = out.lifespan[1] - t0
            if out.error is not None:
                r.error = str(out.error)
            done += 1
        return list(results.values())

    def close(self) -> None:
        self._manager_cm.__exit__(None, None, None)
        del self.model


class _StepClock:
    """A ``generate`` streamer that only notes when each step's tokens come out."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate first pushes the prompt itself
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFGenerateTarget:
    name = "hf-generate"

    def __init__(self, config: TargetConfig) -> None:
        from transformers import GenerationConfig

        self.config = config
        self.model = _load_model(config.model)
        self.pad_id = 1
        # No eos: a batch runs until its longest request's max_tokens, like a fixed-batch server.
        self.gen_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=self.pad_id)

    def warmup(self, specs: list[RequestSpec]) -> None:
        t0 = time.perf_counter()
        self._run_batch(specs, {s.request_id: RequestResult(s.request_id, 0, 0, 0) for s in specs}, t0)

    def run(self, specs: list[RequestSpec], label: str, offered_rate: float) -> RunResult:
        t0 = time.perf_counter()
        results = {
            s.request_id: RequestResult(s.request_id, s.arrival, s.num_prompt_tokens, s.max_tokens)
            for s in specs
        }
        i = 0
        while i < len(specs):
            now = time.perf_counter() - t0
            if specs[i].arrival > now:
                time.sleep(specs[i].arrival - now)
                continue
            j = i
            while j < len(specs) and j - i < self.config.max_num_seqs and specs[j].arrival <= now:
                j += 1
            self._run_batch(specs[i:j], results, t0)
            i = j
        cfg = {"max_batch": self.config.max_num_seqs, "padding": "left"}
        return RunResult(self.name, label, offered_rate, list(results.values()), config=cfg)

    @torch.inference_mode()
    def _run_batch(self, batch: list[RequestSpec], results: dict[str, RequestResult], t0: float) -> None:
        width = max(s.num_prompt_tokens for s in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, s in enumerate(batch):
            ids[row, width - s.num_prompt_tokens :] = torch.tensor(s.prompt_token_ids)
            mask[row, width - s.num_prompt_tokens :] = 1
        started = time.perf_counter() - t0
        clock = _StepClock()
        self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=self.gen_config,
            max_new_tokens=max(s.max_tokens for s in batch),
            streamer=clock,
        )
        times = [t - t0 for t in clock.times]
        for s in batch:
            r = results[s.request_id]
            r.first_scheduled = started
            r.token_times = times[: s.max_tokens]
            # It leaves with the batch: nothing is returned before generate returns.
            r.finished = times[-1] if times else None

    def close(self) -> None:
        del self.model
