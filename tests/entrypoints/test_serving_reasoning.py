"""Chat with --reasoning-parser, in-process, on a fake engine that writes scripted text token
by token with a real (tiny, in-memory) tokenizer whose `<think>`/`</think>` are single tokens,
and that runs each request's structured-output grammar over what it writes: the thinking
comes out as `reasoning_content` and the rest as `content`, whole and streamed alike; tool
calls are read after the thinking only; a constraint (response_format, tool_choice
"required") lets the thinking be and holds from `</think>` on; and the chat template gets
`chat_template_kwargs`, `reasoning_effort` and `continue_final_message` (also through
/tokenize)."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from pagoda.engine.core.grammar import GrammarCompiler
from pagoda.engine.core.input_processor import EngineRequest, InputProcessor
from pagoda.engine.loop.request_stream import RequestStream
from pagoda.entrypoints.openai.model_registry import ServedModel
from pagoda.entrypoints.openai.server import build_app
from pagoda.entrypoints.openai.server_state import ServerState
from pagoda.outputs import CompletionOutput, RequestOutput
from tests.entrypoints.test_serving_pipeline import FakeAsyncEngine, error_of, sse_events
from tests.thinking_tokenizer import thinking_tokenizer

QWEN3_TEMPLATE = (
    "{%- if reasoning_effort is defined %}"
    "{{- '<|im_start|>system\\nReasoning effort: ' + reasoning_effort + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")
"""Qwen3's conventions, minimal: the model opens its own think block; enable_thinking false
puts an empty one in the prompt."""
R1_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>{{ message.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
"""DeepSeek-R1's convention: the generation prompt opens the thinking."""
QUESTION = [{"role": "user", "content": "Hi"}]
CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {
        "type": "string"}}, "required": ["zone"]}}}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


class ThinkingEngine(FakeAsyncEngine):
    """Choice j writes scripts[j] (cycling), one token of the thinking tokenizer per step, then
    stops. Under a grammar each token must be allowed: `verdicts[request_id]` says
    "accepted" (every token, then EOS, ended the grammar) or where it was refused (the
    choice then stops there, as a real engine never samples a refused token)."""

    def __init__(self, scripts: list[str], chat_template: str) -> None:
        super().__init__()
        self.tokenizer = thinking_tokenizer(chat_template)
        self.vocab_size = len(self.tokenizer)
        self.max_model_len = 4096
        compiler = GrammarCompiler(self.tokenizer, self.vocab_size, [self.tokenizer.eos_token_id])
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size,
                                              self.max_model_len, compiler)
        self.scripts = scripts
        self.verdicts: dict[str, str] = {}

    async def add_request(self, request: EngineRequest) -> RequestStream:
        self.added.append(request)
        stream = RequestStream(request.request_id, request.params.n)
        asyncio.get_running_loop().create_task(self._write(request, stream))
        return stream

    def _checked(self, request: EngineRequest, token_ids: list[int]) -> list[int]:
        """The tokens the request's grammar lets through (all when it has none)."""
        if request.grammar is None:
            return token_ids
        matcher = self.input_processor.grammar_compiler.matcher(request.grammar)
        for i, token_id in enumerate(token_ids):
            if not matcher.accept(token_id):
                self.verdicts[request.request_id] = (
                    f"refused at {self.tokenizer.decode(token_ids[i:])!r}")
                return token_ids[:i]
        finished = matcher.accept(self.tokenizer.eos_token_id) and matcher.is_finished
        self.verdicts[request.request_id] = "accepted" if finished else "unfinished"
        return token_ids

    async def _write(self, request: EngineRequest, stream: RequestStream) -> None:
        n = request.params.n
        scripts = [self.scripts[j % len(self.scripts)] for j in range(n)]
        token_ids = [self._checked(request, self.tokenizer.encode(s, add_special_tokens=False))
                     for s in scripts]
        completions = [CompletionOutput(index=j) for j in range(n)]
        for step in range(max(1, *(len(ids) for ids in token_ids))):  # (>= 1 output)
            await asyncio.sleep(0)
            for c, ids in zip(completions, token_ids):
                new = ids[step:step + 1]
                text = self.tokenizer.decode(ids[:step + 1])
                c.delta_text, c.delta_token_ids = text[len(c.text):], new
                c.text, c.token_ids = text, c.token_ids + new
                if step + 1 >= len(ids):
                    c.finish_reason = "stop"
            stream.put(RequestOutput(request.request_id, request.prompt,
                                     request.prompt_token_ids,
                                     [CompletionOutput(**vars(c)) for c in completions],
                                     all(c.finish_reason for c in completions)))


def client_for(scripts: list[str], reasoning_parser: str | None = "qwen3",
               chat_template: str = QWEN3_TEMPLATE) -> tuple[TestClient, ThinkingEngine]:
    engine = ThinkingEngine(scripts, chat_template)
    app = build_app(ServerState(models=[ServedModel("m", engine, "/m")],
                                reasoning_parser=reasoning_parser))
    return TestClient(app), engine


