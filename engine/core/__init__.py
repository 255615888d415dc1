"""The engine core and its clients (vLLM v1's ``engine/``: core.py beside core_client.py).

    caller process (torch-free)                         core process (spawned)
    EngineCoreClient + OutputProcessor ── Add / Abort / StopSequence / Inspect ──▶ proc.py: EngineCore
                     text, stop strings ◀── one Step per step ── token ids, finish reasons, records, load

``engine_core.py`` is the step loop (token ids only, no tokenizer); ``output_processor.py`` turns its
outputs into text beside the client; ``client.py`` holds the interface every caller uses and
``make_client``, which builds the process client (``process_client.py``) or the in-process one
(``inproc_client.py``, the core stepped on a thread). The core process has an interpreter of its own,
so the caller's Kafka, Redis and HTTP work never shares a GIL with the model step.
"""
