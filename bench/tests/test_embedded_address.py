"""multi_instance and startup read each embedded server's address where it published it (port 0, no
port picked beforehand that another process could take), and say so plainly when there is none."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from pegaflow.bench.harness.connector_config import embedded_address
from pegaflow.connector.embedded import address_file


@dataclasses.dataclass
class StandInVllm:
    workdir: pathlib.Path
    log_path: pathlib.Path


def test_the_published_address_is_read_from_the_instance_s_temp_dir(tmp_path):
    vllm = StandInVllm(tmp_path / "vllm0", tmp_path / "vllm0" / "vllm.log")
    (vllm.workdir / "tmp").mkdir(parents=True)
    address_file("e0", vllm.workdir / "tmp").write_text("127.0.0.1:41234\n")
    assert embedded_address("e0", vllm) == "127.0.0.1:41234"


def test_an_instance_without_an_embedded_server_fails_the_run_naming_its_log(tmp_path):
    vllm = StandInVllm(tmp_path / "vllm1", tmp_path / "vllm1" / "vllm.log")
    with pytest.raises(RuntimeError, match=r"published no address.*runs without the cache.*vllm1/vllm\.log"):
        embedded_address("e1", vllm)
