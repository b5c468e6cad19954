"""The ``atom`` command, shaped like vLLM's ``vllm``:

atom serve [MODEL] [options]     the OpenAI-compatible server (``atom serve --help``)
"""

from __future__ import annotations

import sys

USAGE = "usage: atom serve [MODEL] [options]   (atom serve --help for the options)"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        from atom.entrypoints.openai_server import main as serve_main

        serve_main(argv[1:])
    elif argv and argv[0] in ("-h", "--help"):
        print(USAGE)
    else:
        sys.exit(f"{USAGE}\natom: error: unknown command {argv[0]!r}" if argv else USAGE)


if __name__ == "__main__":
    main()
