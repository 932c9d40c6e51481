"""Open-loop load generation against an OpenAI-compatible chat endpoint.

dataset.py builds the requests and their arrival schedule, client.py sends
them and times each stream, metrics.py turns the per-request records into a
result dict whose keys match vLLM's `vllm bench serve`. search.py bisects the
request rate for the maximum goodput under SLOs, plot.py draws P99 TTFT/TPOT
against rate, cli.py is bin/epd-bench, and launched.py drives a whole stack
under bin/epd-launch for the comparison scripts.
"""
