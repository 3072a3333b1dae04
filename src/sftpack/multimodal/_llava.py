"""A second model family: LLaVA (image tokens replaced by projected features, 1-D positions).

Qwen2-VL is one way to put images into a language model; LLaVA is the other common
one, and nothing Qwen-shaped carries over to it:

- each image is one fixed-size pixel tensor ``(3, H, W)`` (no patch grid), and the
  vision tower (CLIP-style, with a class token) sees one image per batch entry;
- the image token is repeated a fixed number of times per image, ``(H / patch)**2``
  (the class token dropped, LLaVA's ``"default"`` feature select), and the language
  model's input embeddings at those slots are *replaced* by the projected vision
  features;
- positions are plain 1-D, restarting per sample (no MRoPE).

What stays the same: the text row is :meth:`sftpack.PackedBatch.from_samples` (labels
shifted within each sample, positions restarting per sample, ``cu_seqlens`` /
``cu_seqlens_padded``), the media travel in row order with each image's slot run and
segment (``image_slots`` / ``image_sequence``, as on a Qwen2-VL row), the language
model runs sftpack's training attention on ``cu_seqlens`` (either boundary mode), and
the exactness check compares with each sample run alone through the model's own
forward (``model(input_ids, pixel_values)``).

:class:`sftpack.PackedBatch`'s media fields are Qwen-shaped (``validate()`` requires
``image_grid_thw``, ``vision_cu_seqlens`` and ``mrope_position_ids`` whenever
``pixel_values`` is set), so a LLaVA row is a :class:`LlavaRow`: the text
``PackedBatch`` (media fields ``None``) with the images beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from .. import _optional
from ..exactness import norms_in_model_dtype
from ..handoff import PackedBatch, PackedBatchError
from ..handoff.media import check_pixel_values
from ..sample import Sample
from ._exactness import compare_packed_alone
from ._images import load_image
from ._model import _train_attention_name
from ._sample import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    UnsupportedModelError,
    _check_image_runs,
    _check_tokenizer,
    _ids_and_mask,
    _render,
    qwen2vl_tokenizer,
)

__all__ = [
    "LlavaCheck",
    "LlavaRow",
    "LlavaSample",
    "build_llava_row",
    "check_llava_packed",
    "llava_alone_logits",
    "llava_image_processor",
    "llava_image_tokens",
    "llava_packed_logits",
    "tiny_llava",
    "tokenize_llava",
]


# ------------------------------------------------------------------ the sample
@dataclass(eq=False)
class LlavaSample(Sample):
    """A :class:`~sftpack.Sample` with its images, LLaVA-style.

    Attributes (beyond ``input_ids``, ``loss_mask``, ``conversation_id``, ``meta``):
        pixel_values: ``(I, 3, H, W)`` float32 (or float16), finite, one fixed-size tensor per
            image, in order.
        image_runs: ``(I, 2)`` int64 ``(start, length)`` of each image's run of
            ``image_token_id`` in ``input_ids``; every run has the same length (the
            tower's feature count per image).
        image_token_id: the image token id.
    """

    pixel_values: np.ndarray = field(default_factory=lambda: np.zeros((0, 3, 1, 1), np.float32))
    image_runs: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    image_token_id: int = 151655

    def __post_init__(self) -> None:
        super().__post_init__()
        self.pixel_values = np.asarray(self.pixel_values)
        self.image_runs = np.asarray(self.image_runs, dtype=np.int64).reshape(-1, 2)
        who = self.conversation_id
        check_pixel_values(self.pixel_values, f"LlavaSample {who!r}: pixel_values", patches=False, error=ValueError)
        n_img = self.pixel_values.shape[0]
        if self.image_runs.shape[0] != n_img:
            raise ValueError(f"LlavaSample {who!r}: {self.image_runs.shape[0]} image runs for {n_img} images")
        if n_img and len(set(self.image_runs[:, 1].tolist())) != 1:
            raise ValueError(
                f"LlavaSample {who!r}: image runs of lengths {self.image_runs[:, 1].tolist()}; a LLaVA image "
                "always takes the same number of tokens"
            )
        _check_image_runs(self, f"LlavaSample {who!r}", None, "image")

    @property
    def num_images(self) -> int:
        return int(self.pixel_values.shape[0])


@lru_cache(maxsize=8)
def llava_image_processor(size: int = 32) -> Any:
    """LLaVA's image processing (CLIP's: shortest edge to ``size``, bicubic; centre crop to
    ``size x size``; CLIP mean and std), transformers' PIL/numpy ``CLIPImageProcessorPil``."""
    hf = _optional.transformers()
    return hf.CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})


