"""CPU reference backend: every KernelSet op in plain, readable torch (the oracle for other backends)."""
