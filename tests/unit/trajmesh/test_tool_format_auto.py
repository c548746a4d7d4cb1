"""``tool_format: auto`` (the default of the tool sources) resolves when the config is loaded with the
model: ``native`` for a chat model whose template knows tool calls (the ChatML test model,
tests/chatml_model.py), ``tags`` for the character-tokenizer demo model (no chat template); the task
prompts then ask for that format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Literal

import pytest

pytest.importorskip("torch")

from chatml_model import CHATML_TEMPLATE, build_chatml_model  # noqa: E402
from repo_paths import REPO

from trajmesh import plugins  # noqa: E402
from trajmesh.config import ToolSourceConfig, load_config  # noqa: E402
from trajmesh.tasks import load_split  # noqa: E402

DEMO = next((REPO / "examples" / "demo-start").glob("demo-model-*/sft"))
SOURCES = [{"type": "math_tool"}, {"type": "search", "corpus_size": 20}, {"type": "workplace", "pool_size": 5}]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chatml_model(tmp_path_factory.mktemp("chatml"), ["What is 6*7? <tool_call>{}</tool_call>"] * 4,
                              vocab_size=300)


def _formats(model: Path | None, sources: list[dict[str, object]] = SOURCES) -> list[str]:
    overrides: dict[str, object] = {"tasks.sources": sources}
    if model is not None:
        overrides["model.path"] = str(model)
    return [s.tool_format for s in load_config(None, overrides).tasks.sources]  # type: ignore[attr-defined]


def test_chat_model_with_tool_calls_resolves_native(chatml: Path) -> None:
    assert _formats(chatml) == ["native"] * 3
    cfg = load_config(None, {"model.path": str(chatml), "tasks.sources": SOURCES[:1]})
    train, _ = load_split(cfg.tasks.sources[0], 2, 1)
    assert "<tool_call>" in train[0].prompt and train[0].metadata.get("tools")


def test_demo_model_resolves_tags() -> None:
    assert not (DEMO / "chat_template.jinja").exists()
    assert _formats(DEMO) == ["tags"] * 3
    cfg = load_config(None, {"model.path": str(DEMO), "tasks.sources": SOURCES[:1]})
    train, _ = load_split(cfg.tasks.sources[0], 2, 1)
    assert "<tool_call>" not in train[0].prompt and "tools" not in train[0].metadata


def test_explicit_formats_and_no_model_stay(chatml: Path) -> None:
    assert _formats(chatml, [{"type": "math_tool", "tool_format": "tags"}]) == ["tags"]
    assert _formats(DEMO, [{"type": "math_tool", "tool_format": "native"}]) == ["native"]
    assert _formats(None) == ["auto"] * 3  # no model yet (the demo is built later): read as tags


def _chat_model(tmp: Path, template: str, tool_token: bool) -> Path:
    out = tmp / f"m{len(list(tmp.iterdir()))}"
    out.mkdir()
    cfg: dict[str, object] = {"chat_template": template}
    if tool_token:
        cfg["added_tokens_decoder"] = {"7": {"content": "<tool_call>", "special": False}}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def test_template_without_tools_resolves_tags_unless_the_tokenizer_has_tool_calls(tmp_path: Path,
                                                                                  chatml: Path) -> None:
    plain = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    assert _formats(_chat_model(tmp_path, plain, tool_token=False))[0] == "tags"
    assert _formats(_chat_model(tmp_path, plain, tool_token=True))[0] == "native"
    qwen_like = plain + "{% if tools %}# Tools\n{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
    assert _formats(_chat_model(tmp_path, qwen_like, tool_token=False))[0] == "native"
    assert "tool" in CHATML_TEMPLATE  # the test model's template has a tool role: native above
    copy = tmp_path / "copy"
    shutil.copytree(chatml, copy)
    for name in ("tokenizer_config.json", "chat_template.jinja", "chat_template.json"):  # no template at all:
        (copy / name).unlink(missing_ok=True)  # tags, whatever the tokenizer has
    assert _formats(copy)[0] == "tags"


class ToyToolSource(ToolSourceConfig):
    """A test-only tool-using source registered from outside config.py (a plug-in of its own)."""

    type: Literal["toy_tool"] = "toy_tool"
    """Selects this source."""
    name: str = "toy_tool"
    """Source name recorded on every task."""


def test_auto_resolves_for_any_registered_source_with_the_tool_format_field(chatml: Path) -> None:
    # Not a list of type names: a source registered at run time whose config is a ToolSourceConfig
    # resolves like the built-in ones; one without the field (reasoning_gym) is left as it is.
    plugins.register_source(plugins.SourcePlugin(type="toy_tool", config=ToyToolSource, draw=lambda *a: [],
                                                 environments={}, graders={}))
    try:
        for model, expected in ((chatml, "native"), (DEMO, "tags"), (None, "auto")):
            overrides: dict[str, object] = {"tasks.sources": [{"type": "toy_tool"}, {"type": "reasoning_gym"}]}
            if model is not None:
                overrides["model.path"] = str(model)
            toy, gym = load_config(None, overrides).tasks.sources
            assert isinstance(toy, ToyToolSource) and toy.tool_format == expected, model
            assert "tool_format" not in type(gym).model_fields
    finally:
        plugins.unregister_source("toy_tool")
