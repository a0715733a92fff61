"""Where sealed blocks' bytes live, behind one narrow interface (base.py): dram/ (L1), ssd/ (L3)."""
