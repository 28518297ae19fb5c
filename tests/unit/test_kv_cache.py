"""The KV cache argument's name across transformers versions (``agentrl.kv_cache``)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from agentrl.kv_cache import cache_kwargs, output_cache


class _New:
    def forward(self, input_ids=None, cache=None, **kwargs): ...


class _Old:
    def forward(self, input_ids=None, past_key_values=None, **kwargs): ...


class _Wrapper:  # a test double or a custom wrapper: only **kwargs
    def __call__(self, **kwargs): ...


class _Peft:  # peft: the base model's name counts
    def forward(self, *args, **kwargs): ...

    def get_base_model(self):
        return _Old()


def test_the_name_is_the_one_the_forward_declares() -> None:
    from transformers import LlamaForCausalLM

    declared = inspect.signature(LlamaForCausalLM.forward).parameters
    stock = "cache" if "cache" in declared else "past_key_values"
    assert cache_kwargs(_New(), 1) == {"cache": 1}
    assert cache_kwargs(_Old(), 2) == {"past_key_values": 2}
    assert cache_kwargs(_Peft(), 3) == {"past_key_values": 3}
    assert cache_kwargs(_Wrapper(), 4) == {stock: 4}


def test_an_outputs_cache_is_found_under_either_name() -> None:
    assert output_cache(SimpleNamespace(cache="new")) == "new"
    assert output_cache(SimpleNamespace(past_key_values="old")) == "old"
    assert output_cache(SimpleNamespace(cache=None, past_key_values="old")) == "old"
