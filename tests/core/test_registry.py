"""core.choices.Registry: the functions behind one of the config's choices, by name. The names it holds must equal
the config's Literal both ways (checked where the built-ins are registered); lookups of a name it lacks are refused
naming the flag."""

from __future__ import annotations

from typing import Literal

import pytest

from verifiers_rl.core.choices import Registry

Colour = Literal["red", "blue"]


def test_check_builtins_names_a_choice_without_function_and_a_function_without_choice():
    registry = Registry("colour", Colour)
    registry.register("red")(lambda: 1)
    with pytest.raises(RuntimeError, match=r"no function for \['blue'\], not a choice: \[\]"):
        registry.check_builtins()
    registry.register("blue")(lambda: 2)
    registry.check_builtins()
    registry.register("green")(lambda: 3)
    with pytest.raises(RuntimeError, match=r"no function for \[\], not a choice: \['green'\]"):
        registry.check_builtins()


def test_lookups_registration_and_removal():
    registry = Registry("colour", Colour)

    @registry.register("blue", shade="dark")
    @registry.register("red", shade="warm")
    def paint():
        return "paint"

    assert registry.get("red").function is paint and registry.get("red").options == {"shade": "warm"}
    assert registry.names == ("red", "blue") and "blue" in registry
    registry.register("green")(lambda: 3)
    assert registry.names == ("red", "blue", "green")  # the config's choices first, in their order
    with pytest.raises(ValueError, match="Unknown colour 'pink'; expected one of red, blue, green"):
        registry.get("pink")
    with pytest.raises(ValueError, match="colour 'red' is already registered"):
        registry.register("red")(lambda: 4)
    with pytest.raises(ValueError, match="colour 'red' is built in"):
        registry.unregister("red")
    registry.unregister("green")
    assert "green" not in registry and registry.names == ("red", "blue")
