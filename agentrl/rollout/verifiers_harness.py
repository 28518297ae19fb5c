"""``AgentrlHarness``: the program every verifiers seat runs under ``data.generator: verifiers``.

Why it exists: verifiers' own chat harnesses (``null``, ``bash``) install and launch a script with
``uv`` (network) and stream their requests; training needs neither. This harness is the same loop
run in-process: ask the model (through verifiers' interception ``endpoint``, so verifiers' trace
records every call), run the tool calls on the task's MCP tool servers (verifiers' ``Toolset``s,
via verifiers' own MCP helpers), repeat until a reply without tool calls. Requests are
non-streaming, so the recording proxy behind the interception answers them token-exact.

verifiers finds a harness by module: this module exports :class:`AgentrlHarness` in ``__all__``
(its verifiers id is the alias ``agentrl_verifiers_harness``). Imported only by the verifiers adapter.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

from verifiers.v1 import Harness, HarnessConfig
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp
from verifiers.v1.runtimes import ProgramResult

__all__ = ["AgentrlHarness", "AgentrlHarnessConfig"]


class AgentrlHarnessConfig(HarnessConfig):
    """No options: the loop's limits are verifiers' seat caps (``max_turns``, ...)."""


class AgentrlHarness(Harness[AgentrlHarnessConfig]):
    """In-process, non-streaming chat + MCP tool loop (the ``null`` harness's loop)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(  # type: ignore[override]  # verifiers passes tool_interception_url too
        self,
        ctx: Any,
        trace: Any,
        runtime: Any,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: Any,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        """Run the conversation of ``data`` to a reply without tool calls; exit 0."""
        import openai

        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        try:
            async with AsyncExitStack() as stack:
                tools: list[dict[str, Any]] = []
                dispatch: dict[str, Any] = {}
                servers: dict[str, Any] = {}
                if mcp_urls:
                    spec = {"mcpServers": {n: {"url": u} for n, u in mcp_urls.items()}}
                    tools, dispatch, servers = await connect_mcp(spec, stack)
                await _loop(client, ctx.model, messages, tools, dispatch, servers)
        except openai.APIStatusError as exc:
            # A stop (turn cap, @vf.stop) answers the request with an error: the run ends here.
            if trace.stop_condition is None:
                return ProgramResult(1, "", f"model call failed: {exc}")
        finally:
            await client.close()
        return ProgramResult(0, "", "")


async def _loop(
    client: Any,
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    dispatch: dict[str, Any],
    servers: dict[str, Any],
) -> None:
    """Model turns until one without tool calls; each call answered by its MCP server."""
    while True:
        kwargs: dict[str, Any] = {"model": model, "messages": messages}
        if tools:
            kwargs["tools"] = tools
        completion = await client.chat.completions.create(**kwargs)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return
        for call in message.tool_calls:
            name = call.function.name
            try:
                args = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError as exc:
                content: Any = f"error: invalid JSON in tool arguments ({exc})"
            else:
                if not isinstance(args, dict):
                    content = "error: tool arguments must be a JSON object"
                elif name in dispatch:
                    content = await call_mcp(servers, dispatch, name, args)
                else:
                    content = f"error: unknown tool {name!r}"
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "name": name, "content": content}
            )
