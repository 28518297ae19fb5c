"""The rollout service (``agentrl serve``): scored rollouts, sessions and weight pushes over HTTP.

Why it exists: a trainer that is not agentrl's (TRL, verl, a research loop on another cluster)
can use agentrl's agent loop, tools, exact token bookkeeping, streaming rewards and verified
weight sync through an HTTP API and the SDK :class:`agentrl.client.RolloutClient`.

Modules: :mod:`~agentrl.service.app` (routes, settings, :func:`~agentrl.service.app.run_service`),
:mod:`~agentrl.service.jobs` (rollout jobs, cursors, SSE), :mod:`~agentrl.service.store`
(SQLite), :mod:`~agentrl.service.weights` (pushes and verification),
:mod:`~agentrl.service.weight_state` (the latest verified push, durable across restarts),
:mod:`~agentrl.serving.supervisor` (dead servers ejected, restarted, rejoining at the version),
:mod:`~agentrl.service.sessions` (black-box agents through the recording proxy),
:mod:`~agentrl.auth` (bearer auth and body limits, shared with the proxy),
:mod:`~agentrl.service.serving` (what the service is built on), :mod:`~agentrl.service.cli`.

Importing this package is cheap (no torch, no servers): the proxy imports its auth module.
"""
