"""The plain-text table the CLI reports share."""

from __future__ import annotations

from vllm_recoverssm.cli.text import table


def test_table_places_titles_by_their_column_spec_and_rules_the_header() -> None:
    lines = table([("mode", "<6"), ("rate", ">7.1%"), ("", ""), ("n", ">3")],
                  [("a", 0.5, "", 7), ("bb", 0.125, "", 12)])
    assert lines == [
        "mode      rate    n",
        "-" * 19,
        "a        50.0%    7",
        "bb       12.5%   12",
    ]
