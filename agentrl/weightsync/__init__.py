"""Weight sync: every new weight version from the trainer to every inference server, verified.

One package for the trainer and the rollout service alike (issue 20; prime-rl keeps its
``transports/weights`` the same way). Read it in this order:

- :mod:`agentrl.weightsync.transports`: the protocol's data, :class:`StagedWeights` (one
  version's weights, staged once for every server), and the :class:`WeightTransport` interface
  with two transports, :class:`SharedDirTransport` (safetensors on a shared directory) and
  :class:`HttpStreamTransport` (the same bytes over HTTP);
- :mod:`agentrl.weightsync.collective`: the third transport, :class:`CollectiveTransport`
  (bucketed broadcasts over a ``torch.distributed`` weight group);
- :mod:`agentrl.weightsync.engine`: :class:`CheckpointEngine` (pause, transfer, verify, resume
  on every server; the push lease and writer), its :class:`PushReport` and the verifier.

The servers' end (loading, digests, the staging buffer) is :mod:`agentrl.inference.weights`.
"""

from agentrl.weightsync.engine import (
    CheckpointEngine,
    PushReport,
    ServerPushStatus,
    WeightPushError,
    make_transport,
    transport_from_config,
)
from agentrl.weightsync.transports import (
    HttpStreamTransport,
    SharedDirTransport,
    StagedWeights,
    WeightTransport,
)

__all__ = [
    "CheckpointEngine",
    "HttpStreamTransport",
    "PushReport",
    "ServerPushStatus",
    "SharedDirTransport",
    "StagedWeights",
    "WeightPushError",
    "WeightTransport",
    "make_transport",
    "transport_from_config",
]
