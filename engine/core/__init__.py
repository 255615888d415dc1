"""The engine core in its own process: the step loop away from the caller's I/O (vLLM v1's EngineCore).

    caller process (torch-free)              core process (spawned)
    EngineCoreClient ── Add / Abort / Inspect ──▶ run_engine_core: LLMEngine
                     ◀── one StepMessage per step ── outputs, step and request records, load

``EngineCoreClient`` answers the same calls as ``AsyncLLMEngine`` (the thread-based engine), so the
worker runs on either; the core process has an interpreter of its own, so the caller's Kafka, Redis and
HTTP work never shares a GIL with the model step.
"""
