"""The faces' data: what ``sftpack map``, ``sftpack bench``, ``sftpack plan`` and ``sftpack demo``
show, computed and returned, never printed (only :mod:`sftpack.cli` prints).

- ``layout``: the contract's worked example (``docs/contract.md``, section 2)
  built by each path's own code, its drawings (text, PNG), and the demo's PNG report.
- ``savings``: what packing saves on a set of lengths, per algorithm.
- ``demo``: the main job on the embedded default, as a stream of sections.
- ``balance``: every path's balance across data-parallel ranks, simulated on a
  dataset's lengths (``sftpack plan``).
"""
