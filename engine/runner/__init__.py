"""Turns scheduler decisions into tensors and runs the model."""
