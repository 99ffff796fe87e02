"""moed.gateway: the HTTP process (OpenAI, Ollama and Anthropic APIs, /health, /metrics).

A client of the daemon over the wire protocol, like `moe`; it never imports mlx.
"""
