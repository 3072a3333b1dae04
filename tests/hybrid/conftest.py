"""The loop's fixtures (a tokenize cache in a temporary folder, the short chats, the rank
launcher) for the hybrid models' tests."""

from tests.loop.conftest import cache_in_tmp, chat, run_ranks  # noqa: F401
