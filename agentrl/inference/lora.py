"""LoRA adapter pushes: the payload format, its checks, and the merge into a server's weights.

Why it exists: with LoRA only the adapter changes between two weight versions, so a push should
carry the adapter (megabytes), not the model (gigabytes). The trainer sends the adapter; the
embedded server merges it into the base weights it keeps; vLLM loads it as a LoRA adapter
(``--enable-lora``, ``POST /v1/load_lora_adapter``).

**The payload** (what the actor pushes, :class:`LoraAdapter`): peft's adapter state dict, the one
``peft.get_peft_model_state_dict`` returns and ``save_pretrained`` writes to
``adapter_model.safetensors``, i.e. for every adapted linear layer ``M``::

    base_model.model.<M>.lora_A.weight    [r, in_features]
    base_model.model.<M>.lora_B.weight    [out_features, r]

plus a :class:`LoraSpec` (rank ``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``,
``fan_in_fan_out``). On the wire the spec travels as the safetensors ``__metadata__`` key
:data:`METADATA_KEY` (a JSON object) or, in a directory, as peft's ``adapter_config.json`` next
to ``adapter_model.safetensors`` (the layout vLLM and ``PeftModel.from_pretrained`` read).

**The merge** (:class:`LoraMerger`, embedded server): ``W = W_base + scaling * B @ A`` with
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), computed in float32 and
cast to the weight's dtype. The server keeps a copy of every base weight an adapter ever touched,
so each version is merged onto the base, never onto the previous merge (nothing accumulates), and
a module that the new adapter leaves out gets its base weight back. A full-weight push replaces
the base (the kept copies are dropped).

**Checks before anything changes** (:func:`check_adapter`): every key has peft's form, each
module has both matrices, names an existing 2-D weight of the model, is in ``target_modules``,
has shapes that fit the weight and the rank, a float dtype and finite values; the spec is valid.
Errors are :class:`~agentrl.inference.weights.WeightLoadError` naming the key and the fix.
Unsupported peft features (DoRA, per-module rank/alpha patterns, LoRA on embeddings, LoRA biases)
are refused by name.

Example (the actor side)::

    adapter = LoraAdapter.from_peft(peft_model)          # adapter tensors + its LoraConfig
    report = await engine.push(adapter, version, score=score_with_the_peft_model)
    report.num_bytes                                     # adapter bytes only
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.inference.weights import WeightLoadError
from agentrl.jsonsafe import loads_limited

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_FILE",
    "METADATA_KEY",
    "VLLM_LORA_NAME",
    "LoraAdapter",
    "LoraMerger",
    "LoraSpec",
    "check_adapter",
]

METADATA_KEY = "agentrl_lora"
"""The safetensors ``__metadata__`` key holding the :class:`LoraSpec` as JSON."""
ADAPTER_FILE = "adapter_model.safetensors"
"""The adapter's file name in a directory (peft's and vLLM's)."""
ADAPTER_CONFIG = "adapter_config.json"
"""peft's adapter config file name; its presence marks a directory as an adapter."""
VLLM_LORA_NAME = "agentrl-lora"
"""The name LoRA pushes load their adapter under on vLLM; generation requests name this model."""

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA hyper-parameters a server needs to merge an adapter (peft's ``LoraConfig`` subset)."""

    r: int
    """Rank of every adapted module."""
    lora_alpha: float
    """Scaling numerator: ``scaling = lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``)."""
    target_modules: tuple[str, ...]
    """Module names (last path component, e.g. ``q_proj``) that the adapter may adapt."""
    use_rslora: bool = False
    """Rank-stabilized scaling (``lora_alpha / sqrt(r)``)."""
    fan_in_fan_out: bool = False
    """The base layer stores ``[in, out]`` (GPT-2's Conv1D): the delta is transposed."""

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise WeightLoadError(f"LoRA r={self.r!r}; it must be an integer >= 1")
        if not (isinstance(self.lora_alpha, int | float) and math.isfinite(self.lora_alpha)):
            raise WeightLoadError(
                f"LoRA lora_alpha={self.lora_alpha!r}; it must be a finite number"
            )
        if not self.target_modules or not all(
            isinstance(m, str) and m for m in self.target_modules
        ):
            raise WeightLoadError(
                f"LoRA target_modules={self.target_modules!r}; give a non-empty list of module "
                "names (e.g. ['q_proj', 'v_proj'])"
            )

    @property
    def scaling(self) -> float:
        """The factor in front of ``B @ A``."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_json(self) -> str:
        """The spec as the JSON object stored under :data:`METADATA_KEY`."""
        return json.dumps(
            {
                "r": self.r,
                "lora_alpha": self.lora_alpha,
                "target_modules": list(self.target_modules),
                "use_rslora": self.use_rslora,
                "fan_in_fan_out": self.fan_in_fan_out,
            }
        )

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any], where: str = "LoRA config") -> LoraSpec:
        """From our metadata object or peft's ``adapter_config.json`` (unsupported features are
        refused by name)."""
        if cfg.get("peft_type", "LORA") != "LORA":
            raise WeightLoadError(f"{where}: peft_type={cfg.get('peft_type')!r}; only LORA merges")
        for name in ("use_dora", "lora_bias"):
            if cfg.get(name):
                raise WeightLoadError(f"{where}: {name}=true is not supported; train without it")
        for name in ("rank_pattern", "alpha_pattern"):
            if cfg.get(name):
                raise WeightLoadError(
                    f"{where}: {name} is not supported (one rank and alpha for every module)"
                )
        targets = cfg.get("target_modules")
        if isinstance(targets, str):
            raise WeightLoadError(
                f"{where}: target_modules is the pattern {targets!r}; send the module names as a "
                "list (e.g. ['q_proj', 'v_proj'])"
            )
        try:
            return cls(
                r=cfg["r"],
                lora_alpha=cfg["lora_alpha"],
                target_modules=tuple(sorted(targets or ())),
                use_rslora=bool(cfg.get("use_rslora", False)),
                fan_in_fan_out=bool(cfg.get("fan_in_fan_out", False)),
            )
        except KeyError as e:
            raise WeightLoadError(f"{where}: missing {e.args[0]!r}") from e

    @classmethod
    def from_json(cls, raw: str, where: str = "LoRA metadata") -> LoraSpec:
        """Parse :meth:`to_json` output (or an ``adapter_config.json`` text)."""
        try:
            cfg = loads_limited(raw, what=where)
        except ValueError as e:
            raise WeightLoadError(f"{where} is not valid JSON: {e}") from e
        if not isinstance(cfg, dict):
            raise WeightLoadError(f"{where} is not a JSON object")
        return cls.from_dict(cfg, where)

    def adapter_config(self) -> dict[str, Any]:
        """peft's ``adapter_config.json`` for this spec (what vLLM's LoRA loader reads)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "lora_dropout": 0.0,
            "target_modules": list(self.target_modules),
            "use_rslora": self.use_rslora,
            "fan_in_fan_out": self.fan_in_fan_out,
            "bias": "none",
            "use_dora": False,
            "modules_to_save": None,
        }


