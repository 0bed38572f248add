"""An agent loop end to end on the default model (SmolLM2-135M-Instruct): the openai-agents SDK
runs a Python tool through the server and returns the model's final answer, over the
Responses API and over chat completions.

The first turn requires a call (`tool_choice="required"`, one call): constrained, so even this
small model calls the tool with arguments that match its signature. The SDK then resets the
choice to "auto" and the model answers in text. What the answer says is the model's; that the
loop runs to a final answer through both APIs is the server's.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from test_server import MODEL, start_server

agents = pytest.importorskip("agents")

from contbatch.setup.loading import default_model_dir  # noqa: E402


@pytest.fixture(scope="module")
def smollm(default_model):  # the pytest session's default model writes its safetensors cache first
    srv = start_server(default_model_dir(), num_blocks=256)
    yield srv
    srv.stop()


def run_agent(srv, api: str) -> tuple[object, list[str]]:
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is sunny and 24 C in {city}."

    async def run():
        client = openai.AsyncOpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=120)
        model_class = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
        agent = agents.Agent(
            name="weather", instructions="You answer questions about the weather. Use the get_weather tool.",
            tools=[get_weather], model=model_class(model=MODEL, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                                max_tokens=48))
        try:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        finally:
            await client.close()

    agents.set_tracing_disabled(True)
    return asyncio.run(run()), calls


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_an_agent_calls_a_python_tool_and_answers(smollm, api):
    result, calls = run_agent(smollm, api)
    assert calls and all(isinstance(city, str) and city for city in calls)  # called, with a valid argument
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
    assert result.new_items[1].output == f"It is sunny and 24 C in {calls[0]}."
