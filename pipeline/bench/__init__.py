"""Open-loop load generation against an OpenAI-compatible chat endpoint.

dataset.py builds the requests and their arrival schedule, client.py sends
them and times each stream, metrics.py turns the per-request records into a
result dict whose keys match vLLM's `vllm bench serve`.
"""
