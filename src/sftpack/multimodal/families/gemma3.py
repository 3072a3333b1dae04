"""Gemma 3: fixed-size images pooled to a fixed run of soft tokens that attend to each other both ways.

The third family behind :class:`~sftpack.multimodal.Family` (``family_for("gemma3")``,
or ``family_for(config)`` of a ``model_type`` ``"gemma3"`` config), chosen because it is
the vision-language model users fine-tune most that is neither Qwen nor LLaVA, and
because its attention rule is one a packed row can get wrong:

- the chat template writes an image part as ``<start_of_image>``, which Gemma 3's
  processor rewrites as ``"\\n\\n<start_of_image>" + mm_tokens_per_image x
  <image_soft_token> + "<end_of_image>\\n\\n"`` (``Gemma3Processor.full_image_sequence``;
  :meth:`Gemma3.media_text` writes the same, the ``"\\n\\n"`` as plain text);
- each image is one square pixel tensor (``Gemma3ImageProcessor``: resized to the
  tower's ``image_size``, no crop, no pan-and-scan); the SigLIP tower and the projector
  pool it to ``mm_tokens_per_image`` features that *replace* the soft tokens' embeddings;
- positions are the text's 1-D ones, restarting per sample;
- attention: causal, except that the soft tokens of one image see each other both ways
  (Hugging Face builds this from ``token_type_ids`` in training); sliding-window layers
  add their window. A packed row keeps both and keeps samples apart:
  :func:`packed_masks` builds the dense boolean masks (same segment, and causal or the
  same image, and for sliding layers within the window) and the language model runs
  ``sdpa`` on them. Exactness on CPU is the point, not speed: the masks are ``T x T``.

The embedded default (nothing downloaded): the embedded Qwen BPE plus Gemma 3's control
tokens (``<bos>``, ``<start_of_turn>``, ``<end_of_turn>``, ``<start_of_image>``,
``<end_of_image>``, ``<image_soft_token>``) as special tokens, with :data:`GEMMA3_TEMPLATE`
(Gemma 3's conversation format: ``<bos><start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n...``).
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np
import torch

from ... import _optional
from ...data import default_tokenizer
from ...handoff import PackedBatch, PackedBatchError
from ...handoff.payload import ImageMedia
from .._family import EncodedImages, Family, ImageProcessor, UnsupportedModelError, VisionLanguageModel, seeded_model

__all__ = ["GEMMA3_TEMPLATE", "Gemma3", "gemma3_tokenizer", "packed_masks"]

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
TURN_START, TURN_END, BOS = "<start_of_turn>", "<end_of_turn>", "<bos>"

#: Gemma 3's conversation format: ``bos_token``; a system message's text opens the first user
#: turn, followed by a blank line; each turn ``<start_of_turn>{user|model}\\n{content}<end_of_turn>\\n``
#: (contents trimmed; an image part is ``<start_of_image>``); the generation prompt opens a model turn.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(prefix='') %}"
    "{% for message in messages %}"
    "{% set parts = [{'type': 'text', 'text': message['content']}] if message['content'] is string "
    "else message['content'] %}"
    "{% if message['role'] == 'system' %}"
    "{% set ns.prefix = ns.prefix + (parts | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('') | trim) + '\\n\\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' + ns.prefix }}"
    "{% set ns.prefix = '' %}"
    "{% for part in parts %}"
    "{% if part['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}"
    "{{ '<end_of_turn>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


#: why ``PackedBatch.to_hf_kwargs()`` refuses a Gemma 3 row (:attr:`~sftpack.handoff.payload.Media.hf_refusal`)
HF_REFUSAL = (
    "Gemma 3's own forward cannot run a packed row (without token_type_ids its image tokens attend causally; "
    "with them its mask does not keep the packed samples apart): run "
    "family_for(model).packed_logits(model, row) (or packed_hidden) instead, which keeps samples apart and each "
    "image's tokens bidirectional"
)


@lru_cache(maxsize=1)
def _tokenizer() -> Any:
    tok = copy.deepcopy(default_tokenizer())
    tok.add_special_tokens(
        {"bos_token": BOS, "additional_special_tokens": [TURN_START, TURN_END, BOI, EOI, SOFT]},
        replace_extra_special_tokens=False,
    )
    tok.chat_template = GEMMA3_TEMPLATE
    return tok


def gemma3_tokenizer() -> Any:
    """The gemma3 family's embedded tokenizer: the embedded Qwen BPE plus Gemma 3's control tokens
    as special tokens (``bos_token`` ``<bos>``), with :data:`GEMMA3_TEMPLATE`. Shared within the process."""
    return _tokenizer()


@lru_cache(maxsize=8)
def _image_processor(size: int) -> Any:
    return _optional.transformers().Gemma3ImageProcessorPil(size={"height": size, "width": size})


def _side(processor: ImageProcessor) -> int | None:
    size = getattr(processor, "size", None)
    h = size.get("height") if isinstance(size, dict) else getattr(size, "height", None)
    w = size.get("width") if isinstance(size, dict) else getattr(size, "width", None)
    return int(h) if isinstance(h, int) and h == w else None


def packed_masks(batch: PackedBatch, sliding_window: int | None, image_runs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gemma 3's attention masks of a packed row, ``(1, 1, T, T)`` boolean (True: may attend):
    key ``k`` is seen from query ``q`` when both are in one segment (``cu_seqlens_padded``) and
    ``k <= q`` or both are soft tokens of one image (``image_runs``: ``(start, length)`` per
    image); ``sliding_attention`` also asks ``k > q - sliding_window``, as Hugging Face's
    ``create_masks_for_vision_model`` does for one sample (within a segment, row distance is
    the sample's own position distance)."""
    T = batch.num_tokens
    device = batch.input_ids.device
    slot = torch.arange(T, device=device)
    seg = torch.repeat_interleave(torch.arange(len(batch.cu_seqlens_padded) - 1, device=device), batch.padded_seqlens)
    block = torch.full((T,), -1, dtype=torch.int64, device=device)
    for i, (s, n) in enumerate(image_runs.tolist()):
        block[s : s + n] = i
    q, k = slot[:, None], slot[None, :]
    same_image = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
    full = (seg[:, None] == seg[None, :]) & ((k <= q) | same_image)
    sliding = full & (k > q - sliding_window) if sliding_window else full
    return {"full_attention": full[None, None], "sliding_attention": sliding[None, None]}


