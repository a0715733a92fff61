"""The main of every Bazel test in the repo (see //tools:pytest.bzl).

usage (Bazel passes the arguments):
  test_main.py --pytest FILE [pytest args...]   one pytest file (path relative to the repo root)
  test_main.py --module MODULE [args...]        a module run as a script (python -m MODULE args...)

Before the test starts:
  * `pegaflow.<part>` becomes the only way to import the repo's code, as under
    pip (see import_like_pip);
  * the test gets a private temporary folder with a short path under /tmp, as
    TMPDIR and TEST_TMPDIR, removed afterwards. Bazel's own TEST_TMPDIR is over
    110 characters long, and a Unix socket path (fd passing, vLLM's ZMQ
    sockets) must fit in 107;
  * Bazel passes no HOME: one inside that folder keeps the caches that vLLM,
    torch and Hugging Face write under ~ out of /root.

The repo root in runfiles is this file's grandparent folder (<runfiles>/pegaflow),
which holds pyproject.toml, so pytest reads the same configuration as
`make pytest`.
"""

import os
import pathlib
import runpy
import shutil
import sys
import tempfile

USAGE = "usage: test_main.py --pytest FILE [args...] | --module MODULE [args...]"


def import_like_pip(root: pathlib.Path) -> None:
    """Drops the repo root and this script's folder from sys.path and PYTHONPATH.

    Python puts the (resolved) folder of the main script first on sys.path, and
    Bazel's stub adds the repo root itself, so `server`, `proto`, ... would be
    top-level names. Both go, also from the PYTHONPATH that child processes
    (servers, vLLM engines) inherit; the runfiles root, which holds `pegaflow/`,
    stays.
    """
    drop = {os.path.dirname(os.path.realpath(__file__)), os.path.realpath(root)}
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") not in drop]
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in entries if p and os.path.realpath(p) not in drop)


def private_tmp() -> pathlib.Path:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="pgf-test-", dir="/tmp"))
    os.environ["TMPDIR"] = os.environ["TEST_TMPDIR"] = str(tmp)
    tempfile.tempdir = str(tmp)
    if "HOME" not in os.environ:
        (tmp / "home").mkdir()
        os.environ["HOME"] = str(tmp / "home")
    return tmp


class WholeFileSkipPasses:
    """pytest plugin: a file skipped as a whole (pytest.importorskip of a GPU
    library on a CPU machine) is a pass, not pytest's "no tests collected" (5),
    which Bazel would report as a failure. A file with no tests at all still fails."""

    def pytest_sessionfinish(self, session, exitstatus):
        import pytest

        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        skipped = reporter is not None and bool(reporter.stats.get("skipped"))
        if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and skipped:
            session.exitstatus = pytest.ExitCode.OK


def run_pytest(root: pathlib.Path, test_file: str, extra: list[str], tmp: pathlib.Path) -> int:
    import pytest

    args = [str(root / test_file), "-c", str(root / "pyproject.toml"), "--rootdir", str(root)]
    args += ["--basetemp", str(tmp / "pytest")]
    # Bazel asks for a JUnit report (per-test-case results in test.xml) and
    # passes --test_filter as TESTBRIDGE_TEST_ONLY.
    if os.environ.get("XML_OUTPUT_FILE"):
        args += ["--junitxml", os.environ["XML_OUTPUT_FILE"]]
    if os.environ.get("TESTBRIDGE_TEST_ONLY"):
        args += ["-k", os.environ["TESTBRIDGE_TEST_ONLY"]]
    return int(pytest.main(args + extra, plugins=[WholeFileSkipPasses()]))


def run_module(module: str, extra: list[str]) -> int:
    sys.argv = [module, *extra]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        code = exit_.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] not in ("--pytest", "--module"):
        print(USAGE, file=sys.stderr)
        return 2
    # Not resolved: the runfiles tree is symlinks into the source tree.
    root = pathlib.Path(os.path.abspath(__file__)).parents[2]
    import_like_pip(root)
    tmp = private_tmp()
    try:
        if argv[1] == "--pytest":
            return run_pytest(root, argv[2], argv[3:], tmp)
        return run_module(argv[2], argv[3:])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
