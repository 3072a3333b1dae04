"""Where the loop's optional-dependency helpers used to live; they are in :mod:`sftpack._optional`
now (one helper per optional dependency for the whole package). This module only keeps
``tests/loop/test_public_api.py``'s import working until it imports ``sftpack._optional``;
nothing in the package imports it.
"""

from __future__ import annotations

from .._optional import MissingDependency, _need

__all__ = ["MissingDependency", "_need"]
