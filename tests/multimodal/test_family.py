"""The seam a model family implements: :func:`family_for`, :class:`Family`'s checks, and what each
family makes of a conversation (its media kind and its positions).

``family_for`` takes a family name, a Hugging Face ``model_type``, a config, a model or a model
folder; anything else is refused in one line naming the model type and the supported families,
before any work. Each family's samples carry its media kind: Qwen2-VL and Qwen2.5-VL a
``PatchMedia`` whose positions equal Hugging Face's own ``get_rope_index`` (tested on both
models), LLaVA an ``ImageMedia`` with the text's 1-D positions.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sftpack import PackedBatch
from sftpack.handoff.payload import ImageMedia, PatchMedia
from sftpack.multimodal import Family, UnsupportedModelError, family_for, tokenize_media_conversation
from sftpack.multimodal.families.gemma3 import Gemma3
from sftpack.multimodal.families.llava import Llava
from sftpack.multimodal.families.qwen2_5_vl import Qwen25VL
from sftpack.multimodal.families.qwen2_vl import Qwen2VL
from tests.helpers import png_bytes
from tests.multimodal.conftest import Renumbered

hf = pytest.importorskip("transformers")

FAMILIES = {"qwen2_vl": Qwen2VL, "qwen2_5_vl": Qwen25VL, "llava": Llava, "gemma3": Gemma3}


def _conv(*sizes: tuple[int, int]) -> list[dict]:
    images = [{"type": "image", "bytes": png_bytes(w, h)} for w, h in sizes]
    return [
        {"role": "user", "content": [*images, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A red square."},
    ]


# ------------------------------------------------------------------ family_for


@pytest.mark.parametrize("name", list(FAMILIES))
def test_by_name_and_model_type(name):
    fam = family_for(name)
    assert type(fam) is FAMILIES[name] and isinstance(fam, Family) and fam.name == name
    assert name in fam.model_types  # each family's name is its Hugging Face model_type
    assert family_for(fam) is fam  # a Family is taken as is


def test_the_default_is_qwen2_vl():
    assert type(family_for()) is Qwen2VL and type(family_for(None)) is Qwen2VL


def test_by_hf_config():
    assert type(family_for(hf.Qwen2VLConfig())) is Qwen2VL
    assert type(family_for(hf.Qwen2_5_VLConfig())) is Qwen25VL
    # LLaVA is configured from its config: llava-1.5's CLIP 336 px / 14 px patches, class token dropped
    # and its image token's id (llava-1.5's <image> is 32000)
    assert family_for(hf.LlavaConfig()) == Llava(image_tokens=576, image_size=336, image_token_id=32000)


def test_by_model(model):
    assert type(family_for(model)) is Qwen2VL
    llava = Llava(image_tokens=16, image_size=32)
    tiny = llava.tiny_model(dtype=torch.float32, layers=1, vision_layers=1)
    image_id = llava.tokenizer().convert_tokens_to_ids("<image>")
    assert family_for(tiny) == Llava(16, 32, image_id)  # read back from the model's config
    assert family_for(Llava(image_tokens=4, image_size=16).tiny_model(layers=1)) == Llava(4, 16, image_id)


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_by_model_folder(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": name, "architectures": ["X"]}))
    assert type(family_for(tmp_path)) is FAMILIES[name]
    assert type(family_for(str(tmp_path))) is FAMILIES[name]


def test_gemma3_is_configured_from_its_config(tmp_path):
    """Gemma 3's image tokens, image size and soft-token id come from its config (folder or object);
    a config whose logits are soft-capped is refused in one line."""
    cfg = hf.Gemma3Config(mm_tokens_per_image=16, vision_config={"image_size": 64, "patch_size": 8})
    cfg.save_pretrained(tmp_path)
    want = Gemma3(image_tokens=16, image_size=64, image_token_id=262144)
    assert family_for(tmp_path) == family_for(cfg) == want
    capped = hf.Gemma3Config(text_config={"final_logit_softcapping": 30.0})
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping 30.0") as e:
        family_for(capped)
    assert "\n" not in str(e.value)


def test_by_llava_model_folder_reads_its_config(tmp_path):
    """A LLaVA folder configures the family from its config.json, as its config object does
    (576 image tokens of 336 px for llava-1.5), not LLaVA's tiny defaults."""
    hf.LlavaConfig().save_pretrained(tmp_path)
    want = Llava(image_tokens=576, image_size=336, image_token_id=32000)
    assert family_for(tmp_path) == family_for(hf.LlavaConfig()) == want


