"""Runs ``ditrun``'s command-line entry point once per argument list, all in one interpreter, so a
table of mistakes costs one start-up (torch, Hydra) instead of one per case.

    python tests/cli_batch.py CASES.json   ->  one JSON line per case: {"args", "exit", "stdout", "stderr"}

Each case runs ``ditrun.__main__.main`` exactly as the ``ditrun`` command does, with ``sys.argv``
set to its arguments; what it prints and how it exits are captured.
"""

import contextlib
import io
import json
import sys

from ditrun.__main__ import main


def run_case(args: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    sys.argv = ["ditrun", *args]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:  # a traceback: reported as exit 1 with the traceback text
            import traceback

            traceback.print_exc(file=err)
            code = 1
    return {"args": args, "exit": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    cases = json.loads(open(sys.argv[1]).read())
    for case in cases:
        print(json.dumps(run_case(case)), flush=True)
