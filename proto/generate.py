"""Generate the Python gRPC stubs for every proto/*.proto.

One generator for every build path (make, pip install, Bazel genrule), so the
stubs cannot drift from the .proto files: they are never committed.

The .proto files are compiled under the virtual path `pegaflow/proto/` so that
the generated `*_pb2_grpc.py` imports `from pegaflow.proto import x_pb2` (an
absolute import inside our package) instead of a bare top-level `import x_pb2`.

usage: python proto/generate.py [OUT_DIR] [PROTO ...]
  OUT_DIR defaults to this folder; PROTOs default to every *.proto here.
"""

import pathlib
import shutil
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


def generate(out_dir: pathlib.Path, protos: list[pathlib.Path]) -> list[pathlib.Path]:
    import grpc_tools
    from grpc_tools import protoc  # imported late: only build environments need it

    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for proto in protos:
            src_dir = proto.resolve().parent
            args = [
                "grpc_tools.protoc",
                f"-Ipegaflow/proto={src_dir}",
                f"-I{well_known}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                f"pegaflow/proto/{proto.name}",
            ]
            if protoc.main(args) != 0:
                raise SystemExit(f"protoc failed on {proto}")
        for f in sorted((pathlib.Path(tmp) / "pegaflow" / "proto").iterdir()):
            dst = out_dir / f.name
            shutil.copyfile(f, dst)
            written.append(dst)
    return written


def main(argv: list[str]) -> int:
    out_dir = pathlib.Path(argv[1]) if len(argv) > 1 else HERE
    protos = [pathlib.Path(p) for p in argv[2:]] or sorted(HERE.glob("*.proto"))
    for path in generate(out_dir, protos):
        print(f"generated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
