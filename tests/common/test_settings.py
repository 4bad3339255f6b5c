"""``common.settings``: a config key's bounds, choices and description declared once, checked from there."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.settings import accepted, check_settings, doc_of, setting


@dataclass
class Section:
    count: int = setting(1, doc="how many", ge=1)
    share: float = setting(0.5, doc="a fraction", gt=0, le=1)
    mode: str = setting("a", doc="which one", choices=("a", "b"))
    free: str = setting("", doc="anything")
    items: list[int] = setting(factory=list, doc="a list")

    def __post_init__(self):
        check_settings(self, "sec")


def test_defaults_and_factory():
    s = Section()
    assert (s.count, s.share, s.mode, s.items) == (1, 0.5, "a", [])
    assert Section().items is not s.items


@pytest.mark.parametrize("kwargs, message", [
    ({"count": 0}, "sec.count must be >= 1, got 0 [sec.count: how many]"),
    ({"count": 1.5}, "sec.count must be an integer >= 1, got 1.5"),
    ({"count": True}, "sec.count must be an integer >= 1, got True"),
    ({"share": 0.0}, "sec.share must be in (0, 1], got 0.0 [sec.share: a fraction]"),
    ({"share": float("nan")}, "sec.share must be a finite number in (0, 1], got nan"),
    ({"share": "x"}, "sec.share must be a finite number in (0, 1], got 'x'"),
    ({"mode": "c"}, "sec.mode='c' is not one of ['a', 'b'] [sec.mode: which one]"),
])
def test_a_value_outside_the_declared_bounds_or_choices_names_key_value_and_what_is_accepted(kwargs, message):
    with pytest.raises(ValueError) as refused:
        Section(**kwargs)
    assert message in str(refused.value)


def test_accepted_in_words():
    from dataclasses import fields

    by_name = {f.name: f for f in fields(Section)}
    assert [accepted(by_name[k]) for k in ("count", "share", "mode", "free")] == [
        ">= 1", "in (0, 1]", "one of ['a', 'b']", ""]
    assert doc_of(by_name["free"]) == "anything"


def test_a_setting_needs_a_one_line_doc():
    with pytest.raises(ValueError, match="one-line doc"):
        setting(1, doc="")
    with pytest.raises(ValueError, match="one-line doc"):
        setting(1, doc="two\nlines")
