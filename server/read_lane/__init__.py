"""The read lane: prefix queries and lease releases of DRAM blocks answered by native code, out of
the interpreter (ARCHITECTURE.md, "The read lane")."""
