"""`python -m vlmctl.distributed.accelerate launch ARGS`: `accelerate launch` (the same arguments) as `vlmctl train`
runs it: it dies with vlmctl, and when ranks fail it exits with their code instead of printing the agent's
traceback (see `vlmctl.distributed.process.run_agent`)."""

from __future__ import annotations

import sys

# accelerate is imported inside the functions that use it: importing vlmctl (the CLI's start-up) must not pay for
# it.
# Light vlmctl modules are imported next to their use as well.


def main(argv: list[str] | None = None) -> None:
    from accelerate.commands.accelerate_cli import main as accelerate_main

    from vlmctl.distributed.process import run_agent

    sys.argv = ["accelerate", *(sys.argv[1:] if argv is None else argv)]
    run_agent(accelerate_main)


if __name__ == "__main__":
    main()
