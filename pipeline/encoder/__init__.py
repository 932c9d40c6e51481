"""The encoder's logic (the process entry point is stages/encoder.py)."""
