"""Fixtures of the compiler tests: a stand-in sglang package for the parser gate."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernels.compiler.gates import ParserGate

# A STAND-IN, not sglang: sglang/srt/server_args.py imports sglang.srt.utils.common, which imports
# torch at module level, so the real parser cannot run without a CUDA-sized environment. This module
# implements the same contract the gate relies on (ServerArgs.add_cli_args(parser) and
# ServerArgs.from_cli_args(namespace), raising on invalid combinations) for the flags Polymorph renders.
_SERVER_ARGS = textwrap.dedent('''
    import dataclasses

    @dataclasses.dataclass
    class ServerArgs:
        model_path: str = ""
        tp_size: int = 1
        dp_size: int = 1
        max_running_requests: int = None
        chunked_prefill_size: int = None
        max_prefill_tokens: int = 16384
        schedule_policy: str = "fcfs"
        kv_cache_dtype: str = "auto"
        cuda_graph_max_bs: int = None
        page_size: int = 1
        mem_fraction_static: float = None
        disable_radix_cache: bool = False
        speculative_algorithm: str = None
        speculative_num_steps: int = None
        speculative_num_draft_tokens: int = None

        def __post_init__(self):
            if self.mem_fraction_static is not None and self.mem_fraction_static > 0.92:
                raise ValueError("mem_fraction_static above 0.92 (stand-in rule)")

        @staticmethod
        def add_cli_args(parser):
            parser.add_argument("--model-path", required=True)
            for name in ("tp-size", "dp-size", "max-running-requests", "chunked-prefill-size", "max-prefill-tokens",
                         "cuda-graph-max-bs", "page-size", "speculative-num-steps", "speculative-num-draft-tokens"):
                parser.add_argument("--" + name, type=int)
            parser.add_argument("--schedule-policy", choices=["fcfs", "lpm", "random", "dfs-weight", "lof", "priority"])
            parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3", "fp8_e5m2", "bf16"])
            parser.add_argument("--mem-fraction-static", type=float)
            parser.add_argument("--speculative-algorithm", choices=["EAGLE", "EAGLE3", "NGRAM", "STANDALONE"])
            parser.add_argument("--disable-radix-cache", action="store_true")

        @classmethod
        def from_cli_args(cls, args):
            print("stand-in: building ServerArgs")  # sglang logs to stdout too; the gate's answers must survive it
            names = [f.name for f in dataclasses.fields(cls)]
            return cls(**{n: getattr(args, n) for n in names if getattr(args, n, None) is not None})
''')


@pytest.fixture
def standin_sglang(tmp_path: Path) -> Iterator[ParserGate]:
    package = tmp_path / "standin" / "sglang" / "srt"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "server_args.py").write_text(_SERVER_ARGS)
    with ParserGate(python=sys.executable, env={"PYTHONPATH": str(tmp_path / "standin")}) as gate:
        yield gate
