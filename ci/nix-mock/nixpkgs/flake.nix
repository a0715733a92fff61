{
  # Offline stand-in for github:NixOS/nixpkgs (ci/nix_check.sh): `import nixpkgs`
  # evaluates default.nix, which provides every attribute flake.nix uses.
  description = "offline stand-in for nixpkgs";
  outputs = _: { };
}
