"""Progress bars off a terminal: whole lines, not carriage-return redraws, so logs stay readable."""

from __future__ import annotations

from moaspec.progress import progress_bar


def test_off_a_terminal_a_bar_writes_whole_lines_at_most_once_per_interval(capsys) -> None:  # type: ignore[no-untyped-def]
    bar = progress_bar(total=1000, desc="work", unit="step")
    for i in range(1000):
        bar.update()
        bar.set_postfix(loss=f"{i}", refresh=False)
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    # the first line on starting, the last on closing; a thousand quick updates add none between them
    assert len(lines) <= 3 and lines[0].startswith("work: 0/1000") and lines[-1].startswith("work: 1000/1000 (100%)")
    assert "loss=999" in lines[-1]


def test_a_disabled_bar_writes_nothing(capsys) -> None:  # type: ignore[no-untyped-def]
    bar = progress_bar(total=3, disable=True)
    bar.update(3)
    bar.close()
    assert capsys.readouterr().err == ""
