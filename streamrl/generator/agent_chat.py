"""An agent's chat-completions requests as its episode's exact token history.

The endpoint (`streamrl.generator.endpoint`) hands each request of an agent episode here: what
to sample (`AgentChat.prompt`), and the response once sampled (`AgentChat.reply`). What is
recorded is what the engine saw and sampled, never a re-tokenisation of text:

- The first request is rendered with the model's chat template (`ChatRenderer`), its `tools=`
  given to the template (hermes) or described in the system prompt (tagged: the template knows
  no tools; `streamrl.envs.formats`) — exactly as a `ToolEnvironment`'s first prompt.
- A later request that repeats the conversation so far — every message the engine saw, and the
  assistant message it answered with, compared by role, text and tool calls (not by ids or by
  how the client re-serialised arguments: `streamrl.generator.agent_messages.message_key`) — is
  that history plus new messages: the new ones are rendered as the template's delta after the
  sampled turn (`ChatRenderer.observation_ids`, as a tool environment's observation: cut to
  `observation_max_chars` and `observation_max_tokens`) and appended, loss mask 0. The sampled
  tokens stay as sampled.
- Any other request — the agent edited or dropped messages, changed its tools, or the
  conversation was reset — is rendered whole; when its tokens extend the history exactly they
  are appended as above, else the episode's current *segment* ends (finish reason `split`) and
  a new one starts from the rendering. Each segment is a response of the group in the stream
  record, scored with its episode's reward; the learner never sees tokens in a context the
  engine did not sample them in.

Before any of this a request's sampling settings are checked and its messages read as plain
data (`streamrl.generator.agent_messages`: a request that asks for other sampling than the
run's is refused, naming the setting); the sampled turn is answered with its tool calls read
from its text (`streamrl.generator.agent_replies`).

Budgets are the environment's (`generator.env`): at most `max_turns` requests (the one after is
refused and ends the episode with `max_turns`), each segment within `max_episode_tokens` (a
request that does not fit ends it with `max_tokens`), and a turn cut at its token limit ends
the episode (`max_tokens`), as for an environment; later requests are refused. A request's
`max_tokens` can only lower its turn's budget. A request to be rendered whole whose messages
hold more characters than the budget's tokens could spell (at the most characters one of the
model's tokens stands for) is refused so before it is templated or tokenised. A request the
model's chat template refuses (`raise_exception`) is refused with the template's message. Every
refusal is a `RequestRefusedError`; nothing of the episode changes, except that a used-up
budget ends it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from streamrl.envs.chat import ChatRenderer
from streamrl.envs.config import EnvConfig
from streamrl.envs.conversations import (
    ConversationError,
    answered,
    assistant_text,
    tools_from_schemas,
)
from streamrl.envs.formats import TOOL_FORMATS
from streamrl.envs.limits import truncate_all
from streamrl.generator.agent_messages import (
    MessageKey,
    RequestRefusedError,
    check_sampling,
    message_key,
    normalized,
    request_tools,
    tool_names,
)
from streamrl.generator.agent_replies import chat_completion, tool_calls
from streamrl.generator.agent_requests import most_chars_per_token
from streamrl.generator.config import GeneratorConfig
from streamrl.generator.engine import Completion
from streamrl.generator.transcript import Transcript

__all__ = ["AgentChat", "AgentEpisode"]


@dataclass(eq=False)
class AgentEpisode:
    """One agent episode's token history across its requests: its segments (each a response
    of the group), what the engine has seen in the current one (`seen`: message keys, with the
    answer it gave), and its counts. `finish_reason` is set once a budget ended it."""

    token: str
    greedy: bool = False  # every turn sampled greedily (an evaluation's greedy answer)
    segments: list[Transcript] = field(default_factory=list)
    segment_tool_calls: list[int] = field(default_factory=list)
    seen: list[MessageKey] = field(default_factory=list)
    tools_key: str | None = None
    tools_offered: bool = False
    last_eos: bool = False
    requests: int = 0
    final: str = ""  # the text of its latest sampled turn
    finish_reason: str | None = None
    error: str = ""  # why a request of it could not be served (finish reason env_error)
    refused: str = ""  # its latest refused request's status and why
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
        check_sampling(request, self.generator)
        messages = [normalized(m) for m in request.messages]
        if not messages:
            raise RequestRefusedError("messages is empty")
        if episode.requests >= self.env.max_turns:
            episode.finish_reason = "max_turns"
            raise RequestRefusedError(
                f"this episode used its {self.env.max_turns} requests (max_turns)",
                ended=True,
            )
        tools = request_tools(request)
        tools_key = json.dumps(tools, sort_keys=True) if tools else None
        keys = [message_key(m) for m in messages]
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

    def _history(
        self,
        episode: AgentEpisode,
        messages: list[dict[str, Any]],
        keys: list[MessageKey],
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
            names = tool_names(messages)
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
        template = self._template_messages(messages, tool_names(messages), cut=False)
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
        tokenizer = self.renderer.tokenizer
        content, calls = tool_calls(
            completion.text,
            request,
            tagged=self.tagged,
            tool_parser=self.tool_parser,
            tokenizer=tokenizer,
        )
        episode.segment_tool_calls[-1] += len(calls)
        if completion.truncated:
            episode.finish_reason = "max_tokens"
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        episode.seen = [*episode.seen, message_key(normalized(message))]
        return chat_completion(
            request,
            message,
            completion,
            total_tokens=segment.length,
            model_name=self.model_name,
            tokenizer=tokenizer,
        )
