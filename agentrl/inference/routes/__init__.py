"""The embedded server's routes, one module per concern (assembled by ``server.create_app``).

``generation`` (completions, chat), ``control`` (pause/resume/abort/probe), ``weights`` (loads
and versions), ``metrics`` (health, models, Prometheus), ``scoring`` (a reward model's
``/pooling``, on a server started with ``--task score``); ``auth`` decides who may call what and
``common`` holds the shared state, errors and disconnect handling.
"""
