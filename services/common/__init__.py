"""What the gateway and the worker share: wire messages, settings, Redis keys and scripts."""
