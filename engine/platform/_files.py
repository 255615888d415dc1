"""Reading the host's own files (/proc, /sys), which a container or another OS may not have."""

from __future__ import annotations

from pathlib import Path


def read_host_file(path: Path) -> str | None:
    """The file's text, or None where it cannot be read."""
    try:
        return path.read_text()
    except (OSError, ValueError):
        return None
