"""Tests under Bazel: one py_test per pytest file, found by glob, and modules run as tests.

Each folder's BUILD.bazel calls `pytest_tests()` once; adding a test file needs
no BUILD edit. Files named `test_e2e_*.py` (real vLLM, many processes) run one
at a time (tag "exclusive") with a long timeout, except those a BUILD lists in
`shares_machine` (server-only end-to-end files: a few processes, no vLLM), which
keep the long timeout and run beside one other test, as ordinary files do. Every test runs through
tools/python/test_main.py, which gives it pip's import semantics, a short
private TMPDIR/TEST_TMPDIR and a HOME of its own.
"""

_MAIN = "//tools/python:test_main.py"

# Bazel's per-file timeouts are ceilings only: pytest-timeout (pyproject.toml)
# stops a hung test much earlier and names it.
_TIMEOUT = "long"  # 900 s
_HEAVY_TIMEOUT = "eternal"  # 3600 s

def _target_name(src):
    # "tests/test_engine.py" -> "test_engine"; "pool/tests/test_region.py" -> "pool_test_region"
    parts = src[:-len(".py")].split("/")
    return "_".join([p for p in parts if p != "tests"])

def pytest_test(name, src, deps = [], data = [], tags = [], timeout = None, args = [], alone = None, **kwargs):
    """One pytest file as a py_test. alone: tag "exclusive" (None: for test_e2e_* files)."""
    heavy = src.split("/")[-1].startswith("test_e2e_")
    if alone == None:
        alone = heavy
    native.py_test(
        name = name,
        srcs = [src, _MAIN],
        main = _MAIN,
        args = ["--pytest", "$(location %s)" % src] + args,
        data = data + ["//:pyproject.toml"],
        deps = deps + ["//:pegaflow"],
        python_version = "PY3",
        srcs_version = "PY3",
        tags = tags + (["exclusive"] if alone else []),
        timeout = timeout or (_HEAVY_TIMEOUT if heavy else _TIMEOUT),
        **kwargs
    )

def py_module_test(name, module, heavy = False, deps = [], tags = [], timeout = None, args = [], **kwargs):
    """`python -m <module> args...` as a py_test: it passes when the module exits 0.

    heavy: runs alone (tag "exclusive") with the long timeout, like test_e2e_* files.
    """
    native.py_test(
        name = name,
        srcs = [_MAIN],
        main = _MAIN,
        args = ["--module", module] + args,
        deps = deps + ["//:pegaflow"],
        python_version = "PY3",
        srcs_version = "PY3",
        tags = tags + (["exclusive"] if heavy else []),
        timeout = timeout or (_HEAVY_TIMEOUT if heavy else _TIMEOUT),
        **kwargs
    )

def pytest_tests(deps = [], data = [], names = {}, shares_machine = []):
    """A py_test for every **/tests/test_*.py of this package.

    names: {test file: target name} for files whose target a README names otherwise, e.g.
    {"tests/test_e2e_mla_dedup.py": "mla_dedup"} makes `bazel test //bench:mla_dedup` run it.
    (Not an `alias`: Bazel 4.2.3 does not expand aliases for `bazel test`, so one would run
    nothing.) `bazel test //...` still runs each file exactly once.
    shares_machine: test_e2e_* files that need not run alone (no vLLM; bounds that hold beside
    another test), so that CI's serial part is only the vLLM files.

    Helpers next to the tests (conftest.py and any other non-test module or file
    under a tests/ folder) go into every test's runfiles.
    """
    test_files = native.glob(["**/tests/test_*.py"])
    support = native.glob(
        ["**/tests/**"],
        exclude = test_files + ["**/__pycache__/**", "**/*.pyc"],
    )
    support_py = [f for f in support if f.endswith(".py")]
    support_data = [f for f in support if not f.endswith(".py")]
    if support_py:
        native.py_library(
            name = "test_support",
            srcs = support_py,
            data = support_data,
            testonly = True,
            deps = ["//:package_init"],
        )
    for src in test_files:
        pytest_test(
            name = names.get(src, _target_name(src)),
            src = src,
            deps = deps + ([":test_support"] if support_py else []),
            data = data + ([] if support_py else support_data),
            alone = False if src in shares_machine else None,
        )
