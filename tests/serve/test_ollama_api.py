"""serve/ollama_api.py in-process: the real app and door over a scripted queue (tool calls the model writes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from starlette.testclient import TestClient

from fixtures.chat_reference import ScriptedQueue
from fixtures.schemas import OLLAMA_WEATHER_FUNCTION
from mlxpipe.serve.app import build_app
from mlxpipe.serve.door import ServerSettings
from mlxpipe.serve.queue import RequestLog

TOOL_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def scripted(demo_model: Path) -> Iterator[ollama.Client]:
    tokenizer = load_tokenizer(demo_model, tokenizer_config_extra={"tool_parser_type": "json_tools"})
    settings = ServerSettings(model_id="scripted", api_key=None, context=4096)
    with TestClient(build_app(ScriptedQueue(tokenizer, TOOL_REPLY), tokenizer, settings,  # type: ignore[arg-type]
                              RequestLog())) as http:
        client = ollama.Client(host="http://testserver")
        client._client = http  # the real door in-process
        yield client


def test_a_tool_call_comes_back_in_the_message(scripted: ollama.Client) -> None:
    reply = scripted.chat(model="scripted", messages=[{"role": "user", "content": "Weather in Paris?"}],
                          tools=[OLLAMA_WEATHER_FUNCTION])
    (call,) = reply.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris"})