def test_a_folder_without_a_config_is_refused_in_one_line(tmp_path):
    with pytest.raises(UnsupportedModelError) as e:
        family_for(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "config.json" in msg and all(n in msg for n in FAMILIES)


def _unsupported():
    return {
        "mistral3": "mistral3",
        "idefics3": "idefics3",
        "llama-config": hf.LlamaConfig(),
        "idefics3-config": hf.Idefics3Config(),
        "llava-next-config": hf.LlavaNextConfig(),
        "mistral3-config": hf.Mistral3Config(),
    }


@pytest.mark.parametrize("which", list(_unsupported()))
def test_unknown_model_types_are_refused_in_one_line(which):
    spec = _unsupported()[which]
    kind = spec if isinstance(spec, str) else spec.model_type
    with pytest.raises(UnsupportedModelError) as e:
        family_for(spec)
    msg = str(e.value)
    assert "\n" not in msg and f"model type {kind!r}" in msg
    assert "supported: qwen2_vl" in msg and all(n in msg for n in FAMILIES)
    if not isinstance(spec, str):
        assert type(spec).__name__ in msg


def test_a_model_of_an_unknown_type_is_refused():
    class Model:
        config = hf.LlamaConfig()

    with pytest.raises(UnsupportedModelError, match=r"model type 'llama' \(LlamaConfig\)"):
        family_for(Model())


# ------------------------------------------------------------------ Family.check


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_a_qwen_family_refuses_a_clip_processor(tok, name):
    clip = family_for("llava").image_processor()
    with pytest.raises(UnsupportedModelError) as e:
        family_for(name).check(tok, clip)
    msg = str(e.value)
    assert "\n" not in msg and type(clip).__name__ in msg and f"not a {name} image processor" in msg
    family_for(name).check(tok, family_for(name).image_processor())  # its own is taken


def test_llava_refuses_a_qwen_processor(tok, proc):
    with pytest.raises(UnsupportedModelError) as e:
        family_for("llava").check(tok, proc)
    msg = str(e.value)
    assert "\n" not in msg and type(proc).__name__ in msg and "not a llava image processor" in msg
    llava = family_for("llava")
    llava.check(llava.tokenizer(), llava.image_processor())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_refuses_a_tokenizer_without_its_tokens(name):
    from sftpack.testing import tiny_chat_tokenizer

    fam = family_for(name)
    with pytest.raises(UnsupportedModelError) as e:
        fam.check(tiny_chat_tokenizer("chatml"), fam.image_processor())
    msg = str(e.value)
    assert "\n" not in msg and fam.placeholder in msg and name in msg


def test_tokenize_refuses_a_wrong_processor_before_any_work(tok, proc):
    missing = [{"role": "user", "content": [{"type": "image", "path": "/nonexistent.png"}]}]
    msgs = missing + [{"role": "assistant", "content": "x"}]
    with pytest.raises(UnsupportedModelError, match="not a llava image processor"):  # not the missing file
        tokenize_media_conversation(msgs, family="llava", tokenizer=tok, processor=proc)
    with pytest.raises(UnsupportedModelError, match="model type 'mistral3'"):
        tokenize_media_conversation(msgs, family="mistral3", tokenizer=tok, processor=proc)


# ------------------------------------------------------------------ what each family makes


def test_llava_samples_carry_image_media_and_1d_positions():
    llava = family_for("llava")
    (s,) = tokenize_media_conversation(_conv((100, 60), (40, 90)), family="llava", conversation_id="l")
    m = s.media
    assert isinstance(m, ImageMedia) and m.num_items == 2 and not hasattr(m, "positions")
    assert tuple(m.pixel_values.shape) == (2, 3, llava.image_size, llava.image_size)
    assert m.slots[:, 1].tolist() == [llava.image_tokens] * 2 and m.sequence.tolist() == [0, 0]
    assert not {151652, 151653} & set(s.input_ids.tolist())  # no vision block around the run
    row = PackedBatch.from_samples([s, s], pad_id=151643).validate()
    kw = row.to_hf_kwargs()
    assert kw["position_ids"].tolist() == [list(range(len(s))) * 2]  # the text's own, restarting
    assert "image_grid_thw" not in kw and kw["pixel_values"] is row.media.pixel_values


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_samples_carry_patch_media_and_mrope_positions(tok, name):
    (s,) = tokenize_media_conversation(_conv((100, 60), (40, 90)), family=name, tokenizer=tok, conversation_id="q")
    m = s.media
    assert isinstance(m, PatchMedia) and m.num_items == 2 and m.merge_size == 2
    assert m.positions.shape == (3, len(s)) and m.positions.dtype == torch.int64
    assert int(m.positions[:, 0].abs().sum()) == 0  # a sample's positions start at 0
    assert m.slots[:, 1].tolist() == (m.grid_thw.prod(dim=1) // 4).tolist()
    # Qwen2.5-VL's images are Qwen2-VL's: the same tokens, patches and positions
    (q,) = tokenize_media_conversation(_conv((100, 60), (40, 90)), tokenizer=tok, conversation_id="q")
    assert s.input_ids.tolist() == q.input_ids.tolist()
    for f in ("pixel_values", "grid_thw", "slots", "positions"):
        assert torch.equal(getattr(m, f), getattr(q.media, f)), f


@pytest.fixture(scope="module")
def qwen25_model(vqa_samples):
    return Renumbered(vqa_samples, family="qwen2_5_vl").model()


@pytest.mark.parametrize("which", ["qwen2_vl", "qwen2_5_vl"])
def test_positions_are_the_models_get_rope_index(renumbered, model, qwen25_model, which):
    """Each sample's positions equal the model's own get_rope_index on it alone (one and two
    images, grids 4x4 to 8x8 patches), for Qwen2-VL's model and Qwen2.5-VL's."""
    m = model if which == "qwen2_vl" else qwen25_model
    assert m.config.model_type == which
    grids = set()
    for s in renumbered.samples:
        ids = torch.from_numpy(s.input_ids)[None]
        media = s.media
        ref, _ = m.model.get_rope_index(ids, (ids == media.token_id).int(), media.grid_thw)
        np.testing.assert_array_equal(media.positions.numpy(), ref[:, 0].numpy())
        grids.update(map(tuple, media.grid_thw.tolist()))
    assert len(grids) >= 3  # the seeded sizes give runs of different lengths