def _gemma_rms_norm(self: Any, x: torch.Tensor) -> torch.Tensor:
    """Gemma 3's RMSNorm, ``x / sqrt(mean(x**2) + eps) * (1 + w)``, in the input's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _norms_in_float64(model: VisionLanguageModel) -> Any:
    """A float64 Gemma 3 with its RMSNorms in float64 (they upcast to float32 otherwise, so two
    groupings of the same tokens could differ by a float32 rounding step)."""
    if model.dtype == torch.float64:
        for mod in model.modules():
            if type(mod).__name__ == "Gemma3RMSNorm":
                mod.forward = types.MethodType(_gemma_rms_norm, mod)
    return model


@dataclass
class Gemma3(Family):
    """Gemma 3 (see the module text): ``image_tokens`` soft tokens per image (``mm_tokens_per_image``),
    ``image_size`` pixels square, its image token's id from a config (:meth:`from_config`)."""

    image_tokens: int = 4
    image_size: int = 32
    image_token_id: int | None = field(default=None, repr=False)  # from a config; checked against the tokenizer

    name: ClassVar[str] = "gemma3"
    model_types: ClassVar[tuple[str, ...]] = ("gemma3",)
    image_block: ClassVar[tuple[str, ...]] = (BOI, SOFT, EOI)
    placeholder: ClassVar[str] = SOFT
    image_mark: ClassVar[str | None] = BOI
    chat_template: ClassVar[str | None] = GEMMA3_TEMPLATE
    processor_wanted: ClassVar[str] = (
        "(a Gemma3ImageProcessor resizing to the tower's square image_size, no pan-and-scan): the gemma3 "
        "family takes Gemma3ImageProcessorPil (Family.image_processor()), the qwen families "
        "Qwen2VLImageProcessorPil, the llava family a CLIP processor"
    )
    model_class: ClassVar[str] = "Gemma3ForConditionalGeneration"

    @classmethod
    def from_config(cls, config: Any) -> Gemma3:
        text = config.get_text_config()
        if text.final_logit_softcapping is not None or text.use_bidirectional_attention:
            raise UnsupportedModelError(
                f"gemma3: final_logit_softcapping {text.final_logit_softcapping!r} and use_bidirectional_attention "
                f"{text.use_bidirectional_attention!r} are not packed (Gemma 3's are None and False)"
            )
        return cls(
            image_tokens=int(config.mm_tokens_per_image),
            image_size=int(config.vision_config.image_size),
            image_token_id=int(config.image_token_id),
        )

    def _default_tokenizer(self) -> Any:
        return gemma3_tokenizer()

    def _default_image_processor(self) -> Any:
        return _image_processor(self.image_size)

    def takes_processor(self, processor: ImageProcessor) -> bool:
        return (
            type(processor).__name__.startswith("Gemma3ImageProcessor")
            and not getattr(processor, "do_pan_and_scan", False)
            and _side(processor) == self.image_size
        )

    def check(self, tokenizer: Any, processor: ImageProcessor) -> None:
        """The base checks, and the tokenizer's ``<image_soft_token>`` at the config's ``image_token_index``."""
        super().check(tokenizer, processor)
        got = self.placeholder_id(tokenizer)
        if self.image_token_id is not None and got != self.image_token_id:
            raise UnsupportedModelError(
                f"{type(tokenizer).__name__} has {SOFT} at id {got}, the model's config at image_token_index "
                f"{self.image_token_id}: use the tokenizer saved with the model"
            )

    def token_ids(self, tokenizer: Any) -> dict[str, int]:
        """The ids a config names: the soft token and the image's start and end."""
        ids = tokenizer.convert_tokens_to_ids([SOFT, BOI, EOI])
        return dict(image_token_id=ids[0], boi_token_id=ids[1], eoi_token_id=ids[2])

    def media_text(self, kind: str, index: int, encoded: EncodedImages) -> str | None:
        """``Gemma3Processor``'s rewrite of the template's ``<start_of_image>`` (one soft token,
        repeated to the image's count afterwards)."""
        return f"\n\n{BOI}{SOFT}{EOI}\n\n"

    def encode_images(self, images: list[Any], processor: ImageProcessor) -> EncodedImages:
        if images:
            pv = np.ascontiguousarray(processor(images=images, return_tensors="np")["pixel_values"], dtype=np.float32)
        else:
            pv = np.zeros((0, 3, self.image_size, self.image_size), np.float32)
        return EncodedImages(pv, np.full(pv.shape[0], self.image_tokens, np.int64))

    # ------------------------------------------------------------- the model
    def pretrained(self, model_dir: Any, *, dtype: torch.dtype = torch.float32, vision_attention: str = "sdpa") -> Any:
        """The base's, the language model on ``sdpa`` (:func:`packed_masks` are dense masks)."""
        try:
            model = _optional.from_pretrained(
                "Gemma3ForConditionalGeneration",
                model_dir,
                local_files_only=True,
                dtype=dtype,
                attn_implementation={"": "sdpa", "text_config": "sdpa", "vision_config": vision_attention},
            )
        except _optional.CustomCodeError:
            raise
        except (OSError, ValueError) as e:
            raise ValueError(
                f"cannot load a {self.model_class} from {str(model_dir)!r} ({' '.join(str(e).split())[:200]}); "
                "give a local folder written by model.save_pretrained()"
            ) from None
        return _norms_in_float64(model.to(dtype).train())

    def _tiny_model(self, vocab_size: int, ids: dict[str, int], build: dict[str, Any], sizes: dict[str, Any]) -> Any:
        """A ``Gemma3ForConditionalGeneration``: a SigLIP tower (``image_size`` px, patches of
        ``image_size / (2 sqrt(image_tokens))`` px, pooled 2x2 to ``image_tokens`` features) and a
        Gemma 3 language model (one sliding-window layer of window ``sliding_window``, default 24,
        then one full-attention layer, repeating). ``sizes``: ``dim``, ``layers``, ``heads``,
        ``kv_heads``, ``vision_dim``, ``vision_layers``, ``vision_heads``, ``sliding_window``."""
        side = int(round(self.image_tokens**0.5))
        if side * side != self.image_tokens or self.image_size % (2 * side):
            raise ValueError(
                f"tiny_model: {self.image_tokens} image tokens on {self.image_size} px images: need a square "
                "number of tokens whose side x 2 divides the image size"
            )
        dim, layers, heads = sizes.get("dim", 32), sizes.get("layers", 2), sizes.get("heads", 4)
        vision_dim = sizes.get("vision_dim", 16)
        hf = _optional.transformers()
        cfg = hf.Gemma3Config(
            text_config=dict(
                vocab_size=vocab_size,
                hidden_size=dim,
                intermediate_size=2 * dim,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=sizes.get("kv_heads", 2),
                head_dim=dim // heads,
                query_pre_attn_scalar=dim // heads,
                sliding_window=sizes.get("sliding_window", 24),
                layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
                max_position_embeddings=32768,
                attention_dropout=0.0,
                bos_token_id=None,
                eos_token_id=None,
                pad_token_id=None,
            ),
            vision_config=dict(
                model_type="siglip_vision_model",
                hidden_size=vision_dim,
                intermediate_size=2 * vision_dim,
                num_hidden_layers=sizes.get("vision_layers", 2),
                num_attention_heads=sizes.get("vision_heads", 2),
                image_size=self.image_size,
                patch_size=self.image_size // (2 * side),
                attention_dropout=0.0,
            ),
            mm_tokens_per_image=self.image_tokens,
            image_token_index=ids["image_token_id"],
            boi_token_index=ids["boi_token_id"],
            eoi_token_index=ids["eoi_token_id"],
            tie_word_embeddings=False,
        )
        build = {**build, "text_attention": build.get("text_attention") or "sdpa"}
        model = seeded_model(hf.Gemma3ForConditionalGeneration, cfg, **build)
        # Hugging Face starts the projector's weight at zero, so images would not reach the text
        # (nor gradients the tower): a seeded random start instead, as a trained model's.
        weight = model.model.multi_modal_projector.mm_input_projection_weight
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(build["seed"])
            weight.copy_(torch.randn(weight.shape, dtype=torch.float64).mul_(cfg.initializer_range).to(weight.dtype))
        return _norms_in_float64(model)

    def packed_hidden(
        self, model: VisionLanguageModel, batch: PackedBatch, *, pad_between_seqs: bool = True
    ) -> torch.Tensor:
        """``(T, H)`` hidden states of a packed Gemma 3 row: the tower and projector once over the
        row's images (one image per batch entry), their features replacing the soft tokens'
        embeddings in row order, the language model on the 1-D positions and :func:`packed_masks`
        (which keep samples apart and each image's soft tokens bidirectional; ``pad_between_seqs``
        is moot: real tokens never see a padding slot, which sits after them in its segment)."""
        b = batch
        cfg = model.config
        ids = b.input_ids
        if cfg.image_token_id >= cfg.get_text_config().vocab_size:  # as Hugging Face: an out-of-vocabulary id reads 0
            ids = ids.masked_fill(ids == cfg.image_token_id, 0)
        embeds = model.get_input_embeddings()(ids)
        media = b.media
        runs = torch.zeros((0, 2), dtype=torch.int64)
        if isinstance(media, ImageMedia) and media.num_items:
            feats = model.model.get_image_features(pixel_values=media.pixel_values.to(embeds.dtype)).pooler_output
            flat = feats.reshape(-1, feats.shape[-1]).to(embeds.dtype)
            runs = media.slots
            idx = torch.cat([torch.arange(s, s + n, device=b.device) for s, n in runs.tolist()])
            if flat.shape[0] != idx.shape[0]:
                raise PackedBatchError(
                    f"the vision tower gives {flat.shape[0]} features for the row's {idx.shape[0]} image slots: "
                    "build the samples with family_for(model.config), which takes mm_tokens_per_image per image"
                )
            embeds = embeds.index_put((idx,), flat)
        masks = packed_masks(b, cfg.get_text_config().sliding_window, runs)
        out = model.model.language_model(
            inputs_embeds=embeds.unsqueeze(0),
            position_ids=b.position_ids.unsqueeze(0),
            attention_mask=masks,
            use_cache=False,
        )
        return out.last_hidden_state[0]

    def _media_fields(
        self, input_ids: np.ndarray, runs: np.ndarray, images: EncodedImages, **videos: Any
    ) -> dict[str, Any]:
        """The refusal a packed row's ``to_hf_kwargs()`` raises: Hugging Face's Gemma 3 forward makes
        each image's soft tokens see each other only from ``token_type_ids``, and with them its mask
        over a packed row does not keep the samples apart (tests/multimodal/test_outputs.py
        measures both); :meth:`packed_logits` runs the row exactly."""
        return {"hf_refusal": HF_REFUSAL}

    def padded_kwargs(self, input_ids: torch.Tensor, media: Any) -> dict[str, Any]:
        """``token_type_ids``: 1 on the soft tokens, from which Hugging Face makes each image's
        soft tokens see each other both ways (without them its mask is causal throughout)."""
        return {"token_type_ids": (input_ids == media.token_id).to(torch.int64)}

    def _alone_media(self, model: VisionLanguageModel, input_ids: torch.Tensor, media: ImageMedia) -> dict[str, Any]:
        """``model(input_ids, pixel_values, token_type_ids)``: Hugging Face's own mask (its soft
        tokens bidirectional within each image, from ``token_type_ids``), tower and scatter."""
        return {"pixel_values": media.pixel_values.to(model.dtype), **self.padded_kwargs(input_ids, media)}

    def part_of(self, parameter: str) -> str:
        if ".vision_tower." in parameter:
            return "vision"
        return "projector" if ".multi_modal_projector." in parameter else "language"
