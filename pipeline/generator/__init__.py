"""The generator's message handling around the engine (the process entry
point is stages/generator.py)."""
