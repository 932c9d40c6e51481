"""The OpenAI-compatible front end's logic (the process is stages/proxy.py)."""
