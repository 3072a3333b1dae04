"""Conversations with media are written by the chat template, as the text path writes text.

The media tokenizer renders with the tokenizer's own chat template (a model folder's), or the
family's default when the tokenizer has none or only sftpack's text ChatML: Qwen2-VL's default is
ChatML writing ``<|vision_start|><|image_pad|><|vision_end|>``, LLaVA's LLaVA-1.5's format
writing ``<image>``, Gemma 3's its turns writing ``<start_of_image>``. The trainable spans are the
text path's (:class:`sftpack.chat.ChatRenderer`), so a text-only conversation gives the text
path's tokens and mask exactly; a template that cannot write the family's media parts is refused
in one line before any work; a video part for a family without video is one line naming the
family and the field.
"""

from __future__ import annotations

import copy
import json

import pytest

from sftpack.chat import ChatRenderer, tokenize_conversation
from sftpack.data import CHATML_TEMPLATE, chatml_template
from sftpack.multimodal import (
    MediaTokenizeStats,
    UnsupportedModelError,
    family_for,
    tokenize_media_conversation,
    tokenize_media_conversations,
)
from tests.helpers import png_bytes

FAMILIES = ["qwen2_vl", "llava", "gemma3"]

TEXT_ONLY = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": [{"type": "text", "text": "And grass"}, {"type": "text", "text": "?"}]},
    {"role": "assistant", "content": "Green."},
]

#: A Qwen2-VL-style folder template (written here): a default system prompt when none is given,
#: each image part as the vision block.
QWEN_WITH_SYSTEM = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _with_image() -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image", "bytes": png_bytes(40, 40)}, {"type": "text", "text": "Colour?"}],
        },
        {"role": "assistant", "content": "Red."},
    ]


@pytest.fixture(scope="module")
def qwen_copy():
    """A copy of the Qwen2-VL tokenizer whose chat template the tests set."""
    return copy.deepcopy(family_for("qwen2_vl").tokenizer())


@pytest.mark.parametrize("name", FAMILIES)
def test_a_text_only_conversation_is_the_text_paths(name):
    """Same template, same spans: the media tokenizer gives the text path's tokens and mask
    (contents as strings or as text parts), for each family's default tokenizer."""
    fam = family_for(name)
    tok = fam.tokenizer()
    (s,) = tokenize_media_conversation(TEXT_ONLY, family=fam, tokenizer=tok)
    joined = [{**m, "content": "And grass?"} if isinstance(m["content"], list) else m for m in TEXT_ONLY]
    ref = tokenize_conversation(joined, tok)
    assert s.input_ids.tolist() == ref.input_ids.tolist()
    assert s.loss_mask.tolist() == ref.loss_mask.tolist()
    assert s.media.num_items == 0
    trained = tok.decode(s.input_ids[s.loss_mask])
    assert trained == {"qwen2_vl": "Blue.<|im_end|>Green.<|im_end|>", "llava": " Blue.</s> Green.</s>",
                       "gemma3": "Blue.<end_of_turn>Green.<end_of_turn>"}[name]  # fmt: skip


def test_qwen2_vls_default_is_sftpacks_chatml_with_the_vision_block(qwen_copy):
    """The embedded Qwen2-VL tokenizer carries sftpack's text ChatML, which cannot write an image:
    the family's default renders instead, and renders text exactly as that ChatML does."""
    fam = family_for("qwen2_vl")
    qwen_copy.chat_template = CHATML_TEMPLATE
    renderer = fam.renderer(qwen_copy)
    assert renderer.template == chatml_template(
        "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
    )
    strings = [{**m, "content": "And grass?"} if isinstance(m["content"], list) else m for m in TEXT_ONLY]
    assert renderer.render(TEXT_ONLY) == ChatRenderer(CHATML_TEMPLATE).render(strings)


def test_a_folders_own_template_wins(qwen_copy):
    """A template of the tokenizer's own (here one that adds a default system prompt) writes the
    sample; the trained tokens are still the answer and its end of turn."""
    qwen_copy.chat_template = QWEN_WITH_SYSTEM
    (s,) = tokenize_media_conversation(_with_image(), tokenizer=qwen_copy)
    image = s.media.slots[0].tolist()
    text = qwen_copy.decode(s.input_ids[: image[0]])
    assert text == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
    assert qwen_copy.decode(s.input_ids[s.loss_mask]) == "Red.<|im_end|>"
    qwen_copy.chat_template = CHATML_TEMPLATE
    (plain,) = tokenize_media_conversation(_with_image(), tokenizer=qwen_copy)
    assert qwen_copy.decode(plain.input_ids).startswith("<|im_start|>user\n<|vision_start|>")


