"""POST /v1/responses driven by the official openai package against a real daemon: at temperature
0 its text equals the chat completion of the same conversation, streamed or not, with items."""

from __future__ import annotations

import openai
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from moed.gateway.generation import Finish, Outcome
from moed.gateway.responses_api import _Envelope, _Events

N = 8


@pytest.fixture(scope="module")
def oai(gateway_stack) -> openai.OpenAI:
    _, gateway = gateway_stack
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(oai) -> str:
    return oai.models.list().data[0].id


def chat_text(oai, model, messages) -> str:
    done = oai.chat.completions.create(model=model, messages=messages, max_tokens=N, temperature=0)
    return done.choices[0].message.content


@pytest.mark.process
def test_text_input_streamed_and_not_equals_the_chat_completion(oai, model_name):
    expected = chat_text(oai, model_name, [{"role": "user", "content": "Hello!"}])
    assert expected
    done = oai.responses.create(
        model=model_name, input="Hello!", max_output_tokens=N, temperature=0
    )
    assert done.output_text == expected
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.usage.output_tokens == N and done.usage.input_tokens > 0

    # At max_output_tokens the stream ends with response.incomplete, as OpenAI's does (the SDK's
    # responses.stream() helper waits for response.completed only).
    events = list(
        oai.responses.create(
            model=model_name, input="Hello!", max_output_tokens=N, temperature=0, stream=True
        )
    )
    kinds = [event.type for event in events]
    assert events[-1].response.output_text == expected
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == expected
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "response.output_text.delta" in kinds
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]


@pytest.mark.process
def test_items_with_instructions_and_function_calls_render_as_the_chat_turns(oai, model_name):
    """instructions, a developer message, a function call and its output become the same chat
    turns (and so the same tokens) as the Chat Completions messages."""
    messages = [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    expected = chat_text(oai, model_name, messages)
    done = oai.responses.create(
        model=model_name,
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        max_output_tokens=N,
        temperature=0,
    )
    assert done.output_text == expected


@pytest.mark.process
def test_stored_state_and_custom_tools_are_refused_not_ignored(oai, model_name):
    with pytest.raises(openai.BadRequestError) as stateful:
        oai.responses.create(model=model_name, input="hi", previous_response_id="resp_1")
    assert "stateless" in stateful.value.message
    with pytest.raises(openai.BadRequestError) as custom:
        oai.responses.create(
            model=model_name, input="hi", tools=[{"type": "custom", "name": "apply_patch"}]
        )
    assert "function tools only" in custom.value.message
    # A hosted tool (Codex offers web_search) is left out: the prompt is the one without it.
    plain = oai.responses.create(model=model_name, input="hi", max_output_tokens=4, temperature=0)
    hosted = oai.responses.create(
        model=model_name,
        input="hi",
        tools=[{"type": "web_search"}],
        max_output_tokens=4,
        temperature=0,
    )
    assert hosted.output_text == plain.output_text
    assert hosted.usage.input_tokens == plain.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as too_long:
        oai.responses.create(model=model_name, input="hi " * 600, max_output_tokens=4)
    assert too_long.value.code == "context_length_exceeded"


def test_streamed_tool_calls_parse_as_function_call_items():
    """The events of text then a call, through the openai package's own stream accumulator."""
    envelope = _Envelope({"model": "m"}, "m")
    events = _Events()
    frames = [events.event("response.created", response=envelope.base)]
    frames += events.text_delta("Let me look.")
    frames += events.tool_call({"id": "call_7", "name": "get_weather", "arguments": {"q": 1}})
    parse = TypeAdapter(ResponseStreamEvent).validate_json
    state = ResponseStreamState(input_tools=[], text_format=openai.NOT_GIVEN)
    outcome = Outcome(Finish.TOOL_CALLS, 3, 9, None, {})
    frames.append(
        events.event("response.completed", response=envelope.finished(events.output, outcome))
    )
    for frame in frames:
        state.handle_event(parse(frame.decode().split("data: ", 1)[1]))
    snapshot = state._completed_response  # the SDK checks every item's identity on the way
    kinds = [item.type for item in snapshot.output]
    assert kinds == ["message", "function_call"]
    assert snapshot.output[0].content[0].text == "Let me look."
    call = snapshot.output[1]
    assert (call.call_id, call.name, call.arguments) == ("call_7", "get_weather", '{"q": 1}')
    Response.model_validate(envelope.base)  # the envelope is a valid Response
