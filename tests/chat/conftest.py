"""Fixtures shared by the sftpack.chat tests."""

from __future__ import annotations

import pytest

from sftpack import Sample
from sftpack.chat import tokenize_conversation
from tests.helpers import CONVO, tok_of


@pytest.fixture(scope="module")
def full() -> Sample:
    """``CONVO`` tokenized whole with the tiny ChatML tokenizer."""
    return tokenize_conversation(CONVO, tok_of("chatml"))
