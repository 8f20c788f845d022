"""Settings parsing: precedence, aliases, and errors that name the variable."""

from __future__ import annotations

import pytest

from pdpatch import config

NAMES = ["layout", "num_blocks", "read_guard"]


def read(**env: str) -> config.Settings:
    return config.read_settings(NAMES, env)


def test_master_switch_default_off_and_alias():
    assert config.master_enabled({}) == (False, "ENABLE_PDPATCH unset")
    assert config.master_enabled({"ENABLE_PDPATCH": "true"}) == (True, "ENABLE_PDPATCH")
    assert config.master_enabled({"PDPATCH_ENABLED": "1"}) == (True, "PDPATCH_ENABLED")
    assert config.master_enabled({"ENABLE_PDPATCH": "off"})[0] is False


@pytest.mark.parametrize("raw", ["maybe", "2", "enable", "tru"])
def test_invalid_master_value_names_variable_and_choices(raw):
    with pytest.raises(config.ConfigError) as err:
        config.master_enabled({"ENABLE_PDPATCH": raw})
    assert "ENABLE_PDPATCH" in str(err.value) and "true" in str(err.value)


def test_aliases_must_agree():
    with pytest.raises(config.ConfigError, match="disagree"):
        read(ENABLE_PDPATCH="1", PDPATCH_ENABLED="0")


def test_disable_list_and_star():
    assert read(PDPATCH_DISABLE="layout, num_blocks").disabled == {"layout", "num_blocks"}
    assert read(PDPATCH_DISABLE="*").disabled == set(NAMES)


def test_unknown_patch_in_disable_list_is_an_error():
    with pytest.raises(config.ConfigError, match=r"unknown patch.*lay_out"):
        read(PDPATCH_DISABLE="lay_out")


def test_unknown_pdpatch_variable_is_an_error_listing_accepted_names():
    with pytest.raises(config.ConfigError) as err:
        read(PDPATCH_NUMBLOCKS="1")
    assert "PDPATCH_NUMBLOCKS" in str(err.value) and "PDPATCH_NUM_BLOCKS" in str(err.value)


def test_per_patch_toggle_wins_over_disable_list():
    s = read(PDPATCH_DISABLE="*", PDPATCH_LAYOUT="1", PDPATCH_NUM_BLOCKS="0")
    assert s.patch_toggle("layout") == (True, "PDPATCH_LAYOUT=1")
    assert s.patch_toggle("num_blocks") == (False, "PDPATCH_NUM_BLOCKS=0")
    assert s.patch_toggle("read_guard") == (False, "listed in PDPATCH_DISABLE")
    assert read().patch_toggle("read_guard") == (True, "default")


def test_strict_untested_and_log_level():
    s = read(PDPATCH_STRICT="yes", PDPATCH_ALLOW_UNTESTED_VLLM="1", PDPATCH_LOG_LEVEL="debug")
    assert s.strict and s.allow_untested and s.log_level == "DEBUG"
    with pytest.raises(config.ConfigError, match="PDPATCH_LOG_LEVEL"):
        read(PDPATCH_LOG_LEVEL="loud")
    with pytest.raises(config.ConfigError, match="PDPATCH_STRICT"):
        read(PDPATCH_STRICT="sometimes")


def test_extra_config_section():
    assert config.extra_config_allows("layout", None)
    assert config.extra_config_allows("layout", {"other": 1})
    assert not config.extra_config_allows("layout", {"pdpatch": {"layout": False}})
    assert not config.extra_config_allows("layout", {"pdpatch": {"disable": ["layout"]}})
    assert not config.extra_config_allows("layout", {"pdpatch": {"disable": "*"}})
    assert config.extra_config_allows("layout", {"pdpatch": {"disable": ["num_blocks"]}})
    with pytest.raises(config.ConfigError, match="true or false"):
        config.extra_config_allows("layout", {"pdpatch": {"layout": "no"}})
    with pytest.raises(config.ConfigError, match="must be an object"):
        config.extra_config_allows("layout", {"pdpatch": ["layout"]})


def test_patch_options_and_harness_variables_are_not_typos():
    from lab.env import VARS  # the harness's own: another prefix, nothing to declare here

    s = read(PDPATCH_LAYOUT_FORCE="1", **dict.fromkeys(VARS, "/x"))
    assert s.overrides == {}


# a value of the right kind, and one outside each declared option's range or choices
BAD = {"switch": ["2", "maybe"], "choice": ["ignore"],
       "int": ["abc", "-1", "1.5", "99999999"]}


@pytest.mark.parametrize("option", config.PATCH_OPTIONS, ids=lambda s: s.var)
def test_every_option_is_validated_when_settings_are_read(option):
    """The declaration is the check: its default parses, and a bad value stops
    ``read_settings`` (startup, ``pdpatch doctor``) naming the variable and the valid values."""
    from pdpatch.patches import patch_names, read_settings

    assert option.patch in patch_names()
    assert option.read({}) == option.parse(option.default)
    read_settings({option.var: option.default})
    for raw in BAD[option.kind]:
        with pytest.raises(config.ConfigError) as err:
            read_settings({option.var: raw})
        assert f"{option.var}={raw!r} is not a valid value; accepted: {option.accepted()}" \
            in str(err.value)


def test_size_options_units_ranges_and_auto():
    assert config.KV_STAGING_MIB.read({}) == 128
    assert config.KV_STAGING_MIB.read({"PDPATCH_KV_STAGING_MIB": " 0 "}) == 0
    assert config.KV_GAP_KIB.read({}) is None
    assert config.KV_GAP_KIB.read({"PDPATCH_KV_GAP_KIB": " Auto "}) is None
    with pytest.raises(config.ConfigError, match=r"accepted: 0-65536 MiB \(default 128\)"):
        config.KV_STAGING_MIB.read({"PDPATCH_KV_STAGING_MIB": "auto"})
