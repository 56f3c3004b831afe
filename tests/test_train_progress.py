"""The train step's progress display: a bar redrawn in place on a terminal, sparse lines in a log."""

from __future__ import annotations

import io

from trainer.progress import StepProgress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_on_a_terminal_is_redrawn_in_place_and_ends_with_a_newline():
    out = Terminal()
    bar = StepProgress(out, width=10)
    for done in range(1, 5):
        bar("train", done, 4)
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n")
    assert "[##########] 4/4 batches" in text and "[#####-----] 2/4 batches" in text


def test_log_output_is_quiet_for_quick_steps_and_periodic_for_long_ones():
    quick = io.StringIO()
    progress = StepProgress(quick, log_every=3600)
    for done in range(1, 101):
        progress("train", done, 100)
    assert quick.getvalue() == ""
    slow = io.StringIO()
    progress = StepProgress(slow, log_every=0.0)
    for done in range(1, 4):
        progress("values", done, 3)
    assert slow.getvalue().splitlines() == [f"  values: {d}/3 batches, 0s" for d in (1, 2, 3)]
