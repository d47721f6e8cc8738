"""The OpenAPI schema as this server serves it, with the server's own limits written in."""
from __future__ import annotations

from lookahead_core.engine.config import EngineConfig
from lookahead_core.serving import RequestLimits


def _cap_token_ids(schema, vocab_size: int) -> None:
    """Every token-id item (an integer >= 0 inside `items`) gets the vocabulary's last id as maximum."""
    if isinstance(schema, list):
        for s in schema:
            _cap_token_ids(s, vocab_size)
    elif isinstance(schema, dict):
        items = schema.get("items")
        if isinstance(items, dict) and items.get("type") == "integer" and items.get("minimum") == 0:
            items["maximum"] = vocab_size - 1
        for value in schema.values():
            _cap_token_ids(value, vocab_size)


def served_schema(schema: dict, model_name: str, vocab_size: int, engine: EngineConfig, limits: RequestLimits) -> dict:
    """The OpenAPI schema with this server's own limits, so that a body valid by the schema is one
    it serves: the one `model` id the OpenAI routes accept (any other is a 404), token ids within
    the vocabulary, the engine's token budget and largest (N, W, G), and the stop strings
    RequestLimits allows."""
    bodies = schema.get("components", {}).get("schemas", {})
    n, chars = limits.max_stop_strings, limits.max_stop_chars
    stop_string = {"type": "string", "minLength": 1, "maxLength": chars}
    stop_list = {"type": "array", "items": stop_string, "maxItems": n}
    for name, body in bodies.items():
        props = body.get("properties", {})
        for budget in ("max_new_tokens", "max_tokens", "max_completion_tokens"):
            if budget in props:
                props[budget]["maximum"] = engine.max_new_tokens  # binds only numbers, so beside a null branch too
        for branch in props.get("lookahead", {}).get("anyOf", ()):
            for key, limit in (("n", engine.max_n), ("w", engine.max_w), ("g", engine.max_g)):
                if key in branch.get("properties", {}):
                    branch["properties"][key]["maximum"] = limit
        if name == "GenerateRequest":
            props["stop"] = {**props["stop"], **stop_list}
        elif "stop" in props:  # OpenAI's: a string, a list of them, or null (a string is one stop string)
            props["stop"] = {"anyOf": [stop_string, stop_list, {"type": "null"}] if n else [stop_list, {"type": "null"}],
                             "title": "Stop"}
        for prompt in ("prompt", "input_ids"):
            _cap_token_ids(props.get(prompt), vocab_size)
        if "model" in props:
            props["model"] = {"anyOf": [{"type": "string", "enum": [model_name]}, {"type": "null"}],
                              "title": "Model", "description": "the served model id (GET /v1/models)"}
    return schema
