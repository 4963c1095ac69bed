"""The rules every DDTREE_* variable is read by (ddtree/base/knobs.py)."""
from pathlib import Path

import pytest

from ddtree.base.config import ConfigError
from ddtree.base.knobs import env_choice, env_flag, env_path


@pytest.mark.parametrize("value, expected", [("1", True), ("TRUE", True), ("yes", True), ("On", True),
                                             ("0", False), ("false", False), ("NO", False), ("off", False),
                                             ("", True), ("  ", True)])
def test_flags_take_every_boolean_spelling_and_empty_is_unset(monkeypatch, value, expected):
    monkeypatch.setenv("DDTREE_TEST_FLAG", value)
    assert env_flag("DDTREE_TEST_FLAG", True) is expected


def test_an_unknown_flag_or_choice_is_refused_with_the_valid_values(monkeypatch):
    monkeypatch.setenv("DDTREE_TEST_FLAG", "nope")
    with pytest.raises(ConfigError, match=r"DDTREE_TEST_FLAG='nope' is not a boolean: use one of 1, true, yes, on"):
        env_flag("DDTREE_TEST_FLAG", True)
    monkeypatch.setenv("DDTREE_TEST_CHOICE", "bogus")
    with pytest.raises(ConfigError, match=r"DDTREE_TEST_CHOICE='bogus' is not valid: use one of a, b \(or unset"):
        env_choice("DDTREE_TEST_CHOICE", ("a", "b"))
    monkeypatch.setenv("DDTREE_TEST_CHOICE", "B")
    assert env_choice("DDTREE_TEST_CHOICE", ("a", "b")) == "b"
    monkeypatch.setenv("DDTREE_TEST_CHOICE", "")
    assert env_choice("DDTREE_TEST_CHOICE", ("a", "b"), "a") == "a"


def test_paths_expand_the_home_folder_and_empty_is_unset(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDTREE_TEST_PATH", "~/x")
    assert env_path("DDTREE_TEST_PATH", Path("/default")) == tmp_path / "x"
    monkeypatch.setenv("DDTREE_TEST_PATH", "")
    assert env_path("DDTREE_TEST_PATH", Path("/default")) == Path("/default")
    monkeypatch.setenv("DDTREE_TEST_PATH", "rel")
    assert env_path("DDTREE_TEST_PATH", Path("/default")) == tmp_path / "rel"
