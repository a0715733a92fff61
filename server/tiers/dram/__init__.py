"""L1: the shared DRAM pool (memfd region, slab allocator) as a tier."""
