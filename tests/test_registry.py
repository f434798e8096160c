from dataclasses import dataclass

import pytest

from fedcomp.registry import ConfigError, Registry


def make_registry():
    reg = Registry("widget")

    @reg.register("knob")
    class Knob:
        @dataclass(frozen=True)
        class Config:
            size: int = 3

            def __post_init__(self):
                if self.size < 0:
                    raise ValueError("size must be >= 0")

        def __init__(self, config):
            self.config = config

    @reg.register("plain")
    class Plain:
        pass

    return reg


def test_build_with_typed_config():
    reg = make_registry()
    knob = reg.build("knob", size=5)
    assert knob.config.size == 5 and knob.registry_name == "knob"
    assert reg.names() == ["knob", "plain"]


def test_unknown_name_lists_known():
    with pytest.raises(ConfigError, match="known: knob, plain"):
        make_registry().build("nope")


def test_unknown_option_is_rejected():
    with pytest.raises(ConfigError, match="unknown option"):
        make_registry().build("knob", sise=5)


def test_invalid_value_becomes_config_error():
    with pytest.raises(ConfigError, match="size must be"):
        make_registry().build("knob", size=-1)


def test_options_to_class_without_config():
    reg = make_registry()
    assert type(reg.build("plain")).__name__ == "Plain" and reg.get("plain") is type(reg.build("plain"))
    with pytest.raises(ConfigError, match="takes no options"):
        reg.build("plain", x=1)


def test_duplicate_registration():
    reg = make_registry()
    with pytest.raises(ConfigError, match="twice"):
        reg.register("knob")(type("Other", (), {}))


@pytest.mark.parametrize("compressor, options, words", [
    ("dgc+int8", {"density": True}, "density must be a number, got True"),
    ("topk", {"density": "AUTO"}, "density must be a number, got 'AUTO'"),
    ("int8", {"block": "x"}, "block must be an integer, got 'x'"),
    ("dgc+int8", {"density": 0.02, "momentum": 0.9}, "momentum: of memory 'dgc', this one's is 'residual'"),
])
def test_an_option_of_the_wrong_type_or_memory_is_a_config_error_naming_it(compressor, options, words):
    """A bool is no density (True used to mean 1.0) and a word is no number (it used to fail inside a comparison);
    an option of another memory says which."""
    from fedcomp.client.pipeline import build
    from fedcomp.spec import ModelSpec

    with pytest.raises(ConfigError) as info:
        build(compressor, ModelSpec((("w", (8,)),)), memory="residual", **options)
    assert words in str(info.value), info.value
    assert build("topk", ModelSpec((("w", (8,)),)), density=1).compressor is not None  # an int is a number


@pytest.mark.parametrize("value", [2**64, "18446744073709551616", 1.5, "1.5", float("inf"), float("nan"), 2**63])
def test_an_integer_option_must_be_a_whole_number_of_at_most_63_bits(value):
    """A seed of 2**64 from a server's options failed inside torch ("Overflow when unpacking long long", a bare
    ValueError), and 1.5 with a RuntimeError; both are the option's ConfigError now."""
    from fedcomp.client.pipeline import build
    from fedcomp.spec import ModelSpec

    with pytest.raises(ConfigError, match="seed must be a whole number of at most 63 bits"):
        build("topk+int8", ModelSpec((("w", (8,)),)), density=0.5, seed=value)


@pytest.mark.parametrize("value, whole", [(2**63 - 1, 2**63 - 1), ("9223372036854775807", 2**63 - 1), (1e3, 1000),
                                          ("1e3", 1000), ("-0", 0), (7, 7)])
def test_a_whole_number_in_any_spelling_reaches_the_config_as_an_int(value, whole):
    reg = Registry("knob")

    @reg.register("k")
    class Knob:
        @dataclass
        class Config:
            seed: int = 0

        def __init__(self, config):
            self.config = config

    seed = reg.build("k", seed=value).config.seed
    assert seed == whole and type(seed) is int
