"""What a prepack run returns: :class:`PrepackResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["PrepackResult"]


@dataclass
class PrepackResult:
    """What :func:`~sftpack.offline.prepack` wrote: the directory, its manifest, and the time per stage (s)."""

    path: Path
    manifest: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, Any]:
        return self.manifest["counts"]
