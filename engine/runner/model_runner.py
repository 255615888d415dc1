"""Packs a scheduled step into flat tensors, runs the model, samples.

The runner makes no policy: it executes exactly what the SchedulerOutput says. It reads nothing else
of the engine (no ``Request``, no KV cache manager): the output carries new requests once and then
per-step diffs, and the runner keeps its own rows (``InputBatch``).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention.backend import AttentionMetadata, get_attention_backend
from engine.config import EngineConfig
from engine.distributed.parallel_state import SINGLE, TensorParallel
from engine.kernels import kv_quant
from engine.kv_cache.manager import cdiv
from engine.models.decoder import DecoderModel
from engine.models.loader import load_weights
from engine.platform import memory
from engine.quant.stacked import any_kept_quantized
from engine.runner.cuda_graph import GraphedDecode
from engine.runner.input_batch import CachedRequestState, InputBatch
from engine.runner.kernel_choice import choose_kernels
from engine.runner.piecewise_graph import PiecewiseGraphs, piecewise_buckets
from engine.runner.prompt_scoring import PromptScores, blocks, plan_prompt_scoring, score_prompt
from engine.runner.staging import InputStaging
from engine.runner.step_io import PreparedInputs, RunnerOutput, StepArrays
from engine.runner.step_overlap import StepHandle, StepOverlap
from engine.sampling.sampler import Sampler, SamplingRow
from engine.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from engine.distributed.launcher import RankSet

# Without an explicit size, the CPU cache holds every sequence at full length, capped at this.
_DEFAULT_CPU_KV_BYTES = 2 << 30
_GPU_MEMORY_UTILIZATION = 0.9

log = logging.getLogger(__name__)


class ModelRunner:
    """``tp``: a tensor-parallel rank's group (ranks 1..N-1 pass theirs; rank 0, given none, starts
    the other ranks itself when ``config.tensor_parallel_size`` > 1)."""

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        self.config = config
        self.device = config.device
        self.ranks: RankSet | None = None  # rank 0 of a tensor-parallel group: the other ranks
        if tp is None and config.tensor_parallel_size > 1:
            from engine import envs
            from engine.distributed.launcher import RankSet

            self.ranks = RankSet(config, envs.tp_timeout_s())
            # An engine dropped without close() still ends its ranks and leaves the process group,
            # so that another tensor-parallel engine can start in this process.
            weakref.finalize(self, self.ranks.close)
            tp = self.ranks.tp
        self.tp = tp or SINGLE
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig) -> None:
        mc = config.model
        tp = self.tp
        plan = None
        if tp.enabled:
            from engine.distributed.sharding import ShardPlan

            plan = ShardPlan(mc, tp.rank, tp.size)
        # A model whose every layer shares one window attends within it (its freed blocks are never read).
        self.backend = get_attention_backend(config.attention_backend)
        if self.device.type == "cpu":
            # Before the weights: a step's activations then reuse pages instead of faulting new ones.
            memory.reuse_freed_memory()
        weights = load_weights(
            config.model_path,
            mc,
            config.dtype,
            self.device,
            config.load_format,
            config.seed,
            plan,
            config.quantization,
        )
        self.model = DecoderModel(
            mc,
            weights,
            self.backend,
            choose_kernels(config, self.device, any_kept_quantized(weights.values())),
            config.max_model_len,
            tp,
        )
        # Each rank sizes its cache from its own memory; the one scheduler uses the smallest.
        self.num_blocks = tp.agree_min(self._decide_num_blocks())
        # The backend picks the layout its kernels read (engine/attention/backend.py, KVLayout).
        # An 8-bit cache's rows carry their scale: D + 4 elements (engine/kernels/kv_quant.py).
        kv_dtype = config.kv_cache_dtype
        self.kv_layout = self.backend.kv_layout(kv_dtype, mc.head_dim, self.device)
        self.backend.prepare(self.model.num_heads, self.model.num_kv_heads, mc.head_dim, kv_dtype)
        row = kv_quant.row_elements(kv_dtype, mc.head_dim)
        shape = self.kv_layout.shape(self.num_blocks, config.block_size, self.model.num_kv_heads, row)
        self.kv_caches = [self._kv_cache(shape) for _ in range(mc.num_hidden_layers)]
        self.max_blocks_per_req = cdiv(config.max_model_len, config.block_size)
        self.input_batch = InputBatch(config.max_num_seqs, config.max_model_len, self.max_blocks_per_req)
        self.sampler = Sampler()
        # On CUDA, inputs go through persistent pinned mirrors of persistent device buffers.
        self.staging = self._make_staging(pin=True) if self.device.type == "cuda" else None
        if self.model.kernels.triton:
            # Every Triton variant a step can pick compiles now, not in the middle of serving.
            from engine.kernels.warmup import warm_up

            warm_up(
                self.model.num_heads,
                self.model.num_kv_heads,
                mc.head_dim,
                config.block_size,
                config.dtype,
                mc.vocab_size,
                self.device,
                config.kv_cache_dtype,
            )
        # Async scheduling: steps run behind the engine thread (a worker thread on CPU, the stream on CUDA).
        self.overlap = StepOverlap(self) if config.async_scheduling and tp.rank == 0 else None
        self.graphs: GraphedDecode | None = None
        self.piecewise: PiecewiseGraphs | None = None
        if config.enable_cuda_graph and self.device.type == "cuda":
            # Mixed steps first: their largest size reserves the pool the decode graphs then share.
            self.piecewise = self._capture_piecewise()
            self.graphs = GraphedDecode(
                self.model,
                self.kv_caches,
                config.max_num_seqs,
                self.max_blocks_per_req,
                config.max_model_len,
                self.device,
                pool=self.piecewise.pool if self.piecewise is not None else None,
            )

    def _capture_piecewise(self) -> PiecewiseGraphs | None:
        buckets = piecewise_buckets(self.config.max_num_batched_tokens)
        try:
            return PiecewiseGraphs(self.model, self.kv_caches, buckets)
        except RuntimeError:
            # Not yet run on a GPU: a failed capture costs mixed steps their graphs (they run eager,
            # as before), not the engine. scripts/gpu_check.sh's graph_check fails on it.
            log.exception("piecewise CUDA graphs not captured; mixed steps run eager")
            return None

    def _make_staging(self, pin: bool) -> InputStaging:
        tokens, seqs = self.config.max_num_batched_tokens, self.config.max_num_seqs
        i32, i64 = torch.int32, torch.int64
        sizes = {
            "input_ids": (tokens, i64),
            "positions": (tokens, i64),
            "slot_mapping": (tokens, i64),
            "query_start_loc": (seqs + 1, i32),
            "seq_lens": (seqs, i32),
            "block_tables": (seqs * self.max_blocks_per_req, i32),
            "logits_indices": (seqs, i64),
        }
        return InputStaging(sizes, self.device, pin)

    def _kv_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":
            # Blocks are read scattered over the cache: 2 MiB pages spare a TLB miss per block.
            return memory.huge_page_zeros(shape, self.config.kv_cache_dtype)
        return torch.zeros(shape, dtype=self.config.kv_cache_dtype, device=self.device)

    # ---- KV cache sizing -------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        mc = self.config.model
        per_head = kv_quant.bytes_per_token_head(self.config.kv_cache_dtype, mc.head_dim)
        kv_heads = self.model.num_kv_heads  # this rank's
        return 2 * mc.num_hidden_layers * self.config.block_size * kv_heads * per_head

    def _decide_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        per_block = self.bytes_per_block()
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave headroom for activations and CUDA graphs beyond the weights already loaded.
            budget = int(free - total * (1 - _GPU_MEMORY_UTILIZATION))
        else:
            full = cfg.max_num_seqs * cdiv(cfg.max_model_len, cfg.block_size) * per_block
            budget = min(full, _DEFAULT_CPU_KV_BYTES)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes")
        return int(num_blocks)

    # ---- one step --------------------------------------------------------------------------
    def update_rows(self, out: SchedulerOutput) -> None:
        # Removals first: a request preempted (or finished and re-added) may come back as new this step.
        for req_id in out.finished_req_ids:
            self.input_batch.remove(req_id)
        for req_id in out.preempted_req_ids:
            self.input_batch.remove(req_id)
        for new in out.scheduled_new_reqs:
            state = self.input_batch.add(new)
            spec = new.sampling_params.structured
            if spec is not None:
                from engine.structured.grammar import compiler_for_engine

                # Compiled (and cached) when the engine admitted it: here a lookup and a replay.
                state.grammar = compiler_for_engine(self.config).state(spec, state.output_token_ids)
        for cached in out.scheduled_cached_reqs:
            self.input_batch.update(cached)

    def prepare(self, out: SchedulerOutput) -> PreparedInputs:
        """Flat inputs for the step. Loops run per request (S), never per token (T).

        Example, block_size 4: A computed 5 scheduled 1, B computed 0 scheduled 3
            req_idx   [0 1 1 1]     offsets [0 0 1 2]     positions [5 0 1 2]
            slot      table[A][5 // 4] * 4 + 5 % 4, table[B][0] * 4 + 0, ...
        """
        batch = self.input_batch
        num_seqs = out.num_seqs
        rows = np.empty(num_seqs, dtype=np.int64)
        num_sched = np.empty(num_seqs, dtype=np.int64)
        computed = np.empty(num_seqs, dtype=np.int64)
        states = [batch.requests[req_id] for req_id in out.num_scheduled_tokens]
        for i, state in enumerate(states):
            rows[i] = state.row
            num_sched[i] = out.num_scheduled_tokens[state.req_id]
            computed[i] = state.num_computed_tokens
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(num_sched, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        req_idx = np.repeat(np.arange(num_seqs), num_sched)  # [T]
        positions = computed[req_idx] + np.arange(num_tokens) - query_start_loc[:-1][req_idx]
        token_rows = rows[req_idx]
        input_ids = batch.token_ids[token_rows, positions]
        bs = self.config.block_size
        slot_mapping = batch.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = computed + num_sched
        max_blocks = int(cdiv(int(seq_lens.max()), bs))
        block_tables = batch.block_table[rows, :max_blocks]
        # A request samples when this step computes its last known token.
        samples = seq_lens == batch.num_tokens[rows]
        logits_indices = query_start_loc[1:][samples] - 1
        sampling_requests = [r for r, s in zip(states, samples, strict=True) if s]
        # Requests asking for prompt logprobs: their prefill positions get logits too.
        prompt_plan = plan_prompt_scoring(states, computed, num_sched, query_start_loc[:-1])
        arrays = StepArrays(
            input_ids=input_ids,
            positions=positions,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            logits_indices=logits_indices,
            max_query_len=int(num_sched.max()),
            decode_only=bool((num_sched == 1).all()),
            prompt_logits_indices=None if prompt_plan is None else prompt_plan.indices,
        )
        prepared = self.to_device(arrays, sampling_requests)
        prepared.prompt_plan = prompt_plan
        if self.ranks is not None:
            prepared.arrays = arrays  # the other ranks get them when the step runs (forward)
        return prepared

    def to_device(self, arrays: StepArrays, sampling_requests: list[CachedRequestState]) -> PreparedInputs:
        """The step's tensors on the runner's device (on CUDA through the persistent staging buffers)."""
        dev = self.device

        pin = dev.type == "cuda"
        staging = self.staging
        if staging is not None:
            staging.begin()

        def to_dev(a: np.ndarray, dtype: torch.dtype, name: str) -> torch.Tensor:
            if staging is not None and staging.fits(name, a.size):
                return staging.stage(name, a)  # persistent pinned mirror -> persistent device buffer
            host = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
            # From pinned memory the copy is truly asynchronous; the step's kernels queue behind it.
            return host.pin_memory().to(dev, non_blocking=True) if pin else host

        a = arrays
        metadata = AttentionMetadata(
            num_tokens=int(a.input_ids.size),
            num_seqs=int(a.seq_lens.size),
            max_query_len=a.max_query_len,
            max_seq_len=int(a.seq_lens.max()),
            query_start_loc=to_dev(a.query_start_loc, torch.int32, "query_start_loc"),
            seq_lens=to_dev(a.seq_lens, torch.int32, "seq_lens"),
            block_tables=to_dev(a.block_tables, torch.int32, "block_tables"),
            slot_mapping=to_dev(a.slot_mapping, torch.int64, "slot_mapping"),
            query_start_loc_cpu=a.query_start_loc.tolist(),
            seq_lens_cpu=a.seq_lens.tolist(),
            decode_only=a.decode_only,
        )
        prepared = PreparedInputs(
            input_ids=to_dev(a.input_ids, torch.int64, "input_ids"),
            positions=to_dev(a.positions, torch.int64, "positions"),
            metadata=metadata,
            logits_indices=to_dev(a.logits_indices, torch.int64, "logits_indices"),
            sampling_requests=sampling_requests,
        )
        if staging is not None:
            staging.end()
        return prepared

    def forward(self, inputs: PreparedInputs) -> torch.Tensor:
        """Hidden states [T, hidden]: decode-only steps replay a whole-model graph; other steps up
        to the largest piecewise size replay graphs around eager attention; larger ones run eager."""
        meta = inputs.metadata
        if self.ranks is not None:
            self._hand_to_ranks(inputs)
        if self.graphs is not None and meta.decode_only and meta.num_seqs <= self.graphs.max_batch:
            return self.graphs.run(inputs.input_ids, inputs.positions, meta)
        if self.piecewise is not None and meta.num_tokens <= self.piecewise.max_tokens:
            return self.piecewise.run(inputs.input_ids, inputs.positions, meta)
        return self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, meta)

    # ---- tensor parallelism ----------------------------------------------------------------------
    def _hand_to_ranks(self, inputs: PreparedInputs) -> None:
        """Rank 0: give the other ranks this step's inputs, as it is about to run (async scheduling
        has filled in the previous step's tokens by now)."""
        assert self.ranks is not None and inputs.arrays is not None
        arrays = inputs.arrays
        if self.device.type == "cpu":
            # The filled-in ids (on a CPU the tensor is the host array's memory or its copy).
            arrays.input_ids = inputs.input_ids.numpy()
        self.ranks.broadcast(arrays)
        if self.device.type != "cpu":
            # On a GPU the previous step's tokens are still on the device: the ids go by NCCL, in
            # stream order, with no wait on the host.
            self._broadcast_ids(inputs.input_ids)

    def _broadcast_ids(self, input_ids: torch.Tensor) -> None:
        import torch.distributed as dist

        from engine.distributed.parallel_state import RankFailure

        try:
            dist.broadcast(input_ids, src=0, group=self.tp.device_group)
        except RuntimeError as exc:
            raise RankFailure(f"tensor-parallel broadcast failed on rank {self.tp.rank}: {exc}") from exc

    @torch.inference_mode()
    def run_rank_step(self, arrays: StepArrays) -> None:
        """Ranks 1..N-1: one step's forward on this rank's shard, and its part of the logits."""
        inputs = self.to_device(arrays, [])
        if self.device.type != "cpu":
            self._broadcast_ids(inputs.input_ids)
        hidden = self.forward(inputs)
        if arrays.prompt_logits_indices is not None:  # before the sampling logits, as rank 0 does
            for index in blocks(arrays.prompt_logits_indices, hidden.device):
                self.model.compute_logits(hidden.index_select(0, index))
        if arrays.logits_indices.size:
            self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        start = time.perf_counter()
        self.update_rows(out)
        inputs = self.prepare(out)
        # Host time: on a GPU the copies above are asynchronous and the model has not started.
        prepare_time = time.perf_counter() - start
        rows = [
            SamplingRow(
                params=r.sampling_params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                seed=r.seed,
                eos_token_id=r.eos_token_id,
                grammar=r.grammar,
            )
            for r in inputs.sampling_requests
        ]
        # Grammar masks (structured outputs) fill while the model runs; nothing happens without one.
        masks = self.sampler.begin_masks(rows, self.config.model.vocab_size)
        hidden = self.forward(inputs)
        scores = self.score_prompts(hidden, inputs)  # read after sampling: one wait for both
        if not inputs.sampling_requests:
            prompt_only = scores.to_host() if scores is not None else {}
            return RunnerOutput({}, {}, prepare_time, prompt_logprobs=prompt_only)
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        result = self.sampler(logits, rows, masks)
        sampled = {}
        for state, token in zip(inputs.sampling_requests, result.token_ids, strict=True):
            sampled[state.req_id] = token
            self.input_batch.append_token(state, token)  # after sampling: the rows above read the list
        logprobs = {
            r.req_id: lp
            for r, lp in zip(inputs.sampling_requests, result.logprobs, strict=True)
            if lp is not None
        }
        prompt_logprobs = scores.to_host() if scores is not None else {}
        return RunnerOutput(sampled, logprobs, prepare_time, prompt_logprobs=prompt_logprobs)

    def score_prompts(self, hidden: torch.Tensor, inputs: PreparedInputs) -> PromptScores | None:
        """Prompt logprobs of this step's prefill positions, for the requests that ask (else None).
        Before the sampling logits: tensor-parallel ranks gather their logits in the same order."""
        plan = inputs.prompt_plan
        if plan is None:
            return None
        return score_prompt(hidden, plan, self.model.compute_logits)

    # ---- async scheduling (engine/runner/step_overlap.py) ----------------------------------------
    def submit(self, out: SchedulerOutput, prev: StepHandle | None) -> StepHandle:
        """Start step ``out`` behind ``prev`` (the step still running) without waiting for either."""
        assert self.overlap is not None, "async_scheduling is off"
        return self.overlap.submit(out, prev)

    def collect(self, handle: StepHandle) -> RunnerOutput:
        """Wait for a submitted step; its tokens. Raises what the step raised."""
        assert self.overlap is not None, "async_scheduling is off"
        return self.overlap.collect(handle)

    def close(self) -> None:
        overlap = getattr(self, "overlap", None)
        if overlap is not None:
            overlap.close()
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
