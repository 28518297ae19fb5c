"""The embedded inference engine: KV-cached generation with continuous batching, in torch.

Why it exists: tests, the quickstart and CPU-only users need a real inference server without
vLLM. This engine loads any local Hugging Face causal-LM directory and generates with the same
sampling semantics and logprob convention as vLLM with ``--logprobs-mode processed_logprobs``.

One module per part, each opening with its invariants (read them in this order):

- ``request``: a request and its output; the checks at the door;
- ``sampling``: processed logprobs and per-request seeded sampling (pure functions);
- ``batch``: the running batch and its left-padded per-layer KV cache;
- ``pause``: the ``keep`` / ``abort`` / ``wait`` pause state machine (a pause always ends);
- ``scheduler``: the engine thread, its queues and its step loop;
- ``probe``: the verification probe, served ahead of the queue and while paused;
- ``weight_store`` / ``loaders``: the served weights and version, and every way new ones arrive
  (checked completely, swapped together between decode steps);
- ``inference_engine``: :class:`InferenceEngine`, the handle that wires them together.
"""

from agentrl.inference.engine.inference_engine import InferenceEngine
from agentrl.inference.engine.probe import PROBE_MAX_TOKENS
from agentrl.inference.engine.request import (
    MIN_TEMPERATURE,
    EngineOutput,
    EngineRequestError,
    EngineStepError,
    normalize_sampling,
)
from agentrl.inference.engine.sampling import process_logits, sample_token, sample_tokens
from agentrl.inference.engine.weight_store import (
    MAX_VERSION,
    PushLease,
    VersionConflict,
    check_version,
    state_digest,
)
from agentrl.inference.weights import WeightLoadError

__all__ = [
    "MAX_VERSION",
    "MIN_TEMPERATURE",
    "PROBE_MAX_TOKENS",
    "EngineOutput",
    "EngineRequestError",
    "EngineStepError",
    "InferenceEngine",
    "PushLease",
    "VersionConflict",
    "WeightLoadError",
    "check_version",
    "normalize_sampling",
    "process_logits",
    "sample_token",
    "sample_tokens",
    "state_digest",
]
