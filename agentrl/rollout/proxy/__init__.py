"""An OpenAI-compatible recording proxy: train agents written against the stock ``openai`` client.

Why it exists: many agents are already written as ``AsyncOpenAI(base_url=...)`` loops. Pointed
at this proxy (``base_url=f"{proxy.base_url}/sessions/{session_id}/v1"``) such an agent runs
unmodified, while the proxy talks to the policy in token ids and records, per session, exactly
the tokens the model saw and sampled — the same :class:`~agentrl.types.Trajectory` a native
agent produces (the bookkeeping is :class:`agentrl.episode.EpisodeRecorder`, shared with the
native agents). See docs/proxy.md.

One module per part (read them in this order):

- ``protocol``: the OpenAI wire format (the request read, the ``ChatCompletion`` and errors
  written);
- ``messages``: request translation (OpenAI messages as the chat template renders them, and as
  keys to compare);
- ``segment``: one token-exact stretch of a session and how a request extends it (continuation,
  token prefix, prefix break);
- ``session``: one episode's state, and its trajectories when it is finished;
- ``recorder``: :class:`ProxyRecorder`, the logic without HTTP (sessions in, trajectories out);
- ``app``: the HTTP routes over a recorder (:func:`create_proxy_app`), with bearer auth;
- ``server``: :class:`RecordingProxy`, the app served on a local port in the running loop.
"""

from agentrl.rollout.proxy.app import add_proxy_error_handlers, create_proxy_app
from agentrl.rollout.proxy.messages import ALLOWED_ROLES
from agentrl.rollout.proxy.protocol import ChatCompletionRequest, ProxyError
from agentrl.rollout.proxy.recorder import ProxyRecorder
from agentrl.rollout.proxy.server import RecordingProxy

__all__ = [
    "ALLOWED_ROLES",
    "ChatCompletionRequest",
    "ProxyError",
    "ProxyRecorder",
    "RecordingProxy",
    "add_proxy_error_handlers",
    "create_proxy_app",
]