@dataclass(frozen=True)
class LoraAdapter:
    """What the actor pushes for LoRA: peft's adapter tensors (CPU, contiguous) and their spec."""

    state: dict[str, torch.Tensor]
    """``base_model.model.<module>.lora_{A,B}.weight`` -> tensor (peft's saved naming)."""
    spec: LoraSpec

    @property
    def num_bytes(self) -> int:
        """Bytes of the adapter's tensors."""
        return sum(t.numel() * t.element_size() for t in self.state.values())

    @classmethod
    def from_peft(
        cls,
        model: Any,
        adapter_name: str = "default",
        state_dict: Mapping[str, torch.Tensor] | None = None,
    ) -> LoraAdapter:
        """The adapter of a peft ``PeftModel`` (``state_dict``: a gathered full state dict of it,
        e.g. from FSDP; default ``model.state_dict()``)."""
        from peft import get_peft_model_state_dict

        cfg = model.peft_config[adapter_name]
        state = get_peft_model_state_dict(
            model, state_dict=dict(state_dict) if state_dict else None, adapter_name=adapter_name
        )
        spec = LoraSpec.from_dict(
            {
                "peft_type": str(getattr(cfg.peft_type, "value", cfg.peft_type)),
                "r": cfg.r,
                "lora_alpha": cfg.lora_alpha,
                "target_modules": sorted(cfg.target_modules)
                if not isinstance(cfg.target_modules, str)
                else cfg.target_modules,
                "use_rslora": cfg.use_rslora,
                "fan_in_fan_out": cfg.fan_in_fan_out,
                "use_dora": cfg.use_dora,
                "rank_pattern": cfg.rank_pattern,
                "alpha_pattern": cfg.alpha_pattern,
            },
            where=f"peft adapter {adapter_name!r}",
        )
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        return cls(state=tensors, spec=spec)


@dataclass
class _Module:
    param: str
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None


def _group_keys(state: Mapping[str, torch.Tensor]) -> dict[str, _Module]:
    modules: dict[str, _Module] = {}
    for key, t in state.items():
        m = _KEY.match(key)
        if m is None:
            raise WeightLoadError(
                f"adapter tensor {key!r} is not a LoRA matrix; send peft's adapter state dict "
                "(keys 'base_model.model.<module>.lora_A.weight' / '.lora_B.weight'; LoRA on "
                "embeddings and LoRA biases are not supported)"
            )
        module = m["module"]
        entry = modules.setdefault(module, _Module(param=f"{module}.weight"))
        if m["ab"] == "A":
            entry.a = t
        else:
            entry.b = t
    return modules


