"""One py_library per part of the package, by glob, so no BUILD edit is needed
when modules are added."""

# Non-Python files a part may read at run time (next to its modules).
DATA_PATTERNS = ["**/*.c", "**/*.json", "**/*.jinja", "**/*.proto", "**/*.sh", "**/*.toml", "**/*.txt", "**/*.yaml"]

# Tests and what only they use live under tests/ folders (see //tools:pytest.bzl).
_NOT_LIBRARY = ["**/tests/**", "**/__pycache__/**"]

def package_library(name, deps = [], exclude = [], visibility = ["//visibility:public"]):
    """Every non-test .py file (and its data files) under this folder, subfolders included."""
    native.py_library(
        name = name,
        srcs = native.glob(["**/*.py"], exclude = _NOT_LIBRARY + exclude),
        data = native.glob(DATA_PATTERNS, exclude = _NOT_LIBRARY + exclude),
        srcs_version = "PY3",
        visibility = visibility,
        deps = deps + ["//:package_init"],
    )
