"""OpenAI tool calls without a model: `tools` and `tool_choice` checked, the grammar forcing calls, the chat's turns for
templates with and without tool support (`tool_calls` reads the calls back). A call is written one way in the prompt,
the grammar and the parser: {"name": <tool>, "arguments": <JSON object>}; under "auto" in <tool_call> blocks among the
text (Hermes' format), under "required" the output is a JSON array of calls (vLLM's, with `arguments` for its
`parameters`), under a named function one call."""
from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import llguidance

from lookahead_core.constraints.grammar import GrammarSpec
from lookahead_core.serving.outputs import RequestError

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule on function names
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# Forced calls are written as json.dumps writes them, as the prompt shows them: no free whitespace for a model to loop on.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOLS_NOTE = "You may call these tools (`parameters`: the JSON schema of their arguments):\n<tools>\n{tools}\n</tools>"
AUTO_RULE = ('To call a tool, reply with one <tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call> block per '
             "call; each result comes back in a <tool_response></tool_response> block. Answer directly where no tool is needed.")
RESPONSE = "<tool_response>\n{}\n</tool_response>"
REQUIRED_RULE = 'Reply only with a JSON array of the calls you make: [{"name": <tool name>, "arguments": <JSON object>}, ...].'
NAMED_RULE = 'Call the tool {name}: reply only with {{"name": "{name}", "arguments": <JSON object>}}.'
ChoiceMode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call; `parameters`: the JSON schema of its arguments (None: any object). `strict` is
    kept as given: forced calls follow the schema whatever it says, "auto" calls are not constrained."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = field(default=None, hash=False)
    strict: bool = False

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request states it, as chat templates taking `tools` read it."""
        described = {"description": self.description} if self.description is not None else {}
        parameters = self.parameters if self.parameters is not None else {"type": "object", "properties": {}}
        return {"type": "function", "function": {"name": self.name, **described, "parameters": parameters}}


def parse_tools(raw: object) -> tuple[ToolSpec, ...]:
    """A request's `tools` (None or []: none), each checked; RequestError (400, `tools`) naming what is wrong."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise RequestError(400, f'`tools` must be a list of at most {MAX_TOOLS} {{"type": "function", "function": ...}}', "tools")
    specs: list[ToolSpec] = []
    for i, item in enumerate(raw):
        f = item.get("function") if isinstance(item, Mapping) and item.get("type") == "function" else None
        if not isinstance(f, Mapping):
            raise RequestError(400, f'`tools[{i}]` must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise RequestError(400, f"`tools[{i}]`: a function's name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}", "tools")
        if any(s.name == name for s in specs):
            raise RequestError(400, f"`tools[{i}]`: two tools are named {name!r}", "tools")
        for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                                ("strict", bool, "a boolean")):
            if f.get(key) is not None and not isinstance(f[key], kind):
                raise RequestError(400, f"`tools[{i}]`: `{key}` must be {what}", "tools")
        specs.append(ToolSpec(name, f.get("description"), f.get("parameters"), bool(f.get("strict"))))
    return tuple(specs)


@dataclass(frozen=True)
class ToolChoice:
    """How the model may call tools: "none", "auto" (as it decides), "required" (one call or more), "function" (one
    call, of `name`). The last two are `forced`: the output is calls only, under `tool_grammar`."""

    mode: ChoiceMode = "none"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")

    def offered(self, tools: Sequence[ToolSpec]) -> list[ToolSpec]:
        """The tools the model may call: none under "none", a named function alone."""
        return [t for t in tools if self.mode != "none" and (self.mode != "function" or t.name == self.name)]


def parse_tool_choice(raw: object, tools: Sequence[ToolSpec]) -> ToolChoice:
    """A request's `tool_choice`: absent, "auto" with tools, "none" without; RequestError (400, `tool_choice`)."""
    if raw is None or raw == "none":
        return ToolChoice("auto" if raw is None and tools else "none")
    if not tools:
        raise RequestError(400, f"`tool_choice` {raw!r} needs `tools`", "tool_choice")
    if raw in ("auto", "required"):
        return ToolChoice(cast(ChoiceMode, raw))
    f = raw.get("function") if isinstance(raw, Mapping) and raw.get("type") == "function" else None
    name = f.get("name") if isinstance(f, Mapping) else None
    if not isinstance(name, str):
        raise RequestError(400, '`tool_choice` must be "none", "auto", "required" or {"type": "function", "function": {"name"}}',
                           "tool_choice")
    if all(t.name != name for t in tools):
        raise RequestError(400, f"`tool_choice` names {name!r}, which is not among `tools`", "tool_choice")
    return ToolChoice("function", name)


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    """One call of `tool` as a JSON schema. "name" comes first (llguidance keeps the properties' order: the model names
    the tool, then writes its arguments); an `$id` makes the arguments a resource whose `$ref`s to its `$defs` resolve."""
    arguments = {"$id": f"urn:tool:{tool.name}", **(tool.parameters if tool.parameters is not None else {"type": "object"})}
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_grammar(tools: Sequence[ToolSpec], choice: ToolChoice) -> GrammarSpec | None:
    """What forced calls match: a named function's one call, or for "required" a JSON array of one call or more of any
    tool; None for "none" and "auto". RequestError (400, `tools`) where the tools' schemas make no grammar."""
    if not choice.forced:
        return None
    if choice.mode == "function":
        schema = call_schema(next(t for t in tools if t.name == choice.name))
    else:
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [call_schema(t) for t in tools]}}
    try:
        spec = GrammarSpec.json_schema(json.dumps({**schema, "x-guidance": JSON_STYLE}))  # not sorted: "name" first
        error = llguidance.LLMatcher.validate_grammar(spec.llguidance())
    except ValueError as exc:
        error = str(exc)
    if error and not error.startswith("WARNING"):
        raise RequestError(400, f"the tools' parameters make no grammar: {error.strip()}", "tools")
    return spec


