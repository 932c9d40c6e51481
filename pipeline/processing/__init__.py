"""Turning request media (image bytes) into the tensors a vision encoder reads."""
