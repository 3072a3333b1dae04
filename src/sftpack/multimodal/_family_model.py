"""The model side of a vision-language model family: :class:`FamilyModel`.

What training and checking take of a family's model, and nothing of how its data is tokenized:
its model in a local folder (:meth:`FamilyModel.pretrained`) or a tiny one built from a config
(:meth:`FamilyModel.tiny_model`), its vision tower's outputs (:meth:`FamilyModel.vision_outputs`),
the language model over a packed row (:meth:`FamilyModel.packed_hidden`,
:meth:`FamilyModel.packed_logits`) and over one sample alone (:meth:`FamilyModel.alone_logits`),
and which parameters are its vision part (:meth:`FamilyModel.part_of`). The trainer, the loop
and the exactness report take a family through this side; the data side is
:class:`~sftpack.multimodal._family_data.FamilyData`, and :class:`~sftpack.multimodal.Family` is both.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from .. import _optional
from ..attention import TRAIN_ATTENTION, register_train_attention
from ..exactness import mark_exact, norms_in_model_dtype

if TYPE_CHECKING:
    from ..handoff import PackedBatch
    from ..handoff.payload import Media
    from ..sample import Sample

__all__ = ["FamilyModel", "VisionLanguageModel", "seeded_model", "text_kwargs"]


class VisionLanguageModel(Protocol):
    """What sftpack takes of a family's model: a Hugging Face ``PreTrainedModel`` of its
    :attr:`FamilyModel.model_class` (transformers' classes are the untyped edge here: their
    config and inner modules are read as the family knows them)."""

    #: its ``PretrainedConfig``
    config: Any
    #: its inner model (``*Model``: the vision tower and the language model, under the output head)
    model: Any
    dtype: torch.dtype

    def get_input_embeddings(self) -> Any: ...

    def modules(self) -> Iterator[torch.nn.Module]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

    def get_output_embeddings(self) -> Any: ...


class FamilyModel:
    """The model side of one vision-language model family (see the module text)."""

    #: the family's name (a key of the registry, :data:`~sftpack.multimodal._family.FAMILIES`)
    name: ClassVar[str] = ""
    #: the Hugging Face class of its models (a name in ``transformers``)
    model_class: ClassVar[str] = ""
    #: its RMSNorm classes, computed in float64 in a float64 model (``None``: Llama's)
    norm_classes: ClassVar[tuple[str, ...] | None] = None

    def pretrained(
        self, model_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32, vision_attention: str = "sdpa"
    ) -> Any:
        """The family's model in the local folder ``model_dir`` (``save_pretrained``; never
        downloads), as :func:`seeded_model` prepares a tiny one: the language model on sftpack's
        training attention, the vision tower on ``vision_attention``, in training mode and ``dtype``."""

        name = register_train_attention()
        try:
            model = _optional.from_pretrained(
                self.model_class,
                model_dir,
                local_files_only=True,
                dtype=dtype,
                attn_implementation={"": name, "text_config": name, "vision_config": vision_attention},
            )
        except _optional.CustomCodeError:
            raise
        except (OSError, ValueError) as e:
            raise ValueError(
                f"cannot load a {self.model_class} from {os.fspath(model_dir)!r} ({' '.join(str(e).split())[:200]}); "
                "give a local folder written by model.save_pretrained()"
            ) from None
        return _prepared(model, dtype, self.norm_classes)

    def tokenizer(self, model_dir: str | os.PathLike | None = None) -> Any:  # pragma: no cover - the data side's
        """The family's tokenizer (:meth:`FamilyData.tokenizer`): :meth:`tiny_model` sizes its vocabulary by it."""
        raise NotImplementedError

    def placeholder_id(self, tokenizer: Any) -> int:  # pragma: no cover - the data side's
        """The image placeholder's id (:meth:`FamilyData.placeholder_id`): a config names it."""
        raise NotImplementedError

    def token_ids(self, tokenizer: Any) -> dict[str, int]:
        """The token ids a model config of this family names, by config key (the placeholder's;
        a family with more control tokens adds them)."""
        return {"image_token_id": self.placeholder_id(tokenizer)}

    # ------------------------------------------------------------- the model
    def tiny_model(
        self,
        tokenizer: Any = None,
        *,
        vocab_size: int | None = None,
        token_ids: dict[str, int] | None = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        text_attention: str | None = None,
        **sizes: Any,
    ) -> Any:
        """A small randomly initialised model of this family built from a config (seeded, nothing
        downloaded), for tests, the demo and CPU training.

        ``vocab_size`` (default the tokenizer's) and ``token_ids`` (default the tokenizer's, see
        :meth:`token_ids`; a renumbered vocabulary passes its own) size and name its vocabulary;
        the tokenizer defaults to :meth:`tokenizer`. ``dtype=torch.float64`` also makes the
        RMSNorms compute in float64. ``text_attention``: the language model's attention (default
        sftpack's training attention; ``"sdpa"`` makes Hugging Face find the boundaries from the
        restarts of the position row). ``sizes``: the family's own (:meth:`_tiny_model`).
        """
        if token_ids is None or vocab_size is None:
            tokenizer = tokenizer if tokenizer is not None else self.tokenizer()
        ids = token_ids if token_ids is not None else self.token_ids(tokenizer)
        vocab = int(vocab_size) if vocab_size is not None else len(tokenizer)
        build = {"seed": seed, "dtype": dtype, "text_attention": text_attention}
        return self._tiny_model(vocab, ids, build, sizes)

    def _tiny_model(self, vocab_size: int, ids: dict[str, int], build: dict[str, Any], sizes: dict[str, Any]) -> Any:
        """:meth:`tiny_model` over ``vocab_size`` ids, its config naming the token ``ids``;
        ``build``: ``seed``, ``dtype`` and ``text_attention`` (:func:`seeded_model`'s)."""
        raise NotImplementedError  # pragma: no cover - per family

    def vision_outputs(self, model: VisionLanguageModel, media: Any) -> Any:  # pragma: no cover - per family
        """The vision tower over a row's media, in the form the model takes precomputed
        (``mm_encoder_outputs``), for a family whose tower runs apart from the language model."""
        raise NotImplementedError(f"the {self.name} family does not run its vision tower apart from its model")

    def packed_hidden(
        self, model: VisionLanguageModel, batch: PackedBatch, *, pad_between_seqs: bool = True
    ) -> torch.Tensor:  # pragma: no cover
        """``(T, H)`` hidden states of the language model over a packed row
        (:class:`~sftpack.PackedBatch` with media), before the output head."""
        raise NotImplementedError

    def packed_logits(
        self, model: VisionLanguageModel, batch: PackedBatch, *, pad_between_seqs: bool = True
    ) -> torch.Tensor:
        """``(T, V)`` logits of a packed row: the model's output head over :meth:`packed_hidden`."""
        return model.get_output_embeddings()(self.packed_hidden(model, batch, pad_between_seqs=pad_between_seqs))

    def alone_logits(self, model: VisionLanguageModel, sample: Sample) -> torch.Tensor:
        """``(L, V)`` logits of one sample run alone, the model's own way: ``model(input_ids,
        ...)`` with what its vision tower takes of the sample's images (:meth:`_alone_media`)."""
        ids = torch.from_numpy(sample.input_ids).unsqueeze(0)
        kw: dict[str, Any] = {"input_ids": ids, "use_cache": False}
        media = sample.media
        if media is not None and media.num_items:
            kw.update(self._alone_media(model, ids, media))
        return model(**kw).logits[0]

    def padded_kwargs(self, input_ids: torch.Tensor, media: Media) -> dict[str, Any]:
        """What the model's own forward takes beyond the media's ``hf_kwargs`` for right-padded
        rows ``input_ids`` ``(B, S)`` (Gemma 3: ``token_type_ids``, which make each image's soft
        tokens bidirectional); by default nothing."""
        return {}

    def _alone_media(
        self, model: VisionLanguageModel, input_ids: torch.Tensor, media: Any
    ) -> dict[str, Any]:  # pragma: no cover
        """The keyword arguments of a sample's images for the model's own forward (``input_ids`` ``(1, L)``)."""
        raise NotImplementedError

    def part_of(self, parameter: str) -> str:
        """Which part of the model a parameter belongs to (the exactness report groups by it)."""
        return "language"


