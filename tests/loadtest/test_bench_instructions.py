"""`polymorph bench instructions`: the parts that decide what is counted (the run itself needs valgrind and minutes)."""

from __future__ import annotations

import json
from pathlib import Path

from classifiers.tokens import count_chat_tokens
from loadtest.bench.instructions import read_instructions, request_body


def test_the_mix_reaches_both_pools_and_streams_a_quarter() -> None:
    bodies = [json.loads(request_body(i)[0]) for i in range(8)]
    prompt_tokens = [count_chat_tokens(b["messages"]) for b in bodies]
    assert sum(t >= 4096 for t in prompt_tokens) == 2  # long-context: the second pool
    assert sum(t < 4096 for t in prompt_tokens) == 6
    assert [b["stream"] for b in bodies].count(True) == 2
    assert request_body(5) == request_body(5)  # every tree and round sends the same bytes


def test_read_instructions_takes_the_totals_line_not_a_wrapped_summary(tmp_path: Path) -> None:
    dump = tmp_path / "callgrind.out.1"
    dump.write_text("# callgrind format\nversion: 1\nevents: Ir\nsummary: 18446744073435145848\nfn=(1) main\n0 12\ntotals: 1234567\n")
    assert read_instructions(dump) == 1234567
