"""Proof that packing is exact: packed vs. one-conversation-at-a-time.

Training on a packed row must give the same logits on real tokens, the same
token-mean loss and the same parameter gradients as running every conversation
alone. This package holds the small, real models and the comparison used by the
test suite (and by ``sftpack demo``), so anyone can run the same check against
their own packing settings.

- :class:`TinyCausalLM`: a plain-PyTorch causal transformer (RMSNorm, RoPE from
  ``position_ids``, grouped-query attention through :func:`sftpack.attention.varlen_attention`,
  SwiGLU MLP). Without boundaries it runs one ordinary causal sequence through
  ``scaled_dot_product_attention(is_causal=True)`` - the reference shares no
  packing code with the packed path.
- :func:`check_plain_model` / :func:`check_hf_model` return an
  :class:`ExactnessReport` with the largest differences.
- The tolerance of such a comparison, derived from the model's shape
  (:func:`rounding_chain`, :func:`tolerance`), and the guard every packed training run
  passes first (:func:`probe_packing`, :func:`require_exact_packing`): a few short
  synthetic sequences through the user's own model, packed against each alone, so that
  no model whose layers carry state across sequence boundaries trains packed unawares.

The reference labels are built here independently of :class:`~sftpack.PackedBatch`
(target of token ``t`` is token ``t+1`` when that one is trainable).

The parts, one concept per module: ``_models`` (the tiny models, :func:`norms_in_model_dtype`,
:func:`mark_exact`), ``_check`` (the comparison and its report, :func:`random_samples`,
:func:`exactness_table`), ``_tolerance`` (:func:`rounding_chain`, :func:`tolerance`,
``UNIT_ROUNDOFF``) and ``_guard`` (the probe and the guard, and the packed / alone logits of a
Hugging Face model they compare: ``packed_text_logits``, ``alone_text_logits``). Out of
``__all__`` and importable from here: ``random_samples``, ``exactness_table``,
``small_text_config``, ``UNIT_ROUNDOFF``, ``PROBE_LENGTHS``, ``state_carrying_layers``,
``packed_text_logits``, ``alone_text_logits``.
"""

from __future__ import annotations

from ._check import ExactnessReport, check_hf_model, check_plain_model, reference_labels
from ._check import exactness_table as exactness_table
from ._check import random_samples as random_samples
from ._guard import PROBE_LENGTHS as PROBE_LENGTHS
from ._guard import InexactPackingError, PackingProbe, probe_packing, require_exact_packing
from ._guard import alone_text_logits as alone_text_logits
from ._guard import packed_text_logits as packed_text_logits
from ._guard import state_carrying_layers as state_carrying_layers
from ._models import TinyCausalLM, mark_exact, norms_in_model_dtype, tiny_llama
from ._models import small_text_config as small_text_config
from ._tolerance import UNIT_ROUNDOFF as UNIT_ROUNDOFF
from ._tolerance import rounding_chain, tolerance

__all__ = [
    "ExactnessReport",
    "InexactPackingError",
    "PackingProbe",
    "TinyCausalLM",
    "check_hf_model",
    "check_plain_model",
    "mark_exact",
    "norms_in_model_dtype",
    "probe_packing",
    "reference_labels",
    "require_exact_packing",
    "rounding_chain",
    "tiny_llama",
    "tolerance",
]