def _check_module(
    name: str, entry: _Module, spec: LoraSpec, params: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    if entry.a is None or entry.b is None:
        missing = "lora_A" if entry.a is None else "lora_B"
        raise WeightLoadError(f"adapter module {name!r} has no {missing}.weight; send both")
    if name.rsplit(".", 1)[-1] not in spec.target_modules:
        raise WeightLoadError(
            f"adapter module {name!r} is not in target_modules={list(spec.target_modules)}"
        )
    weight = params.get(entry.param)
    if weight is None or weight.dim() != 2:
        raise WeightLoadError(
            f"adapter module {name!r}: the model has no 2-D weight {entry.param!r}; the adapter "
            "was trained on another architecture (or names modules differently)"
        )
    out_f, in_f = weight.shape[::-1] if spec.fan_in_fan_out else weight.shape
    want_a, want_b = (spec.r, in_f), (out_f, spec.r)
    if tuple(entry.a.shape) != want_a or tuple(entry.b.shape) != want_b:
        raise WeightLoadError(
            f"adapter module {name!r}: lora_A {tuple(entry.a.shape)} / lora_B "
            f"{tuple(entry.b.shape)} do not fit weight {tuple(weight.shape)} at r={spec.r}; "
            f"want {want_a} / {want_b}"
        )
    for ab, t in (("lora_A", entry.a), ("lora_B", entry.b)):
        if not t.is_floating_point():
            raise WeightLoadError(f"adapter tensor {name}.{ab} has dtype {t.dtype}; send floats")
        if not bool(torch.isfinite(t).all()):
            raise WeightLoadError(
                f"adapter tensor {name}.{ab} has non-finite values (NaN or inf); the update is "
                "refused (a diverged trainer? check the loss and grad_norm)"
            )
    return entry.a, entry.b


def check_adapter(
    state: Mapping[str, torch.Tensor], spec: LoraSpec, params: Mapping[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{weight name: (A, B)}`` for a valid adapter; :class:`WeightLoadError` otherwise.

    ``params`` is the model's ``state_dict()``. Weights that share storage with another
    parameter (a tied ``lm_head``) cannot be adapted alone and are refused."""
    if not state:
        raise WeightLoadError("the adapter has no tensors; send peft's adapter state dict")
    modules = _group_keys(state)
    storage: dict[int, int] = {}
    for t in params.values():
        storage[t.data_ptr()] = storage.get(t.data_ptr(), 0) + 1
    plan: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, entry in sorted(modules.items()):
        plan[entry.param] = _check_module(name, entry, spec, params)
        if storage.get(params[entry.param].data_ptr(), 0) > 1:
            raise WeightLoadError(
                f"adapter module {name!r}: {entry.param!r} is tied to another parameter; "
                "LoRA on a tied weight is not supported (leave it out of target_modules)"
            )
    return plan


@dataclass
class LoraMerger:
    """Merges adapters into a model's weights, keeping the base of every weight it changed."""

    params: Mapping[str, torch.Tensor]
    """The model's ``state_dict()`` (tensors shared with the model: merged in place)."""
    base: dict[str, torch.Tensor] = field(default_factory=dict)
    """A copy of the base value of every weight an adapter changed since the last full load."""
    spec: LoraSpec | None = None
    """The spec of the adapter merged now (None: the base weights are served)."""
    modules: int = 0
    """How many weights the current adapter changed."""

    def apply(self, plan: Mapping[str, tuple[torch.Tensor, torch.Tensor]], spec: LoraSpec) -> None:
        """Merge a checked adapter (:func:`check_adapter`); weights it leaves out get their base
        back. Runs where the weights may change (the engine's control operation)."""
        with torch.no_grad():
            for name in [n for n in self.base if n not in plan]:
                self.params[name].copy_(self.base.pop(name))
            for name, (a, b) in plan.items():
                weight = self.params[name]
                if name not in self.base:
                    self.base[name] = weight.detach().clone()
                delta = b.to(torch.float32) @ a.to(torch.float32)
                if spec.fan_in_fan_out:
                    delta = delta.T
                merged = self.base[name].to(torch.float32) + spec.scaling * delta.to(weight.device)
                weight.copy_(merged.to(weight.dtype))
        self.spec = spec
        self.modules = len(plan)

    def forget(self) -> None:
        """After a full-weight load: the loaded weights are the new base."""
        self.base.clear()
        self.spec = None
        self.modules = 0

    def info(self) -> dict[str, Any] | None:
        """``{"r", "lora_alpha", "modules"}`` of the merged adapter, or None."""
        if self.spec is None:
            return None
        return {"r": self.spec.r, "lora_alpha": self.spec.lora_alpha, "modules": self.modules}
