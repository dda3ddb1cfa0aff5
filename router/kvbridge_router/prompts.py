"""A request's prompt as the pair chooser matches it against the engines' prefix caches: pure.

One P/D request body (batched prompts are split before this, batching.py) gives either its
token ids (a completion whose ``prompt`` is already token ids), or the request vLLM's
``/tokenize`` turns into the engine's own token ids (the chat template applied as the chat
endpoint applies it), or, for the approximate mode, a text that grows with the prompt in the
same order (the messages' roles and contents as they would be templated).
"""

from __future__ import annotations

import json
from typing import Any

#: the chat request's fields that change how vLLM templates and tokenizes the messages
CHAT_TOKENIZE_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
                        "add_special_tokens", "chat_template", "chat_template_kwargs",
                        "tools")  # fmt: skip
COMPLETION_TOKENIZE_FIELDS = ("prompt", "add_special_tokens")


def is_chat(body: dict[str, Any]) -> bool:
    return "messages" in body


def token_ids(body: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids where the client sent them (``prompt`` as ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


def tokenize_request(body: dict[str, Any]) -> dict[str, Any] | None:
    """The ``/tokenize`` body that yields the tokens this request's prompt has at the engine;
    None when there is no text prompt to tokenize."""
    if is_chat(body):
        if not isinstance(body.get("messages"), list):
            return None
        out = {k: body[k] for k in CHAT_TOKENIZE_FIELDS if k in body}
    elif isinstance(body.get("prompt"), str):
        out = {k: body[k] for k in COMPLETION_TOKENIZE_FIELDS if k in body}
    else:
        return None
    if "model" in body:
        out["model"] = body["model"]
    return out


def prompt_text(body: dict[str, Any]) -> str:
    """A text that shares a prefix with another request's exactly when their prompts do (up
    to templating): the completion's prompt, or each message's role and content in order."""
    if not is_chat(body):
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else ""
    parts: list[str] = []
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):   # content parts: their text, others as JSON
            content = "".join(p.get("text", "") if isinstance(p, dict) and "text" in p
                              else json.dumps(p, sort_keys=True) for p in content)  # fmt: skip
        parts.append(f"<{message.get('role', '')}>{content if content is not None else ''}")
    return "".join(parts)
