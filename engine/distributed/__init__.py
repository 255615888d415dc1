"""Tensor parallelism: N ranks under ``torch.distributed``, one scheduler (engine/distributed/launcher.py)."""
