"""A Python 3.11 venv from third_party/requirements.lock as Bazel's Python toolchain.

rules_python cannot be fetched offline (and its source is not copied in), so the
build uses Bazel's native py_* rules with this repository rule as the toolchain:

  * PEGAFLOW_VENV=/abs/venv set (make and CI set it to the repo's .venv): that
    venv is used as is. It must carry the stamp that ci/venv.sh writes after
    installing the lock (.pegaflow-lock.sha256); a venv built from another lock
    is refused, so Bazel never tests against the wrong dependencies.
  * PEGAFLOW_VENV unset: a venv is built inside this external repository with
    `pip install --no-deps --require-hashes -r requirements.lock`, exactly as
    ci/venv.sh does (needs the package index once; later builds are offline).

The generated repository exposes:
  :toolchain        registered in WORKSPACE for @bazel_tools//tools/python:toolchain_type
  :python           the interpreter as an executable label, for genrules
  :lock_stamp       sha256 of the lock; every target of the package depends on it,
                    so a new lock re-runs every test even though the interpreter
                    path is unchanged (a platform runtime has no file inputs).
"""

_STAMP = ".pegaflow-lock.sha256"

_BUILD = """\
load("@bazel_tools//tools/python:toolchain.bzl", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{interpreter}",
    python_version = "PY3",
    # Bazel 4.2.3's default is "#!/usr/bin/env python": Debian has no `python`,
    # and --incompatible_strict_action_env strips PATH anyway.
    stub_shebang = "#!{interpreter}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)

filegroup(
    name = "lock_stamp",
    srcs = ["lock.sha256"],
)

sh_binary(
    name = "python",
    srcs = ["python.sh"],
    data = [":lock_stamp"],
)
"""

def _sha256(rctx, path):
    result = rctx.execute(["sha256sum", str(path)])
    if result.return_code != 0:
        fail("sha256sum %s failed: %s" % (path, result.stderr))
    return result.stdout.split(" ")[0]

def _build_venv(rctx, venv, lock, lock_sha):
    python = rctx.os.environ.get("PEGAFLOW_PYTHON", "") or rctx.attr.python
    python_path = rctx.which(python) if "/" not in python else rctx.path(python)
    if not python_path or not python_path.exists:
        fail("python_venv: no %s interpreter found (set PEGAFLOW_PYTHON)" % python)
    steps = [
        ("creating venv", [str(python_path), "-m", "venv", str(venv)]),
        ("installing the lock", [
            str(venv) + "/bin/python",
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--require-hashes",
            "-r",
            str(lock),
        ]),
    ]
    for what, cmd in steps:
        rctx.report_progress(what)
        result = rctx.execute(cmd, timeout = rctx.attr.timeout, quiet = False)
        if result.return_code != 0:
            fail("python_venv: %s failed (%d):\n%s" % (what, result.return_code, result.stderr))
    rctx.file(str(venv) + "/" + _STAMP, lock_sha + "\n")

def _python_venv_impl(rctx):
    lock = rctx.path(rctx.attr.lock)  # a label: Bazel re-runs this rule when the lock changes
    lock_sha = _sha256(rctx, lock)
    existing = rctx.os.environ.get("PEGAFLOW_VENV", "")
    if existing:
        venv = rctx.path(existing)
        if not venv.get_child("bin").get_child("python").exists:
            fail("PEGAFLOW_VENV=%s has no bin/python" % existing)
        stamp = venv.get_child(_STAMP)
        found = rctx.read(stamp).strip() if stamp.exists else "(no stamp)"
        if found != lock_sha:
            fail(("PEGAFLOW_VENV=%s was not built from the current lock (stamp %s, lock %s): " +
                  "run `make venv`, or unset PEGAFLOW_VENV to let Bazel build its own") %
                 (existing, found, lock_sha))
    else:
        venv = rctx.path("venv")
        _build_venv(rctx, venv, lock, lock_sha)

    interpreter = str(venv) + "/bin/python"
    rctx.file("lock.sha256", lock_sha + "\n")
    rctx.file("python.sh", "#!/bin/sh\nexec %s \"$@\"\n" % interpreter, executable = True)
    rctx.file("BUILD.bazel", _BUILD.format(interpreter = interpreter))
    rctx.file("WORKSPACE", "workspace(name = \"%s\")\n" % rctx.name)

python_venv = repository_rule(
    implementation = _python_venv_impl,
    attrs = {
        "lock": attr.label(allow_single_file = True, mandatory = True),
        "python": attr.string(default = "python3.11", doc = "interpreter used to create the venv"),
        "timeout": attr.int(default = 3600, doc = "seconds for each of venv creation and pip install"),
    },
    environ = ["PEGAFLOW_VENV", "PEGAFLOW_PYTHON"],
)
