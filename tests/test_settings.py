"""The settings object: every choice checked once, at start-up."""

from __future__ import annotations

import dataclasses

import pytest

from tokenpipe.errors import ConfigError
from tokenpipe.settings import Settings

CHOICES = [f.name for f in dataclasses.fields(Settings) if Settings.choices(f.name)]


def test_the_choice_settings_include_engine_process_and_cuda_graphs() -> None:
    assert {"dtype", "quant", "kernels", "engine_process", "cuda_graphs"} <= set(CHOICES)


@pytest.mark.parametrize("name", CHOICES)
def test_engine_process_and_cuda_graphs_were_not_checked_at_start_like_every_other_choice(name: str) -> None:
    # Settings resolved only three of its Literal aliases by name, so a bad TOKENPIPE_ENGINE_PROCESS
    # or TOKENPIPE_CUDA_GRAPHS got through the start-up check and failed later, in the generator.
    variable = f"TOKENPIPE_{name.upper()}"
    with pytest.raises(ConfigError, match=f"{variable}='bogus': use one of") as err:
        Settings.load(env={variable: "bogus"})
    assert err.value.param == name
    for choice in Settings.choices(name):
        assert getattr(Settings.load(env={variable: choice}), name) == choice
