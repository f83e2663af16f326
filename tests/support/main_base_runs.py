"""SkyRL's launcher ``main_base`` run for several command lines in one interpreter: each case is
what ``python -m skyrl.train.entrypoints.main_base ARGS`` gives (exit status, stdout, stderr),
without an interpreter start and the imports of torch, megatron-core and SkyRL per case (seconds
each on a 2-core machine). For commands that end before Ray starts (the dry run, refusals of the
command line); tests/test_skyrl.py still starts ``main_base`` as its own process once.

``run(cases)`` is called from the tests; this file, run as a script, runs the cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path


def run(cases: dict[str, tuple[list[str], dict]], drop_env: tuple[str, ...] = ()) -> dict:
    """name -> ``CompletedProcess`` of ``main_base`` with (args, environment additions); the
    variables in ``drop_env`` are removed from every case's environment."""
    with tempfile.TemporaryDirectory(prefix="main_base_runs_") as tmp:
        spec, results = Path(tmp, "cases.json"), Path(tmp, "results.json")
        spec.write_text(json.dumps(cases))
        env = {k: v for k, v in os.environ.items() if k not in drop_env}
        done = subprocess.run([sys.executable, __file__, str(spec), str(results)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and results.exists(), done.stdout[-3000:] + done.stderr[-3000:]
        return {name: subprocess.CompletedProcess(cases[name][0], *result)
                for name, result in json.loads(results.read_text()).items()}


def _status(code) -> int:
    """The exit status an interpreter gives ``SystemExit(code)``; a message goes to stderr."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _case(args: list[str], env: dict) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``main_base`` with ``args``, as the process would end."""
    from skyrl.train.entrypoints import main_base

    saved_env, saved_argv = dict(os.environ), sys.argv
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved_fds = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)  # the file descriptors: loggers hold sys.stderr itself
        os.dup2(err.fileno(), 2)
        try:
            os.environ.update(env)
            sys.argv = [main_base.__file__, *args]
            try:
                main_base.main()
                status = 0
            except SystemExit as exit:
                status = _status(exit.code)
            except BaseException:
                traceback.print_exc()
                status = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            sys.argv = saved_argv
            os.environ.clear()
            os.environ.update(saved_env)
        out.seek(0)
        err.seek(0)
        return status, out.read(), err.read()


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as ``python -m`` has it, not this file's folder
    cases = json.loads(Path(sys.argv[1]).read_text())
    results = {name: _case(args, env) for name, (args, env) in cases.items()}
    Path(sys.argv[2]).write_text(json.dumps(results))
