"""A stand-in for sglang's interpreter where sglang cannot run (it serves on GPUs only).

``python sglang_standin.py -m sglang.launch_server ARGS`` serves the emulator (``polymorph emulate``,
the project's stand-in for GPU timing) with the engine configuration that sglang's own flags name
(``EngineConfig.from_sglang_args``), on the ``--host`` and ``--port`` given, for the catalog model
``$STANDIN_MODEL`` on ``$STANDIN_GPU``. It appends its arguments and ``CUDA_VISIBLE_DEVICES`` to
``$STANDIN_RECORD`` (one JSON line a start), so a test sees what the real sglang would have been given.
Where Polymorph's code depends on sglang (a process that serves /health and the OpenAI API on that port
and stops on SIGTERM) the emulator behaves like it. Anything else runs in this interpreter, where sglang
is not installed (a version query then finds none)."""

from __future__ import annotations

import json
import os
import sys

from kernels.config import EngineConfig


def main(argv: list[str]) -> None:
    if argv[:2] != ["-m", "sglang.launch_server"]:
        os.execv(sys.executable, [sys.executable, *argv])
    args = argv[2:]
    with open(os.environ["STANDIN_RECORD"], "a") as record:
        record.write(json.dumps({"argv": args, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\n")
    config = EngineConfig.from_sglang_args(args)
    emulate = ["emulate", "--model", os.environ["STANDIN_MODEL"], "--gpu", os.environ["STANDIN_GPU"], "--speed", "1",
               "--config", json.dumps(config.to_dict()), "--host", args[args.index("--host") + 1], "--port", args[args.index("--port") + 1]]
    os.execv(sys.executable, [sys.executable, "-m", "gateway.cli", *emulate])


if __name__ == "__main__":
    main(sys.argv[1:])
