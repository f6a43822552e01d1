"""The block contract shared by both I/O backends, the tier and the tools (private)."""
