"""Subcommands of ``inflight``; see ``inflight.cli`` for the contract each module follows."""