@pytest.mark.parametrize(
    "template, why",
    [
        (CHATML_TEMPLATE.replace("<|im_start|>", "<|im_start|> "), "cannot render a message with media parts"),
        (QWEN_WITH_SYSTEM.replace("'<|vision_start|><|image_pad|><|vision_end|>'", "''"), "0 times"),
        (QWEN_WITH_SYSTEM.replace("<|image_pad|>", "<|image_pad|><|image_pad|>"), "2 times"),
    ],
    ids=["strings-only", "no-image", "image-twice"],
)
def test_a_template_that_cannot_write_images_is_refused_before_any_work(qwen_copy, template, why):
    qwen_copy.chat_template = template
    convs = [{"id": "r1", "messages": _with_image()}]
    st = MediaTokenizeStats()
    with pytest.raises(UnsupportedModelError) as e:
        list(tokenize_media_conversations(convs, tokenizer=qwen_copy, on_bad_row="skip", stats=st))
    msg = str(e.value)
    assert "\n" not in msg and why in msg and "chat template" in msg and "qwen2_vl" in msg, msg
    assert st.read == 0


@pytest.mark.parametrize("name", ["llava", "gemma3"])
def test_a_video_part_is_refused_by_a_family_without_video(name):
    conv = [
        {"role": "user", "content": [{"type": "video", "frames": ["a.png"]}, {"type": "text", "text": "What?"}]},
        {"role": "assistant", "content": "A clip."},
    ]
    with pytest.raises(ValueError) as e:
        tokenize_media_conversation(conv, family=name, conversation_id="v1")
    msg = str(e.value)
    assert "\n" not in msg and f"the {name} family takes no video parts" in msg
    assert "'v1'" in msg and "messages[0].content[0]" in msg
    st = MediaTokenizeStats()
    assert (
        list(tokenize_media_conversations([{"id": "v1", "messages": conv}], family=name, on_bad_row="skip", stats=st))
        == []
    )
    assert st.dropped == {"bad_record": 1} and st.read == 1


def test_the_renderer_keeps_special_text_split_over_parts_as_text():
    """ChatRenderer.spans_special_text on contents in parts: the text is the template's own
    rendering, and the only special tokens it reports are the template's, never a string
    that two parts form when joined."""
    r = ChatRenderer(chatml_template("<img>", "<vid>"), special_tokens=["<|im_start|>", "<|im_end|>", "<img>"])
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "a <im"}, {"type": "text", "text": "g> b"}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "c<|im"}, {"type": "text", "text": "_end|>"}]},
    ]
    text, spans, specials = r.spans_special_text(msgs)
    assert text == r.render(msgs)
    assert [text[a:b] for a, b in specials] == ["<|im_start|>", "<img>", "<|im_end|>", "<|im_start|>", "<|im_end|>"]
    assert [text[a:b] for a, b in spans] == ["c<|im_end|><|im_end|>"]
    assert r.count_special_text(msgs) == 2


def test_a_folders_processor_template_is_used_when_its_tokenizer_has_none(tmp_path):
    """LLaVA-1.5 folders keep their template in the processor's ``chat_template.json``: the
    family's tokenizer of the folder takes it, as ``AutoProcessor`` would."""
    from sftpack.multimodal.families.llava import Llava
    from sftpack.testing import tiny_chat_tokenizer
    from tests.helpers import LLAVA_15_TEMPLATE

    tok = tiny_chat_tokenizer("chatml")
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]}, replace_extra_special_tokens=False)
    tok.chat_template = None
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": LLAVA_15_TEMPLATE}))
    got = family_for("llava").tokenizer(tmp_path)
    assert got.chat_template == LLAVA_15_TEMPLATE
    (s,) = tokenize_media_conversation(_with_image(), family=Llava(image_tokens=4, image_size=32), tokenizer=got)
    assert got.decode(s.input_ids) == "USER: " + "<image>" * 4 + "\nColour? ASSISTANT: Red. "
    assert got.decode(s.input_ids[s.loss_mask]) == "Red. "
