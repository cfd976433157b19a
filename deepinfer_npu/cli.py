"""The ``deepinfer-npu`` command: ``deepinfer-npu run ...`` (offline generation, as ``python -m
deepinfer_npu.run``) and ``deepinfer-npu serve ...`` (the OpenAI-compatible server, as ``python -m
deepinfer_npu.serve``)."""

from __future__ import annotations

import sys

COMMANDS = {"run": "generate completions from the command line", "serve": "start the OpenAI-compatible server"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        lines = "\n".join(f"  {name:<6} {text}" for name, text in COMMANDS.items())
        print(f"usage: deepinfer-npu {{run,serve}} [options]\n\ncommands:\n{lines}\n\n"
              "`deepinfer-npu COMMAND --help` lists a command's options.", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    if command == "run":
        from deepinfer_npu.run import main as run_main

        return run_main(rest)
    from deepinfer_npu.serve import main as serve_main

    return serve_main(rest)


if __name__ == "__main__":
    sys.exit(main())