#: The vision towers :func:`llava_image_tokens` counts for, and whether each puts a class token first.
_LLAVA_TOWERS = {"clip_vision_model": True, "siglip_vision_model": False}


def llava_image_tokens(config: Any) -> int:
    """Image tokens per image for a LLaVA config (``model_type`` ``"llava"``, a CLIP or SigLIP
    tower): the tower's ``(image_size / patch_size)**2`` patch features, plus CLIP's class
    token, less the first feature under the ``"default"`` feature select (LLaVA drops it
    whatever the tower). 576 for llava-1.5 (CLIP, 336 px, 14 px patches, ``"default"``).

    Raises:
        UnsupportedModelError: another family (LLaVA-NeXT and -OneVision tile images into a
            varying number of tokens; Gemma 3, Idefics3, SmolVLM, Mistral3, InternVL, Qwen2-VL
            are not LLaVA), another tower or feature select, all in one line.
    """
    kind = getattr(config, "model_type", None)
    supported = (
        "supported: model_type 'llava' with a CLIP or SigLIP vision tower ('clip_vision_model', "
        "'siglip_vision_model') and vision_feature_select_strategy 'default' or 'full'; Qwen2-VL-style "
        "models go through tokenize_multimodal"
    )
    if kind != "llava":
        raise UnsupportedModelError(
            f"llava_image_tokens: model_type {kind!r} ({type(config).__name__}) is not {supported}"
        )
    v = getattr(config, "vision_config", None)
    tower = getattr(v, "model_type", None)
    strategy = getattr(config, "vision_feature_select_strategy", None)
    size, patch = getattr(v, "image_size", None), getattr(v, "patch_size", None)
    if tower not in _LLAVA_TOWERS or strategy not in ("default", "full"):
        raise UnsupportedModelError(
            f"llava_image_tokens: vision tower {tower!r} with feature select {strategy!r} is not {supported}"
        )
    if not (isinstance(size, int) and isinstance(patch, int)) or min(size, patch) < 1:
        raise UnsupportedModelError(
            f"llava_image_tokens: vision_config.image_size {size!r} and patch_size {patch!r} (not positive ints: "
            f"square images and patches) are not {supported}"
        )
    n = (size // patch) ** 2 + (1 if _LLAVA_TOWERS[tower] else 0)
    return n - (1 if strategy == "default" else 0)


def tokenize_llava(
    messages: list[dict],
    *,
    image_tokens: int,
    tokenizer: Any = None,
    processor: Any = None,
    conversation_id: Any = None,
) -> LlavaSample:
    """One multimodal chat conversation to a :class:`LlavaSample`.

    ChatML as for Qwen2-VL (the same renderer and tokenizer, :func:`qwen2vl_tokenizer`),
    but LLaVA-shaped: each image is one image token (``<|image_pad|>``, no
    ``<|vision_start|>`` / ``<|vision_end|>`` around it) repeated ``image_tokens`` times,
    and its pixels are one ``(3, size, size)`` tensor from ``processor`` (default
    :func:`llava_image_processor`). Loss on the assistant's content and ``<|im_end|>``.
    """
    tokenizer = tokenizer if tokenizer is not None else qwen2vl_tokenizer()
    processor = processor if processor is not None else llava_image_processor()
    _check_tokenizer(tokenizer)
    r = _render(messages, conversation_id)
    images = [load_image(p, conversation_id, where) for p, where in r.images]
    ids, mask = _ids_and_mask(r, tokenizer)
    image_id, vs, ve = (int(tokenizer.convert_tokens_to_ids(t)) for t in (IMAGE_PAD, VISION_START, VISION_END))
    keep = (ids != vs) & (ids != ve)
    ids, mask = ids[keep], mask[keep]
    where = np.flatnonzero(ids == image_id)
    assert where.size == len(images), "one image token per image part: content text never makes one"
    reps = np.ones(ids.shape, dtype=np.int64)
    reps[where] = image_tokens
    new_start = np.cumsum(reps) - reps
    runs = np.stack([new_start[where], reps[where]], axis=1) if where.size else np.zeros((0, 2), np.int64)
    if images:
        pv = np.ascontiguousarray(processor(images=images, return_tensors="np")["pixel_values"], dtype=np.float32)
    else:
        size = int(processor.crop_size["height"])
        pv = np.zeros((0, 3, size, size), np.float32)
    return LlavaSample(
        np.repeat(ids, reps),
        np.repeat(mask & (ids != image_id), reps),
        conversation_id,
        pixel_values=pv,
        image_runs=runs,
        image_token_id=image_id,
    )


# ------------------------------------------------------------------ the row
@dataclass(eq=False)
class LlavaRow:
    """A packed row of LLaVA samples: the text row and its images, in row order.

    Attributes:
        batch: the text :class:`~sftpack.PackedBatch` (1-D ``position_ids`` restarting per
            sample, ``cu_seqlens`` / ``cu_seqlens_padded``; its media fields ``None``).
        pixel_values: ``(I, 3, H, W)``: every image of the row, in row order.
        image_slots: ``(I, 2)`` int64: each image's token run ``(start slot, length)``.
        image_sequence: ``(I,)`` int64: the segment each image belongs to.
        image_token_id: the image token id.
    """

    batch: PackedBatch
    pixel_values: torch.Tensor
    image_slots: torch.Tensor
    image_sequence: torch.Tensor
    image_token_id: int

    @property
    def num_images(self) -> int:
        return int(self.pixel_values.shape[0])

    @property
    def num_image_tokens(self) -> int:
        """Slots whose embeddings the vision features replace."""
        return int(self.image_slots[:, 1].sum()) if self.num_images else 0

    def packed_batch(self) -> PackedBatch:
        """The same row as one :class:`~sftpack.PackedBatch` with its media fields set (the
        LLaVA form: ``pixel_values`` ``(I, C, H, W)``, ``image_slots``, ``image_sequence``,
        ``image_token_id``; the patch fields and ``mrope_position_ids`` ``None``), validated. Its
        :meth:`~sftpack.PackedBatch.to_hf_kwargs` carries ``pixel_values`` for
        ``LlavaForConditionalGeneration``; :meth:`~sftpack.PackedBatch.concat` lays rows end to end."""
        return dataclasses.replace(
            self.batch,
            pixel_values=self.pixel_values,
            image_slots=self.image_slots,
            image_sequence=self.image_sequence,
            image_token_id=self.image_token_id,
        ).validate()

    def validate(self) -> LlavaRow:
        """The text row's invariants (:meth:`PackedBatch.validate`) and the media's: one run per
        image, in row order, inside its segment's real tokens, every image token in a run, all
        runs one length, no label on an image token. Raises :class:`PackedBatchError`."""
        b = self.batch.validate()
        if b.has_media:
            raise PackedBatchError("LlavaRow.batch must be a text row (its Qwen2-VL media fields None)")
        pv, sl, sq = self.pixel_values, self.image_slots, self.image_sequence
        check_pixel_values(pv, "LlavaRow.pixel_values", patches=False)
        n = pv.shape[0]
        if tuple(sl.shape) != (n, 2) or tuple(sq.shape) != (n,):
            raise PackedBatchError(
                f"LlavaRow: {n} images but image_slots {tuple(sl.shape)} and image_sequence {tuple(sq.shape)}"
            )
        ids = b.input_ids.cpu().numpy()
        is_img = ids == int(self.image_token_id)
        marked = np.zeros_like(is_img)
        cu, cup = b.cu_seqlens.cpu().numpy(), b.cu_seqlens_padded.cpu().numpy()
        s_h, q_h = sl.cpu().numpy(), sq.cpu().numpy()
        if n and len(set(s_h[:, 1].tolist())) != 1:
            raise PackedBatchError(f"LlavaRow.image_slots lengths {s_h[:, 1].tolist()}: one length for every image")
        for i in range(n):
            s, k, seg = int(s_h[i, 0]), int(s_h[i, 1]), int(q_h[i])
            if i and s <= int(s_h[i - 1, 0]):
                raise PackedBatchError(f"LlavaRow.image_slots[{i}] starts at {s}, not after image {i - 1}: row order")
            if not 0 <= seg < b.num_sequences:
                raise PackedBatchError(f"LlavaRow.image_sequence[{i}] = {seg}, not a segment of {b.num_sequences}")
            a, e = int(cup[seg]), int(cup[seg] + cu[seg + 1] - cu[seg])
            if not (a <= s and s + k <= e) or not bool(is_img[s : s + k].all()):
                raise PackedBatchError(
                    f"LlavaRow.image_slots[{i}] = [{s}, {s + k}) is not a run of image token {self.image_token_id} "
                    f"inside the real tokens [{a}, {e}) of segment {seg}"
                )
            marked[s : s + k] = True
        stray = np.flatnonzero(is_img & ~marked)
        if stray.size:
            raise PackedBatchError(f"LlavaRow.input_ids[{int(stray[0])}] is the image token but lies in no image run")
        if bool((b.labels == int(self.image_token_id)).any()):
            raise PackedBatchError("LlavaRow.labels: an image token is a target; images are never trained on")
        return self

    @classmethod
    def concat(cls, rows: Sequence[LlavaRow]) -> LlavaRow:
        """Rows laid end to end in one flat run (:meth:`PackedBatch.concat` for the text; images
        appended in order, their slots and segments shifted by the rows before)."""
        rows = list(rows)
        if not rows:
            raise PackedBatchError("LlavaRow.concat needs at least one row, got none")
        ids = {r.image_token_id for r in rows}
        if len(ids) != 1:
            raise PackedBatchError(f"LlavaRow.concat: the rows use different image token ids {sorted(ids)}")
        slots, seqs, t_off, n_off = [], [], 0, 0
        for r in rows:
            slots.append(
                r.image_slots + torch.tensor([t_off, 0], dtype=r.image_slots.dtype, device=r.image_slots.device)
            )
            seqs.append(r.image_sequence + n_off)
            t_off += r.batch.num_tokens
            n_off += r.batch.num_sequences
        return cls(
            batch=PackedBatch.concat([r.batch for r in rows]),
            pixel_values=torch.cat([r.pixel_values for r in rows]),
            image_slots=torch.cat(slots),
            image_sequence=torch.cat(seqs),
            image_token_id=ids.pop(),
        )

    def to(self, device: torch.device | str) -> LlavaRow:
        return dataclasses.replace(
            self,
            batch=self.batch.to(device),
            pixel_values=self.pixel_values.to(device),
            image_slots=self.image_slots.to(device),
            image_sequence=self.image_sequence.to(device),
        )


def build_llava_row(
    samples: Sequence[LlavaSample],
    *,
    row_width: int | None = None,
    pad_multiple: int = 1,
    pad_id: int = 151643,
) -> LlavaRow:
    """Lay LLaVA ``samples`` end to end (input order) with their images in row order.

    The text is :meth:`PackedBatch.from_samples` (``row_width``, ``pad_multiple`` and
    ``pad_id`` as there); ``image_slots`` are the samples' image runs moved to their
    segments; ``pixel_values`` the samples' images concatenated.
    """
    items = list(samples)
    if not items:
        raise PackedBatchError("build_llava_row needs at least one sample, got none")
    ids = {s.image_token_id for s in items}
    if len(ids) != 1:
        raise PackedBatchError(f"samples use different image token ids {sorted(ids)}")
    image_token_id = ids.pop()
    if pad_id == image_token_id:
        raise PackedBatchError(f"pad_id {pad_id} is the image token id; pad with another token")
    shapes = {s.pixel_values.shape[1:] for s in items if s.num_images}
    if len(shapes) > 1:
        raise PackedBatchError(f"samples have images of different shapes {sorted(shapes)}: LLaVA's are one size")
    text = PackedBatch.from_samples(items, row_width=row_width, pad_multiple=pad_multiple, pad_id=pad_id)
    cup = text.cu_seqlens_padded.tolist()
    slots = [(cup[i] + s, n) for i, x in enumerate(items) for s, n in x.image_runs.tolist()]
    seq = [i for i, x in enumerate(items) for _ in range(x.num_images)]
    shape = shapes.pop() if shapes else items[0].pixel_values.shape[1:]
    pv = np.concatenate([x.pixel_values.reshape(-1, *shape) for x in items])
    return LlavaRow(
        batch=text,
        pixel_values=torch.from_numpy(np.ascontiguousarray(pv)),
        image_slots=torch.tensor(slots, dtype=torch.int64).reshape(-1, 2),
        image_sequence=torch.tensor(seq, dtype=torch.int64),
        image_token_id=int(image_token_id),
    )


# ------------------------------------------------------------------ the model
def tiny_llava(
    vocab_size: int,
    *,
    image_token_id: int,
    dim: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vision_dim: int = 16,
    vision_layers: int = 2,
    vision_heads: int = 2,
    image_size: int = 32,
    patch_size: int = 8,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    text_attention: str | None = None,
    vision_attention: str = "sdpa",
) -> Any:
    """A randomly initialised ``LlavaForConditionalGeneration`` (seeded, nothing downloaded):
    a CLIP vision tower (``image_size`` px, ``patch_size`` patches, features from its
    second-to-last layer, class token dropped) and a Llama language model.

    ``text_attention``: the language model's attention (default sftpack's training
    attention; ``"sdpa"`` makes Hugging Face find the boundaries from the restarts of the
    position row). ``dtype=torch.float64`` also makes the RMSNorms compute in float64
    (Llama's upcast them to float32 otherwise).
    """
    from .._train_attention import register_train_attention

    hf = _optional.transformers()
    cfg = hf.LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=vision_dim,
            intermediate_size=2 * vision_dim,
            num_hidden_layers=vision_layers,
            num_attention_heads=vision_heads,
            image_size=image_size,
            patch_size=patch_size,
            num_channels=3,
            projection_dim=vision_dim,
            attention_dropout=0.0,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=vocab_size,
            hidden_size=dim,
            intermediate_size=2 * dim,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=32768,
            attention_dropout=0.0,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        ),
        image_token_index=image_token_id,
        image_seq_length=(image_size // patch_size) ** 2,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )
    name = text_attention or register_train_attention()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = hf.LlavaForConditionalGeneration._from_config(
            cfg, attn_implementation={"": name, "text_config": name, "vision_config": vision_attention}
        )
    model = model.to(dtype).train()
    return norms_in_model_dtype(model) if dtype == torch.float64 else model


def _slot_index(row: LlavaRow) -> torch.Tensor:
    """Every image-token slot, image after image (row order)."""
    dev = row.image_slots.device
    if not row.num_images:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    return torch.cat([torch.arange(s, s + n, device=dev) for s, n in row.image_slots.tolist()])


def llava_packed_logits(model: Any, row: LlavaRow, *, pad_between_seqs: bool = True) -> torch.Tensor:
    """``(T, V)`` logits of a packed LLaVA row.

    The vision tower and projector run once over all the row's images (one image per
    batch entry, so images never see each other); their features, image after image,
    replace the embeddings at the row's image slots; the language model runs on those
    embeddings with the 1-D positions and the boundaries (sftpack's training attention:
    ``cu_seq_lens_q`` padded, and with ``pad_between_seqs`` the real ones as
    ``sftpack_cu_seqlens_real``). With any other attention only the embeddings and the
    positions go in, and Hugging Face finds the boundaries from the position restarts.
    """
    b = row.batch
    embeds = model.get_input_embeddings()(b.input_ids)
    if row.num_images:
        feats = model.model.get_image_features(pixel_values=row.pixel_values.to(embeds.dtype)).pooler_output
        flat = torch.cat(list(feats)).to(embeds.dtype)
        idx = _slot_index(row)
        if flat.shape[0] != idx.shape[0]:
            raise PackedBatchError(
                f"the vision tower gives {flat.shape[0]} features for the row's {idx.shape[0]} image slots: "
                "build the samples with llava_image_tokens(model.config) tokens per image"
            )
        embeds = embeds.index_put((idx,), flat)
    kw: dict[str, Any] = {
        "inputs_embeds": embeds.unsqueeze(0),
        "position_ids": b.position_ids.unsqueeze(0),
        "use_cache": False,
    }
    if model.config.text_config._attn_implementation == _train_attention_name():
        kw.update(
            cu_seq_lens_q=b.cu_seqlens_padded,
            cu_seq_lens_k=b.cu_seqlens_padded,
            max_length_q=int(b.max_seqlen),
            max_length_k=int(b.max_seqlen),
        )
        if pad_between_seqs:
            kw["sftpack_cu_seqlens_real"] = b.cu_seqlens
    return model(**kw).logits[0]


def llava_alone_logits(model: Any, sample: LlavaSample) -> torch.Tensor:
    """``(L, V)`` logits of one sample alone, the model's own way: ``model(input_ids,
    pixel_values)`` (its vision tower, its own feature scatter, its own positions)."""
    kw: dict[str, Any] = {"input_ids": torch.from_numpy(sample.input_ids).unsqueeze(0), "use_cache": False}
    if sample.num_images:
        kw["pixel_values"] = torch.from_numpy(sample.pixel_values).to(model.dtype)
    return model(**kw).logits[0]


# ------------------------------------------------------------------ packed vs alone
@dataclass(frozen=True)
class LlavaCheck:
    """Largest absolute differences, packed vs alone."""

    logits: float
    loss: float
    grads_language: float
    grads_projector: float
    grads_vision: float
    max_abs_logit: float  #: the largest logit magnitude (a premise of the tolerance)
    max_abs_grad: float  #: the largest gradient entry (the other premise)

    @property
    def worst(self) -> float:
        return max(self.logits, self.loss, self.grads_language, self.grads_projector, self.grads_vision)

    def within(self, tol: float) -> bool:
        return self.worst <= tol


def check_llava_packed(
    model: Any,
    samples: Sequence[LlavaSample],
    *,
    pad_between_seqs: bool = True,
    pad_multiple: int = 1,
    row_width: int | None = None,
    pad_id: int = 151643,
    rows: int = 1,
    tamper: Callable[[LlavaRow], LlavaRow] | None = None,
) -> LlavaCheck:
    """Compare one packed row of ``samples`` with each sample alone: logits of every real
    token, the token-mean loss (:func:`sftpack.loss.token_mean_loss`, one shared count of
    targets) and every gradient (language model, projector, vision tower). ``rows``: cut
    the samples into this many consecutive rows (each ``row_width`` wide) run as one flat
    run (:meth:`LlavaRow.concat`). ``tamper`` (negative controls) edits the validated run
    before it runs: the check must then fail."""
    k = -(-len(samples) // rows)
    parts = [samples[i : i + k] for i in range(0, len(samples), k)]
    built = [build_llava_row(p, pad_multiple=pad_multiple, row_width=row_width, pad_id=pad_id) for p in parts]
    row = LlavaRow.concat(built).validate()
    if tamper is not None:
        row = tamper(row)
    b = row.batch
    logits, loss, by_part, max_logit, max_grad = compare_packed_alone(
        model,
        samples,
        b,
        alone=llava_alone_logits,
        packed=lambda: llava_packed_logits(model, row, pad_between_seqs=pad_between_seqs),
        part_of=lambda name: (
            "vision" if ".vision_tower." in name else "projector" if ".multi_modal_projector." in name else "language"
        ),
    )
    return LlavaCheck(
        logits=logits,
        loss=loss,
        grads_language=by_part.get("language", 0.0),
        grads_projector=by_part.get("projector", 0.0),
        grads_vision=by_part.get("vision", 0.0),
        max_abs_logit=max_logit,
        max_abs_grad=max_grad,
    )