def chat(client, **fields) -> dict:
    response = client.post("/v1/chat/completions", json={"messages": QUESTION, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def streamed_choices(client, **fields) -> dict[int, dict]:
    """Per choice index: its reasoning and content as a client assembles them, its tool
    calls, the kinds of its deltas in order, and its finish_reason."""
    response = client.post("/v1/chat/completions",
                           json={"messages": QUESTION, "stream": True, **fields})
    choices: dict[int, dict] = {}
    for event in sse_events(response):
        for choice in event["choices"]:
            state = choices.setdefault(choice["index"], {
                "reasoning": "", "content": "", "calls": {}, "kinds": [], "finish": None})
            delta = choice["delta"]
            assert not ("reasoning_content" in delta and "content" in delta and delta["content"])
            for key in ("reasoning_content", "content", "tool_calls"):
                if delta.get(key):
                    state["kinds"].append(key)
            state["reasoning"] += delta.get("reasoning_content") or ""
            state["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = state["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call.get("function", {}).get("name") or ""
                entry["arguments"] += call.get("function", {}).get("arguments") or ""
            state["finish"] = choice["finish_reason"] or state["finish"]
    return choices


def kinds_in_order(kinds: list[str]) -> list[str]:
    """The kinds, each run of one kind collapsed: ["reasoning_content", "content"], ..."""
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def test_qwen3_thinking_is_split_off_whole_and_streamed():
    scripts = ["<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
               "A plain answer, no thinking."]
    client, _ = client_for(scripts)
    with client:
        body = chat(client, n=2, max_tokens=100)
        streamed = streamed_choices(client, n=2, max_tokens=100)
    first, second = (c["message"] for c in body["choices"])
    assert first == {"role": "assistant", "content": "Hello! How can I help?",
                     "refusal": None, "reasoning_content": "The user greets me."}
    assert second == {"role": "assistant", "content": "A plain answer, no thinking.",
                      "refusal": None}  # no reasoning: the field is left out
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "stop"]
    assert streamed[0]["reasoning"] == first["reasoning_content"]
    assert streamed[0]["content"] == first["content"]
    assert kinds_in_order(streamed[0]["kinds"]) == ["reasoning_content", "content"]
    assert (streamed[1]["reasoning"], streamed[1]["content"]) == ("", second["content"])
    assert streamed[0]["finish"] == streamed[1]["finish"] == "stop"


def test_deepseek_r1_output_begins_in_the_thinking_auto_from_the_template():
    client, _ = client_for(["Two and two.\n</think>\n\n4", "Still thinking when cut"],
                           reasoning_parser="auto", chat_template=R1_TEMPLATE)
    with client:
        body = chat(client, n=2, max_tokens=100)
        streamed = streamed_choices(client, n=2, max_tokens=100)
    first, second = (c["message"] for c in body["choices"])
    assert (first["reasoning_content"], first["content"]) == ("Two and two.", "4")
    assert (second["reasoning_content"], second["content"]) == ("Still thinking when cut", None)
    assert (streamed[0]["reasoning"], streamed[0]["content"]) == ("Two and two.", "4")
    assert (streamed[1]["reasoning"], streamed[1]["content"]) == ("Still thinking when cut", "")


def test_without_a_reasoning_parser_the_thinking_stays_in_the_content():
    script = "<think>\nHmm.\n</think>\n\nHello"
    client, _ = client_for([script], reasoning_parser=None)
    with client:
        message = chat(client, max_tokens=100)["choices"][0]["message"]
        streamed = streamed_choices(client, max_tokens=100)
    assert message == {"role": "assistant", "content": script, "refusal": None}
    assert (streamed[0]["content"], streamed[0]["reasoning"]) == (script, "")


def test_tool_calls_are_read_after_the_thinking_only():
    script = "<think>I need the time. A <tool_call> block calls it.</think>\n\n" + CALL
    client, _ = client_for([script])
    with client:
        body = chat(client, tools=TOOLS, max_tokens=200)
        streamed = streamed_choices(client, tools=TOOLS, max_tokens=200)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["reasoning_content"] == "I need the time. A <tool_call> block calls it."
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "get_time", {"zone": "UTC"})
    assert streamed[0]["reasoning"] == message["reasoning_content"]
    assert streamed[0]["calls"] == {0: {"name": "get_time",
                                        "arguments": call["function"]["arguments"]}}
    assert kinds_in_order(streamed[0]["kinds"]) == ["reasoning_content", "tool_calls"]
    assert streamed[0]["finish"] == "tool_calls"


@pytest.mark.parametrize(("parser", "template", "thinking"), [
    ("qwen3", QWEN3_TEMPLATE, "<think>Let me see: {not json} [1]</think>\n\n"),
    ("deepseek_r1", R1_TEMPLATE, "Let me see: {not json} [1]\n</think>\n\n"),
])
def test_response_format_holds_only_after_the_thinking(parser, template, thinking):
    client, engine = client_for([thinking + '{"a":1}'], parser, template)
    with client:
        message = chat(client, response_format=SCHEMA, max_tokens=200)["choices"][0]["message"]
        assert engine.verdicts[engine.added[-1].request_id] == "accepted"
        assert json.loads(message["content"]) == {"a": 1}
        assert message["reasoning_content"] == "Let me see: {not json} [1]"
        engine.scripts = [thinking + "Not JSON"]
        message = chat(client, response_format=SCHEMA, max_tokens=200)["choices"][0]["message"]
        assert engine.verdicts[engine.added[-1].request_id] == "refused at 'Not JSON'"
        assert message["content"] is None  # the engine stopped at the refused token
    client, engine = client_for([thinking + '{"a":1}'], reasoning_parser=None,
                                chat_template=template)
    with client:  # without a reasoning parser the constraint holds from the first token
        chat(client, response_format=SCHEMA, max_tokens=200)
        assert engine.verdicts[engine.added[-1].request_id].startswith("refused at")


def test_a_forced_tool_call_follows_the_thinking():
    client, engine = client_for(["<think>The user wants the time.</think>\n" + CALL])
    with client:
        body = chat(client, tools=TOOLS, tool_choice="required", max_tokens=200)
    assert engine.verdicts[engine.added[-1].request_id] == "accepted"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "The user wants the time."
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_time"


def test_the_template_gets_chat_template_kwargs_and_reasoning_effort():
    client, engine = client_for(["ok"])
    with client:
        chat(client)
        assert engine.added[-1].prompt.endswith("<|im_start|>assistant\n")
        chat(client, chat_template_kwargs={"enable_thinking": False})
        assert engine.added[-1].prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        chat(client, reasoning_effort="high")
        assert engine.added[-1].prompt.startswith("<|im_start|>system\nReasoning effort: high")
        chat(client, reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"})
        assert "Reasoning effort: low" in engine.added[-1].prompt  # the kwargs win
        plain = client.post("/tokenize", json={"messages": QUESTION}).json()
        no_think = client.post("/tokenize", json={
            "messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False},
            "return_token_strs": True}).json()
    assert no_think["count"] == plain["count"] + 6  # <think> \n \n </think> \n \n
    assert no_think["token_strs"][-6:] == ["<think>", "Ċ", "Ċ", "</think>", "Ċ", "Ċ"]


def test_continue_final_message_continues_the_assistant_message():
    client, engine = client_for(["ing."])
    partial = [*QUESTION, {"role": "assistant", "content": "<think>\nGreet"}]
    with client:
        chat(client, messages=partial, add_generation_prompt=False,
             continue_final_message=True)
        assert engine.added[-1].prompt.endswith("<|im_start|>assistant\n<think>\nGreet")
        tokens = client.post("/tokenize", json={
            "messages": partial, "add_generation_prompt": False,
            "continue_final_message": True, "return_token_strs": True}).json()
    assert tokens["token_strs"][-7:] == ["<think>", "Ċ", "G", "r", "e", "e", "t"]


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt", "renderer"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools", "renderer"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs", "an object"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "'high'"),
    ({"continue_final_message": "yes"}, "continue_final_message", "boolean"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_bad_template_fields_are_a_400_naming_them(path, fields, param, says):
    if path == "/tokenize" and param == "reasoning_effort":
        param = says = "reasoning_effort"  # not a /tokenize field: unknown
    client, engine = client_for(["ok"])
    with client:
        error = error_of(client.post(path, json={"messages": QUESTION, **fields}))
    assert error["param"] == param and says in error["message"], error
    assert engine.added == []


HARMONY_TEMPLATE = (
    "{% for message in messages %}<|start|>{{ message.role }}<|message|>{{ message.content }}"
    "<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
    "{# the model answers in <|channel|>analysis, then final #}")
HARMONY_CALL = ("<|channel|>analysis<|message|>Needs the clock.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
                '{"zone": "UTC"}<|call|>')


def test_gpt_oss_harmony_reasoning_and_tool_calls_whole_and_streamed():
    """--reasoning-parser and --tool-call-parser auto on a template that writes harmony's
    channels: the analysis is reasoning_content, the commentary message to a function a
    tool call (finish_reason tool_calls), the output decoded with its special tokens; a
    constraint is a 400 (harmony leaves it no place)."""
    engine = ThinkingEngine([HARMONY_CALL], HARMONY_TEMPLATE)
    app = build_app(ServerState(models=[ServedModel("m", engine, "/m")],
                                reasoning_parser="auto", tool_call_parser="auto"))
    client = TestClient(app)
    message = chat(client, tools=TOOLS)["choices"][0]
    assert message["message"]["reasoning_content"] == "Needs the clock."
    assert message["message"]["content"] is None and message["finish_reason"] == "tool_calls"
    (call,) = message["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert engine.added[-1].params.skip_special_tokens is False
    (streamed,) = streamed_choices(client, tools=TOOLS).values()
    assert streamed["reasoning"] == "Needs the clock." and streamed["content"] == ""
    assert streamed["calls"] == {0: {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    response = client.post("/v1/chat/completions",
                           json={"messages": QUESTION, "response_format": SCHEMA})
    assert response.status_code == 400
    assert "openai_gptoss" in error_of(response)["message"]
