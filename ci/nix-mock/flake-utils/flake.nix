{
  # Offline stand-in for github:numtide/flake-utils: only eachSystem, which
  # turns { name = value; } for each system into { name.<system> = value; }.
  description = "offline stand-in for flake-utils (ci/nix_check.sh)";
  outputs = _: {
    lib.eachSystem = systems: perSystem:
      builtins.foldl'
        (merged: system:
          let outputs = perSystem system;
          in merged // builtins.mapAttrs (name: value: (merged.${name} or { }) // { ${system} = value; }) outputs)
        { }
        systems;
  };
}
