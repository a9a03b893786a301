"""Command line (`hybrid-pd`) and, later, the Ray launcher."""
