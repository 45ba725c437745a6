"""Ollama's API (/api/*) over the router's one generation path and its
model pool, for the apps that speak it (router/ollama/routes.py)."""
