"""The evaluation suite's text handling that needs no benchmark file (the files: tests/integration)."""

from __future__ import annotations

from mha2mla.evaluate.tasks import capitalize_last_fragment


def test_hellaswag_capitalisation():
    assert capitalize_last_fragment("Label: A man sits. the man") == "Label: A man sits. The man"
    assert capitalize_last_fragment("Label: she") == "Label: She"
    assert capitalize_last_fragment("Health: How to rest. Sleep well.") == "Health: How to rest. Sleep well."
