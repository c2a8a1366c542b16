"""An agent's chat-completions requests as its episode's exact token history.

The endpoint (`streamrl.generator.endpoint`) hands each request of an agent episode here: what
to sample (`AgentChat.prompt`), and the response once sampled (`AgentChat.reply`). What is
recorded is what the engine saw and sampled, never a re-tokenisation of text:

- The first request is rendered with the model's chat template (`ChatRenderer`), its `tools=`
  given to the template (hermes) or described in the system prompt (tagged: the template knows
  no tools; `streamrl.envs.formats`) — exactly as a `ToolEnvironment`'s first prompt.
- A later request that repeats the conversation so far — every message the engine saw, and the
  assistant message it answered with, compared by role, text and tool calls (not by ids or by
  how the client re-serialised arguments) — is that history plus new messages: the new ones are
  rendered as the template's delta after the sampled turn (`ChatRenderer.observation_ids`,
  as a tool environment's observation: cut to `observation_max_chars` and
  `observation_max_tokens`) and appended, loss mask 0. The sampled tokens stay as sampled.
- Any other request — the agent edited or dropped messages, changed its tools, or the
  conversation was reset — is rendered whole; when its tokens extend the history exactly they
  are appended as above, else the episode's current *segment* ends (finish reason `split`) and
  a new one starts from the rendering. Each segment is a response of the group in the stream
  record, scored with its episode's reward; the learner never sees tokens in a context the
  engine did not sample them in.

Sampling is the run's: a request may not ask for another temperature, top-p, penalties, stop
strings, top log-probs, constrained decoding, more than one choice or a streamed answer
(`RequestRefusedError`, naming the setting), since the learner's importance weights need the
behaviour policy's log-probs; `max_tokens` can only lower the turn's budget. Tool calls in the
sampled text come back as `tool_calls`, read by vLLM's tool parser for the template's format
(hermes, or `generator.env.tool_parser`), or by streamrl's tagged format.

Budgets are the environment's (`generator.env`): at most `max_turns` requests (the one after is
refused and ends the episode with `max_turns`), each segment within `max_episode_tokens` (a
request that does not fit ends it with `max_tokens`), and a turn cut at its token limit ends
the episode (`max_tokens`), as for an environment; later requests are refused. A request to be
rendered whole whose messages hold more characters than the budget's tokens could spell (at
the most characters one of the model's tokens stands for) is refused so before it is
templated or tokenised. A request the model's chat template refuses (`raise_exception`) is
refused with the template's message.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from streamrl.envs.agent import EPISODE_ENDED
from streamrl.envs.chat import ChatRenderer
from streamrl.envs.config import EnvConfig
from streamrl.envs.conversations import (
    ConversationError,
    answered,
    assistant_text,
    tools_from_schemas,
)
from streamrl.envs.formats import TOOL_FORMATS, TaggedFormat
from streamrl.envs.limits import truncate_all
from streamrl.generator.agent_requests import arguments_too_deep, most_chars_per_token
from streamrl.generator.config import GeneratorConfig
from streamrl.generator.engine import Completion
from streamrl.generator.transcript import Transcript

__all__ = ["EPISODE_ENDED", "AgentChat", "AgentEpisode", "RequestRefusedError"]

# Set in a request without changing what is sampled: read, or ignored.
_HARMLESS = frozenset(
    {"messages", "model", "tools", "max_tokens", "max_completion_tokens", "seed", "user",
     "parallel_tool_calls", "stream_options", "return_token_ids", "request_id", "logprobs",
     "include_reasoning", "reasoning_effort"}
)  # fmt: skip
_NEUTRAL = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
_FIX = "leave it unset: the learner's importance weights need the run's own sampling"


class RequestRefusedError(Exception):
    """A request the endpoint answers with an error (`status`, the message saying why)."""

    def __init__(self, message: str, status: int = 400, *, ended: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = EPISODE_ENDED if ended else None


Key = tuple[str, str, tuple[tuple[str, str], ...]]


@dataclass(eq=False)
class AgentEpisode:
    """One agent episode's token history across its requests: its segments (each a response
    of the group), what the engine has seen in the current one (`seen`: message keys, with the
    answer it gave), and its counts. `finish_reason` is set once a budget ended it."""

    token: str
    greedy: bool = False  # every turn sampled greedily (an evaluation's greedy answer)
    segments: list[Transcript] = field(default_factory=list)
    segment_tool_calls: list[int] = field(default_factory=list)
    seen: list[Key] = field(default_factory=list)
    tools_key: str | None = None
    tools_offered: bool = False
    last_eos: bool = False
    requests: int = 0
    final: str = ""  # the text of its latest sampled turn
    finish_reason: str | None = None
    error: str = ""  # why a request of it could not be served (finish reason env_error)
    started: bool = False  # its agent claimed its one run
    waiting: bool = False  # a request of it is being sampled

    @property
    def sampled(self) -> bool:
        return any(s.turns for s in self.segments)


class AgentChat:
    """Renders an agent's requests into token ids and sampled turns into responses (module
    docstring), for one generator."""

    def __init__(
        self,
        renderer: ChatRenderer,
        generator: GeneratorConfig,
        env: EnvConfig,
        tool_format: str,
        max_episode_tokens: int,
        model_name: str,
    ) -> None:
        self.renderer, self.generator, self.env = renderer, generator, env
        # A vLLM tool parser reads the formats of templates that render tools: given one, the
        # tools go to the template, as for hermes.
        self.tagged = tool_format == "tagged" and env.tool_parser is None
        self.format = TOOL_FORMATS["tagged" if self.tagged else "hermes"]
        self.tool_parser = env.tool_parser or "hermes"
        self.turn_max_tokens = env.turn_max_tokens or generator.max_tokens
        self.max_episode_tokens = max_episode_tokens
        self.chars_per_token = most_chars_per_token(renderer.tokenizer)
        self.model_name = model_name
        # vLLM's parsers log a traceback for every malformed call: a policy's noise, not ours.
        logging.getLogger("vllm.tool_parsers").setLevel(logging.CRITICAL)

    # -- a request ------------------------------------------------------------------------------

    def prompt(self, episode: AgentEpisode, request: Any) -> tuple[list[int], int]:
        """The token ids to sample `request`'s answer after, and the most tokens it may sample;
        the episode's history is extended (or a new segment started) to match.

        Raises:
            RequestRefusedError: the episode ended, a budget is used up, or the request asks
                for what training cannot allow; nothing of the episode changed, except that
                a used-up budget ends it.
        """
        if episode.finish_reason is not None:
            raise RequestRefusedError(
                f"this episode has ended ({episode.finish_reason}); return your answer",
                ended=True,
            )
        self.check_sampling(request)
        messages = [_normalized(m) for m in request.messages]
        if not messages:
            raise RequestRefusedError("messages is empty")
        if episode.requests >= self.env.max_turns:
            episode.finish_reason = "max_turns"
            raise RequestRefusedError(
                f"this episode used its {self.env.max_turns} requests (max_turns)",
                ended=True,
            )
        tools = _tools(request)
        tools_key = json.dumps(tools, sort_keys=True) if tools else None
        keys = [_key(m) for m in messages]
        try:
            extension, context = self._history(episode, messages, keys, tools, tools_key)
        except ConversationError as problem:  # a call or tool the tool format cannot write
            raise RequestRefusedError(str(problem)) from None
        except TemplateError as refused:  # the template's raise_exception, or its own error
            raise RequestRefusedError(
                f"the model's chat template refused this conversation: {refused}"
            ) from None
        used = len(context) if context is not None else episode.segments[-1].length
        used += len(extension or ())
        if (extension is None and context is None) or used >= self.max_episode_tokens:
            episode.finish_reason = "max_tokens"
            raise RequestRefusedError(
                f"the conversation would be {used} tokens; this episode's budget is "
                f"{self.max_episode_tokens} (generator.env.max_episode_tokens)",
                ended=True,
            )
        if context is not None:  # a new segment
            episode.segments.append(Transcript())
            episode.segment_tool_calls.append(0)
            episode.segments[-1].add_observation(context)
            episode.tools_key = tools_key
        elif extension:
            episode.segments[-1].add_observation(extension)
        episode.seen = keys
        episode.tools_offered |= bool(tools)
        episode.requests += 1
        fields = vars(request)  # reading `max_tokens` as an attribute warns: it is deprecated
        asked = fields.get("max_completion_tokens") or fields.get("max_tokens")
        asked = asked or self.turn_max_tokens
        budget = max(1, min(self.turn_max_tokens, asked, self.max_episode_tokens - used))
        return episode.segments[-1].token_ids(), budget

    def check_sampling(self, request: Any) -> None:
        """Refuse a request that asks for other sampling than the run's (module docstring)."""
        cfg = self.generator
        for name in sorted(request.model_fields_set & set(type(request).model_fields)):
            value = vars(request).get(name)  # `max_tokens` as an attribute warns
            if name in _HARMLESS or value is None:
                continue
            if name == "temperature" and math.isclose(value, cfg.temperature, rel_tol=1e-6):
                continue
            if name == "top_p" and math.isclose(value, cfg.top_p, rel_tol=1e-6):
                continue
            if name == "n" and value == 1:
                continue
            if name == "top_logprobs" and value == 0:
                continue
            if name == "stream" and not value:
                continue
            if name == "tool_choice" and value in ("auto", "none"):
                continue
            if _NEUTRAL.get(name) == value:
                continue
            if value == type(request).model_fields[name].default:
                continue
            raise RequestRefusedError(_refusal(name, value, cfg))

    def _history(
        self,
        episode: AgentEpisode,
        messages: list[dict[str, Any]],
        keys: list[Key],
        tools: list[dict[str, Any]] | None,
        tools_key: str | None,
    ) -> tuple[list[int] | None, list[int] | None]:
        """`(extension, None)`: ids appended to the current segment (None: they do not fit
        `observation_max_tokens`); `(None, context)`: a new segment's first ids."""
        seen = len(episode.seen)
        if (
            episode.segments
            and tools_key == episode.tools_key
            and len(keys) > seen
            and keys[:seen] == episode.seen
        ):
            names = _tool_names(messages)
            new = self._template_messages(messages[seen:], names, cut=True)
            ids = self.renderer.observation_ids_within(
                new, episode.last_eos, self.env.observation_max_tokens
            )
            return ids, None
        self._check_size(episode, messages)
        rendered = self._render(messages, tools)
        if episode.segments:
            history = episode.segments[-1].token_ids()
            if len(rendered) > len(history) and rendered[: len(history)] == history:
                return rendered[len(history) :], None
        return None, rendered

    def _check_size(self, episode: AgentEpisode, messages: Sequence[dict[str, Any]]) -> None:
        """Refuse, before templating and tokenising it, a conversation whose message contents
        alone are more characters than the episode's token budget could spell (it would be
        refused after, as too many tokens); the episode ends (`max_tokens`) as it would then."""
        chars = sum(len(m["content"]) for m in messages)
        most = self.max_episode_tokens * self.chars_per_token
        if chars > most:
            episode.finish_reason = "max_tokens"
            raise RequestRefusedError(
                f"the messages hold {chars} characters: more than the {self.max_episode_tokens}"
                f" tokens of this episode's budget (generator.env.max_episode_tokens) can hold "
                f"at {self.chars_per_token} characters a token, the most any token of the "
                "model stands for",
                ended=True,
            )

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """A whole request as the model's first prompt would be (module docstring)."""
        template = self._template_messages(messages, _tool_names(messages), cut=False)
        if not tools:
            return self.renderer.prompt_ids(template)
        described = tools_from_schemas(tools)
        template = self.format.prompt(template, described)
        return self.renderer.prompt_ids(template, self.format.template_tools(described) and tools)

    def _template_messages(
        self, messages: Sequence[dict[str, Any]], names: Mapping[str, str], *, cut: bool
    ) -> list[dict[str, Any]]:
        """OpenAI messages as the chat template takes them, as an environment would give them:
        an assistant's tool calls written in the tool format, tool results (named after their
        call) answered as the format answers them (`streamrl.envs.conversations`). `cut`: an
        observation's contents, cut to `observation_max_chars` together."""
        out: list[dict[str, Any]] = []
        between: list[dict[str, Any]] = []
        for message in messages:
            if message["role"] != "assistant":
                name = names.get(message.get("tool_call_id", ""), "")
                between.append({**message, "name": name} if message["role"] == "tool" else message)
                continue
            out += answered(self.format, between)
            between = []
            text = assistant_text(self.format, message, "an assistant message")
            out.append({"role": "assistant", "content": text})
        out += answered(self.format, between)
        if cut:
            limit = self.env.observation_max_chars
            contents = truncate_all([m["content"] for m in out], limit)
            out = [{**m, "content": c} for m, c in zip(out, contents, strict=True)]
        return out

    # -- its answer -----------------------------------------------------------------------------

    def reply(self, episode: AgentEpisode, request: Any, completion: Completion) -> dict[str, Any]:
        """Record the sampled turn in the episode; the chat completion answering `request`."""
        segment = episode.segments[-1]
        segment.add_turn(completion)
        episode.last_eos = self.renderer.ended_with_eos(completion.token_ids)
        episode.final = completion.text
        content, calls = self._tool_calls(completion.text, request)
        episode.segment_tool_calls[-1] += len(calls)
        if completion.truncated:
            episode.finish_reason = "max_tokens"
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        episode.seen = [*episode.seen, _key(_normalized(message))]
        finish = "length" if completion.truncated else "tool_calls" if calls else "stop"
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        choice["logprobs"] = self._logprobs(completion) if request.logprobs else None
        prompt_tokens = segment.length - len(completion.token_ids)
        return {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.model or self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(completion.token_ids),
                "total_tokens": segment.length,
            },
        }

    def _tool_calls(self, text: str, request: Any) -> tuple[str | None, list[dict[str, Any]]]:
        """The turn's text before its tool calls (None when empty), and the calls."""
        tools = _tools(request)
        if not tools:
            return text, []
        if self.tagged:
            return _tagged_calls(text, tools)
        from vllm.tool_parsers import ToolParserManager

        parser = ToolParserManager.get_tool_parser(self.tool_parser)(
            self.renderer.tokenizer, tools=request.tools
        )
        found = parser.extract_tool_calls(text, request)
        # A call nested deeper than the tool formats read stays text: echoed back, the
        # endpoint would refuse it (`streamrl.generator.agent_requests`).
        readable = [c for c in found.tool_calls if not arguments_too_deep(c.function.arguments)]
        if not found.tools_called or not readable:
            return text, []
        calls = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in readable
        ]  # fmt: skip
        return found.content or None, calls

    def _logprobs(self, completion: Completion) -> dict[str, Any]:
        tokenizer = self.renderer.tokenizer
        content = []
        for token_id, logprob in zip(completion.token_ids, completion.logprobs, strict=True):
            token = tokenizer.decode([int(token_id)])
            content.append({"token": token, "logprob": float(logprob),
                            "bytes": list(token.encode()), "top_logprobs": []})  # fmt: skip
        return {"content": content}