def text_kwargs(
    model: VisionLanguageModel, batch: PackedBatch, inputs: dict[str, Any], *, pad_between_seqs: bool
) -> dict[str, Any]:
    """The language model's keyword arguments for a packed row: ``inputs`` (its ids or
    embeddings and its positions), no cache and, under sftpack's training attention, the row's
    boundaries (``cu_seq_lens_q/k`` padded, ``max_length_q/k``, and with ``pad_between_seqs``
    the real ones as ``sftpack_cu_seqlens_real``). Any other attention gets nothing more:
    Hugging Face finds the boundaries where the text position row restarts."""

    kw: dict[str, Any] = {**inputs, "use_cache": False}
    if model.config.get_text_config()._attn_implementation == TRAIN_ATTENTION:
        kw.update(
            cu_seq_lens_q=batch.cu_seqlens_padded,
            cu_seq_lens_k=batch.cu_seqlens_padded,
            max_length_q=int(batch.max_seqlen),
            max_length_k=int(batch.max_seqlen),
        )
        if pad_between_seqs:
            kw["sftpack_cu_seqlens_real"] = batch.cu_seqlens
    return kw


def seeded_model(
    model_class: Any,
    config: Any,
    *,
    seed: int,
    dtype: torch.dtype,
    text_attention: str | None = None,
    vision_attention: str = "sdpa",
    norm_classes: tuple[str, ...] | None = None,
) -> Any:
    """``model_class`` built from ``config`` with seeded random weights (the global RNG left as
    it was), in training mode and ``dtype``: the language model on ``text_attention`` (default
    sftpack's training attention), the vision tower on ``vision_attention``; in float64 its
    ``norm_classes`` (default Llama's) compute in float64 too."""

    name = text_attention or register_train_attention()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class._from_config(
            config, attn_implementation={"": name, "text_config": name, "vision_config": vision_attention}
        )
    return mark_exact(_prepared(model, dtype, norm_classes))  # a family's tiny model: proven exact by the suite


def _prepared(model: Any, dtype: torch.dtype, norm_classes: tuple[str, ...] | None) -> Any:
    """``model`` in training mode and ``dtype``; in float64 its ``norm_classes`` (default
    Llama's) compute in float64 too."""
    model = model.to(dtype).train()
    if dtype != torch.float64:
        return model
    return norms_in_model_dtype(model, norm_classes) if norm_classes else norms_in_model_dtype(model)
