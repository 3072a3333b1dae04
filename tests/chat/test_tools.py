"""Tool-calling SFT: a row's ``tools`` and an assistant turn's ``tool_calls`` reach the chat
template; the call is trained as assistant output, the ``tool`` answer is not; a turn that only
calls tools may have empty or null content; a template that cannot write tools is refused in one
line naming it. Checked with the embedded ChatML template (``<tools>`` / ``<tool_call>`` blocks)
and with a Llama-3-style template written here (tools in the system header, calls as JSON,
answers under an ``ipython`` header)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from sftpack.chat import BadRowError, read_conversations, tokenize_conversation, tokenize_conversations
from sftpack.cli import main
from sftpack.data import default_tokenizer
from sftpack.testing import tiny_chat_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def _row(content=None, arguments=None) -> dict:
    call = copy.deepcopy(CALL)
    if arguments is not None:
        call["function"]["arguments"] = arguments
    return {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "content": '{"celsius": 21}'},
            {"role": "assistant", "content": "It is 21 degrees in Paris."},
        ],
        "tools": TOOLS,
    }


# A Llama-3-style template that writes tools: the schemas in the system header, a call as
# {"name", "parameters"} JSON ending with <|eom_id|>, a tool's answer under an ipython header.
LLAMA3_TOOLS = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\nTools:\\n' }}"
    "{% for t in tools %}{{ (t | tojson) + '\\n' }}{% endfor %}{{ '<|eot_id|>' }}{% endif %}"
    "{% for m in messages %}"
    "{% set role = 'ipython' if m['role'] == 'tool' else m['role'] %}"
    "{{ '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{% if m['tool_calls'] %}"
    "{% for c in m['tool_calls'] %}"
    "{{ {'name': c['function']['name'], 'parameters': c['function']['arguments']} | tojson }}"
    "{% endfor %}{{ '<|eom_id|>' }}"
    "{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def _llama3_tools():
    tok = tiny_chat_tokenizer("llama3")
    tok.add_special_tokens({"additional_special_tokens": ["<|eom_id|>"]}, replace_extra_special_tokens=False)
    tok.chat_template = LLAMA3_TOOLS
    return tok


def _trained(tok, sample) -> list[str]:
    """The decoded runs of trained tokens, in order."""
    ids, mask = sample.input_ids, sample.loss_mask
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [tok.decode(ids[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2])]


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


@pytest.mark.parametrize("content", [None, "", "  "])
def test_the_call_is_trained_and_the_answer_is_not_with_the_embedded_template(content):
    tok = default_tokenizer()
    row = _row(content)
    sample = tokenize_conversation(row, tok)
    assert _trained(tok, sample) == [CALL_TEXT, "It is 21 degrees in Paris.<|im_end|>"]
    text = tok.decode(sample.input_ids.tolist())
    want = tok.apply_chat_template(
        [{**m, "content": "" if m.get("tool_calls") else m["content"]} for m in row["messages"]],
        tools=TOOLS,
        tokenize=False,
    )
    assert text == want  # Hugging Face's own rendering of the same conversation
    assert "<tools>" in text and "get_weather" in text.split("<tools>")[1]
    # the negative control: without the row's tools the system turn lists none
    bare = tokenize_conversation({"messages": row["messages"]}, tok)
    assert "<tools>" not in tok.decode(bare.input_ids.tolist())


def test_arguments_stored_as_a_json_string_are_the_same_call():
    tok = default_tokenizer()
    a = tokenize_conversation(_row(), tok)
    b = tokenize_conversation(_row(arguments='{"city": "Paris"}'), tok)
    assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)


def test_another_familys_template_writes_and_trains_the_call():
    tok = _llama3_tools()
    sample = tokenize_conversation(_row(), tok)
    assert _trained(tok, sample) == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>',
        "It is 21 degrees in Paris.<|eot_id|>",
    ]
    text = tok.decode(sample.input_ids.tolist())
    assert "<|start_header_id|>ipython<|end_header_id|>" in text and '"description"' in text


def test_a_template_that_cannot_write_tools_is_refused_naming_it():
    tok = tiny_chat_tokenizer("llama3")  # its template writes contents only
    with pytest.raises(BadRowError, match=r"chat template .*does not write the tool call 'get_weather'"):
        tokenize_conversation(_row("Let me look."), tok)
    out = tokenize_conversations([_row("Let me look.")], tok, on_bad_row="skip")
    assert list(out) == [] and dict(out.stats.skipped) == {"template_error": 1}


@pytest.mark.parametrize(
    ("calls", "said"),
    [
        ([], "tool_calls is not a non-empty list"),
        ([{"type": "function", "function": {"arguments": {}}}], "tool_calls[0] has no function name"),
        ([{"function": {"name": "f", "arguments": "{oops"}}], "tool_calls[0].arguments is a string that is not JSON"),
        ([{"function": {"name": "f", "arguments": [1]}}], "tool_calls[0].arguments is not an object"),
    ],
)
def test_a_malformed_call_names_the_field(calls, said):
    row = _row()
    row["messages"][2]["tool_calls"] = calls
    with pytest.raises(BadRowError, match=said.replace("[", r"\[").replace("]", r"\]")):
        tokenize_conversation(row, default_tokenizer())


def test_tool_rows_from_a_file_through_the_cli(tmp_path, capsys):
    path = tmp_path / "tools.jsonl"
    row = _row()
    row["tools"] = json.dumps(TOOLS)  # as some datasets store it: a JSON string
    path.write_text(json.dumps(row) + "\n" + json.dumps(_row("")) + "\n")
    convs = list(read_conversations([str(path)]))
    assert len(convs) == 2 and convs[0].messages.tools == TOOLS
    assert main(["prepack", str(path), "--out", str(tmp_path / "rows"), "--max-seq-len", "512", "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "rows" / "manifest.json").read_text())
    assert manifest["counts"]["kept"] == 2 and manifest["counts"]["dropped"] == {}