def template_takes_tools(template: str | Mapping[str, str] | None) -> bool:
    """Whether a chat template renders `tools` itself (its text names them); of named templates, any."""
    return "tools" in (template if isinstance(template, str) else " ".join((template or {}).values()))


def loads_or_text(text: Any) -> Any:
    """`text` parsed where it is JSON text, else as it is."""
    try:
        return json.loads(text, parse_constant=int) if isinstance(text, str) else text  # int() refuses NaN, as JSON does
    except (ValueError, RecursionError):  # RecursionError: nested too deep
        return text


def template_turns(messages: Sequence[Mapping[str, Any]], takes_tools: bool) -> list[dict[str, Any]]:
    """OpenAI chat turns as a chat template takes them (RequestError (400, `messages`) for what is not one). With tool
    support: `tool_calls` with parsed arguments (as vLLM passes them), results as role "tool" named for their call.
    Without: {role, content}, calls as <tool_call> blocks after the text, a run of results one user turn."""
    names: dict[str, str] = {}  # call id -> function name, for the results
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        try:
            role, content, call_id, calls = m["role"], m.get("content"), m.get("tool_call_id"), m.get("tool_calls") or []
            made = [(c.get("id", ""), c["function"]["name"], loads_or_text(c["function"].get("arguments", "{}"))) for c in calls]
        except (KeyError, TypeError, AttributeError):
            made, role, calls = [], None, None
        if not all(isinstance(v, str) for v in (role, content or "", call_id or "", *(x for c in made for x in c[:2]))) \
                or (made and role != "assistant") or not isinstance(calls, list):
            raise RequestError(400, f"`messages[{i}]` must be a chat turn {{role, content (a string or null), tool_calls (assistant: "
                                    '[{"id", "type": "function", "function": {"name", "arguments"}}]), tool_call_id (tool)}}', "messages")
        names.update((c[0], c[1]) for c in made)
        if takes_tools:
            made_ = {"tool_calls": [{"id": c, "type": "function", "function": {"name": n, "arguments": a}} for c, n, a in made]}
            result = {"tool_call_id": call_id or "", **({"name": names[call_id]} if call_id in names else {})}
            turns.append({"role": role, "content": content or "", **(made_ if made else {}), **(result if role == "tool" else {})})
        elif role == "tool" and i and messages[i - 1].get("role") == "tool":
            turns[-1]["content"] += "\n" + RESPONSE.format(content or "")
        elif role == "tool":
            turns.append({"role": "user", "content": RESPONSE.format(content or "")})
        else:
            blocks = [CALL_OPEN + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + CALL_CLOSE for _, n, a in made]
            turns.append({"role": role, "content": "\n".join([content, *blocks] if content else blocks)})
    return turns


def render_tool_prompt(template_takes_tools: bool, messages: Sequence[Mapping[str, Any]], tools: Sequence[ToolSpec],
                       choice: ToolChoice) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra kwargs for `apply_chat_template`. A template taking tools gets them as `tools` (OpenAI's
    dicts, as transformers passes them); else the first system turn (added where there is none) lists them with
    AUTO_RULE. Forced choices add their rule either way; "none" offers no tools, a named function itself alone."""
    offered = choice.offered(tools)
    turns = template_turns(messages, template_takes_tools)
    notes = []
    if offered and not template_takes_tools:
        notes.append(TOOLS_NOTE.format(tools="\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in offered)))
        notes += [AUTO_RULE] if choice.mode == "auto" else []
    if choice.forced:
        notes.append(REQUIRED_RULE if choice.mode == "required" else NAMED_RULE.format(name=choice.name))
    if notes and turns and turns[0]["role"] == "system":
        turns[0] = {**turns[0], "content": "\n\n".join([turns[0]["content"], *notes] if turns[0]["content"] else notes)}
    elif notes:
        turns.insert(0, {"role": "system", "content": "\n\n".join(notes)})
    return turns, ({"tools": [t.openai() for t in offered]} if template_takes_tools and offered else {})
