from __future__ import annotations

import pytest

from corral.errors import TraceError
from corral.sim.trace import parse_trace

MODELS = ("a", "b")


def problems(*lines: str) -> list[str]:
    with pytest.raises(TraceError) as exc:
        parse_trace(lines, MODELS, "t.jsonl")
    return [str(p) for p in exc.value.problems]


def test_open_and_closed_loop_lines() -> None:
    tr = parse_trace(
        [
            '{"t": 1.5, "model": "a", "service_s": 2, "priority": 1}',
            "",
            '{"session": "s", "model": "b", "service_s": 1, "t": 3}',
            '{"session": "s", "think_s": 0.5, "model": "a", "service_s": 1}',
        ],
        MODELS,
    )
    assert [x.line for x in tr.lines] == [1, 3, 4]
    assert tr.lines[0].t == 1.5
    assert tr.lines[0].priority == 1
    assert tr.lines[1].session == "s"
    assert tr.lines[1].t == 3
    assert tr.lines[2].think_s == 0.5
    assert not tr.open_loop


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ('{"t": 1, "model": "a"}', "missing key 'service_s'"),
        ('{"t": 1, "service_s": 1}', "missing key 'model'"),
        ('{"model": "a", "service_s": 1}', "missing key 't'"),
        ('{"t": 1, "model": "zz", "service_s": 1}', "unknown model 'zz' (the config has: a, b)"),
        ('{"t": -1, "model": "a", "service_s": 1}', "t must be >= 0"),
        ('{"t": 1, "model": "a", "service_s": 0}', "service_s must be > 0"),
        ('{"t": 1, "model": "a", "service_s": "1"}', "service_s must be a finite number"),
        ('{"t": 1, "model": "a", "service_s": 1, "prio": 2}', "unknown key 'prio' (allowed: t,"),
        ('{"t": 1, "model": "a", "service_s": 1, "priority": 1.5}', "priority must be an integer"),
        ('{"t": 1, "model": "a", "service_s": 1, "priority": 400}', "from -100 to 100; got 400"),
        ('{"t": 1, "model": "a", "service_s": 1, "class": "bulk"}', "class must be 'interactive'"),
        ('{"t": 1, "model": "a", "service_s": 1, "think_s": 1}', "think_s needs a 'session'"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_lines_name_the_line(line: str, fragment: str) -> None:
    ps = problems('{"t": 0, "model": "a", "service_s": 1}', line)
    assert any(p.startswith("t.jsonl:2: ") and fragment in p for p in ps), ps


def test_t_only_on_a_sessions_first_line() -> None:
    ps = problems(
        '{"session": "s", "model": "a", "service_s": 1}',
        '{"session": "s", "t": 5, "model": "a", "service_s": 1}',
    )
    assert any("t.jsonl:2: t is allowed only on session 's'" in p for p in ps)


def test_empty_trace() -> None:
    assert "no requests" in problems("", "  ")[0]


def test_stops_after_twenty_problems() -> None:
    ps = problems(*["{}"] * 50)
    assert ps[-1].endswith("stopped after 20 problems")
