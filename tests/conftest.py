"""Shared pytest configuration. Scripted fakes live in ``tests/fakes.py`` (one place)."""

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen2 model + byte-level tokenizer (``agentrl.inference.tiny_model``), built once."""
    from agentrl.inference.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "tiny-qwen2", seed=0)