# -- messages --------------------------------------------------------------------------------


def _normalized(message: Any) -> dict[str, Any]:
    """A request message as plain data: role (developer read as system), text content (parts
    joined; only text parts), and an assistant's tool calls or a tool result's call id."""
    if not isinstance(message, Mapping):
        raise RequestRefusedError(f"a message must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise RequestRefusedError(
            f"message role {role!r} is not served (system, user, assistant, tool)"
        )
    out: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
    if role == "assistant" and message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                raise RequestRefusedError(
                    "an assistant tool call needs function.name and function.arguments"
                )
            arguments = function.get("arguments", "{}")
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            called = {"name": function["name"], "arguments": arguments}
            calls.append({"id": call.get("id", ""), "type": "function", "function": called})
        out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = str(message.get("tool_call_id", ""))
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Iterable) and not isinstance(content, Mapping):  # vLLM's iterator too
        parts = []
        for part in content:
            if not (isinstance(part, Mapping) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise RequestRefusedError(f"only text content is served, not {kind!r}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RequestRefusedError(f"message content must be text, got {type(content).__name__}")


def _key(message: Mapping[str, Any]) -> Key:
    """What makes two messages the same turn: role, text and tool calls (name and arguments as
    JSON values; not their ids, nor how the client serialised them)."""
    calls = tuple(
        (c["function"]["name"], json.dumps(_arguments(c["function"]["arguments"]), sort_keys=True))
        for c in message.get("tool_calls") or ()
    )
    return (message["role"], message["content"] or "", calls)


def _arguments(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        return arguments


def _tool_names(messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Tool call id → the tool's name, over the assistant messages' calls."""
    return {
        c["id"]: c["function"]["name"]
        for m in messages
        for c in m.get("tool_calls") or ()
        if c.get("id")
    }


def _tools(request: Any) -> list[dict[str, Any]] | None:
    """The request's tools as the template's `tools=` list; None without any, or when
    `tool_choice` is "none"."""
    if not request.tools or request.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in request.tools]


def _tagged_calls(
    text: str, tools: Sequence[Mapping[str, Any]]
) -> tuple[str | None, list[dict[str, Any]]]:
    """Calls written in the tagged format; those that cannot be read stay in the text only."""
    parameters = {
        t["function"]["name"]: list(t["function"].get("parameters", {}).get("properties", {}))
        for t in tools
    }
    calls = []
    for call in TaggedFormat().parse(text):
        names = parameters.get(call.name)
        if call.error is not None or names is None or len(call.positional) > len(names):
            continue
        arguments = {**dict(zip(names, call.positional, strict=False)), **call.arguments}
        called = {"name": call.name, "arguments": json.dumps(arguments)}
        calls.append(
            {"id": f"call_{secrets.token_hex(12)}", "type": "function", "function": called}
        )
    if not calls:
        return text, []
    content = text[: text.find("<tool>")].rstrip()
    return content or None, calls


def _refusal(name: str, value: Any, cfg: GeneratorConfig) -> str:
    shown = json.dumps(value, default=str)[:80]
    if name in ("temperature", "top_p"):
        return (
            f"{name}={shown}: this run samples at generator.{name}={getattr(cfg, name):g}; {_FIX}"
        )
    if name == "n":
        return f"n={shown}: one choice per request; send more requests for more samples"
    if name == "stream":
        return "stream=true: streaming responses are not served; call with stream=false"
    if name == "tool_choice":
        return (
            f"tool_choice={shown}: only auto and none are served; a forced call would need "
            "constrained decoding, which changes the sampled distribution"
        )
    if name == "top_logprobs":
        return (
            f"top_logprobs={shown}: only the sampled tokens' log-probs are served (logprobs=true)"
        )
    return f"{name}={shown}: not served, it changes what is sampled; {_FIX}"
