"""The trained model as a Hugging Face folder (``sftpack train --save-model DIR``).

:func:`save_model` writes what ``AutoModelForCausalLM.from_pretrained(DIR)`` (or, for a
vision-language model, ``AutoModelForImageTextToText``) and ``AutoTokenizer.from_pretrained(DIR)``
read: ``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer's
files with its chat template (and the image processor's, given one). The weights are the
trained model's, in its dtype, byte for byte. The folder is written beside ``out`` and renamed
into place (:mod:`~sftpack.loop._model_dir`): ``out`` is the old folder or the whole new one,
and a folder with files in it is replaced only when asked (``overwrite``).

The default model of ``sftpack train`` is :class:`~sftpack.loop._llama.SmallLlama`, the
same network as transformers' ``LlamaForCausalLM`` with the same parameter names: it is
written as a ``LlamaForCausalLM`` (its config's fields, its state dict). The attention the
loop registers with transformers for packed rows is not written into the config: the
folder loads with transformers' own attention, whose outputs on one conversation are
those of the trained model (``tests/loop/test_save_model.py``).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from .._optional import transformers
from ._llama import SmallLlama
from ._model_dir import publish_model_dir

__all__ = ["hf_model", "save_model"]


def hf_model(model: Any, state: dict[str, torch.Tensor] | None = None) -> Any:
    """``model`` as a transformers ``PreTrainedModel``: itself, or for a
    :class:`~sftpack.loop._llama.SmallLlama` a ``LlamaForCausalLM`` holding its weights.
    ``state``: the full weights of a sharded (``--fsdp``) ``model``
    (:func:`~sftpack.loop._fsdp.full_state`), loaded into a new model of its config."""
    if not isinstance(model, SmallLlama):
        if not hasattr(model, "save_pretrained"):
            raise TypeError(f"{type(model).__name__} is not a Hugging Face model (it has no save_pretrained)")
        if state is None:
            return model
        with torch.random.fork_rng(devices=[]):
            whole = transformers().AutoModelForCausalLM.from_config(model.config, trust_remote_code=False)
        whole = whole.to(next(model.parameters()).dtype)
        whole.load_state_dict(state, strict=True)
        return whole
    c = model.config
    hf = transformers()
    cfg = hf.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        max_position_embeddings=c.max_position_embeddings,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
        initializer_range=c.initializer_range,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):  # its initial weights are overwritten: the RNG stays as it was
        out = hf.LlamaForCausalLM(cfg)
    out = out.to(next(model.parameters()).dtype)  # first: a float64 model's weights are not rounded to float32
    out.load_state_dict(model.state_dict() if state is None else state, strict=True)
    return out


def save_model(
    model: Any,
    out: str | os.PathLike[str],
    *,
    tokenizer: Any = None,
    processor: Any = None,
    state: dict[str, torch.Tensor] | None = None,
    chat_template: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (trained) as a Hugging Face folder ``out``, with ``tokenizer`` (its chat
    template included) and a vision-language model's image ``processor`` beside it.

    The config names the tokenizer's ``eos``/``pad``/``bos`` ids, so ``generate`` stops
    where the chat template ends a turn. ``state``: a sharded (``--fsdp``) model's full
    weights (:func:`~sftpack.loop._fsdp.full_state`). ``chat_template``: the template the run
    rendered its conversations with, saved with the tokenizer in place of the tokenizer's own
    (a vision-language run: the family's, which writes image parts;
    :meth:`~sftpack.multimodal.Family.chat_template_for`). ``overwrite``: replace a folder with
    files in it (whole). The folder is written beside ``out`` and renamed into place. Returns ``out``.

    Raises:
        TypeError: ``model`` is neither a Hugging Face model nor the default ``SmallLlama``.
        ValueError: ``out`` cannot take the model: a file, a folder with files in it (without
            ``overwrite``), a parent that is a file or not writable
            (:func:`~sftpack.loop._model_dir.check_model_dir`).
    """
    model_hf = hf_model(model, state)
    if tokenizer is not None and chat_template is not None and chat_template != tokenizer.chat_template:
        tokenizer = copy.copy(tokenizer)  # the run's tokenizer keeps its own template
        tokenizer.chat_template = chat_template
    if tokenizer is not None:
        for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(tokenizer, key, None)
            if value is not None:
                setattr(model_hf.config, key, value)
                if getattr(model_hf, "generation_config", None) is not None:
                    setattr(model_hf.generation_config, key, value)
    logging = transformers().utils.logging

    def write(folder: Path) -> None:
        bar = logging.is_progress_bar_enabled()
        logging.disable_progress_bar()  # the library prints nothing ("Writing model shards")
        try:
            model_hf.save_pretrained(folder)
            if tokenizer is not None:
                tokenizer.save_pretrained(folder)
            if processor is not None:
                processor.save_pretrained(folder)
        finally:
            if bar:
                logging.enable_progress_bar()

    return publish_model_dir(out, write, overwrite=overwrite)
